"""A prefix LM's self-attention in the style of transformers' GIT (models/git/modeling_git.py: GitModel's
create_attention_mask and _generate_future_mask, folded into the attention): the first `num_image_tokens` positions
see each other both ways, each later (text) one sees them and the text up to itself; BERT-like query/key/value,
scores / √d_head plus the additive mask, no output projection."""

from __future__ import annotations

import math

import torch
from torch import nn


class PrefixSelfAttention(nn.Module):
    def __init__(self, hidden_size: int = 32, num_attention_heads: int = 4, num_image_tokens: int = 3,
                 bug: str | None = None):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.num_image_tokens, self.bug = num_image_tokens, bug
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)

    def _future_mask(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        diagonal = {"future_diagonal": 0, "future_wide": 2}.get(self.bug or "", 1)
        future = torch.triu(torch.ones(size, size), diagonal=diagonal)
        return future.masked_fill(future == 1, float("-inf")).to(dtype)

    def _create_attention_mask(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        images, texts = self.num_image_tokens, length - self.num_image_tokens
        top = torch.cat([torch.zeros(images, images), torch.full((images, texts), float("-inf"))], dim=1)
        bottom = torch.cat([torch.zeros(texts, images), self._future_mask(texts, torch.float32)], dim=1)
        return torch.cat([top, bottom], dim=0).to(dtype)[None, None]

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        mask = self._create_attention_mask(hidden_states.shape[1], attention_scores.dtype)
        attention_scores = attention_scores + mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*context_layer.shape[:2], -1)
