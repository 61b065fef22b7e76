"""Attention modules written as real libraries write them, for tests/test_trace_round14_groups.py: code that reads
its mask by comparing it with a number (an additive mask compared with 0, -inf or finfo.min), dropout left on at
each place a library puts one, and attention over groups of tokens the module makes itself (MobileViT's
unfold / fold, a window partition, axial rows). Each class takes `bug`: None is the correct module, any other a
planted mistake."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- masks the code compares with a number ------------------------------------------------------------------------


class SlicedCompared(nn.Module):
    """transformers' eager attention of a decoder (Mistral, Jamba): a 4-D additive mask sliced to the keys and added;
    bug 'after': the mask applied to the weights after the softmax, as `masked_fill(mask < 0, 0.0)`."""

    def __init__(self, hidden_size: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal_mask = None if attention_mask is None else attention_mask[:, :, :, : k.shape[-2]]
        if causal_mask is not None and self.bug != "after":
            attn_weights = attn_weights + causal_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        if causal_mask is not None and self.bug == "after":
            attn_weights = attn_weights.masked_fill(causal_mask < 0, 0.0)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class WhereBelowZero(nn.Module):
    """A T5-like block that turns an additive mask back into a choice: `torch.where(mask < 0, finfo.min, scores)`
    (fused qkv, einsum); bug 'after': the weights of the masked keys zeroed after the softmax,
    `torch.where(mask < 0, 0, attn)`."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        if mask is not None and self.bug != "after":
            sim = torch.where(mask < 0, torch.finfo(sim.dtype).min, sim)
        attn = sim.softmax(dim=-1)
        if mask is not None and self.bug == "after":
            attn = torch.where(mask < 0, torch.zeros_like(attn), attn)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class FinfoMinEquals(nn.Module):
    """Code that finds the masked cells of transformers' 4-D mask by `mask == torch.finfo(dtype).min` and fills
    them; bug 'after': the weights multiplied by `(mask > -1)` after the softmax."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_mask=None):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
        if attn_mask is not None and self.bug != "after":
            blocked = attn_mask == torch.finfo(attn_mask.dtype).min
            scores = scores.masked_fill(blocked, float("-inf"))
        probs = scores.softmax(dim=-1)
        if attn_mask is not None and self.bug == "after":
            probs = probs * (attn_mask > -1)
        out = (probs @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


# --- dropout left on, wherever it sits ----------------------------------------------------------------------------


class ResidDropoutAfterProj(nn.Module):
    """GPT-2 / StarCoder2-like: the output projection, then `resid_dropout` on its output; bug 'on': F.dropout
    without `training=`, so it drops in eval() mode too."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, p: float = 0.2, bug: str | None = None):
        super().__init__()
        self.n_head, self.p, self.bug = n_head, p, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        if self.bug == "on":
            return F.dropout(y, self.p)
        return F.dropout(y, self.p, training=self.training)


class DropoutBeforeProj(nn.Module):
    """A hand-written block (einsum, separate projections) that drops the merged heads before its output
    projection; bug 'on': `F.dropout(out, p=self.p)`."""

    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.2, bug: str | None = None):
        super().__init__()
        self.heads, self.p, self.bug = heads, p, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d // self.heads)
        dots = dots.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhij,bhjd->bhid", dots.softmax(-1), v).transpose(1, 2).reshape(b, n, d)
        out = F.dropout(out, p=self.p) if self.bug == "on" else F.dropout(out, p=self.p, training=self.training)
        return self.to_out(out)


