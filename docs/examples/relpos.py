"""ESPnet's RelPositionMultiHeadedAttention traced by itself (docs/trace.md, "A term of the code's own on its scores"
and "What each parameter of your forward gets"): forward(query, key, value, pos_emb, mask), pos_emb the relative
embedding [1, 2T-1, d] its encoder's RelPositionalEncoding makes. `transpose=False` splits the heads without the
transpose (a plant)."""

import math

import torch
from torch import nn


class RelPositionMultiHeadedAttention(nn.Module):
    def __init__(self, n_head=4, n_feat=32, dropout_rate=0.0, transpose=True):
        super().__init__()
        self.d_k, self.h, self.transpose = n_feat // n_head, n_head, transpose
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        heads = []
        for linear, x in ((self.linear_q, query), (self.linear_k, key), (self.linear_v, value)):
            if self.transpose:
                heads.append(linear(x).view(n_batch, -1, self.h, self.d_k).transpose(1, 2))
            else:
                heads.append(linear(x).view(n_batch, self.h, -1, self.d_k))
        return heads

    def rel_shift(self, x):
        zero_pad = torch.zeros((*x.size()[:3], 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1).view(*x.size()[:2], x.size(3) + 1, x.size(2))
        return x_padded[:, :, 1:].view_as(x)[:, :, :, : x.size(-1) // 2 + 1]

    def forward(self, query, key, value, pos_emb, mask):
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)  # (batch, time1, head, d_k)
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        matrix_ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.dropout(attn), v)
        return self.linear_out(x.transpose(1, 2).contiguous().view(query.size(0), -1, self.h * self.d_k))
