"""Attention that never builds the whole scores: Rabe & Staats' chunked attention as lucidrains'
memory-efficient-attention-pytorch writes it, blocks of queries and keys, each block's exp(scores − max) and
weighted values, renormalized by the global max (docs/trace.md, "Causes named by experiment")."""

import torch
from torch import nn


class ChunkedAttention(nn.Module):
    def __init__(self, dim=32, heads=4, bucket=3, causal=False, values_from_keys=False):
        super().__init__()
        self.heads, self.bucket, self.causal, self.values_from_keys = heads, bucket, causal, values_from_keys
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, dim * 2, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)  # [b, h, n, d]
        k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_kv(x).chunk(2, dim=-1))
        if self.values_from_keys:
            v = k
        q = q * q.shape[-1] ** -0.5
        out = []
        for qs in range(0, n, self.bucket):
            sums, values, maxes = [], [], []
            for ks in range(0, n, self.bucket):
                weight = torch.einsum("bhid,bhjd->bhij", q[..., qs:qs + self.bucket, :], k[..., ks:ks + self.bucket, :])
                if self.causal:
                    i = torch.arange(qs, qs + weight.shape[-2])[:, None]
                    j = torch.arange(ks, ks + weight.shape[-1])[None, :]
                    weight = weight.masked_fill(j > i, -torch.finfo(weight.dtype).max)
                weight_max = weight.amax(dim=-1, keepdim=True)
                exp_weight = (weight - weight_max).exp()
                sums.append(exp_weight.sum(dim=-1))
                values.append(torch.einsum("bhij,bhjd->bhid", exp_weight, v[..., ks:ks + self.bucket, :]))
                maxes.append(weight_max.squeeze(-1))
            maxes = torch.stack(maxes, dim=-1)
            renorm = (maxes - maxes.amax(dim=-1, keepdim=True)).exp()
            total = (torch.stack(sums, dim=-1) * renorm).sum(dim=-1)
            out.append((torch.stack(values, dim=-1) * renorm[..., None, :]).sum(dim=-1) / total[..., None])
        return self.to_out(torch.cat(out, dim=-2).transpose(1, 2).reshape(b, n, -1))
