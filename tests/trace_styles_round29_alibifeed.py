"""Styles of our own for tests/test_trace_round29_alibifeed.py: attention that takes ALiBi's bias as a forward
argument its model built, in the layouts models hand it (issue #41). Weights moved off their initial values.

- BloomLike: BLOOM's `alibi` [n_batch·n_head, 1, n_K] used as `alibi.baddbmm(q, kᵀ, beta=1, alpha=1/√d)` over the
  heads folded into the batch, an additive float mask. `bug`: 'sign' (beta=-1: the bias subtracted), 'heads'
  (the heads' biases read in reverse order: other slopes), 'after_softmax' (bmm for the scores, the bias added to
  the weights).
- MptLike: transformers' MPT `position_bias` [n_head, 1, n_K] (3 axes asserted), sliced `[:, q0:, -n_K:]` and added
  to [n_batch, n_head, n_Q, n_K] scores, a boolean mask True = masked. `bug`: 'after_softmax' (the bias added to
  the attention weights), 'heads'.
- ByUse: BLOOM's bias under a name that says nothing (`slope_term`), `torch.baddbmm(slope_term, q, kᵀ)`: read
  from its use. `bug`: 'sign'.
- FoundryLike: llm-foundry's `attn_bias` [1, n_head, 1, n_K] sliced on 4 axes, `is_causal` applied by the code
  itself with `masked_fill(~causal, finfo.min)`, einops-free rearranges. `bug`: 'sign', 'after_softmax'.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # the same weights in each instance of a class


class BloomLike(nn.Module):
    def __init__(self, hidden=32, n_head=4, bug=""):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = n_head, hidden // n_head, bug
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = -1.0 if bug == "sign" else 1.0
        trained(self, 29)

    def forward(self, hidden_states, alibi, attention_mask):
        batch_size, q_length, hidden = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(batch_size, q_length, self.num_heads, 3, self.head_dim)
        query = fused[..., 0, :].transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        key = fused[..., 1, :].transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        value = fused[..., 2, :].transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        if self.bug == "heads":
            alibi = alibi.view(batch_size, self.num_heads, 1, -1).flip(1).reshape(batch_size * self.num_heads, 1, -1)
        if self.bug == "after_softmax":
            scores = torch.bmm(query, key.transpose(-1, -2)) * self.inv_norm_factor
        else:
            scores = alibi.baddbmm(batch1=query, batch2=key.transpose(-1, -2), beta=self.beta,
                                   alpha=self.inv_norm_factor)
        weights = scores.view(batch_size, self.num_heads, q_length, -1) + attention_mask
        probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        if self.bug == "after_softmax":
            probs = probs + alibi.view(batch_size, self.num_heads, 1, -1)
        context = torch.bmm(probs.view(batch_size * self.num_heads, q_length, -1), value)
        context = context.view(batch_size, self.num_heads, q_length, self.head_dim).permute(0, 2, 1, 3)
        return self.dense(context.reshape(batch_size, q_length, hidden))


class ByUse(nn.Module):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.h, self.d, self.bug = heads, dim // heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        trained(self, 32)

    def forward(self, x, slope_term, attention_mask):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4).reshape(3, b * self.h, n, self.d)
        sign = -1.0 if self.bug == "sign" else 1.0
        att = torch.baddbmm(slope_term, q, k.transpose(1, 2), beta=sign, alpha=self.d ** -0.5).view(b, self.h, n, n)
        att = F.softmax(att + attention_mask, dim=-1).view(b * self.h, n, n)
        return self.proj(torch.bmm(att, v).view(b, self.h, n, self.d).transpose(1, 2).reshape(b, n, c))


class MptLike(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=""):
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, d_model // n_heads, bug
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model)
        self.softmax_scale = 1 / math.sqrt(self.head_dim)
        trained(self, 30)

    def forward(self, hidden_states, position_bias, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:2]
        q, k, v = self.Wqkv(hidden_states).chunk(3, dim=2)
        q, k, v = (t.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if len(position_bias.shape) != 3:
            raise ValueError(f"Expecting position_bias shape to be 3 dimensions, got {len(position_bias.shape)}")
        key_length = k.shape[-2]
        position_bias = position_bias[:, max(0, position_bias.size(1) - seq_length):,
                                      max(0, position_bias.size(2) - key_length):]
        if self.bug == "heads":
            position_bias = position_bias.flip(0)
        if self.bug != "after_softmax":
            scores = scores + position_bias
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, torch.finfo(q.dtype).min)
        weights = F.softmax(scores.float(), dim=-1).to(v.dtype)
        if self.bug == "after_softmax":
            weights = weights + position_bias
        out = torch.matmul(weights, v).permute(0, 2, 1, 3).contiguous().view(batch_size, seq_length, -1)
        return self.out_proj(out)


class FoundryLike(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=""):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out_proj = nn.Linear(d_model, d_model)
        self.softmax_scale = (d_model // n_heads) ** -0.5
        trained(self, 31)

    def forward(self, x, attn_bias=None, is_causal=True):
        b, s_q, d = x.shape
        h = self.n_heads
        q = self.q_proj(x).view(b, s_q, h, d // h).permute(0, 2, 1, 3)  # b h s d
        k = self.k_proj(x).view(b, s_q, h, d // h).permute(0, 2, 3, 1)  # b h d s
        v = self.v_proj(x).view(b, s_q, h, d // h).permute(0, 2, 1, 3)
        s_k = k.size(-1)
        attn_weight = q.matmul(k) * self.softmax_scale
        if attn_bias is not None:
            _s_q, _s_k = max(0, attn_bias.size(2) - s_q), max(0, attn_bias.size(3) - s_k)
            attn_bias = attn_bias[:, :, _s_q:, _s_k:]
            if self.bug == "sign":
                attn_weight = attn_weight - attn_bias
            elif self.bug != "after_softmax":
                attn_weight = attn_weight + attn_bias
        min_val = torch.finfo(q.dtype).min
        if is_causal and s_q > 1:
            causal_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=x.device).tril()
            attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s_q, s_k), min_val)
        attn_weight = torch.softmax(attn_weight, dim=-1)
        if self.bug == "after_softmax":
            attn_weight = attn_weight + attn_bias
        out = attn_weight.matmul(v).permute(0, 2, 1, 3).reshape(b, s_q, d)
        return self.out_proj(out)


class FoundryOwn(FoundryLike):
    """llm-foundry's attention as its module makes ALiBi itself where the caller hands none (`if attn_bias is None:
    attn_bias = self._attn_bias(...)`, as MPTModel._attn_bias does): the bias is the code's own, compared as its
    code makes it, so a mistake in its making is named. `bug`: 'own_sign' (the slopes negated in its builder)."""

    def forward(self, x, attn_bias=None, is_causal=True):
        if attn_bias is None:
            n = x.shape[1]
            m = torch.tensor([2.0 ** (-8 * (h + 1) / self.n_heads) for h in range(self.n_heads)], dtype=x.dtype)
            attn_bias = (torch.arange(1 - n, 1, dtype=x.dtype).view(1, 1, 1, n) * m.view(1, -1, 1, 1))
            if self.bug == "own_sign":
                attn_bias = -attn_bias
        return super().forward(x, attn_bias, is_causal)


class FalconLike(nn.Module):
    """Falcon's `alibi`: positional without a default, None in its RoPE models, which the forward tests for
    (`if alibi is None:` plain scaled scores, else the bias added): run without --alibi, it is given None."""

    def __init__(self, hidden=32, n_head=4, bug=""):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = n_head, hidden // n_head, bug
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        trained(self, 37)

    def forward(self, hidden_states, alibi, attention_mask=None):
        b, n, c = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).view(b, n, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.head_dim)
        if alibi is not None:
            scores = scores + alibi.view(b, self.num_heads, 1, -1)
        if attention_mask is not None:
            scores = scores + attention_mask
        out = F.softmax(scores, dim=-1) @ v
        return self.dense(out.transpose(1, 2).reshape(b, n, c))
