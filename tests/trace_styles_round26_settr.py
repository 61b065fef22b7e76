"""Set-Transformer-like attention blocks (Lee et al. 2019): the queries added back to the attention's output head by
head, then LayerNorms of their own around an rFF residual, all inside the module. Heads folded into the batch
head-major by chunk and cat (`SetMAB`), or kept on their own axis and joined by einsum (`HeadAxisMAB`); a pooling
block whose queries are learned seeds (`SeedPool`, PMA's); a block with the norms and no queries' residual
(`NormedOut`). The norms' weights and biases are moved off 1 and 0. Plants: the heads folded into the batch by a
straight reshape (batch-major, tokens mixed into heads), the scale left out, the softmax over the queries."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def fold(x, heads, bug=None):
    """[B, N, h·d] -> [h·B, N, d], head-major as the merge reads it; the plant reshapes straight (batch-major, each
    head a run of whole feature rows of several tokens)."""
    if bug == "flat_fold":
        return x.reshape(-1, x.shape[1], x.shape[2] // heads)
    return torch.cat(x.chunk(heads, dim=-1), dim=0)


class SetMAB(nn.Module):
    """MAB(X, Y): queries from X, keys and values from Y; heads into the batch, scale 1/sqrt(dim), O = Q + A V, then
    `ln0`, `O + gelu(ff(O))`, `ln1` (each norm only with `ln=True`)."""

    def __init__(self, dim_x=24, dim_y=24, dim=32, heads=4, ln=False, bug=None):
        super().__init__()
        self.dim, self.heads, self.bug = dim, heads, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(dim_x, dim), nn.Linear(dim_y, dim), nn.Linear(dim_y, dim)
        self.ff = nn.Linear(dim, dim)
        self.ln0 = nn.LayerNorm(dim) if ln else nn.Identity()
        self.ln1 = nn.LayerNorm(dim) if ln else nn.Identity()
        trained(self, 26, 0.1, 0.02)

    def forward(self, x, y):
        q, k, v = self.to_q(x), self.to_k(y), self.to_v(y)
        qh, kh, vh = (fold(t, self.heads, self.bug) for t in (q, k, v))
        logits = torch.bmm(qh, kh.transpose(1, 2))
        if self.bug != "no_scale":
            logits = logits / math.sqrt(self.dim)
        attn = logits.softmax(dim=1 if self.bug == "softmax_queries" else 2)
        out = qh + torch.bmm(attn, vh)
        out = torch.cat(out.chunk(self.heads, dim=0), dim=-1)
        out = self.ln0(out)
        out = out + F.gelu(self.ff(out))
        return self.ln1(out)


class SetSAB(nn.Module):
    """SAB(X) = MAB(X, X)."""

    def __init__(self, dim=32, heads=4, ln=False, bug=None):
        super().__init__()
        self.block = SetMAB(dim, dim, dim, heads, ln=ln, bug=bug)

    def forward(self, x):
        return self.block(x, x)


class HeadAxisMAB(nn.Module):
    """The same block with the heads on an axis of their own: `[B, h, N, d]` by view and transpose, einsum scores,
    O = Q + A V before the heads merge, a pre-set LayerNorm pair around an rFF with ReLU."""

    def __init__(self, dim=32, heads=4, ln=True, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim ** -0.5, bug
        self.fc_q, self.fc_k, self.fc_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.fc_o = nn.Linear(dim, dim)
        self.norms = nn.ModuleList([nn.LayerNorm(dim), nn.LayerNorm(dim)]) if ln else None
        trained(self, 26, 0.1, 0.02)

    def forward(self, X):
        B, N, D = X.shape
        q, k, v = (f(X).view(B, N, self.heads, -1).transpose(1, 2) for f in (self.fc_q, self.fc_k, self.fc_v))
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 if self.bug == "no_scale" else self.scale)
        o = q + torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        o = o.transpose(1, 2).reshape(B, N, D)
        if self.norms is not None:
            o = self.norms[0](o)
        o = o + F.relu(self.fc_o(o))
        return o if self.norms is None else self.norms[1](o)


class SeedPool(nn.Module):
    """PMA: `k` learned seed vectors attend over the set, MAB(S, X) with the seeds repeated over the batch."""

    def __init__(self, dim=32, heads=4, seeds=3, ln=True, bug=None):
        super().__init__()
        self.S = nn.Parameter(torch.randn(1, seeds, dim, generator=torch.Generator().manual_seed(5)) * 0.5)
        self.mab = SetMAB(dim, dim, dim, heads, ln=ln, bug=bug)

    def forward(self, X):
        return self.mab(self.S.repeat(X.size(0), 1, 1), X)


class NormedOut(nn.Module):
    """No queries' residual: the merged heads normed, then the rFF residual and a second norm."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)
        self.ln0, self.ln1 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dim = dim
        trained(self, 26, 0.1, 0.02)

    def forward(self, x):
        qh, kh, vh = (fold(f(x), self.heads, self.bug) for f in (self.to_q, self.to_k, self.to_v))
        attn = torch.softmax(qh @ kh.transpose(-2, -1) / math.sqrt(self.dim), dim=-1)
        out = torch.cat((attn @ vh).split(x.size(0), dim=0), dim=2)
        out = self.ln0(out)
        return self.ln1(out + torch.relu(self.ff(out)))
