"""A self-attention with a branch of its own beside the heads, in the style of transformers' ConvBertSelfAttention
(models/convbert/modeling_convbert.py): `query`, `key`, `value` write half the heads' width, and `conv_out_layer`,
a Linear named like an output projection, reads the module's input for a span-based convolution whose kernel is a
softmax of its own; the two branches' heads are joined on the heads' axis and there is no output projection."""

from __future__ import annotations

import math

import torch
from torch import nn


class ConvBranchAttention(nn.Module):
    def __init__(self, hidden_size: int = 32, num_attention_heads: int = 8, kernel: int = 3, bug: str | None = None):
        super().__init__()
        self.num_attention_heads = num_attention_heads // 2  # ConvBERT's head_ratio 2
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.kernel, self.bug = kernel, bug
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(hidden_size, self.all_head_size)
        self.value = nn.Linear(hidden_size, self.all_head_size)
        self.conv_kernel_layer = nn.Linear(self.all_head_size, self.num_attention_heads * kernel)
        self.conv_out_layer = nn.Linear(hidden_size, self.all_head_size)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        mixed_query_layer = self.query(hidden_states)
        mixed_key_layer = self.key(hidden_states)
        mixed_value_layer = self.value(hidden_states)
        # the convolution branch: a kernel per token and head from the queries, a softmax over its taps
        conv_kernel_layer = self.conv_kernel_layer(mixed_query_layer).view(-1, self.kernel, 1)
        conv_kernel_layer = torch.softmax(conv_kernel_layer, dim=1)
        conv_out_layer = self.conv_out_layer(hidden_states)
        padded = nn.functional.pad(conv_out_layer.transpose(1, 2), (self.kernel // 2, self.kernel // 2))
        unfolded = padded.unfold(-1, self.kernel, 1)  # [batch, all_head_size, length, kernel]
        unfolded = unfolded.permute(0, 2, 1, 3).reshape(-1, self.attention_head_size, self.kernel)
        conv_out = torch.matmul(unfolded, conv_kernel_layer).view(batch, length, self.num_attention_heads,
                                                                 self.attention_head_size)
        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        if self.bug == "scale_hidden":
            attention_scores = attention_scores / math.sqrt(hidden_states.shape[-1])
        else:
            attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-2 if self.bug == "softmax_axis" else -1)
        context_layer = torch.matmul(attention_probs, value_layer)
        if self.bug == "merge_no_transpose":
            context_layer = context_layer.reshape(batch, length, self.num_attention_heads, self.attention_head_size)
        else:
            context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = torch.cat([context_layer, conv_out], 2)
        return context_layer.view(batch, length, 2 * self.all_head_size)
