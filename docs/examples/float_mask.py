"""A 0/1 float mask (1 = present) the code does arithmetic on, as OpenFold's callers turn a residue mask into a
bias, `inf * (mask - 1)`, and hand it to their attention in a list of biases (docs/trace.md, "Masks in every
convention")."""

import math

import torch
from torch import nn


class PairBiasAttention(nn.Module):
    def __init__(self, c_in=32, c_hidden=8, no_heads=4, inf=1e9):
        super().__init__()
        self.c_hidden, self.no_heads, self.inf = c_hidden, no_heads, inf
        self.linear_q = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_in)

    def forward(self, m, mask=None):
        """mask: [*, N_res], 1 for residues that are present, 0 for padding"""
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        biases = [(self.inf * (mask - 1))[..., None, None, :]]  # [*, 1, 1, N_res]
        q = self.linear_q(m).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)  # [*, H, N_res, C]
        k = self.linear_k(m).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)
        v = self.linear_v(m).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)
        a = q @ k.transpose(-1, -2) / math.sqrt(self.c_hidden)
        for b in biases:
            a = a + b
        o = torch.softmax(a, dim=-1) @ v
        return self.linear_o(o.transpose(-2, -3).flatten(-2))
