"""Round 24's perceiver resampler: the queries are the forward's latents (an argument, not a Parameter of the
module), the keys and values are projected from the context joined to those latents along the tokens, so the latents
attend to themselves beside the context. Styles: a transformers-like Idefics2 perceiver (GQA by repeat_kv,
`torch.concat([context, latents], dim=-2)`), a lucidrains-like PerceiverResampler attention (einops-like,
`torch.cat((x, latents), dim=-2)`, fused to_kv chunked, einsum), a Flamingo-like attention whose latents come first
(`torch.cat([latents, media], dim=1)`, heads folded into the batch). Plants: GQA tiled, no scale, values from the
keys' projection, heads merged without the transpose. And a plain cross-attention whose keys go through a tanh (no
catalog entry) with as many queries as heads: its divergence must not be said to be the queries' correct split."""

import math

import torch
import torch.nn as nn


def split_heads(t, h):
    """einops' rearrange(t, 'b n (h d) -> b h n d', h=h), written out (einops is no dependency)."""
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def merge_heads(t):
    """einops' rearrange(t, 'b h n d -> b n (h d)'), written out."""
    return t.transpose(1, 2).flatten(2)


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


class ResamplerAttention(nn.Module):
    """transformers' Idefics2PerceiverAttention-like: q_proj(latents), k_proj/v_proj(concat([context, latents]))."""

    def __init__(self, hidden=24, heads=4, kv_heads=2, head_dim=8, bug=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bug = heads, kv_heads, head_dim, bug
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        _trained(self)

    def forward(self, latents, context):
        bsz, q_len, _ = latents.size()
        hidden = torch.concat([context, latents], dim=-2)
        kv_len = hidden.shape[1]
        q = self.q_proj(latents).view(bsz, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(bsz, kv_len, self.kv_heads, self.head_dim).transpose(1, 2)
        v = (self.k_proj if self.bug == "values_from_keys" else self.v_proj)(hidden)
        v = v.view(bsz, kv_len, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.bug == "keys_scaled":
            k = k * 1.7
        n_rep = self.heads // self.kv_heads
        if self.bug == "gqa_tiled":
            k, v = k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1)
        else:
            k, v = (t[:, :, None].expand(bsz, self.kv_heads, n_rep, kv_len, self.head_dim)
                    .reshape(bsz, self.heads, kv_len, self.head_dim) for t in (k, v))
        w = torch.matmul(q, k.transpose(2, 3))
        if self.bug != "no_scale":
            w = w / math.sqrt(self.head_dim)
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v)
        if self.bug != "merge_no_transpose":
            out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(bsz, q_len, self.heads * self.head_dim))


class PerceiverAttention(nn.Module):
    """lucidrains' PerceiverResampler attention-like (einops-like helpers), its latents handed in:
    to_kv(cat((x, latents)))."""

    def __init__(self, dim=24, heads=3, dim_head=8, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        _trained(self)

    def forward(self, x, latents):
        h = self.heads
        q = self.to_q(latents)
        kv_input = torch.cat((x, latents), dim=-2)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        if self.bug == "values_from_keys":
            v = k
        q, k, v = (split_heads(t, h) for t in (q, k, v))
        if self.bug != "no_scale":
            q = q * self.scale
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = merge_heads(out) if self.bug != "merge_no_transpose" else out.reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)


class FlamingoCrossAttention(nn.Module):
    """A Flamingo-like resampler attention with the latents first (`torch.cat([latents, media], dim=1)`), heads
    folded into the batch for torch.bmm, a bias on every projection."""

    def __init__(self, dim=24, heads=4, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self)

    def _heads(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, self.head_dim).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def forward(self, latents, media):
        b, n, d = latents.shape
        joined = torch.cat([latents, media], dim=1)
        q = self._heads(self.q(latents))
        k = self._heads(self.k(joined))
        v = self._heads((self.k if self.bug == "values_from_keys" else self.v)(joined))
        scores = torch.bmm(q, k.transpose(1, 2))
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.head_dim)
        out = torch.bmm(scores.softmax(-1), v).view(b, self.heads, n, self.head_dim)
        if self.bug != "merge_no_transpose":
            out = out.transpose(1, 2)
        return self.proj(out.reshape(b, n, d))


class ContextAttention(nn.Module):
    """Plain cross-attention (the keys and values from the context alone), `view(...).transpose(1, 2)` on each role;
    bug='keys_squashed' passes the keys through tanh, which no catalog entry is."""

    def __init__(self, dim=24, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self)

    def forward(self, hidden_states, context):
        b, n, d = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.k_proj(context).view(b, context.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v_proj(context).view(b, context.shape[1], self.heads, -1).transpose(1, 2)
        if self.bug == "keys_squashed":
            k = torch.tanh(k)
        w = (q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, n, d))
