"""Cross-attention whose queries and keys join a positional part of their own to each head (Conditional DETR's and
DAB-DETR's decoder: `cat([q_content, q_pos])` per head), for tests/test_trace_round51_headparts.py. Written with the
heads folded into the batch for bmm, as fairseq-style code does, the positional part before or after the content.
`bug` plants one mistake: "scale_head_dim" scales by the content's head width alone, "softmax_queries" takes the
softmax over the queries, "merge_no_transpose" merges the heads without moving them back behind the positions."""

import torch
from torch import nn


class JoinedPositionCrossAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, pos_first=False, bug=None):
        super().__init__()
        self.h, self.d_head, self.pos_first, self.bug = n_heads, d_model // n_heads, pos_first, bug
        self.q_content = nn.Linear(d_model, d_model)
        self.q_pos = nn.Linear(d_model, d_model)
        self.k_content = nn.Linear(d_model, d_model)
        self.k_pos = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        width = self.d_head if bug == "scale_head_dim" else 2 * self.d_head
        self.scaling = width ** -0.5

    def _fold(self, content, pos):
        """[b, n, d_model] twice -> [b·h, n, 2·d_head], each head its content and positional parts joined."""
        b, n, _ = content.shape
        parts = [content.view(b, n, self.h, self.d_head), pos.view(b, n, self.h, self.d_head)]
        joined = torch.cat(parts[::-1] if self.pos_first else parts, dim=-1)
        return joined.permute(0, 2, 1, 3).reshape(b * self.h, n, 2 * self.d_head)

    def forward(self, tgt, memory, query_pos, memory_pos):
        b, n_q, d_model = tgt.shape
        n_k = memory.shape[1]
        q = self._fold(self.q_content(tgt), self.q_pos(query_pos)) * self.scaling
        k = self._fold(self.k_content(memory), self.k_pos(memory_pos))
        v = self.v_proj(memory).view(b, n_k, self.h, self.d_head).permute(0, 2, 1, 3).reshape(b * self.h, n_k, -1)
        weights = torch.bmm(q, k.transpose(1, 2)).softmax(dim=1 if self.bug == "softmax_queries" else -1)
        out = torch.bmm(weights, v).view(b, self.h, n_q, self.d_head)
        if self.bug == "merge_no_transpose":
            out = out.reshape(b, n_q, d_model)
        else:
            out = out.transpose(1, 2).reshape(b, n_q, d_model)
        return self.out_proj(out)