class DropoutOnHeads(nn.Module):
    """The heads' output `[b, h, n, d_head]` dropped before the heads merge (matmul, one fused qkv); bug 'on':
    `nn.functional.dropout(context, self.p, True)`."""

    def __init__(self, hidden: int = 32, heads: int = 4, p: float = 0.2, bug: str | None = None):
        super().__init__()
        self.heads, self.p, self.bug = heads, p, bug
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        b, n, c = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (c // self.heads) ** -0.5
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
        context = scores.softmax(dim=-1) @ v
        context = nn.functional.dropout(context, self.p, self.bug == "on" or self.training)
        return self.dense(context.transpose(1, 2).reshape(b, n, c))


# --- attention within groups of tokens the module makes itself ------------------------------------------------


class UnfoldPatches(nn.Module):
    """MobileViT v2-like: the token grid `[B, H·W, C]` as a feature map, `F.unfold` into p×p patches, attention
    among the patches at each pixel position (`[B·P, N, C]`), `F.fold` back; einsum heads. Bug 'scale': the scores
    scaled twice."""

    def __init__(self, dim: int = 32, heads: int = 4, height: int = 4, width: int = 4, patch: int = 2,
                 bug: str | None = None):
        super().__init__()
        self.heads, self.hw, self.patch, self.bug = heads, (height, width), patch, bug
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def attend(self, patches):  # [B·P, N, C]
        b, n, _ = patches.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(patches).chunk(3, -1))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        if self.bug == "scale":
            dots = dots * self.scale
        out = torch.einsum("bhij,bhjd->bhid", dots.softmax(dim=-1), v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))

    def forward(self, x):
        B, L, C = x.shape
        (H, W), p = self.hw, self.patch
        fm = x.transpose(1, 2).reshape(B, C, H, W)
        cols = F.unfold(fm, kernel_size=p, stride=p)  # [B, C·P, N]
        n = cols.shape[-1]
        patches = cols.reshape(B, C, p * p, n).permute(0, 2, 3, 1).reshape(B * p * p, n, C)  # [B·P, N, C]
        out = self.attend(patches)
        cols = out.reshape(B, p * p, n, C).permute(0, 3, 1, 2).reshape(B, C * p * p, n)
        fm = F.fold(cols, output_size=(H, W), kernel_size=p, stride=p)  # [B, C, H, W]
        return fm.reshape(B, C, L).transpose(1, 2)


