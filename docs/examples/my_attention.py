import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class MultiHeadedAttention(nn.Module):
    def __init__(self, d_feat, n_head, dropout=0.1):
        super().__init__()
        assert d_feat % n_head == 0
        self.d_feat = d_feat
        self.n_head = n_head
        self.d_head = d_feat // n_head
        self.W_q = nn.Linear(d_feat, d_feat)
        self.W_k = nn.Linear(d_feat, d_feat)
        self.W_v = nn.Linear(d_feat, d_feat)
        self.W_o = nn.Linear(d_feat, d_feat)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, Q, K, V, mask=None):
        n_batch = Q.size(0)
        Q_feat = self.W_q(Q)
        K_feat = self.W_k(K)
        V_feat = self.W_v(V)
        # [n_batch, n, d_feat] -> [n_batch, n_head, n, d_head]
        Q_split = Q_feat.view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        K_split = K_feat.view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        V_split = V_feat.view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        scores = torch.matmul(Q_split, K_split.transpose(-2, -1)) / np.sqrt(K.size()[-1])
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = F.softmax(scores, dim=-1)
        attention = self.dropout(attention)
        x_raw = torch.matmul(attention, V_split)
        # [n_batch, n_head, n_Q, d_head] -> [n_batch, n_Q, d_feat]
        x_rsh1 = x_raw.permute(0, 2, 1, 3).contiguous()
        x_rsh2 = x_rsh1.view(n_batch, -1, self.d_feat)
        x = self.W_o(x_rsh2)
        return {"Q_feat": Q_feat, "Q_split": Q_split, "scores": scores, "attention": attention,
                "x_raw": x_raw, "x_rsh2": x_rsh2, "x": x}


# The rest of this file is not in the tutorial's listing (docs/tutorial.md, "Is my attention right?"):
# the same module corrected, and attention as a function, (query, key, value, mask=None, dropout=None),
# as the Annotated Transformer writes it. Try each with `attnscope trace`:
#
#   attnscope trace docs/examples/my_attention.py:FixedAttention --init "d_feat=200, n_head=5"
#   attnscope trace docs/examples/my_attention.py:attention --causal


class FixedAttention(MultiHeadedAttention):
    """The same module, scores divided by sqrt(d_head)."""

    def forward(self, Q, K, V, mask=None):
        n_batch = Q.size(0)
        Q_split = self.W_q(Q).view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        K_split = self.W_k(K).view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        V_split = self.W_v(V).view(n_batch, -1, self.n_head, self.d_head).permute(0, 2, 1, 3)
        scores = torch.matmul(Q_split, K_split.transpose(-2, -1)) / np.sqrt(self.d_head)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.dropout(F.softmax(scores, dim=-1))
        x_raw = torch.matmul(attention, V_split)
        x_rsh2 = x_raw.permute(0, 2, 1, 3).contiguous().view(n_batch, -1, self.d_feat)
        return self.W_o(x_rsh2)


def attention(query, key, value, mask=None, dropout=None):
    """Scaled dot-product attention, the Annotated Transformer's function."""
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn
