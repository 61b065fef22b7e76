"""Attention written in the column convention, with weights, for tests/test_trace_columns_weights.py: one token a
column (X [d, n]), projections W @ X with W [d_out, d_in], scores Kᵀ Q [n_K, n_Q], the softmax over the keys
(dim -2), as Phuong & Hutter's "Formal Algorithms for Transformers" and the column-convention courses write it.
Each class takes `bug` to plant one mistake the way people make it; "" is the correct code."""

import math

import torch
from torch import nn


def _weight(*shape):
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[-1]))


class ColumnAttention(nn.Module):
    """One head, weights [d_out, d_in] used as W @ x; x [n_batch, d, n] (or [d, n])."""

    def __init__(self, d=12, d_attn=12, causal=False, bias=False, bug=""):
        super().__init__()
        self.W_q, self.W_k, self.W_v = _weight(d_attn, d), _weight(d_attn, d), _weight(d_attn, d)
        self.W_o = _weight(d, d_attn)
        if bias:  # added as columns: b[:, None], and b_o kept as [d, 1]
            self.b_q, self.b_k, self.b_v = (nn.Parameter(torch.randn(d_attn)) for _ in "qkv")
            self.b_o = nn.Parameter(torch.randn(d, 1))
        self.causal, self.bias, self.bug = causal, bias, bug

    def forward(self, x, mask=None):
        Q = self.W_q @ x  # [.., d_attn, n_Q]
        K = self.W_k @ x  # [.., d_attn, n_K]
        V = self.W_v @ x  # [.., d_attn, n_K]
        if self.bias:
            Q, K, V = Q + self.b_q[:, None], K + self.b_k[:, None], V + self.b_v.unsqueeze(-1)
        if self.bug == "kv_swapped":
            K, V = V, K
        S = K.transpose(-2, -1) @ Q  # [.., n_K, n_Q]
        if self.bug == "scale_d_model":
            S = S / math.sqrt(x.shape[-2])
        elif self.bug != "no_scale":
            S = S / math.sqrt(Q.shape[-2])
        if self.causal:  # its own mask, [n_K, n_Q]: key j seen by query i where j <= i
            n = S.shape[-1]
            mask = torch.ones(n, n, dtype=torch.bool).triu()
        if mask is not None and self.bug != "after_softmax":
            S = S.masked_fill(mask if self.bug == "polarity" else ~mask, float("-inf"))
        A = torch.softmax(S, dim=-1 if self.bug == "softmax_axis" else -2)  # each column sums to 1 over the keys
        if self.bug == "after_softmax":
            A = A.masked_fill(~mask, 0.0)
        out = self.W_o @ (V @ A)  # [.., d, n_Q]
        return out + self.b_o if self.bias else out


def self_attention(x, W_q, W_k, W_v, W_o, mask=None, bug=""):
    """A course notebook's: x [n_batch, d, n], each weight [d_out, d_in], written with torch.matmul and .matmul."""
    q, k, v = torch.matmul(W_q, x), W_k.matmul(x), W_v @ x  # [n_batch, d_out, n] each
    scores = torch.matmul(k.transpose(-2, -1), q) / math.sqrt(q.size(-2))  # [n_batch, n_K, n_Q]
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    weights = scores.softmax(dim=-1 if bug == "softmax_axis" else -2)
    return W_o.matmul(v.matmul(weights))


def row_attention(x, w_q, w_k, w_v, mask=None):
    """The row form's counterpart, x [n_batch, n, d] @ w [d_in, d_out]: the side each weight stands on is read."""
    scores = (x @ w_q) @ (x @ w_k).transpose(-2, -1) / math.sqrt(w_q.shape[-1])  # [n_batch, n_Q, n_K]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ (x @ w_v)


def self_columns(X):
    """Weightless self-attention in columns, X [.., d, n]; it runs on rows too (Xᵀ X is then [d, d])."""
    A = torch.softmax(X.transpose(-2, -1) @ X / math.sqrt(X.shape[-2]), dim=-2)  # [.., n_K, n_Q]
    return X @ A  # [.., d, n_Q]


class UnbatchedColumns(nn.Module):
    """Algorithm 3 in a module, for one sequence: X [d, n], `.T` and dim=0 as the paper writes them."""

    def __init__(self, d=12, bug=""):
        super().__init__()
        self.W_q, self.W_k, self.W_v, self.W_o = _weight(d, d), _weight(d, d), _weight(d, d), _weight(d, d)
        self.bug = bug

    def forward(self, X, mask=None):
        Q, K, V = self.W_q @ X, self.W_k @ X, self.W_v @ X  # [d, n] each
        S = K.T @ Q / math.sqrt(Q.shape[0])  # [n_K, n_Q]
        if mask is not None:
            S = S.masked_fill(~mask, float("-inf"))
        return self.W_o @ (V @ torch.softmax(S, dim=1 if self.bug == "softmax_axis" else 0))