def window_partition(x, window_size: int):
    """Swin's: [B, H, W, C] -> [B·nW, ws, ws, C]."""
    B, H, W, C = x.shape
    x = x.view(B, H // window_size, window_size, W // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)


def window_reverse(windows, window_size: int, H: int, W: int):
    """Swin's: [B·nW, ws, ws, C] -> [B, H, W, C]."""
    B = int(windows.shape[0] / (H * W / window_size / window_size))
    x = windows.view(B, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class WindowPartition(nn.Module):
    """A Swin block's attention on a flattened grid: windows partitioned inside the module, timm's WindowAttention
    (one qkv, `reshape(B_, N, 3, h, d).permute(2, 0, 3, 1, 4)`, q scaled first), windows reversed. Bugs: 'scale'
    (scaled twice), 'fold' (the windows put back without the permute)."""

    def __init__(self, dim: int = 32, num_heads: int = 4, resolution: int = 4, window_size: int = 2,
                 bug: str | None = None):
        super().__init__()
        self.num_heads, self.res, self.ws, self.bug = num_heads, resolution, window_size, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, C = x.shape
        x_windows = window_partition(x.view(B, self.res, self.res, C), self.ws).view(-1, self.ws * self.ws, C)
        B_, N, _ = x_windows.shape
        qkv = self.qkv(x_windows).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        if self.bug == "scale":
            attn = attn * self.scale
        attn = attn.softmax(dim=-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C))
        out = out.view(-1, self.ws, self.ws, C)
        if self.bug == "fold":
            return out.reshape(B, L, C)
        return window_reverse(out, self.ws, self.res, self.res).view(B, L, C)


class ChunkedLocal(nn.Module):
    """Blockwise local attention: the sequence cut into chunks folded into the batch, `view(B·n_chunks, chunk, C)`,
    F.scaled_dot_product_attention within each; bug 'scale': `scale=` given the already scaled q."""

    def __init__(self, hidden_size: int = 32, num_heads: int = 4, chunk: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.chunk, self.bug = num_heads, chunk, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        bsz, q_len, dim = hidden_states.shape
        chunks = hidden_states.reshape(bsz * (q_len // self.chunk), self.chunk, dim)
        b, n = chunks.shape[:2]
        q = self.q_proj(chunks).view(b, n, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(chunks).view(b, n, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(chunks).view(b, n, self.num_heads, -1).transpose(1, 2)
        if self.bug == "scale":
            q = q * q.shape[-1] ** -0.5
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.o_proj(out.transpose(1, 2).reshape(b, n, dim))
        return out.reshape(bsz, q_len, dim)


class AxialColumns(nn.Module):
    """Axial attention along the columns of a token grid: `[B, H, W, C] -> [B·W, H, C]`, each column a sequence
    (CCNet / axial-transformer style), matmul heads; bug 'scale': the scores divided by √d_head twice."""

    def __init__(self, dim: int = 32, heads: int = 4, height: int = 4, width: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.h, self.w, self.bug = heads, height, width, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, C = x.shape
        cols = x.view(B, self.h, self.w, C).transpose(1, 2).reshape(B * self.w, self.h, C)
        q = self.to_q(cols)
        k, v = self.to_kv(cols).chunk(2, dim=-1)
        q, k, v = (t.view(B * self.w, self.h, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        d = q.shape[-1]
        sim = q @ k.transpose(-1, -2) / math.sqrt(d)
        if self.bug == "scale":
            sim = sim / math.sqrt(d)
        out = (sim.softmax(dim=-1) @ v).transpose(1, 2).reshape(B * self.w, self.h, C)
        out = self.to_out(out).view(B, self.w, self.h, C).transpose(1, 2)
        return out.reshape(B, L, C)


class OwnBandMask(nn.Module):
    """A module that takes no mask and masks by itself with a fixed pattern it holds (Longformer-like: a local band
    of one key either side, the first token global); `--mask` of that pattern describes the reference. Bug 'after':
    its pattern applied to the weights after the softmax."""

    def __init__(self, d_model: int = 32, n_head: int = 4, n_ctx: int = 8, bug: str | None = None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.W_q, self.W_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_v, self.W_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.register_buffer("pattern", band_pattern(n_ctx), persistent=False)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.n_head, -1).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_head)
        allowed = self.pattern[:n, :n]
        if self.bug != "after":
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if self.bug == "after":
            weights = weights.masked_fill(~allowed, 0.0)
        return self.W_o((weights @ v).transpose(1, 2).reshape(b, n, d))


def band_pattern(n: int) -> torch.Tensor:
    """[n, n], True = may attend: keys i-1 .. i+1, and the first token both ways."""
    i = torch.arange(n)
    allowed = (i[:, None] - i[None, :]).abs() <= 1
    allowed[0, :] = True
    allowed[:, 0] = True
    return allowed


class CausalChunks(nn.Module):
    """Chunked causal attention of a decoder (a local-attention layer's blocks): the sequence cut into chunks of 4
    folded into the batch, causal within each chunk (`is_causal=True`); bug 'scale': `scale=` of d_head, not √."""

    def __init__(self, d_model: int = 32, n_head: int = 4, chunk: int = 4, bug: str | None = None):
        super().__init__()
        self.n_head, self.chunk, self.bug = n_head, chunk, bug
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.size()
        blocks = x.view(B * T // self.chunk, self.chunk, C)
        q, k, v = self.c_attn(blocks).split(C, dim=2)
        q, k, v = (t.view(-1, self.chunk, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        d = C // self.n_head
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / d if self.bug == "scale" else None)
        y = y.transpose(1, 2).reshape(-1, self.chunk, C)
        return self.c_proj(y).view(B, T, C)
