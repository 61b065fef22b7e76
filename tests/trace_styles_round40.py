"""Styles for tests/test_trace_round40.py: VITS' attention (glow-tts' `MultiHeadAttention`: 1x1 Conv1d projections
on channels-first inputs `[b, d, t]`, heads turned to `[b, h, t, d_k]` before the scores, a 0/1 mask
`[b, 1, t_t, t_s]` filled with -1e4); and Graphormer's fairseq-style attention (time-first `[t, b, d]`, a required
`attn_bias` `[b, h, t, s]` added to the scores beside `key_padding_mask` and `attn_mask`). `bug=` plants a mistake."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


class ConvHeads(nn.Module):
    """VITS: q = conv_q(x), k = conv_k(c), v = conv_v(c), each [b, d, t]; `view(b, h, d_k, t).transpose(2, 3)`;
    scores Q Kᵀ / √d_k [b, h, t_t, t_s]; `masked_fill(mask == 0, -1e4)`; the heads back to [b, d, t_t]; conv_o.
    'scale_dk' divides by d_k; 'merge' views the heads back without the transpose."""

    def __init__(self, channels=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.k_channels, self.bug = n_heads, channels // n_heads, bug
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)
        _moved(self, 40)

    def forward(self, x, c, attn_mask=None):
        q, k, v = self.conv_q(x), self.conv_k(c), self.conv_v(c)
        b, d, t_s, t_t = (*k.size(), q.size(2))
        query = q.view(b, self.n_heads, self.k_channels, t_t).transpose(2, 3)
        key = k.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        value = v.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        divisor = self.k_channels if self.bug == "scale_dk" else math.sqrt(self.k_channels)
        scores = torch.matmul(query / divisor, key.transpose(-2, -1))
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask == 0, -1e4)
        output = torch.matmul(F.softmax(scores, dim=-1), value)  # [b, h, t_t, d_k]
        if self.bug != "merge":
            output = output.transpose(2, 3)
        return self.conv_o(output.contiguous().view(b, d, t_t))


class GraphBias(nn.Module):
    """Graphormer: time-first query [t, b, d]; q scaled, `view(t, b·h, d_k).transpose(0, 1)`; `bmm`; `attn_bias`
    [b, h, t, s] added as [b·h, t, s]; key padding (True = pad) filled with -inf; softmax; the heads back to
    [t, b, d]. 'bias_after' adds the bias after the softmax."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 41)

    def forward(self, query, key, value, attn_bias, key_padding_mask=None, need_weights=True, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        bias = attn_bias.view(bsz * self.num_heads, tgt_len, src_len) if attn_bias is not None else 0
        if self.bug != "bias_after":
            attn_weights = attn_weights + bias
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                                                    float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        if self.bug == "bias_after":
            attn_probs = attn_probs + bias
        attn = torch.bmm(attn_probs, v)  # [b·h, t, d_k]
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), None


class BoxKeys(nn.Module):
    """BROS: BERT's self-attention plus a box term, `einsum("bnid,bijd->bnij", q, bbox_pos_emb)`, its relative key
    table handed in `[n, n, n_batch·d_head]` and viewed `[n, n, n_batch, d_head]`, added to q kᵀ before the scale;
    an additive mask. 'box_transposed' reads the table as P[j, i]."""

    def __init__(self, hidden_size=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.size, self.bug = heads, hidden_size // heads, bug
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        _moved(self, 42)

    def forward(self, hidden_states, bbox_pos_emb, attention_mask=None):
        shape = (hidden_states.shape[0], -1, self.heads, self.size)
        q = self.query(hidden_states).view(shape).transpose(1, 2)
        k = self.key(hidden_states).view(shape).transpose(1, 2)
        v = self.value(hidden_states).view(shape).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2))
        batch_size, _, n, d_head = q.shape
        box = bbox_pos_emb.view(n, n, batch_size, d_head).permute([2, 0, 1, 3])
        if self.bug == "box_transposed":
            box = box.transpose(1, 2)
        scores = (scores + torch.einsum("bnid,bijd->bnij", (q, box))) / math.sqrt(self.size)
        if attention_mask is not None:
            scores = scores + attention_mask
        context = torch.matmul(nn.Softmax(dim=-1)(scores), v).permute(0, 2, 1, 3).contiguous()
        return context.view(*context.size()[:-2], self.heads * self.size)


class PermutedPos(nn.Module):
    """Mask2Former's attention as transformers writes it: its inputs time-first `[t, b, d]`, permuted to batch-first
    first thing (`hidden_states.permute(1, 0, 2)`, the position embedding likewise), the position added to what the
    queries and keys read, not the values (`q_proj(x + pos) * scaling`, `k_proj(x + pos)`, `v_proj(x)`), heads folded
    `[b·h, t, d_k]` for `bmm`; the output permuted back. 'no_scale' leaves the queries unscaled."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 43)

    def _shape(self, tensor, seq_len, batch_size):
        return tensor.view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor | None = None):
        hidden_states = hidden_states.permute(1, 0, 2)
        position_embeddings = position_embeddings.permute(1, 0, 2)
        batch_size, target_len, embed_dim = hidden_states.size()
        original = hidden_states
        hidden_states = hidden_states + position_embeddings
        query_states = self.q_proj(hidden_states) * (1.0 if self.bug == "no_scale" else self.scaling)
        key_states = self._shape(self.k_proj(hidden_states), -1, batch_size)
        value_states = self._shape(self.v_proj(original), -1, batch_size)
        proj_shape = (batch_size * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, target_len, batch_size).view(*proj_shape)
        key_states, value_states = key_states.view(*proj_shape), value_states.view(*proj_shape)
        attn_weights = F.softmax(torch.bmm(query_states, key_states.transpose(1, 2)), dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(batch_size, self.num_heads, target_len, self.head_dim).transpose(1, 2)
        attn_output = self.out_proj(attn_output.reshape(batch_size, target_len, embed_dim))
        return attn_output.permute(1, 0, 2)
