"""Cross-attention whose keys and values read an input of another width than the queries' (docs/trace.md,
"Keys and values of another width"): Perceiver IO's decoder cross-attend, its memory behind another optional
parameter and read by a fused `to_kv` of its own width, and a BLIP-2 Q-Former's query tokens attending to image
embeddings of `encoder_width`."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class CrossAttend(nn.Module):
    def __init__(self, dim=32, feat_dim=16, heads=4, dim_head=8):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(feat_dim, 2 * heads * dim_head, bias=False)
        self.proj = nn.Linear(heads * dim_head, dim)

    def forward(self, queries, attn_bias=None, features=None):
        k, v = self.to_kv(queries if features is None else features).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (self.to_q(queries), k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale)
        return self.proj(out.transpose(1, 2).flatten(2))  # [b, n, h·d]


class QueryPool(nn.Module):
    def __init__(self, num_query_tokens=5, hidden_size=32, encoder_width=16, num_attention_heads=4):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.randn(1, num_query_tokens, hidden_size) * 0.02)
        self.heads, self.head_size = num_attention_heads, hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(encoder_width, hidden_size)
        self.value = nn.Linear(encoder_width, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def split(self, x):
        return x.view(*x.shape[:-1], self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, image_embeds, image_attention_mask=None):
        q = self.split(self.query(self.query_tokens.expand(image_embeds.shape[0], -1, -1)))
        k, v = self.split(self.key(image_embeds)), self.split(self.value(image_embeds))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size)
        if image_attention_mask is not None:
            scores = scores + (1.0 - image_attention_mask[:, None, None, :].to(scores.dtype)) * -10000.0
        context = (scores.softmax(dim=-1) @ v).permute(0, 2, 1, 3)
        return self.dense(context.reshape(*context.shape[:2], -1))
