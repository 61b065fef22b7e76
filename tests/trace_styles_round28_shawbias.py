"""Attention handed Shaw et al.'s relative keys as an argument: a table P [n_Q, n_K, d_head], q_i · P[i, j] added to
score (i, j) (tests/test_trace_round28_shawbias.py; `--position-bias FILE` gives the table).

- SpeechT5Attention: HF transformers' SpeechT5Attention (modeling_speecht5.py), the cache left out: queries scaled
  after the projection, heads folded into the batch for bmm, `position_bias` [n, n, d_head] from the encoder's
  SpeechT5RelativePositionalEncoding, `matmul(reshape_q, position_bias.transpose(-2, -1))`.
- ShawRelKeys: a Music-Transformer/Shaw layer of einsums, one fused qkv projection: (q · kᵀ + einsum(q, rel_k)) / √d.
- shaw_attention: a function on q, k, v in heads, Nezha's/Shaw's TF-style product `q[.., i, None, :] @ P[i]ᵀ`.

The classes take `bug` to plant one mistake (the function's plant is a copy with one change); every weight is moved
off its init.
"""

import math

import torch
from torch import nn


def _jitter(module, scale=0.1):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))


class SpeechT5Attention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4, bias=True, bug=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.bug = bug
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        _jitter(self)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        if self.bug == "kv_swapped":
            key_states, value_states = value_states, key_states
        key_states = key_states.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = query_states.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        query_states = query_states.reshape(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if self.bug == "scale_twice":
            attn_weights = attn_weights * self.scaling

        # relative attention bias
        if position_bias is not None:
            reshape_q = query_states.contiguous().view(bsz * self.num_heads, -1, self.head_dim).transpose(0, 1)
            table = position_bias.permute(1, 0, 2) if self.bug == "relpos_transposed" else position_bias
            rel_pos_bias = torch.matmul(reshape_q, table.transpose(-2, -1))
            rel_pos_bias = rel_pos_bias.transpose(0, 1).view(
                bsz * self.num_heads, position_bias.size(0), position_bias.size(1)
            )
            attn_weights += rel_pos_bias

        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        if self.bug != "merge_no_transpose":
            attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None


class ShawRelKeys(nn.Module):
    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.d = n_heads, d_model // n_heads
        self.bug = bug
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        _jitter(self)

    def forward(self, x, pos_bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)  # 3 x [b, h, n, d]
        if self.bug == "kv_swapped":
            k, v = v, k
        content = torch.einsum("bhid,bhjd->bhij", q, k)
        if self.bug == "table_transposed":
            relative = torch.einsum("bhid,jid->bhij", q, pos_bias)
        else:
            relative = torch.einsum("bhid,ijd->bhij", q, pos_bias)
        scores = content + relative
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d)
        attn = scores.softmax(dim=-1)
        y = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.out(y.transpose(1, 2).reshape(b, n, self.h * self.d))


def shaw_attention(q, k, v, rel_bias):
    """q, k, v [b, h, n, d] (or [b, n, d]); rel_bias [n, n, d]: Shaw's relative keys, the TF reference's product per
    query."""
    d = q.size(-1)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [b, h, n, n]
    rel = torch.matmul(q.unsqueeze(-2), rel_bias.transpose(-1, -2)).squeeze(-2)  # [b, h, n, 1, d] @ [n, d, n]
    scores = (scores + rel) / math.sqrt(d)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v)


def shaw_attention_softmax_axis(q, k, v, rel_bias):
    """PLANT: shaw_attention with its softmax over the queries."""
    d = q.size(-1)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [b, h, n, n]
    rel = torch.matmul(q.unsqueeze(-2), rel_bias.transpose(-1, -2)).squeeze(-2)  # [b, h, n, 1, d] @ [n, d, n]
    scores = (scores + rel) / math.sqrt(d)
    weights = torch.softmax(scores, dim=-2)
    return torch.matmul(weights, v)


class ShawGathered(nn.Module):
    """Shaw's relative keys gathered inside the layer: `pos_bias` is the table of clipped distances [2·clip + 1, d]
    (what SpeechT5's encoder embeds), looked up by i − j here. Not a --position-bias form: trace refuses it."""

    def __init__(self, d_model=32, n_heads=4, clip=4):
        super().__init__()
        self.h, self.d, self.clip = n_heads, d_model // n_heads, clip
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        _jitter(self)

    def forward(self, x, pos_bias):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.h, self.d).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(n)
        rel_k = pos_bias[(pos[:, None] - pos[None, :]).clamp(-self.clip, self.clip) + self.clip]  # [n, n, d]
        scores = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, rel_k)) / math.sqrt(self.d)
        y = scores.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, n, self.h * self.d))
