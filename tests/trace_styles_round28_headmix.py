"""Talking-heads attention (Shazeer et al. 2020) in three styles: each head's logits made a weighted sum of all heads'
by a learned [h, h] matrix before the softmax, and each head's weights after it.

- XTalkingHeads: x-transformers' Attend of 2021, the mixing written as an einsum over the head axis
  (`einsum('b h i j, h k -> b k i j', dots, self.pre_softmax_proj)`), a fused qkv projection, causal by a
  `triu(j - i + 1)` mask filled with -finfo.max.
- ConvTalkingHeads: lucidrains' 1x1 Conv2d over the heads (x-transformers' later `nn.Conv2d(heads, heads, 1,
  bias=False)`), no mask, the post-softmax mixing optional (`post=False`: only the logits mixed); `bias=True`: the
  convolutions with their bias; `rel_bias=True`: a learned position bias [h, 8, 8] (sliced to the tokens) added to
  the mixed logits; `rel_bias='whole'`: added as the parameter it is (8 tokens), a bias trace reads no reference for.
- MatmulTalkingHeads: the heads moved last and multiplied by the matrix (`dots.permute(0, 2, 3, 1) @ mix`), moved
  back, a boolean key padding mask filled with -inf before the softmax.

Each takes `bug=` for one planted mistake: 'no_scale' (the scores never scaled), 'split_no_permute' (heads viewed
straight from [b, n, h·d] as [b, h, n, d]), 'causal_diagonal' (triu(j - i): each query loses its own key),
'softmax_axis' (softmax over the queries), 'merge_d_h' (merged as 'b h n d -> b n (d h)').
"""

import torch
import torch.nn.functional as F
from torch import einsum, nn


def _trained(module, scale=0.1):
    # every weight moved off its initial value (no identity mixing, no zero bias)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))


def _split(t, h, bug):
    b, n, _ = t.shape
    if bug == "split_no_permute":
        return t.reshape(b, h, n, -1)
    return t.reshape(b, n, h, -1).permute(0, 2, 1, 3)


def _merge(out, bug):
    b, h, n, d = out.shape
    if bug == "merge_d_h":
        return out.permute(0, 2, 3, 1).reshape(b, n, h * d)
    return out.permute(0, 2, 1, 3).reshape(b, n, h * d)


class XTalkingHeads(nn.Module):
    def __init__(self, dim=32, heads=4, dim_head=8, causal=True, bug=None):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.causal, self.bug = heads, causal, bug
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.pre_softmax_proj = nn.Parameter(torch.eye(heads))
        self.post_softmax_proj = nn.Parameter(torch.eye(heads))
        self.to_out = nn.Linear(heads * dim_head, dim)
        _trained(self)

    def forward(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (_split(t, self.heads, self.bug) for t in (q, k, v))
        dots = einsum('b h i d, b h j d -> b h i j', q, k)
        if self.bug != "no_scale":
            dots = dots * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        dots = einsum('b h i j, h k -> b k i j', dots, self.pre_softmax_proj)
        if self.causal:
            i, j = dots.shape[-2:]
            shift = j - i if self.bug == "causal_diagonal" else j - i + 1
            causal_mask = torch.ones(i, j, dtype=torch.bool, device=x.device).triu(shift)
            dots = dots.masked_fill(causal_mask, mask_value)
        attn = dots.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        attn = einsum('b h i j, h k -> b k i j', attn, self.post_softmax_proj)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        return self.to_out(_merge(out, self.bug))


class ConvTalkingHeads(nn.Module):
    def __init__(self, dim=32, heads=4, dim_head=8, post=True, bias=False, rel_bias=False, bug=None):
        super().__init__()
        torch.manual_seed(1)
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)
        self.pre_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=bias)
        self.post_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=bias) if post else None
        self.rel_bias = nn.Parameter(torch.randn(heads, 8, 8)) if rel_bias else None
        self.whole_bias = rel_bias == "whole"
        self.to_out = nn.Linear(heads * dim_head, dim)
        _trained(self)

    def forward(self, x):
        q = _split(self.to_q(x), self.heads, self.bug)
        k, v = (_split(t, self.heads, self.bug) for t in self.to_kv(x).chunk(2, dim=-1))
        scale = 1.0 if self.bug == "no_scale" else q.shape[-1] ** -0.5
        dots = torch.matmul(q, k.transpose(-1, -2)) * scale
        dots = self.pre_softmax_talking_heads(dots)
        if self.whole_bias:
            dots = dots + self.rel_bias
        elif self.rel_bias is not None:
            i, j = dots.shape[-2:]
            dots = dots + self.rel_bias[:, :i, :j]
        attn = F.softmax(dots, dim=-2 if self.bug == "softmax_axis" else -1)
        if self.post_softmax_talking_heads is not None:
            attn = self.post_softmax_talking_heads(attn)
        out = torch.matmul(attn, v)
        return self.to_out(_merge(out, self.bug))


class MatmulTalkingHeads(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        torch.manual_seed(2)
        self.heads, self.bug = heads, bug
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.mix_logits = nn.Parameter(torch.eye(heads))
        self.mix_weights = nn.Parameter(torch.eye(heads))
        self.o_proj = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, mask):
        # mask: [b, n] boolean, True = may attend
        q, k, v = (_split(p(x), self.heads, self.bug) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.bug != "no_scale":
            q = q / q.shape[-1] ** 0.5
        scores = q @ k.transpose(-2, -1)
        scores = (scores.permute(0, 2, 3, 1) @ self.mix_logits).permute(0, 3, 1, 2)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        weights = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        weights = (weights.permute(0, 2, 3, 1) @ self.mix_weights).permute(0, 3, 1, 2)
        return self.o_proj(_merge(weights @ v, self.bug))
