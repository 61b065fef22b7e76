"""Styles for tests/test_trace_round42.py. MMCV's `MultiheadAttention` (mmcv.cnn.bricks.transformer): a wrapper of
`nn.MultiheadAttention`, `batch_first` inputs turned time-first for it, `identity + dropout_layer(proj_drop(out))`;
and a BART-style self-attention whose output projection's result goes through a dropout written by hand (a keep-mask
from `torch.rand_like`, flax's port: `out * keep / (1 - p)`), drawn only when training. `bug=` plants a mistake:
'proj_drop_on' is MMCV's proj_drop as `F.dropout(out, p)`, whose `training` defaults to True (active in eval());
'keep_always' draws the hand-written keep-mask in eval() too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


class MMCVAttention(nn.Module):
    """mmcv.cnn.bricks.transformer.MultiheadAttention, batch_first, its attn a torch nn.MultiheadAttention."""

    def __init__(self, embed_dims=32, num_heads=4, attn_drop=0.0, proj_drop=0.1, batch_first=True, bug=None):
        super().__init__()
        self.embed_dims, self.num_heads, self.batch_first, self.bug = embed_dims, num_heads, batch_first, bug
        self.attn = nn.MultiheadAttention(embed_dims, num_heads, attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)
        self.dropout_layer = nn.Identity()
        _moved(self, 421)

    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None, attn_mask=None,
                key_padding_mask=None):
        if key is None:
            key = query
        if value is None:
            value = key
        if identity is None:
            identity = query
        if key_pos is None and query_pos is not None and query_pos.shape == key.shape:
            key_pos = query_pos
        if query_pos is not None:
            query = query + query_pos
        if key_pos is not None:
            key = key + key_pos
        if self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if self.bug == "kv_swapped":
            key, value = value, key
        out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask,
                        key_padding_mask=key_padding_mask)[0]
        if self.batch_first:
            out = out.transpose(0, 1)
        if self.bug == "proj_drop_on":
            return identity + self.dropout_layer(F.dropout(out, self.proj_drop.p))
        return identity + self.dropout_layer(self.proj_drop(out))


class KeepMaskAttention(nn.Module):
    """BART-style self-attention (q scaled at its projection, [b, h, n, d] heads), its output projection's result
    dropped by a keep-mask drawn by hand when training, as a port of flax code writes `deterministic`."""

    def __init__(self, embed_dim=32, num_heads=4, dropout=0.1, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.bug = dropout, bug
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 422)

    def _shape(self, t, bsz):
        return t.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None):
        bsz, n, _ = hidden_states.shape
        q = self._shape(self.q_proj(hidden_states) * self.head_dim ** -0.5, bsz)
        k = self._shape(self.k_proj(hidden_states), bsz)
        v = self._shape(self.v_proj(hidden_states), bsz)
        weights = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            weights = weights + attention_mask
        out = (weights.softmax(-1) @ v).transpose(1, 2).reshape(bsz, n, self.embed_dim)
        out = self.out_proj(out)
        if self.training or self.bug == "keep_always":
            keep = torch.rand_like(out) >= self.dropout
            out = out * keep / (1 - self.dropout)
        return out


class DetrSelfAttention(nn.Module):
    """DETR's attention (transformers' DetrAttention): a position embedding added to what q_proj and k_proj read
    (`with_pos_embed`), v_proj reading the input alone; q scaled at its projection, heads folded into the batch for
    `bmm`. 'proj_swapped' makes the keys with v_proj and the values with k_proj, each from its own input."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim, self.bug = embed_dim, num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 423)

    def with_pos_embed(self, tensor, object_queries):
        return tensor if object_queries is None else tensor + object_queries

    def _shape(self, tensor, seq_len, batch_size):
        return tensor.view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, object_queries=None):
        batch_size, target_len, embed_dim = hidden_states.size()
        hidden_states_original = hidden_states
        hidden_states = self.with_pos_embed(hidden_states, object_queries)
        query_states = self.q_proj(hidden_states) * self.scaling
        k_proj, v_proj = (self.v_proj, self.k_proj) if self.bug == "proj_swapped" else (self.k_proj, self.v_proj)
        key_states = self._shape(k_proj(hidden_states), -1, batch_size)
        value_states = self._shape(v_proj(hidden_states_original), -1, batch_size)
        proj_shape = (batch_size * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, target_len, batch_size).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = (attn_weights.view(batch_size, self.num_heads, target_len, -1) + attention_mask
                            ).view(batch_size * self.num_heads, target_len, -1)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(batch_size, self.num_heads, target_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(batch_size, target_len, embed_dim)
        return self.out_proj(attn_output), attn_probs


class MegatronGQA(nn.Module):
    """Megatron-LM's legacy ParallelAttention with group_query_attention (one tensor-parallel rank): time-first
    `[s, b, h]`, one fused `query_key_value` laid out per group (each group's query heads, then its key, then its
    value: `view(s, b, ng, (np // ng + 2) * hn)` and `torch.split(.., [np // ng * hn, hn, hn], dim=3)`), its weights
    drawn as Megatron's init_method does, `normal_(std=0.02)` on the global generator (no qkv bias); the key/value heads
    `repeat_interleave`d, `baddbmm(beta=0, alpha=1/norm_factor)` over the heads folded into the batch, the mask True
    where masked, filled with -10000. 'kv_tiled' repeats the key/value heads with `.repeat` (tiled)."""

    def __init__(self, hidden_size=64, num_attention_heads=4, num_query_groups=2, bug=None):
        super().__init__()
        self.np, self.ng, self.hn = num_attention_heads, num_query_groups, hidden_size // num_attention_heads
        self.bug = bug
        self.norm_factor = self.hn ** 0.5
        width = (self.np + 2 * self.ng) * self.hn
        self.qkv_weight = nn.Parameter(torch.empty(width, hidden_size))  # add_qkv_bias=False, as LLaMA-style configs
        self.dense_weight = nn.Parameter(torch.empty(hidden_size, self.np * self.hn))
        for p in (self.qkv_weight, self.dense_weight):
            torch.nn.init.normal_(p, mean=0.0, std=0.02)

    def _expand_kv(self, layer):
        if self.bug == "kv_tiled":
            return layer.repeat(1, 1, self.np // self.ng, 1)
        return layer.repeat_interleave(self.np // self.ng, dim=2)

    def forward(self, hidden_states, attention_mask):
        mixed_x_layer = F.linear(hidden_states, self.qkv_weight)
        new_tensor_shape = mixed_x_layer.size()[:-1] + (self.ng, (self.np // self.ng + 2) * self.hn)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        query_layer, key_layer, value_layer = torch.split(
            mixed_x_layer, [self.np // self.ng * self.hn, self.hn, self.hn], dim=3)
        query_layer = query_layer.reshape(query_layer.size(0), query_layer.size(1), -1, self.hn)
        key_layer, value_layer = self._expand_kv(key_layer), self._expand_kv(value_layer)
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        query_layer = query_layer.reshape(sq, b * np_, -1)
        key_layer = key_layer.view(sk, b * np_, -1)
        buffer = torch.empty(b * np_, sq, sk, dtype=query_layer.dtype, device=query_layer.device)
        scores = torch.baddbmm(buffer, query_layer.transpose(0, 1), key_layer.transpose(0, 1).transpose(1, 2),
                               beta=0.0, alpha=1.0 / self.norm_factor)
        scores = scores.view(b, np_, sq, sk)
        scores = scores.masked_fill(attention_mask, -10000.0)
        probs = torch.nn.Softmax(dim=-1)(scores)
        value_layer = value_layer.view(sk, b * np_, -1)
        context = torch.bmm(probs.view(b * np_, sq, -1), value_layer.transpose(0, 1))
        context = context.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous()
        context = context.view(sq, b, np_ * hn)
        return F.linear(context, self.dense_weight)
