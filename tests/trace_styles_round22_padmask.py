"""Styles for tests/test_trace_round22_padmask.py: attention whose mask parameter is key padding `[n_batch, n_K]`
(a sequence's padded keys, masked for every query), its queries and keys given apart, traced with a `[B, S]` mask
file and no --batch. Each takes `bug` (a plant) and is written in one library's idiom."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(*linears: nn.Linear) -> None:
    """Move each Linear off its initial values (biases away from their small uniform start)."""
    with torch.no_grad():
        for i, linear in enumerate(linears):
            linear.weight.mul_(1.3 + 0.1 * i)
            if linear.bias is not None:
                linear.bias.add_(0.05 * (i + 1))


class DistilSelf(nn.Module):
    """DistilBERT's MultiHeadSelfAttention: forward(query, key, value, mask) with mask [bs, k_length] of 0/1, viewed
    (bs, 1, 1, k_length) and filled with finfo.min where 0; q divided by √d_head before the matmul."""

    def __init__(self, dim: int = 32, n_heads: int = 4, bug: str = ""):
        super().__init__()
        self.n_heads, self.dim, self.bug = n_heads, dim, bug
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self.q_lin, self.k_lin, self.v_lin, self.out_lin)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor]:
        bs, q_length, dim = query.size()
        k_length = key.size(1)
        dim_per_head = self.dim // self.n_heads
        mask_reshp = (bs, 1, 1, k_length)

        def shape(x: torch.Tensor) -> torch.Tensor:
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)  # (bs, n_heads, n, dim_per_head)

        def unshape(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)  # (bs, n, dim)

        q = shape(self.q_lin(query))
        k = shape(self.k_lin(key))
        v = shape(self.v_lin(value))
        if self.bug != "no_scale":
            q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))  # (bs, n_heads, q_length, k_length)
        mask = (mask == 0).view(mask_reshp).expand_as(scores)
        fill = 0.0 if self.bug == "fill_zero" else torch.finfo(scores.dtype).min
        scores = scores.masked_fill(mask, fill)
        weights = nn.functional.softmax(scores, dim=-1)
        context = unshape(torch.matmul(weights, v))  # (bs, q_length, dim)
        return (self.out_lin(context),)


class BertCross(nn.Module):
    """BERT's BertSelfAttention as cross-attention: the encoder's states and its 2-D attention mask [B, S] made into
    the extended additive mask (1 - mask) · finfo.min over [B, 1, 1, S]; no output projection."""

    def __init__(self, hidden_size: int = 32, num_attention_heads: int = 4, bug: str = ""):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.bug = bug
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(hidden_size, self.all_head_size)
        self.value = nn.Linear(hidden_size, self.all_head_size)
        _trained(self.query, self.key, self.value)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)  # [B, heads, n, head_size]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        extended = (1.0 - encoder_attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
        value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))  # [B, heads, n_Q, n_K]
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if self.bug == "scale_twice":
            attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + extended
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))  # [B, n_Q, hidden]


class FairseqPadded(nn.Module):
    """fairseq's MultiheadAttention, batch first: q scaled by head_dim^-0.5 after q_proj, [bsz·heads, n, head_dim]
    bmm, the key_padding_mask [bsz, src_len] (True marks a padded key) filled with -inf over the 4-D view."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4, bug: str = ""):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        _trained(self.q_proj, self.k_proj, self.v_proj, self.out_proj)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor) -> torch.Tensor:
        bsz, tgt_len, embed_dim = query.size()
        src_len = key.size(1)
        q = self.q_proj(query)
        if self.bug != "no_scale":
            q = q * self.scaling
        k, v = self.k_proj(key), self.v_proj(value)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2).reshape(-1, tgt_len, self.head_dim)
        k = k.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2).reshape(-1, src_len, self.head_dim)
        v = v.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2).reshape(-1, src_len, self.head_dim)
        attn_weights = torch.bmm(q, k.transpose(1, 2))  # [bsz·heads, tgt_len, src_len]
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
        attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                                                float("-inf"))
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)  # [bsz·heads, tgt_len, head_dim]
        attn = attn.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, n_Q, d], k and v [B, H, n_K, d], key_padding_mask [B, n_K] (True = a real token): SDPA with the padding
    broadcast over heads and queries."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_padding_mask[:, None, None, :].bool())


def padded_attention_unscaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor
                              ) -> torch.Tensor:
    """padded_attention written out, its scores never scaled (the plant)."""
    scores = q @ k.transpose(-2, -1)  # [B, H, n_Q, n_K]
    scores = scores.masked_fill(~key_padding_mask[:, None, None, :].bool(), float("-inf"))
    return scores.softmax(-1) @ v
