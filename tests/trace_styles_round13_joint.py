"""Attention whose projections no multi-head reference of four Linear layers holds, each in its own code style:

- MMDiTJoint: SD3/MMDiT-like joint attention, written by hand (no SDPA): the context's tokens first (as HunyuanDiT
  and CogVideoX join them), each stream its own q/k/v Linear layers and per-head RMS norms, one softmax over all
  the tokens, the output split back, each stream its own output projection. `forward(x, context=None)`.
- DoubleStream: a Flux-like double-stream block: each stream one fused qkv Linear viewed `[B, L, 3, H, D]`,
  per-head RMSNorm, txt + img joined, half-split RoPE (rotate_half) over the joined positions, SDPA.
- ParallelBlock: a PaLM / GPT-J parallel block without its residual: one Linear writes q, k, v and the MLP's
  input at once; the output Linear reads the merged heads beside the MLP's activation. Causal, hand-written.

Each takes `bug=` to plant one mistake of trace's catalog.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class HeadRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MMDiTJoint(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ctx_q, self.ctx_k, self.ctx_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = HeadRMSNorm(self.head_dim), HeadRMSNorm(self.head_dim)
        self.ctx_q_norm, self.ctx_k_norm = HeadRMSNorm(self.head_dim), HeadRMSNorm(self.head_dim)
        self.to_out, self.ctx_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm, self.ctx_q_norm, self.ctx_k_norm):
                norm.weight.uniform_(0.5, 1.5)

    def _heads(self, t):
        b, n, _ = t.shape
        if self.bug == "split_no_permute":
            return t.reshape(b, self.heads, n, self.head_dim)
        return t.reshape(b, n, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, context=None):
        b, n, _ = x.shape
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if context is not None:
            cq = self.ctx_q_norm(self._heads(self.ctx_q(context)))
            ck = self.ctx_k_norm(self._heads(self.ctx_k(context)))
            cv = self._heads(self.ctx_v(context))
            q = torch.cat([cq, q], dim=2)
            k = torch.cat([ck, k], dim=2)
            v = torch.cat([cv, v], dim=2)
        scale = 1 / math.sqrt(self.heads * self.head_dim if self.bug == "scale_d_model" else self.head_dim)
        if self.bug == "kv_swapped":
            scores = q @ v.transpose(-2, -1) * scale
        else:
            scores = q @ k.transpose(-2, -1) * scale
        weights = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = weights @ (k if self.bug == "kv_swapped" else v)
        if self.bug == "merge_no_transpose":
            out = out.reshape(b, -1, self.heads * self.head_dim)
        else:
            out = out.permute(0, 2, 1, 3).reshape(b, -1, self.heads * self.head_dim)
        if context is None:
            return self.to_out(out)
        m = context.shape[1]
        return self.to_out(out[:, m:]), self.ctx_out(out[:, :m])


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DoubleStream(nn.Module):
    def __init__(self, hidden=32, n_heads=4, base=10000.0, bug=None):
        super().__init__()
        self.n_heads, self.d, self.base, self.bug = n_heads, hidden // n_heads, base, bug
        self.img_qkv, self.txt_qkv = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, 3 * hidden)
        self.img_qn, self.img_kn = HeadRMSNorm(self.d), HeadRMSNorm(self.d)
        self.txt_qn, self.txt_kn = HeadRMSNorm(self.d), HeadRMSNorm(self.d)
        self.img_proj, self.txt_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        with torch.no_grad():
            for norm in (self.img_qn, self.img_kn, self.txt_qn, self.txt_kn):
                norm.weight.uniform_(0.5, 1.5)

    def _split(self, qkv):
        b, n, _ = qkv.shape
        return qkv.view(b, n, 3, self.n_heads, self.d).permute(2, 0, 3, 1, 4)

    def forward(self, img, txt):
        iq, ik, iv = self._split(self.img_qkv(img))
        tq, tk, tv = self._split(self.txt_qkv(txt))
        q = torch.cat((self.txt_qn(tq), self.img_qn(iq)), dim=2)
        k = torch.cat((self.txt_kn(tk), self.img_kn(ik)), dim=2)
        v = torch.cat((tv, iv), dim=2)
        n = q.shape[2]
        inv = 1.0 / self.base ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
        angles = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.bug == "rope_on_v":
            v = v * cos + rotate_half(v) * sin
        if self.bug == "scale_twice":
            q = q * self.d ** -0.5
        x = F.scaled_dot_product_attention(q, k, v)
        b = x.shape[0]
        if self.bug == "merge_no_transpose":
            x = x.reshape(b, n, -1)
        else:
            x = x.transpose(1, 2).reshape(b, n, -1)
        t = txt.shape[1]
        return self.img_proj(x[:, t:]), self.txt_proj(x[:, :t])


class ParallelBlock(nn.Module):
    def __init__(self, d_model=32, n_head=4, ff_mult=2, bug=None):
        super().__init__()
        self.n_head, self.d_head, self.bug = n_head, d_model // n_head, bug
        self.ff = ff_mult * d_model
        self.fused_in = nn.Linear(d_model, 3 * d_model + self.ff, bias=False)
        self.fused_out = nn.Linear(d_model + self.ff, d_model, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v, ff = self.fused_in(x).split([d, d, d, self.ff], dim=-1)
        q, k, v = (t.view(b, n, self.n_head, self.d_head).transpose(1, 2) for t in (q, k, v))
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(self.d_head)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        if self.bug == "mask_after_softmax":
            attn = scores.softmax(-1).masked_fill(~causal, 0.0)
        else:
            attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        if self.bug == "merge_no_transpose":
            out = out.reshape(b, n, d)
        else:
            out = out.transpose(1, 2).reshape(b, n, d)
        return self.fused_out(torch.cat([out, F.silu(ff)], dim=-1))


class JoinedFirst(nn.Module):
    """CogVideoX-like: the text's and the video's tokens joined before shared projections (one stream made of
    two), the heads folded into the batch as diffusers' head_to_batch_dim does, the output split back."""

    def __init__(self, inner=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(inner, inner), nn.Linear(inner, inner), nn.Linear(inner, inner)
        self.to_out = nn.Linear(inner, inner)

    def head_to_batch_dim(self, t):
        b, n, d = t.shape
        return t.reshape(b, n, self.heads, d // self.heads).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def forward(self, hidden_states, encoder_hidden_states=None):
        text_len = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        if encoder_hidden_states is not None:
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        b, n, d = hidden_states.shape
        q = self.head_to_batch_dim(self.to_q(hidden_states))
        k = self.head_to_batch_dim(self.to_k(hidden_states))
        v = self.head_to_batch_dim(self.to_v(hidden_states))
        scores = torch.matmul(q, (v if self.bug == "kv_swapped" else k).transpose(1, 2))
        if self.bug != "no_scale":
            scores = scores * (d // self.heads) ** -0.5
        probs = F.softmax(scores, dim=1 if self.bug == "softmax_axis" else -1)
        out = torch.matmul(probs, k if self.bug == "kv_swapped" else v)
        out = out.reshape(b, self.heads, n, -1).permute(0, 2, 1, 3).reshape(b, n, d)
        out = self.to_out(out)
        return out[:, text_len:], out[:, :text_len]


class FlatJoint(nn.Module):
    """Streams joined before the heads are split ([B, n, width] along the tokens), grouped-query: each stream a q
    Linear and a fused k/v Linear of its own, 4 query heads sharing 2 key/value heads (SDPA's enable_gqa)."""

    def __init__(self, dim=32, heads=4, kv_heads=2, bug=None):
        super().__init__()
        self.h, self.kvh, self.d, self.bug = heads, kv_heads, dim // heads, bug
        self.wq, self.wkv = nn.Linear(dim, dim), nn.Linear(dim, 2 * kv_heads * self.d)
        self.ctx_wq, self.ctx_wkv = nn.Linear(dim, dim), nn.Linear(dim, 2 * kv_heads * self.d)
        self.wo, self.ctx_wo = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, context=None):
        b, n, _ = x.shape
        m = context.shape[1]
        k, v = self.wkv(x).chunk(2, dim=-1)
        ck, cv = self.ctx_wkv(context).chunk(2, dim=-1)
        q = torch.cat([self.wq(x), self.ctx_wq(context)], dim=1).view(b, n + m, self.h, self.d).transpose(1, 2)
        k = torch.cat([k, ck], dim=1).view(b, n + m, self.kvh, self.d).transpose(1, 2)
        v = torch.cat([v, cv], dim=1).view(b, n + m, self.kvh, self.d).transpose(1, 2)
        scale = 1 / self.d if self.bug == "scale_d_head" else None
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, n + m, -1)
        return self.wo(out[:, :n]), self.ctx_wo(out[:, n:])
