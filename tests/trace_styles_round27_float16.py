"""q @ kᵀ computed in float16 and overflowing, the scale applied after the matmul, in three layouts of the heads:
folded into the batch head-major by split and cat (Set Transformer's MAB, `torch.cat(X.split(d, 2), 0)`, its scale
1/√dim_V its own), folded by diffusers' head_to_batch_dim (batch-major), and kept on their own axis `[B, H, S, D]`
(a fused qkv Linear). `big` scales the query and key weights (a model whose logits run large, as an unnormalized
one's do); the plant `bug='half'` computes the scores' matmul in float16 and casts back after it."""

import math

import torch
import torch.nn as nn
from _trace_ref import trained


class SetMAB(nn.Module):
    """MAB(X, X) with the heads folded into the batch head-major; scores scaled by 1/√dim_V after the bmm."""

    def __init__(self, dim_V=32, num_heads=4, big=300.0, bug=None):
        super().__init__()
        self.dim_V, self.num_heads, self.bug = dim_V, num_heads, bug
        self.fc_q, self.fc_k, self.fc_v = nn.Linear(dim_V, dim_V), nn.Linear(dim_V, dim_V), nn.Linear(dim_V, dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)
        trained(self, 27)
        with torch.no_grad():
            self.fc_q.weight.mul_(big)
            self.fc_k.weight.mul_(big)

    def forward(self, X):
        dim_split = self.dim_V // self.num_heads
        Q, K, V = self.fc_q(X), self.fc_k(X), self.fc_v(X)
        Q_, K_, V_ = (torch.cat(t.split(dim_split, 2), 0) for t in (Q, K, V))
        if self.bug == "half":
            logits = Q_.half().bmm(K_.half().transpose(1, 2)).float()
        else:
            logits = Q_.bmm(K_.transpose(1, 2))
        A = torch.softmax(logits / math.sqrt(self.dim_V), 2)
        out = torch.cat(A.bmm(V_).split(Q.size(0), 0), 2)
        return self.fc_o(out)


class BatchDimAttention(nn.Module):
    """diffusers' Attention processor: head_to_batch_dim, bmm, the scale after it, batch_to_head_dim."""

    def __init__(self, query_dim=32, heads=4, dim_head=8, big=300.0, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.to_q = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_v = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * dim_head, query_dim), nn.Dropout(0.0)])
        trained(self, 28)
        with torch.no_grad():
            self.to_q.weight.mul_(big)
            self.to_k.weight.mul_(big)

    def head_to_batch_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len, self.heads, dim // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(batch_size * self.heads, seq_len, dim // self.heads)

    def batch_to_head_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // self.heads, self.heads, seq_len, dim).permute(0, 2, 1, 3)
        return tensor.reshape(batch_size // self.heads, seq_len, dim * self.heads)

    def forward(self, hidden_states):
        query = self.head_to_batch_dim(self.to_q(hidden_states))
        key = self.head_to_batch_dim(self.to_k(hidden_states))
        value = self.head_to_batch_dim(self.to_v(hidden_states))
        if self.bug == "half":
            scores = torch.bmm(query.half(), key.half().transpose(-1, -2)).float() * self.scale
        else:
            scores = torch.bmm(query, key.transpose(-1, -2)) * self.scale
        hidden_states = self.batch_to_head_dim(torch.bmm(scores.softmax(dim=-1), value))
        return self.to_out[1](self.to_out[0](hidden_states))


class FusedHeads(nn.Module):
    """timm's Attention: one qkv Linear, `[3, B, H, S, D]` by reshape and permute, the scale after the matmul."""

    def __init__(self, dim=32, num_heads=4, big=300.0, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, dim // num_heads, bug
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        trained(self, 29)
        with torch.no_grad():
            self.qkv.weight[: 2 * dim].mul_(big)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.bug == "half":
            attn = (q.half() @ k.half().transpose(-2, -1)).float() * self.scale
        else:
            attn = (q @ k.transpose(-2, -1)) * self.scale
        x = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)
