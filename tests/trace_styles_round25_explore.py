"""Round 25's explorer styles: five attention modules in idioms of real code not traced before, each correct by
default and with bugs planted through `bug=...`.

- `LevitAttention` (HF LeViT): one projection viewed per head and split [key_dim, key_dim, d_value] (values wider
  than the keys), scores `q @ kᵀ * scale + attention_biases[:, attention_bias_idxs]` (a learned bias per offset,
  gathered by a buffer of indices), a Hardswish before the output projection.
- `VideoMAEAttention` (HF VideoMAE): `F.linear(x, qkv.weight, cat(q_bias, zeros_like(v_bias), v_bias))`, packed
  [3, H, d] reshape, queries scaled before the product.
- `LayoutLMv3Attention` (HF LayoutLMv3): queries divided by √d before the product, a 1-D relative bias (one-hot of
  clipped distances through a Linear) and a 2-D one (from a buffer of boxes) added divided by √d, an additive 4-D
  mask, then CogView's PB-Relax softmax: scores / alpha, minus their row max, times alpha.
- `BitNetAttention` (HF BitNet): GQA with RoPE, an RMSNorm over the merged heads (`attn_sub_norm`) before o_proj.
- `HunyuanAttention` (HF HunYuan v1): GQA, RoPE, then a per-head RMSNorm of q and k after the rotation, causal.
- `HeadSubNormAttention` (torchscale's DiffTransformer, on one softmax): each head's output RMS-normed and scaled
  by (1 − lambda_init) before the heads merge.
Plants (`bug=`): LeViT's `no_scale`, `softmax_axis`, `merge_no_transpose`; VideoMAE's `values_from_keys`,
`scale_twice` (q scaled before a product scaled again), `dropout_on` (F.dropout's default training=True);
LayoutLMv3's `values_from_keys`, `no_scale`, `bias_transposed` (the summed bias transposed after its scale),
`bias_after` (added to the weights); BitNet's `rope_on_values`, `gqa_tiled` (`.repeat` for repeat_kv),
`merge_no_transpose`, `k_unrotated` (RoPE on the queries alone); Hunyuan's `split_no_transpose` (the keys viewed
straight as heads), `k_unnormed`, `no_scale` (SDPA's scale=1), `k_unrotated` (its keys normed, never rotated);
HeadSubNorm's `no_scale`, `values_from_keys`, `merge_no_transpose`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    """Weights moved off their initial values, biases not zero, norm gains off 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else 0.05))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(n: int, d: int, base: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


class RmsNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(width)), eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class LevitAttention(nn.Module):
    """HF LevitAttention (its MLPLayerWithBN's batch norms folded into plain Linears)."""

    def __init__(self, hidden_sizes=32, key_dim=6, num_attention_heads=4, attention_ratio=2, resolution=3, bug=None):
        super().__init__()
        self.num_attention_heads, self.scale, self.key_dim = num_attention_heads, key_dim ** -0.5, key_dim
        self.attention_ratio, self.bug = attention_ratio, bug
        self.out_dim_keys_values = attention_ratio * key_dim * num_attention_heads + key_dim * num_attention_heads * 2
        self.out_dim_projection = attention_ratio * key_dim * num_attention_heads
        self.queries_keys_values = nn.Linear(hidden_sizes, self.out_dim_keys_values)
        self.activation = nn.Hardswish()
        self.projection = nn.Linear(self.out_dim_projection, hidden_sizes)
        points = [(x, y) for x in range(resolution) for y in range(resolution)]
        attention_offsets, indices = {}, []
        for p1 in points:
            for p2 in points:
                offset = (abs(p1[0] - p2[0]), abs(p1[1] - p2[1]))
                if offset not in attention_offsets:
                    attention_offsets[offset] = len(attention_offsets)
                indices.append(attention_offsets[offset])
        self.attention_biases = nn.Parameter(torch.zeros(num_attention_heads, len(attention_offsets)))
        self.register_buffer("attention_bias_idxs", torch.LongTensor(indices).view(len(points), len(points)),
                             persistent=False)
        _trained(self, 251)
        with torch.no_grad():
            self.attention_biases.mul_(5.0)

    def forward(self, hidden_state):
        batch_size, seq_length, _ = hidden_state.shape
        queries_keys_values = self.queries_keys_values(hidden_state)
        query, key, value = queries_keys_values.view(batch_size, seq_length, self.num_attention_heads, -1).split(
            [self.key_dim, self.key_dim, self.attention_ratio * self.key_dim], dim=3)
        query = query.permute(0, 2, 1, 3)
        key = key.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)
        bias = self.attention_biases[:, self.attention_bias_idxs]
        scale = 1.0 if self.bug == "no_scale" else self.scale
        attention = query @ key.transpose(-2, -1) * scale + bias
        attention = attention.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        hidden_state = attention @ value  # [b, h, n, d_v]
        if self.bug != "merge_no_transpose":
            hidden_state = hidden_state.transpose(1, 2)  # [b, n, h, d_v]
        hidden_state = hidden_state.reshape(batch_size, seq_length, self.out_dim_projection)
        return self.projection(self.activation(hidden_state))


