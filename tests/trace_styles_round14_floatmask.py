"""Code that does arithmetic on its mask, a 0/1 float with 1 = present (round 14a's OpenFold `inf * (mask - 1)`),
for tests/test_trace_round14_floatmask.py: handed a boolean, each raises in that arithmetic. Each takes `bug=None`."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class PairBiasAttention(nn.Module):
    """OpenFold's callers: a 0/1 residue mask turned into a bias, inf * (mask - 1), in a list of biases."""

    def __init__(self, c_in=32, c_hidden=8, no_heads=4, inf=1e9, bug=None):
        super().__init__()
        self.c_hidden, self.no_heads, self.inf, self.bug = c_hidden, no_heads, inf, bug
        self.linear_q = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_in, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_in)

    def forward(self, m, mask):
        """mask: [*, N_res], 1 for residues that are present, 0 for padding"""
        biases = [(self.inf * (mask - 1))[..., None, None, :]]  # [*, 1, 1, N_res]
        q = self.linear_q(m).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)
        k = self.linear_k(m).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)
        v = self.linear_v(m).unflatten(-1, (self.no_heads, -1)).transpose(-2, -3)
        a = q @ k.transpose(-1, -2) / math.sqrt(self.c_hidden)
        for b in biases:
            a = a + b
        if self.bug == "scale_none":
            a = a * math.sqrt(self.c_hidden)
        o = torch.softmax(a, dim=-1) @ v
        return self.linear_o(o.transpose(-2, -3).flatten(-2))


class MultiplicativeMask(nn.Module):
    """The old TensorFlow form: scores * mask - 1e9 * (1 - mask), a [batch, 1, 1, keys] float mask of 1s and 0s."""

    def __init__(self, d_model=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.depth, self.bug = num_heads, d_model // num_heads, bug
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def split_heads(self, x):
        return x.view(x.shape[0], -1, self.num_heads, self.depth).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q, k, v = self.split_heads(self.wq(x)), self.split_heads(self.wk(x)), self.split_heads(self.wv(x))
        if self.bug == "kv_swapped":
            k, v = v, k
        logits = q @ k.transpose(-1, -2) / math.sqrt(self.depth)
        logits = logits * mask - 1e9 * (1 - mask)
        out = F.softmax(logits, dim=-1) @ v
        return self.dense(out.permute(0, 2, 1, 3).reshape(x.shape[0], -1, self.num_heads * self.depth))


def masked_attention(q, k, v, mask):
    """A function whose 0/1 mask (1 = keep) is made a bias by (mask - 1.0) * 1e4, ESM- and AlphaFold-like."""
    bias = (mask - 1.0) * 1e4
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(scores, dim=-1) @ v