class ColumnMultiHead(nn.Module):
    """Multi-head in columns: per-head weight stacks [n_head, d_head, d] (the head count is only in their shapes),
    the heads' outputs [n_batch, n_head, d_head, n] concatenated into [n_batch, n_head·d_head, n], then W_o @."""

    def __init__(self, d=16, d_head=4, n_stack=4, dropout=0.0, bug=""):
        super().__init__()
        self.W_q, self.W_k, self.W_v = (_weight(n_stack, d_head, d) for _ in range(3))
        self.W_o = _weight(d, n_stack * d_head)
        self.drop = nn.Dropout(dropout)
        self.bug = bug

    def forward(self, x, mask=None):
        B, d, n = x.shape
        xh = x.unsqueeze(1)  # [B, 1, d, n]: one copy for every head
        Q, K, V = self.W_q @ xh, self.W_k @ xh, self.W_v @ xh  # [B, H, d_head, n] each
        H, d_head = Q.shape[1], Q.shape[2]
        S = K.transpose(-2, -1) @ Q  # [B, H, n_K, n_Q]
        S = S / (math.sqrt(d) if self.bug == "scale_d_model" else math.sqrt(d_head))
        if mask is not None:
            S = S.masked_fill(~mask.unsqueeze(1), float("-inf"))  # [B, 1, n_K, n_Q]
        A = self.drop(torch.softmax(S, dim=-2))
        Y = V @ A  # [B, H, d_head, n_Q]
        if self.bug == "merge_without_transpose":  # through rows, forgetting to move the heads behind the tokens
            Y = Y.transpose(-2, -1).reshape(B, n, H * d_head).transpose(-2, -1)  # [B, n, H·d_head] -> [B, H·d_head, n]
        else:
            Y = Y.reshape(B, H * d_head, n)  # [B, H, d_head, n] -> [B, H·d_head, n]
        return self.W_o @ Y  # [B, d, n_Q]


class EinsumColumns(nn.Module):
    """The column form in einsum: per-head stacks [n_head, d_head, d] contracted with x [n_batch, d, n] on d."""

    def __init__(self, d=20, heads=4, bug=""):
        super().__init__()
        self.W_q, self.W_k, self.W_v = (_weight(heads, d // heads, d) for _ in "qkv")
        self.W_o = _weight(d, d)
        self.bug = bug

    def forward(self, x):
        q, k, v = (torch.einsum("hcd,bdn->bhcn", w, x) for w in (self.W_q, self.W_k, self.W_v))  # [b, h, c, n]
        s = torch.einsum("bhck,bhcq->bhkq", k, q)  # [b, h, n_K, n_Q]
        s = s if self.bug == "no_scale" else s / math.sqrt(q.shape[-2])
        y = torch.einsum("bhck,bhkq->bhcq", v, s.softmax(dim=-2)).flatten(1, 2)  # [b, h·c, n_Q]
        return torch.einsum("ed,bdn->ben", self.W_o, y)


class PaddedColumns(nn.Module):
    """Columns in, the heads' scores turned to rows: x [n_batch, d, n], weights [d, d] used as W @ x, the heads
    [n_batch, n_head, d_head, n], scores Qᵀ K [n_batch, n_head, n_Q, n_K] softmaxed over the keys (dim -1), and key
    padding [n_batch, n_K] (True = may attend) indexed by the code itself (`mask[:, None, None, :]`)."""

    def __init__(self, d=16, heads=2, bug=""):
        super().__init__()
        self.W_q, self.W_k, self.W_v, self.W_o = (_weight(d, d) for _ in range(4))
        self.heads, self.bug = heads, bug

    def forward(self, x, mask=None):
        B, d, n = x.shape
        d_head = d // self.heads
        q = (self.W_q @ x).view(B, self.heads, d_head, n)
        k = ((self.W_v if self.bug == "keys_from_values" else self.W_k) @ x).view(B, self.heads, d_head, n)
        v = (self.W_v @ x).view(B, self.heads, d_head, n)
        s = q.transpose(-2, -1) @ k / math.sqrt(d_head)  # [B, H, n_Q, n_K]
        if mask is not None:
            padded = ~mask[:, None, :, None] if self.bug == "on_queries" else ~mask[:, None, None, :]
            s = s.masked_fill(padded, -1e9)
        a = s.softmax(-1)
        return self.W_o @ (v @ a.transpose(-2, -1)).reshape(B, d, n)  # [B, d, n_Q]