class VideoMAEAttention(nn.Module):
    """HF VideoMAESelfAttention + VideoMAESelfOutput's dense."""

    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or SimpleNamespace(hidden_size=32, num_attention_heads=4, qkv_bias=True)
        c, self.bug = self.config, bug
        self.num_attention_heads = c.num_attention_heads
        self.attention_head_size = c.hidden_size // c.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(c.hidden_size, self.all_head_size, bias=False)
        self.key = nn.Linear(c.hidden_size, self.all_head_size, bias=False)
        self.value = nn.Linear(c.hidden_size, self.all_head_size, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(self.all_head_size))
        self.v_bias = nn.Parameter(torch.zeros(self.all_head_size))
        self.dense = nn.Linear(self.all_head_size, c.hidden_size)
        _trained(self, 252)

    def forward(self, hidden_states, head_mask=None):
        b, n, _ = hidden_states.shape
        k_bias = torch.zeros_like(self.v_bias, requires_grad=False)
        keys = F.linear(input=hidden_states, weight=self.key.weight, bias=k_bias)
        values = F.linear(input=hidden_states, weight=self.value.weight, bias=self.v_bias)
        queries = F.linear(input=hidden_states, weight=self.query.weight, bias=self.q_bias)
        key_layer = keys.view(b, n, self.num_attention_heads, self.attention_head_size).transpose(1, 2)
        value_layer = values.view(b, n, self.num_attention_heads, self.attention_head_size).transpose(1, 2)
        query_layer = queries.view(b, n, self.num_attention_heads, self.attention_head_size).transpose(1, 2)
        if self.bug == "values_from_keys":
            value_layer = key_layer
        scaling = self.attention_head_size ** -0.5
        if self.bug == "scale_twice":
            query_layer = query_layer * scaling
        attn_weights = torch.matmul(query_layer, key_layer.transpose(2, 3)) * scaling
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_layer.dtype)
        if self.bug == "dropout_on":
            attn_weights = F.dropout(attn_weights, p=0.1)
        attn_output = torch.matmul(attn_weights, value_layer)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(b, n, self.all_head_size)
        return self.dense(attn_output)


