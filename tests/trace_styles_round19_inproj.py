"""Attention whose q, k and v weights are one packed parameter that the code cuts itself before it projects, in the
idioms torch and other libraries write it, and nn.MultiheadAttention used as a library with masks in its own
conventions, for tests/test_trace_round19_inproj.py. Each takes `bug=None`: a planted mistake, which trace names by
experiment."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _moved(module, seed):
    """Every parameter moved off its initial value (no zero bias, no weight as initialized): a trained model's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module


class TimeFirstInProjection(nn.Module):
    """torch's F.multi_head_attention_forward written out: time-first `[n, n_batch, E]` query, key and value, the
    packed in_proj_weight sliced `[:E]`, `[E:2 * E]`, `[2 * E:]` (F._in_projection), the heads folded into the
    batch, a baddbmm of the scaled queries. attn_mask: bool, True = masked out (nn.MultiheadAttention's)."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim, self.bug = embed_dim, num_heads, embed_dim // num_heads, bug
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.in_proj_bias)
        _moved(self, 1)

    def forward(self, query, key, value, attn_mask=None):
        tgt_len, bsz, e = query.shape
        w, b = self.in_proj_weight, self.in_proj_bias
        q = F.linear(query, w[:e], b[:e])
        k = F.linear(key, w[e:2 * e], b[e:2 * e])
        v = F.linear(value, w[2 * e:], b[2 * e:])
        if self.bug == "kv_swapped":
            k, v = v, k
        q = q.view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)  # [b·h, n_Q, d_head]
        k = k.view(k.shape[0], bsz * self.num_heads, self.head_dim).transpose(0, 1)  # [b·h, n_K, d_head]
        v = v.view(v.shape[0], bsz * self.num_heads, self.head_dim).transpose(0, 1)
        bias = torch.zeros(q.shape[1], k.shape[1], dtype=q.dtype)
        if attn_mask is not None:
            masked = ~attn_mask if self.bug == "polarity" else attn_mask
            bias = bias.masked_fill(masked, float("-inf"))
        scale = 1.0 if self.bug == "scale_none" else 1 / math.sqrt(self.head_dim)
        scores = torch.baddbmm(bias, q * scale, k.transpose(-2, -1))  # [b·h, n_Q, n_K]
        out = torch.bmm(F.softmax(scores, dim=-1), v)  # [b·h, n_Q, d_head]
        out = out.transpose(0, 1).contiguous().view(tgt_len * bsz, e)  # [n_Q·b, E]
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return out.view(tgt_len, bsz, e)


class PackedProjection(nn.Module):
    """torch's F._in_projection_packed in self-attention: one F.linear over the packed weight, its output
    `unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)` into q, k, v, then
    F.scaled_dot_product_attention. attn_mask: bool, True = may attend (SDPA's)."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / math.sqrt(embed_dim))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) * 0.1)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        proj = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # [b, n, 3·E]
        proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()  # [3, b, n, E]
        q, k, v = proj[0], proj[1], proj[2]
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # [b, h, n, d_head]
        if self.bug == "kv_swapped":
            k, v = v, k
        scale = 1 / q.shape[-1] if self.bug == "scale_d_head" else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)  # [b, h, n, d_head]
        if self.bug == "merge":
            return self.out_proj(y.reshape(b, n, e))
        return self.out_proj(y.transpose(1, 2).reshape(b, n, e))


class SplitGqaWeight(nn.Module):
    """A grouped-query block holding one fused `qkv` Linear whose weight and bias it splits itself by the sizes of
    q, k and v (`torch.split(self.qkv.weight, [dq, dk, dv])`), each projected with F.linear; the key heads repeated
    with repeat_interleave. mask: bool, True = may attend."""

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, bug=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, mask=None):
        bsz, seqlen, _ = x.shape
        sizes = [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]
        wq, wk, wv = torch.split(self.qkv.weight, sizes)
        bq, bk, bv = torch.split(self.qkv.bias, sizes)
        xq = F.linear(x, wq, bq).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = F.linear(x, wk, bk).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xv = F.linear(x, wv, bv).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.bug == "kv_swapped":
            xk, xv = xv, xk
        group = self.n_heads // self.n_kv_heads
        if self.bug == "tiled":
            xk, xv = xk.repeat(1, group, 1, 1), xv.repeat(1, group, 1, 1)
        else:
            xk, xv = xk.repeat_interleave(group, dim=1), xv.repeat_interleave(group, dim=1)  # [b, h, n, d_head]
        scores = xq @ xk.transpose(2, 3) / math.sqrt(self.head_dim)  # [b, h, n_Q, n_K]
        if mask is not None:
            keep = ~mask if self.bug == "polarity" else mask
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        out = torch.softmax(scores.float(), dim=-1).type_as(xq) @ xv  # [b, h, n_Q, d_head]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class StackedEinsum(nn.Module):
    """Mesh-TensorFlow-like kernels: one parameter `[3, n_head, d_head, d_model]` whose slices project by einsum
    ('bnd,hkd->bhnk'), an output kernel `[n_head, d_head, d_model]` ('bhnk,hkd->bnd'). mask: bool, True = may
    attend, applied by torch.where."""

    def __init__(self, d_model=32, n_head=4, d_head=8, bug=None):
        super().__init__()
        self.d_head, self.bug = d_head, bug
        self.qkv_kernel = nn.Parameter(torch.randn(3, n_head, d_head, d_model) / math.sqrt(d_model))
        self.o_kernel = nn.Parameter(torch.randn(n_head, d_head, d_model) / math.sqrt(n_head * d_head))

    def forward(self, x, mask=None):
        q = torch.einsum("bnd,hkd->bhnk", x, self.qkv_kernel[0])  # [b, h, n, d_head]
        k = torch.einsum("bnd,hkd->bhnk", x, self.qkv_kernel[1])
        v = torch.einsum("bnd,hkd->bhnk", x, self.qkv_kernel[2])
        if self.bug == "kv_swapped":
            k, v = v, k
        scale = self.d_head ** -0.5
        if self.bug == "scale_twice":
            q = q * scale
        logits = torch.einsum("bhqk,bhmk->bhqm", q * scale, k)  # [b, h, n_Q, n_K]
        if mask is not None:
            logits = torch.where(mask, logits, torch.tensor(float("-inf"), dtype=logits.dtype))
        weights = logits.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhqm,bhmk->bhqk", weights, v)  # [b, h, n_Q, d_head]
        return torch.einsum("bhnk,hkd->bnd", out, self.o_kernel)


