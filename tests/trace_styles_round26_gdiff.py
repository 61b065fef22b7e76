"""Attention over [B, C, T] with pointwise Conv1d projections, as diffusion UNets write it: an OpenAI guided-diffusion-
like AttentionBlock (a float32 GroupNorm, a fused `qkv` 1x1 Conv1d split per head [H, 3, ch] (legacy) or q | k | v
then heads (new order), ch**-0.25 on q and on k, einsum, a 1x1 `proj_out`, the residual `x + h`); an audio-diffusion-
like block of four 1x1 Conv1d layers and one scale on the scores; a function-style block calling F.conv1d with its
own [3C, C, 1] parameter. Plants: the keys' share of the split scale left out, the softmax over the queries, no
scale, keys and values swapped."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


class Norm32(nn.GroupNorm):
    """guided-diffusion's GroupNorm32: computed in float32 at least, handed back in the input's dtype."""

    def forward(self, x):
        return super().forward(x.float() if x.element_size() < 4 else x).type(x.dtype)


class DiffusionBlock(nn.Module):
    """guided-diffusion-like AttentionBlock: `order` "legacy" splits heads before q, k, v (QKVAttentionLegacy),
    "new" q, k, v before heads (QKVAttention)."""

    def __init__(self, channels=32, num_heads=4, order="legacy", bug=None):
        super().__init__()
        self.num_heads, self.order, self.bug = num_heads, order, bug
        self.norm = Norm32(8, channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.proj_out = nn.Conv1d(channels, channels, 1)
        trained(self, 26, 0.1, 0.02)

    def forward(self, x):
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        qkv = self.qkv(self.norm(x))
        h = self._legacy(qkv) if self.order == "legacy" else self._new(qkv)
        h = self.proj_out(h)
        return (x + h).reshape(b, c, *spatial)

    def _weights(self, q, k, ch):
        scale = 1 / math.sqrt(math.sqrt(ch))
        if self.bug == "no_scale":
            weight = torch.einsum("bct,bcs->bts", q, k)
        elif self.bug == "k_share":
            weight = torch.einsum("bct,bcs->bts", q * scale, k)
        else:
            weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)  # [bs·H, T, S]
        return torch.softmax(weight.float(), dim=1 if self.bug == "softmax_queries" else -1).type(weight.dtype)

    def _legacy(self, qkv):
        bs, width, length = qkv.shape
        ch = width // (3 * self.num_heads)
        q, k, v = qkv.reshape(bs * self.num_heads, ch * 3, length).split(ch, dim=1)  # [bs·H, ch, T] each
        if self.bug == "kv_swapped":
            k, v = v, k
        a = torch.einsum("bts,bcs->bct", self._weights(q, k, ch), v)
        return a.reshape(bs, -1, length)  # [bs·H, ch, T] -> [bs, H·ch, T]

    def _new(self, qkv):
        bs, width, length = qkv.shape
        ch = width // (3 * self.num_heads)
        q, k, v = qkv.chunk(3, dim=1)  # [bs, H·ch, T] each
        if self.bug == "kv_swapped":
            k, v = v, k
        heads = [t.reshape(bs * self.num_heads, ch, length) for t in (q, k, v)]  # [bs·H, ch, T]
        a = torch.einsum("bts,bcs->bct", self._weights(heads[0], heads[1], ch), heads[2])
        return a.reshape(bs, -1, length)


class ConvHeads(nn.Module):
    """An audio-diffusion-like block: to_q, to_k, to_v, to_out each a 1x1 Conv1d without a norm, heads [B, H, d, T],
    scores `einsum('bhdi,bhdj->bhij') * d**-0.5`, the pattern applied over j."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Conv1d(dim, dim, 1) for _ in range(3))
        self.to_out = nn.Conv1d(dim, dim, kernel_size=1)
        trained(self, 26, 0.1, 0.02)

    def forward(self, x):
        b, c, t = x.shape
        q, k, v = (layer(x).reshape(b, self.heads, c // self.heads, t) for layer in (self.to_q, self.to_k, self.to_v))
        scale = 1.0 if self.bug == "no_scale" else (c // self.heads) ** -0.5
        sim = torch.einsum("bhdi,bhdj->bhij", q, k) * scale  # [B, H, T, T]
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhdj->bhdi", attn, v)  # [B, H, d, T]
        return self.to_out(out.reshape(b, c, t))


class FunctionalConv(nn.Module):
    """Projections held as raw parameters [3C, C, 1] and [C, C, 1], applied with F.conv1d; q, k, v chunked, then
    the heads; softmax over the keys."""

    def __init__(self, dim=32, heads=2, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.w_qkv = nn.Parameter(torch.randn(3 * dim, dim, 1) / math.sqrt(dim))
        self.b_qkv = nn.Parameter(torch.zeros(3 * dim))
        self.w_out = nn.Parameter(torch.randn(dim, dim, 1) / math.sqrt(dim))
        self.b_out = nn.Parameter(torch.zeros(dim))
        trained(self, 26, 0.1, 0.02)

    def forward(self, x):
        b, c, t = x.shape
        q, k, v = F.conv1d(x, self.w_qkv, self.b_qkv).chunk(3, dim=1)
        q, k, v = (u.reshape(b * self.heads, c // self.heads, t) for u in (q, k, v))  # [B·H, d, T]
        scores = torch.bmm(q.transpose(1, 2), k) / math.sqrt(c // self.heads)  # [B·H, T, S]
        attn = scores.softmax(dim=1 if self.bug == "softmax_queries" else -1)
        out = torch.bmm(v, attn.transpose(1, 2))  # [B·H, d, T]
        return F.conv1d(out.reshape(b, c, t), self.w_out, self.b_out, stride=1, padding=0)
