"""Styles for tests/test_trace_round57.py, written afresh.

FramesOfEachPatch: divided space-time attention's time half (TimeSformer's layer): a video's tokens, a class token
then `patches × frames`, the class token set aside (`x[:, 1:]`), the rest regrouped so that each patch attends over
its own frames (`[B·P, T, C]`), a LayerNorm of the groups' tokens, multi-head attention with one fused qkv, and the
frames folded back to `[B, P·T, C]` (the class token not returned). bug='no_scale' leaves out the scale;
bug='frames_softmax' takes the softmax over the queries.

NormedThenFramed: the same attention with the norm taken before the regrouping (every token its own norm) and the
class token kept in front of the result unchanged. bug='kv_swapped' swaps the keys' and values' thirds.

HeadsBesideConv: ConvBERT-like mixed attention: self-attention heads (no output projection) and as many heads of a
pointwise feature branch, joined along the heads' axis by torch.cat and merged by one view after it, so no tensor
holds the attention heads merged alone. bug='merge_permute' permutes the heads' output (0, 2, 3, 1) and reshapes it
to [B, n, heads, d] before the cat (the merge in another order)."""

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module) -> nn.Module:
    """Every weight moved off its initial value (a norm's weight of 1 and bias of 0 hide mistakes)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module


class _Heads(nn.Module):
    def __init__(self, dim, heads, bug):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores / (c // self.heads) ** 0.5
        weights = scores.softmax(dim=-2 if self.bug == "frames_softmax" else -1)
        return self.proj((weights @ v).transpose(1, 2).reshape(n, t, c))


class FramesOfEachPatch(nn.Module):
    def __init__(self, dim=32, heads=4, frames=3, bug=None):
        super().__init__()
        self.frames = frames
        self.norm = nn.LayerNorm(dim)
        self.attn = _Heads(dim, heads, bug)
        _trained(self)

    def forward(self, x):
        b, n, c = x.shape
        patches = (n - 1) // self.frames
        grouped = x[:, 1:].reshape(b * patches, self.frames, c)
        out = self.attn(self.norm(grouped))
        return out.reshape(b, patches * self.frames, c)


class NormedThenFramed(FramesOfEachPatch):
    def forward(self, x):
        b, n, c = x.shape
        patches = (n - 1) // self.frames
        normed = F.layer_norm(x, (c,), self.norm.weight, self.norm.bias)
        out = self.attn(normed[:, 1:].reshape(b, patches, self.frames, c).flatten(0, 1))
        return torch.cat([x[:, :1], out.reshape(b, patches * self.frames, c)], dim=1)


class HeadsBesideConv(nn.Module):
    def __init__(self, dim=24, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.branch = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q, k, v = (p(x).view(b, n, self.heads, d).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = torch.matmul(torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, dim=-1), v)  # [b, h, n, d]
        if self.bug == "merge_permute":
            out = out.permute(0, 2, 3, 1).contiguous().reshape(b, n, self.heads, d)
        else:
            out = out.permute(0, 2, 1, 3).contiguous()
        side = torch.tanh(self.branch(x)).view(b, n, self.heads, d)
        return torch.cat([out, side], dim=2).view(b, n, 2 * c)
