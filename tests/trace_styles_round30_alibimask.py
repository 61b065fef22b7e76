"""Styles of our own for tests/test_trace_round30_alibimask.py: attention whose model hands it ALiBi merged into its
one additive mask argument (Baichuan-13B's `_gen_alibi_mask`: the slopes times the keys' positions plus -inf above the
diagonal), added to the scores; the module builds no ALiBi itself and takes no bias argument (issue #41). Weights
moved off their initial values.

- HeadsMask: separate q, k, v projections, `torch.einsum` scores times a stored scale, `scores + mask` with the mask
  `[n_head, n_Q, n_K]`, clamped at finfo.min, the softmax in float32. `bug`: 'no_scale' (the scale left out),
  'heads' (the mask's heads read in reverse order: `mask.flip(0)`, other slopes for each head).
- FoldedMask: fairseq/bmm-era HF style, the heads folded into the batch, `torch.bmm(q, kᵀ)` on `[n_batch·n_head,
  T, S]` and a mask of that shape (the code asserts it, as BART did), added. `bug`: 'no_scale', 'axis' (the softmax
  over the queries, dim=1).
- GroupedMask: Llama-style grouped-query attention (2 key/value heads for 4 query heads, repeat_kv), the 4-D mask
  sliced `attention_mask[:, :, :, :n_K]` and added to `[n_batch, n_head, n_Q, n_K]` scores. `bug`: 'no_scale',
  'kv' (keys and values from each other's projection).
- KernelMask: Baichuan2-style fused W_pack, `F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)`,
  the merged mask `[n_head, n_Q, n_K]` added inside the kernel. `bug`: 'no_scale' (`scale=1.0`).
- OwnAlibi: builds ALiBi itself (`m_h · j` from its own slopes) and adds it beside the additive mask argument it
  takes: trace leaves its bias to it. `bug`: 'own_sign' (its slopes negated).
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


class HeadsMask(nn.Module):
    def __init__(self, dim=32, n_heads=4, bug=""):
        super().__init__()
        self.n_heads, self.head_size, self.bug = n_heads, dim // n_heads, bug
        self.scale = 1.0 if bug == "no_scale" else self.head_size ** -0.5
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        trained(self, 301)

    def forward(self, x, mask=None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_size)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_size)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_size)
        scores = torch.einsum("bqhd,bkhd->bhqk", xq, xk) * self.scale
        if mask is not None:
            if self.bug == "heads":
                mask = mask.flip(0)
            scores = scores + mask
            scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        probs = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, xv)
        return self.wo(out.reshape(bsz, seqlen, -1))


class FoldedMask(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=""):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = 1.0 if bug == "no_scale" else self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        trained(self, 302)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attn_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attn_mask is not None:
            assert attn_mask.size() == (bsz * self.num_heads, tgt_len, src_len), attn_mask.size()
            attn_weights = attn_weights + attn_mask
        attn_weights = F.softmax(attn_weights, dim=1 if self.bug == "axis" else -1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, self.embed_dim))


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class GroupedMask(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_key_value_heads=2, bug=""):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.bug = num_heads, num_key_value_heads, bug
        self.head_dim = hidden_size // num_heads
        self.num_key_value_groups = num_heads // num_key_value_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        trained(self, 303)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_proj, value_proj = (self.v_proj, self.k_proj) if self.bug == "kv" else (self.k_proj, self.v_proj)
        key_states = key_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = value_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if self.bug != "no_scale":
            attn_weights = attn_weights / math.sqrt(self.head_dim)
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class KernelMask(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=""):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.W_pack = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        trained(self, 305)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, hidden = hidden_states.size()
        proj = self.W_pack(hidden_states).unflatten(-1, (3, hidden)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states, key_states, value_states = (
            p.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2) for p in proj)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=attention_mask,
                                                     scale=1.0 if self.bug == "no_scale" else None)
        return self.o_proj(attn_output.transpose(1, 2).reshape(bsz, q_len, hidden))


class OwnAlibi(nn.Module):
    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.heads, self.dim_head, self.bug = heads, dim // heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        start = 2 ** (-8 / heads)
        slopes = torch.tensor([start ** (h + 1) for h in range(heads)])
        self.register_buffer("slopes", -slopes if bug == "own_sign" else slopes, persistent=False)
        trained(self, 304)

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.dim_head).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = q @ k.transpose(-1, -2) * self.dim_head ** -0.5
        alibi = self.slopes.to(x.dtype)[:, None, None] * torch.arange(n, dtype=x.dtype, device=x.device)[None, None, :]
        dots = dots + alibi + attention_mask
        attn = dots.softmax(dim=-1)
        return self.to_out((attn @ v).transpose(1, 2).reshape(b, n, -1))
