"""Styles of our own for tests/test_trace_round31_gain.py (issue #41): a learned per-channel gain on the attention's
output after its output projection (LayerScale and its kin), and q, k, v cut from one packed parameter in another
order than q, k, v. Weights moved off their initial values (`trained`).

- CaiTGain: separate q/k/v Linear layers, scores by einsum, `to_out`, then `self.gamma_1 * out` (CaiT's and DeiT III's
  gain on the left, a [dim] parameter of the attention module itself). `bug`: 'softmax_axis' (the softmax over the
  queries), 'kv_swapped' (k from v's Linear, v from k's), 'gain_twice' (the gain applied again on the way out).
- ScaledBranch: the attention half of a pre-norm block without its residual, `branch(attn(x))`: `attn` a fused
  `to_qkv` viewed `[b, n, 3, h, d]`, `branch` a module of its own holding the gain, which it applies in place
  (`x.mul_(self.layer_scale)`) or, with `exp=True`, as `x * self.log_scale.exp()` (a gain the code computes from its
  parameter). `bug`: 'scale_dim' (scores over √dim).
- TimeFirstGain: `[n, n_batch, d]` in and out, a learned scalar `alpha` (`out * torch.tanh(self.alpha)`).
- PackedRows: a hand-written multi-head attention with one packed parameter cut by the code: `order` 'qkv' (w_q, w_k,
  w_v), 'qvk' (w_q, w_v, w_k = in_proj_weight.chunk(3), each used as it is named); `param` names the packed weight
  ('in_proj_weight', PyTorch's own, or 'qkv_weight'); `stacked=True` holds it `[3, d, d]` and unbinds it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS = 32, 4


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (0.6 if p.dim() < 2 else 0.0))  # gains, biases: 0.6 ± 0.3


class CaiTGain(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS, bug=""):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.gamma_1 = nn.Parameter(torch.full((dim,), 1e-4))
        trained(self, 311)

    def forward(self, x):
        b, n, c = x.shape
        h = self.heads
        k_lin, v_lin = (self.v, self.k) if self.bug == "kv_swapped" else (self.k, self.v)
        q = self.q(x).reshape(b, n, h, c // h)
        k = k_lin(x).reshape(b, n, h, c // h)
        v = v_lin(x).reshape(b, n, h, c // h)
        dots = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(c // h)
        attn = dots.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhij,bjhd->bihd", attn, v).reshape(b, n, c)
        out = self.gamma_1 * self.to_out(out)
        if self.bug == "gain_twice":
            out = self.gamma_1 * out
        return out


class _FusedAttention(nn.Module):
    def __init__(self, dim, heads, bug):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.to_qkv(x).view(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        scale = c ** -0.5 if self.bug == "scale_dim" else (c // self.heads) ** -0.5
        attn = F.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
        return self.proj((attn @ v).transpose(1, 2).flatten(2))


class _Branch(nn.Module):
    def __init__(self, dim, exp):
        super().__init__()
        self.exp = exp
        if exp:
            self.log_scale = nn.Parameter(torch.zeros(dim))
        else:
            self.layer_scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.exp:
            return x * self.log_scale.exp()
        return x.mul_(self.layer_scale)


class ScaledBranch(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS, exp=False, bug=""):
        super().__init__()
        self.attn = _FusedAttention(dim, heads, bug)
        self.branch = _Branch(dim, exp)
        trained(self, 312)

    def forward(self, x):
        return self.branch(self.attn(x))


class TimeFirstGain(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.alpha = nn.Parameter(torch.tensor(0.0))
        trained(self, 313)

    def forward(self, x):
        n, b, c = x.shape
        d = c // self.heads

        def heads(t):
            return t.view(n, b * self.heads, d).transpose(0, 1)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        attn = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d), dim=-1)
        out = torch.bmm(attn, v).transpose(0, 1).reshape(n, b, c)
        return self.wo(out) * torch.tanh(self.alpha)


class PackedRows(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS, order="qkv", param="in_proj_weight", stacked=False):
        super().__init__()
        self.heads, self.order, self.param, self.stacked = heads, order, param, stacked
        shape = (3, dim, dim) if stacked else (3 * dim, dim)
        self.register_parameter(param, nn.Parameter(torch.empty(shape)))
        self.in_bias = nn.Parameter(torch.empty(3 * dim))
        self.out = nn.Linear(dim, dim)
        trained(self, 314)

    def forward(self, query, key, value):
        b, n, c = query.shape
        packed = getattr(self, self.param)
        cut = packed.unbind(0) if self.stacked else packed.chunk(3)
        bq, b2, b3 = self.in_bias.chunk(3)
        if self.order == "qvk":
            w_q, w_v, w_k = cut
            b_v, b_k = b2, b3
        else:
            w_q, w_k, w_v = cut
            b_k, b_v = b2, b3
        q = F.linear(query, w_q, bq).view(b, n, self.heads, -1).transpose(1, 2)
        k = F.linear(key, w_k, b_k).view(b, key.shape[1], self.heads, -1).transpose(1, 2)
        v = F.linear(value, w_v, b_v).view(b, value.shape[1], self.heads, -1).transpose(1, 2)
        weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))
