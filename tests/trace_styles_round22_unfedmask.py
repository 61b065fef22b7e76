"""Round 22's unfed masks: key padding taken by a parameter named without "mask" (trace hands it nothing, so a
--mask file describes the reference alone), beside the same attention taking it as `attention_mask`; plants that
mask the queries' rows instead of the keys' columns, and a mask taken and never applied."""

import math

import torch
import torch.nn as nn


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


class FusedPadded(nn.Module):
    """nanoGPT-like fused projection; the key padding (True = a real token) in `key_padding`, masked with -inf."""

    def __init__(self, dim=16, heads=2, plant=""):
        super().__init__()
        self.h, self.plant = heads, plant
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, key_padding=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(C // self.h)
        if key_padding is not None:
            s = s.masked_fill(~key_padding.bool()[:, None, None, :], float("-inf"))
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


class HFSelf(nn.Module):
    """transformers-like separate projections; `attention_mask` (1 = a real token) made additive, finfo.min."""

    def __init__(self, dim=16, heads=2, plant=""):
        super().__init__()
        self.h, self.plant = heads, plant
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dense = nn.Linear(dim, dim)
        _trained(self)

    def _split(self, t):
        B, T, C = t.shape
        return t.view(B, T, self.h, C // self.h).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None):
        B, T, C = hidden_states.shape
        q, k, v = (self._split(f(hidden_states)) for f in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(C // self.h)
        if attention_mask is not None and self.plant != "ignored":
            keep = attention_mask.to(scores.dtype)
            keep = keep[:, None, :, None] if self.plant == "rows" else keep[:, None, None, :]
            scores = scores + (1.0 - keep) * torch.finfo(scores.dtype).min
        probs = nn.functional.softmax(scores, dim=-1)
        return self.dense(torch.matmul(probs, v).transpose(1, 2).reshape(B, T, C))


class FairseqLike(nn.Module):
    """fairseq-like: `key_padding_mask` True = a pad, filled with -inf over [B·h, T, T] scores."""

    def __init__(self, dim=16, heads=2, plant=""):
        super().__init__()
        self.h, self.plant = heads, plant
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape
        d = C // self.h
        q, k, v = (p(x).view(B, T, self.h, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        w = (q * d ** -0.5) @ k.transpose(-1, -2)
        if key_padding_mask is not None:
            pad = key_padding_mask.bool()
            w = w.masked_fill(pad[:, None, :, None] if self.plant == "rows" else pad[:, None, None, :], -1e9)
        return self.out_proj((w.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))
