"""An output gate before the output projection, as OpenFold's (and AlphaFold's) gated attention writes it
(docs/trace.md, "How conventions are read": an output gate)."""

import math

import torch
from torch import nn


class GatedAttention(nn.Module):
    def __init__(self, c_in=32, c_hidden=8, no_heads=4, scale_twice=False):
        super().__init__()
        self.c_hidden, self.no_heads, self.scale_twice = c_hidden, no_heads, scale_twice
        self.linear_q = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_g = nn.Linear(c_in, c_hidden * no_heads)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_in)

    def forward(self, q_x, kv_x):
        q = self.linear_q(q_x).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)  # [*, H, Q, C]
        k = self.linear_k(kv_x).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)  # [*, H, K, C]
        v = self.linear_v(kv_x).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)
        q = q / math.sqrt(self.c_hidden)
        a = torch.matmul(q, k.transpose(-1, -2))  # [*, H, Q, K]
        if self.scale_twice:
            a = a / math.sqrt(self.c_hidden)
        o = torch.matmul(torch.softmax(a, dim=-1), v).transpose(-2, -3)  # [*, Q, H, C]
        g = torch.sigmoid(self.linear_g(q_x)).unflatten(-1, (self.no_heads, -1))  # [*, Q, H, C]
        o = o * g
        return self.linear_o(o.flatten(-2))
