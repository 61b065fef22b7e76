"""ChatGLM2/3's SelfAttention (THUDM modeling_chatglm.py), shrunk: time-first [sq, b, h]; one query_key_value Linear
(with bias) making the queries of num_attention_heads heads and the keys and values of multi_query_group_num groups;
RoPE on the first half of each head only (RotaryEmbedding(kv_channels // 2): a rope cache [sq, b, rot/2, 2] of
(cos, sin), the pairs (2i, 2i + 1) of that half turned by torch.stack, the other half passed); the groups widened by
unsqueeze(-2).expand(...).contiguous().view(...); CoreAttention's explicit path: baddbmm with alpha = 1/norm_factor,
norm_factor = sqrt(hn) * coeff (apply_query_key_layer_scaling, coeff = layer_number), the scores multiplied back by
coeff in float32, masked_fill(attention_mask, -inf) with attention_mask True = masked (the model's
`full_attention_mask < 0.5`), or a causal mask of its own where none is given; bmm with the values, permute back to
[sq, b, np, hn] and the dense projection.

Planted bugs (bug=...):
  'no_coeff'       the scores never multiplied back by coeff: divided by sqrt(hn) * layer_number
  'mask_inverted'  the SDPA path's `attention_mask = ~attention_mask` kept in the explicit path
  'group_tiled'    key_layer.unsqueeze(-3) (the copies before the groups' axis): the groups tiled
  'rope_halfsplit' the rotated half turned as rotate_half (i, i + rot/2) with ChatGLM's interleaved cache
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, rope_ratio=1, original_impl=False, device=None, dtype=None):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).to(dtype=dtype) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim
        self.original_impl = original_impl
        self.rope_ratio = rope_ratio

    def forward_impl(self, seq_len: int, n_elem: int, dtype: torch.dtype, device: torch.device, base: int = 10000):
        base = base * self.rope_ratio
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float, device=device) / n_elem))
        # Create position indexes `[0, 1, ..., seq_len - 1]`
        seq_idx = torch.arange(seq_len, dtype=torch.float, device=device)
        # Calculate the product of position index and $\theta_i$
        idx_theta = torch.outer(seq_idx, theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        # this is to mimic the behaviour of complex32, else we will get different results
        if dtype in (torch.float16, torch.bfloat16, torch.int8):
            cache = cache.bfloat16() if dtype == torch.bfloat16 else cache.half()
        return cache

    def forward(self, max_seq_len, offset=0):
        return self.forward_impl(max_seq_len, self.dim, dtype=self.inv_freq.dtype, device=self.inv_freq.device)


def apply_rotary_pos_emb(x: torch.Tensor, rope_cache: torch.Tensor, bug=None) -> torch.Tensor:
    # x: [sq, b, np, hn]
    sq, np = x.size(0), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    # truncate to support variable sizes
    rope_cache = rope_cache[:sq]
    if bug == "rope_halfsplit":
        cos = rope_cache[..., 0].repeat(1, 1, 2).view(sq, -1, 1, rot_dim)
        sin = rope_cache[..., 1].repeat(1, 1, 2).view(sq, -1, 1, rot_dim)
        x1, x2 = x[..., : rot_dim // 2], x[..., rot_dim // 2 :]
        x_out2 = x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((x_out2, x_pass), dim=-1)
    xshaped = x.reshape(sq, -1, np, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return torch.cat((x_out2, x_pass), dim=-1)


class CoreAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, kv_channels, layer_number, attention_dropout=0.0,
                 apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True, bug=None):
        super().__init__()
        self.apply_query_key_layer_scaling = apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = attention_softmax_in_fp32
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        self.layer_number = max(1, layer_number)
        self.bug = bug

        projection_size = kv_channels * num_attention_heads
        # Per attention head and per partition values.
        self.hidden_size_per_partition = projection_size
        self.hidden_size_per_attention_head = projection_size // num_attention_heads
        self.num_attention_heads_per_partition = num_attention_heads

        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if self.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.coeff = coeff

        self.attention_dropout = torch.nn.Dropout(attention_dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.view(output_size[2], output_size[0] * output_size[1], -1)
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)

        # preallocting input tensor: [b * np, sq, sk]
        matmul_input_buffer = torch.empty(
            output_size[0] * output_size[1], output_size[2], output_size[3], dtype=query_layer.dtype,
            device=query_layer.device
        )

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.baddbmm(
            matmul_input_buffer,
            query_layer.transpose(0, 1),  # [b * np, sq, hn]
            key_layer.transpose(0, 1).transpose(1, 2),  # [b * np, hn, sk]
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)

        # ===========================
        # Attention probs and dropout
        # ===========================

        # attention scores and attention mask [b, np, sq, sk]
        if self.attention_softmax_in_fp32:
            attention_scores = attention_scores.float()
        if self.coeff is not None and self.bug != "no_coeff":
            attention_scores = attention_scores * self.coeff
        if attention_mask is None and attention_scores.shape[2] == attention_scores.shape[3]:
            attention_mask = torch.ones(output_size[0], 1, output_size[2], output_size[3],
                                        device=attention_scores.device, dtype=torch.bool)
            attention_mask.tril_()
            attention_mask = ~attention_mask
        if attention_mask is not None:
            if self.bug == "mask_inverted":
                attention_mask = ~attention_mask
            attention_scores = attention_scores.masked_fill(attention_mask, float("-inf"))
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = attention_probs.type_as(value_layer)

        # This is actually dropout-ing out entire tokens to attend to, which might
        # seem a bit unusual, but is taken from the original Transformer paper.
        attention_probs = self.attention_dropout(attention_probs)
        # =========================
        # Context layer. [sq, b, hp]
        # =========================

        # value_layer -> context layer.
        # [sk, b, np, hn] --> [b, np, sq, hn]

        # context layer shape: [b, np, sq, hn]
        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        # change view [sk, b * np, hn]
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
        # change view [b * np, sq, sk]
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        # matmul: [b * np, sq, hn]
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        # change view [b, np, sq, hn]
        context_layer = context_layer.view(*output_size)
        # [b, np, sq, hn] --> [sq, b, np, hn]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        context_layer = context_layer.view(*new_context_layer_shape)

        return context_layer


class SelfAttention(torch.nn.Module):
    """Parallel self-attention layer abstract class.

    Self-attention layer takes input with size [s, b, h]
    and returns output of the same size.
    """

    def __init__(self, hidden_size=64, num_attention_heads=4, multi_query_group_num=2, kv_channels=16,
                 layer_number=6, seq_length=64, add_qkv_bias=True, bug=None):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.bug = bug

        self.projection_size = kv_channels * num_attention_heads

        # Per attention head and per partition values.
        self.hidden_size_per_attention_head = self.projection_size // num_attention_heads
        self.num_attention_heads_per_partition = num_attention_heads

        self.multi_query_attention = True
        self.qkv_hidden_size = 3 * self.projection_size
        if self.multi_query_attention:
            self.num_multi_query_groups_per_partition = multi_query_group_num
            self.qkv_hidden_size = (
                self.projection_size + 2 * self.hidden_size_per_attention_head * multi_query_group_num
            )
        self.query_key_value = nn.Linear(hidden_size, self.qkv_hidden_size, bias=add_qkv_bias)

        self.core_attention = CoreAttention(hidden_size, num_attention_heads, kv_channels, self.layer_number,
                                            bug=bug)

        # Output.
        self.dense = nn.Linear(self.projection_size, hidden_size, bias=False)

        # the model's RotaryEmbedding (ChatGLMModel: RotaryEmbedding(rotary_dim // 2)), kept here
        self.seq_length = seq_length
        self.rotary_pos_emb = RotaryEmbedding(kv_channels // 2, original_impl=True)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None, kv_cache=None, use_cache=False):
        # hidden_states: [sq, b, h]
        if rotary_pos_emb is None:  # as ChatGLMModel.forward makes it: [sq, b, rot/2 // ... , 2]
            seq_len, batch = hidden_states.shape[0], hidden_states.shape[1]
            rotary_pos_emb = self.rotary_pos_emb(self.seq_length)
            position_ids = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).repeat(batch, 1)
            rotary_pos_emb = rotary_pos_emb[position_ids]
            rotary_pos_emb = rotary_pos_emb.transpose(0, 1).contiguous()

        # =====================
        # Query, Key, and Value
        # =====================

        # Attention heads [sq, b, h] --> [sq, b, (np * 3 * hn)]
        mixed_x_layer = self.query_key_value(hidden_states)

        if self.multi_query_attention:
            (query_layer, key_layer, value_layer) = mixed_x_layer.split(
                [
                    self.num_attention_heads_per_partition * self.hidden_size_per_attention_head,
                    self.num_multi_query_groups_per_partition * self.hidden_size_per_attention_head,
                    self.num_multi_query_groups_per_partition * self.hidden_size_per_attention_head,
                ],
                dim=-1,
            )
            query_layer = query_layer.view(
                query_layer.size()[:-1] + (self.num_attention_heads_per_partition, self.hidden_size_per_attention_head)
            )
            key_layer = key_layer.view(
                key_layer.size()[:-1] + (self.num_multi_query_groups_per_partition, self.hidden_size_per_attention_head)
            )
            value_layer = value_layer.view(
                value_layer.size()[:-1]
                + (self.num_multi_query_groups_per_partition, self.hidden_size_per_attention_head)
            )

        # apply relative positional encoding (rotary embedding)
        if rotary_pos_emb is not None:
            query_layer = apply_rotary_pos_emb(query_layer, rotary_pos_emb, bug=self.bug)
            key_layer = apply_rotary_pos_emb(key_layer, rotary_pos_emb, bug=self.bug)

        # adjust key and value for inference
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            key_layer = torch.cat((cache_k, key_layer), dim=0)
            value_layer = torch.cat((cache_v, value_layer), dim=0)
        if use_cache:
            kv_cache = (key_layer, value_layer)
        else:
            kv_cache = None

        if self.multi_query_attention:
            axis = -3 if self.bug == "group_tiled" else -2
            key_layer = key_layer.unsqueeze(axis)
            key_layer = key_layer.expand(
                -1, -1, -1, self.num_attention_heads_per_partition // self.num_multi_query_groups_per_partition, -1
            ) if axis == -2 else key_layer.expand(
                -1, -1, self.num_attention_heads_per_partition // self.num_multi_query_groups_per_partition, -1, -1
            )
            key_layer = key_layer.contiguous().view(
                key_layer.size()[:2] + (self.num_attention_heads_per_partition, self.hidden_size_per_attention_head)
            )
            value_layer = value_layer.unsqueeze(axis)
            value_layer = value_layer.expand(
                -1, -1, -1, self.num_attention_heads_per_partition // self.num_multi_query_groups_per_partition, -1
            ) if axis == -2 else value_layer.expand(
                -1, -1, self.num_attention_heads_per_partition // self.num_multi_query_groups_per_partition, -1, -1
            )
            value_layer = value_layer.contiguous().view(
                value_layer.size()[:2]
                + (self.num_attention_heads_per_partition, self.hidden_size_per_attention_head)
            )

        # ==================================
        # core attention computation
        # ==================================

        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)

        # =================
        # Output. [sq, b, h]
        # =================

        output = self.dense(context_layer)

        return output, kv_cache
