"""Attention computed in float16 by design, finite: a convention, not a mistake. Three layouts of the heads: kept on
their own axis `[B, H, S, D]` (timm's fused qkv Linear), folded into the batch head-major (Set Transformer's MAB,
`torch.cat(X.split(d, 2), 0)`), and with the q/k/v projections themselves run in float16 (a half-precision
inference port: `F.linear` on half weights). `big` scales the query and key weights (large scores, below float16's
65504 at 40-80, past it at 300). `bug`: 'half' computes only q @ kᵀ in float16 (the round 27 float16 plant),
'no_scale' drops the scale, 'axis' takes the softmax over the queries; each in the float16 module as it is."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


class HalfHeads(nn.Module):
    """timm's Attention with q, k, v cast to float16 before q @ kᵀ; softmax and the weighted sum in float16 too,
    the output cast back to float32 before the projection. `only_scores`: only the matmul in float16."""

    def __init__(self, dim=32, num_heads=4, big=60.0, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, dim // num_heads, bug
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        trained(self, 31)
        with torch.no_grad():
            self.qkv.weight[: 2 * dim].mul_(big)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.bug == "half":  # the round 27 plant: only the product in float16, the rest float32
            attn = (q.half() @ k.half().transpose(-2, -1)).float() * self.scale
            x = attn.softmax(dim=-1) @ v
        else:
            q, k, v = q.half(), k.half(), v.half()
            attn = q @ k.transpose(-2, -1)  # [B, H, N, N] in float16
            if self.bug != "no_scale":
                attn = attn * self.scale
            attn = attn.softmax(dim=-2 if self.bug == "axis" else -1)
            x = (attn @ v).float()
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class HalfMAB(nn.Module):
    """MAB(X, X) with the heads folded into the batch head-major, the attention in float16, scaled by 1/√dim_V."""

    def __init__(self, dim_V=32, num_heads=4, big=60.0, bug=None):
        super().__init__()
        self.dim_V, self.num_heads, self.bug = dim_V, num_heads, bug
        self.fc_q, self.fc_k, self.fc_v = nn.Linear(dim_V, dim_V), nn.Linear(dim_V, dim_V), nn.Linear(dim_V, dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)
        trained(self, 32)
        with torch.no_grad():
            self.fc_q.weight.mul_(big)
            self.fc_k.weight.mul_(big)

    def forward(self, X):
        dim_split = self.dim_V // self.num_heads
        Q, K, V = self.fc_q(X).half(), self.fc_k(X).half(), self.fc_v(X).half()
        Q_, K_, V_ = (torch.cat(t.split(dim_split, 2), 0) for t in (Q, K, V))
        logits = Q_.bmm(K_.transpose(1, 2))  # [H·B, N, N] in float16
        if self.bug != "no_scale":
            logits = logits / math.sqrt(self.dim_V)
        A = torch.softmax(logits, 1 if self.bug == "axis" else 2)
        out = torch.cat(A.bmm(V_).split(Q.size(0), 0), 2).float()
        return self.fc_o(out)


class HalfProjections(nn.Module):
    """A half-precision port: the q/k/v projections run in float16 (F.linear on the weights cast to half), the
    heads `[B, H, S, D]`, the attention in float16, the output projection in float32."""

    def __init__(self, dim=32, num_heads=4, big=60.0, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, dim // num_heads, bug
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        trained(self, 33)
        with torch.no_grad():
            self.q_proj.weight.mul_(big)
            self.k_proj.weight.mul_(big)

    def _heads(self, x, layer):
        B, N, _ = x.shape
        y = F.linear(x.half(), layer.weight.half(), layer.bias.half())  # [B, N, C] in float16
        return y.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, D]

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self._heads(x, self.q_proj), self._heads(x, self.k_proj), self._heads(x, self.v_proj)
        scores = q @ k.transpose(-1, -2)  # [B, H, N, N]
        if self.bug != "no_scale":
            scores = scores * self.head_dim ** -0.5
        weights = scores.softmax(-2 if self.bug == "axis" else -1)
        out = (weights @ v).transpose(1, 2).reshape(B, N, C)
        return self.o_proj(out.float())