class LayoutLMv3Attention(nn.Module):
    """HF LayoutLMv3SelfAttention with the encoder's 1-D and 2-D relative position biases made inside, and its
    output dense."""

    def __init__(self, hidden_size=32, num_attention_heads=4, rel_pos_bins=8, max_rel_pos=16, max_tokens=16,
                 bug=None):
        super().__init__()
        self.num_attention_heads, self.bug = num_attention_heads, bug
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.rel_pos_bins, self.max_rel_pos = rel_pos_bins, max_rel_pos
        self.rel_pos_bias = nn.Linear(rel_pos_bins, num_attention_heads, bias=False)
        self.rel_pos_x_bias = nn.Linear(rel_pos_bins, num_attention_heads, bias=False)
        self.rel_pos_y_bias = nn.Linear(rel_pos_bins, num_attention_heads, bias=False)
        g = torch.Generator().manual_seed(7)
        self.register_buffer("boxes", torch.randint(0, 40, (max_tokens, 2), generator=g), persistent=False)
        _trained(self, 253)
        with torch.no_grad():
            for lin in (self.rel_pos_bias, self.rel_pos_x_bias, self.rel_pos_y_bias):
                lin.weight.mul_(20.0)

    def _bucket(self, relative_position):
        return relative_position.clamp(-self.rel_pos_bins // 2, self.rel_pos_bins // 2 - 1) + self.rel_pos_bins // 2

    def _cal_1d_pos_emb(self, position_ids):
        rel_pos_mat = position_ids.unsqueeze(-2) - position_ids.unsqueeze(-1)
        rel_pos = F.one_hot(self._bucket(rel_pos_mat), num_classes=self.rel_pos_bins).to(self.rel_pos_bias.weight.dtype)
        return self.rel_pos_bias(rel_pos).permute(0, 3, 1, 2).contiguous()

    def _cal_2d_pos_emb(self, bbox):
        rel_x = bbox[:, :, 0].unsqueeze(-2) - bbox[:, :, 0].unsqueeze(-1)
        rel_y = bbox[:, :, 1].unsqueeze(-2) - bbox[:, :, 1].unsqueeze(-1)
        rel_x = F.one_hot(self._bucket(rel_x // 4), num_classes=self.rel_pos_bins).to(self.rel_pos_bias.weight.dtype)
        rel_y = F.one_hot(self._bucket(rel_y // 4), num_classes=self.rel_pos_bins).to(self.rel_pos_bias.weight.dtype)
        rel_x = self.rel_pos_x_bias(rel_x).permute(0, 3, 1, 2)
        rel_y = self.rel_pos_y_bias(rel_y).permute(0, 3, 1, 2)
        return (rel_x + rel_y).contiguous()

    def cogview_attention(self, attention_scores, alpha=32):
        scaled_attention_scores = attention_scores / alpha
        max_value = scaled_attention_scores.amax(dim=(-1)).unsqueeze(-1)
        new_attention_scores = (scaled_attention_scores - max_value) * alpha
        return nn.Softmax(dim=-1)(new_attention_scores)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        position_ids = torch.arange(n, device=hidden_states.device).expand(b, n)
        rel_pos = self._cal_1d_pos_emb(position_ids)
        rel_2d_pos = self._cal_2d_pos_emb(self.boxes[:n].expand(b, n, 2))
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if self.bug == "values_from_keys":
            value_layer = key_layer
        div = 1.0 if self.bug == "no_scale" else math.sqrt(self.attention_head_size)
        attention_scores = torch.matmul(query_layer / div, key_layer.transpose(-1, -2))
        position_bias = (rel_pos + rel_2d_pos) / math.sqrt(self.attention_head_size)
        if self.bug == "bias_transposed":
            position_bias = position_bias.transpose(-1, -2)
        if self.bug != "bias_after":
            attention_scores += position_bias
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.cogview_attention(attention_scores)
        if self.bug == "bias_after":
            attention_probs = attention_probs + position_bias
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return self.dense(context_layer)


class BitNetAttention(nn.Module):
    """HF BitNetAttention (its weights unquantized): GQA, RoPE, causal, attn_sub_norm over the merged heads."""

    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                rope_theta=500000.0, rms_norm_eps=1e-5)
        c, self.bug = self.config, bug
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.num_key_value_groups = c.num_attention_heads // c.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * self.head_dim, c.hidden_size, bias=False)
        self.attn_sub_norm = RmsNorm(c.hidden_size, eps=c.rms_norm_eps)
        _trained(self, 254)

    def forward(self, hidden_states, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = _cos_sin(input_shape[-1], self.head_dim, self.config.rope_theta, hidden_states.dtype)
        query_states = query_states * cos + _rotate_half(query_states) * sin
        if self.bug != "k_unrotated":
            key_states = key_states * cos + _rotate_half(key_states) * sin
        if self.bug == "rope_on_values":
            value_states = value_states * cos + _rotate_half(value_states) * sin
        if self.bug == "gqa_tiled":
            key_states = key_states.repeat(1, self.num_key_value_groups, 1, 1)
            value_states = value_states.repeat(1, self.num_key_value_groups, 1, 1)
        else:
            key_states = _repeat_kv(key_states, self.num_key_value_groups)
            value_states = _repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        if self.bug != "merge_no_transpose":
            attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.attn_sub_norm(attn_output)
        return self.o_proj(attn_output)


class HunyuanAttention(nn.Module):
    """HF HunYuanDenseV1Attention: GQA, RoPE, then query_layernorm and key_layernorm over each rotated head, SDPA."""

    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or SimpleNamespace(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                                rope_theta=10000.0, rms_norm_eps=1e-5, use_qk_norm=True)
        c, self.bug = self.config, bug
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * self.head_dim, c.hidden_size, bias=False)
        self.query_layernorm = RmsNorm(self.head_dim, eps=c.rms_norm_eps)
        self.key_layernorm = RmsNorm(self.head_dim, eps=c.rms_norm_eps)
        _trained(self, 255)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        hidden_shape = (b, n, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.bug == "split_no_transpose":
            key_states = self.k_proj(hidden_states).view(b, -1, n, self.head_dim)
        cos, sin = _cos_sin(n, self.head_dim, self.config.rope_theta, hidden_states.dtype)
        query_states = query_states * cos + _rotate_half(query_states) * sin
        if self.bug != "k_unrotated":
            key_states = key_states * cos + _rotate_half(key_states) * sin
        query_states = self.query_layernorm(query_states)
        if self.bug != "k_unnormed":
            key_states = self.key_layernorm(key_states)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True,
                                                     enable_gqa=True, scale=1.0 if self.bug == "no_scale" else None)
        attn_output = attn_output.transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(attn_output)


class HeadSubNormAttention(nn.Module):
    """Each head's output RMS-normed over its d_head and scaled by (1 − lambda_init) before the heads merge, as
    torchscale's DiffTransformer does to its (differential) attention, here on one softmax; separate projections."""

    def __init__(self, embed_dim=32, num_heads=4, lambda_init=0.2, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.lambda_init, self.bug = num_heads, embed_dim // num_heads, lambda_init, bug
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.subln = RmsNorm(self.head_dim, eps=1e-5)
        _trained(self, 256)

    def forward(self, x):
        bsz, tgt_len, _ = x.shape
        q = self.q_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        if self.bug == "values_from_keys":
            v = k
        q = q * (1.0 if self.bug == "no_scale" else self.head_dim ** -0.5)
        attn_weights = torch.matmul(q, k.transpose(-1, -2))  # [b, h, n, n]
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        attn = torch.matmul(attn_weights, v)  # [b, h, n, d]
        attn = self.subln(attn)
        attn = attn * (1 - self.lambda_init)
        if self.bug != "merge_no_transpose":
            attn = attn.transpose(1, 2)
        attn = attn.reshape(bsz, tgt_len, self.num_heads * self.head_dim)
        return self.out_proj(attn)