class ViewUnbind(nn.Module):
    """A packed weight viewed `[3, E, E]` and unbound, each part applied as `x @ w.T + b`, a cross-attention over a
    memory. key_padding_mask: bool, True = padded (nn.MultiheadAttention's)."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.e, self.h, self.bug = embed_dim, num_heads, bug
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / math.sqrt(embed_dim))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) * 0.1)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, memory, key_padding_mask=None):
        b, n, e = x.shape
        w_q, w_k, w_v = self.in_proj_weight.view(3, e, e).unbind(0)
        b_q, b_k, b_v = self.in_proj_bias.view(3, e).unbind(0)
        q, k, v = x @ w_q.T + b_q, memory @ w_k.T + b_k, memory @ w_v.T + b_v
        q, k, v = (t.unflatten(-1, (self.h, -1)).transpose(1, 2) for t in (q, k, v))  # [b, h, n, d_head]
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.h)  # [b, h, n_Q, n_K]
        if key_padding_mask is not None:
            padded = key_padding_mask[:, None, :, None] if self.bug == "on_queries" else \
                key_padding_mask[:, None, None, :]
            if self.bug == "polarity":
                padded = ~padded
            scores = scores.masked_fill(padded, float("-inf"))
        out = scores.softmax(-1) @ v  # [b, h, n_Q, d_head]
        return self.out_proj(out.transpose(1, 2).flatten(2))


class StackedLinear(nn.Module):
    """Separate weights kept in one stacked parameter `[3, E, E]` (and biases `[3, E]`), projected with
    `F.linear(x, self.w[i], self.b[i])`; self-attention, no mask of its own but the one it is handed. attn_mask:
    additive float, 0 = may attend."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = num_heads, bug
        self.w = nn.Parameter(torch.randn(3, embed_dim, embed_dim) / math.sqrt(embed_dim))
        self.b = nn.Parameter(torch.randn(3, embed_dim) * 0.1)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        q, k, v = (F.linear(x, self.w[i], self.b[i]).view(b, n, self.h, -1).permute(0, 2, 1, 3) for i in range(3))
        if self.bug == "kv_swapped":
            k, v = v, k
        d = q.shape[-1]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 if self.bug == "scale_none" else d ** -0.5)
        if attn_mask is not None:
            scores = scores + attn_mask
        out = torch.matmul(scores.softmax(-1), v)  # [b, h, n_Q, d_head]
        if self.bug == "merge":
            return self.proj(out.reshape(b, n, e))
        return self.proj(out.permute(0, 2, 1, 3).reshape(b, n, e))


class MhaInvertedMask(nn.Module):
    """nn.MultiheadAttention used as a library by an encoder block: its own mask turned round for MHA's attn_mask,
    its key padding handed on as key_padding_mask."""

    def __init__(self, d_model=32, nhead=4, bug=None):
        super().__init__()
        self.bug = bug
        self.self_attn = _moved(nn.MultiheadAttention(d_model, nhead, batch_first=True), 2)

    def forward(self, src, mask, key_padding_mask=None):
        """mask: bool [n_Q, n_K] (or one per sequence and head), True = may attend."""
        attn_mask = ~mask
        if self.bug == "on_queries":
            attn_mask = attn_mask.transpose(-1, -2)
        out, _ = self.self_attn(src, src, src, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                need_weights=False)
        return out


class FunctionalMha(nn.Module):
    """F.multi_head_attention_forward called with the module's own parameters on time-first tensors (fairseq's and
    older torch code's habit), the mask turned round for it: `mask` is True = may attend."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / math.sqrt(embed_dim))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) * 0.1)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None):
        h = x.transpose(0, 1)  # [n, b, E]
        attn_mask = None if mask is None else (mask if self.bug == "polarity" else mask.logical_not())
        out, _ = F.multi_head_attention_forward(
            h, h, h, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0,
            self.out_proj.weight, self.out_proj.bias, training=False, attn_mask=attn_mask, need_weights=False)
        return out.transpose(0, 1)
