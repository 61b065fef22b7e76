"""Attention in the column convention, one token a column, as Phuong & Hutter's "Formal Algorithms for
Transformers" (2022) writes it, for `attnscope trace` (docs/trace.md, "The column form, with weights"): its
Algorithm 3 as a function taking its weights, and Algorithm 5's multi-head attention as a module holding per-head
weight stacks."""

import math

import torch
from torch import nn


def attention(X, Z, W_q, W_k, W_v, mask=None):
    """Algorithm 3: X [d_x, n_Q] the tokens that ask, Z [d_z, n_K] their context; W [d_out, d_in]."""
    Q = W_q @ X  # [d_attn, n_Q]
    K = W_k @ Z  # [d_attn, n_K]
    V = W_v @ Z  # [d_out, n_K]
    S = K.T @ Q  # [n_K, n_Q]
    if mask is not None:
        S = S.masked_fill(~mask, float("-inf"))
    return V @ torch.softmax(S / math.sqrt(Q.shape[0]), dim=0)  # [d_out, n_Q]: a column per query


class MHAttention(nn.Module):
    """Algorithm 5 on a batch, X [n_batch, d, n]: the heads' weights stacked [n_head, d_head, d], the heads'
    outputs stacked as rows of [n_head·d_head, n], then W_o."""

    def __init__(self, d=32, heads=4, scale_by="d_head"):
        super().__init__()
        d_head = d // heads
        self.W_q, self.W_k, self.W_v = (nn.Parameter(torch.randn(heads, d_head, d) / math.sqrt(d)) for _ in "qkv")
        self.W_o = nn.Parameter(torch.randn(d, heads * d_head) / math.sqrt(d))
        self.scale_by = scale_by

    def forward(self, X, mask=None):
        n_batch, _, n = X.shape
        X = X[:, None]  # [n_batch, 1, d, n]: every head reads all of X
        Q, K, V = self.W_q @ X, self.W_k @ X, self.W_v @ X  # [n_batch, n_head, d_head, n]
        S = K.transpose(-2, -1) @ Q  # [n_batch, n_head, n_K, n_Q]
        S = S / math.sqrt(X.shape[-2] if self.scale_by == "d" else Q.shape[-2])
        if mask is not None:
            S = S.masked_fill(~mask[:, None], float("-inf"))
        Y = V @ torch.softmax(S, dim=-2)  # [n_batch, n_head, d_head, n_Q]
        return self.W_o @ Y.flatten(1, 2)  # [n_batch, n_head·d_head, n_Q] -> [n_batch, d, n_Q]
