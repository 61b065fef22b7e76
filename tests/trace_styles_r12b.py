"""Styles for tests/test_trace_r12b.py, each written as a real library writes it.

A memory parameter no name gives away, read from the data flow:
- `VisionCrossAttention`: Mllama's / IDEFICS 2's text-to-image cross-attention (q/k/v/o Linear layers, GQA, per-head
  RMS qk-norm), `forward(hidden_states, vision_states=None, past=None, attention_mask=None, output_attentions=None)`;
  with no vision states it reads its keys and values from the cache, so run with None it raises.
- `LatentCross`: a Perceiver-style block whose latents attend to `kv_input=None` (themselves when None), beside an
  optional `pos=None` added to the queries' input, listed first.
- `attend_source`: a function taking its weights as arguments, `attend_source(x, W_q, W_k, W_v, W_o, n_head,
  scale=None, source=None)`, whose keys and values read `source` (x when None).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if p.dim() > 1 else 0.2) + (1 if p.dim() == 1
                                                                                                  else 0))


class HeadRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class VisionCrossAttention(nn.Module):
    def __init__(self, hidden=32, heads=4, kv_heads=2, layer=0, bug=None):
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim, self.layer, self.bug = heads, kv_heads, hidden // heads, layer, bug
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.q_norm = HeadRMSNorm(self.head_dim)
        self.k_norm = HeadRMSNorm(self.head_dim)
        _trained(self, 1)

    def forward(self, hidden_states, vision_states=None, past=None, attention_mask=None, output_attentions=None):
        b, n, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2))
        if vision_states is not None:
            k = self.k_proj(vision_states).view(b, -1, self.num_kv, self.head_dim).transpose(1, 2)
            v = self.v_proj(vision_states).view(b, -1, self.num_kv, self.head_dim).transpose(1, 2)
            k = self.k_norm(k)
        else:  # the image was seen at prefill: its keys and values are in the cache
            k, v = past[self.layer]
        group = self.num_heads // self.num_kv
        k = k.repeat_interleave(group, dim=1)
        v = (k if self.bug == "v_from_k" else v.repeat_interleave(group, dim=1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = scores.softmax(dim=-2 if self.bug == "softmax_queries" else -1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out), (weights if output_attentions else None)


class LatentCross(nn.Module):
    def __init__(self, dim=24, heads=3, dim_head=8, bug=None):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)
        _trained(self, 2)

    def forward(self, latents, pos=None, kv_input=None):
        if pos is not None:
            latents = latents + pos
        source = latents if kv_input is None else kv_input
        q = self.to_q(latents)
        k, v = self.to_kv(source).chunk(2, dim=-1)
        b, h = q.shape[0], self.heads
        q, k, v = (t.reshape(b, t.shape[1], h, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 if self.bug == "no_scale" else self.scale)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, out.shape[2], -1))


def attend_source(x, W_q, W_k, W_v, W_o, n_head, scale=None, source=None):
    source = x if source is None else source
    q, k, v = x @ W_q, source @ W_k, source @ W_v
    b, n, d = q.shape
    q = q.view(b, n, n_head, d // n_head).transpose(1, 2)
    k = k.view(b, -1, n_head, d // n_head).transpose(1, 2)
    v = v.view(b, -1, n_head, d // n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return y.transpose(1, 2).reshape(b, n, d) @ W_o


def attend_source_d_model(x, W_q, W_k, W_v, W_o, n_head, scale=None, source=None):
    """A plant: the scores divided by √d_model."""
    return attend_source(x, W_q, W_k, W_v, W_o, n_head, scale=1 / math.sqrt(x.shape[-1]), source=source)


# --- nn.Parameter weights the code reshapes before it projects with them ----------------------------------------
# - `SpeedrunAttention`: modded-nanogpt's: one qkv_w [3, hdim, dim] handed to F.linear flattened, the output viewed
#   [B, T, 3·H, D] and chunked on the heads' axis, F.rms_norm qk-norm, a learned gain lambdas[0] on v, SDPA causal at
#   a fixed scale, a CastedLinear output (F.linear(x, weight.type_as(x))).
# - `KernelAttention`: a Flax port: kernels [dim, 3, H, D] and [H, D, dim], x @ kernel.reshape(dim, -1), unbind.
# - `PackedHeads`: GPT-NeoX's per-head packing as a Parameter [H, 3·D, dim] with its bias [H, 3·D], flattened for
#   F.linear, the output viewed [B, T, H, 3·D] and chunked on the last axis.


class CastedLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class SpeedrunAttention(nn.Module):
    def __init__(self, dim=32, num_heads=4, head_dim=8, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, head_dim, bug
        self.qkv_w = nn.Parameter(torch.empty(3, num_heads * head_dim, dim))
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.c_proj = CastedLinear(num_heads * head_dim, dim, bias=False)
        _trained(self, 3)
        with torch.no_grad():
            self.lambdas.copy_(torch.tensor([0.7, 0.3]))
        self.attn_scale = 0.12

    def forward(self, x, ve=None):
        B, T = x.size(0), x.size(1)
        q, k, v = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(
            B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        v = self.lambdas[0] * v if ve is None else self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)
        if self.bug == "scale_twice":
            q = q * self.attn_scale
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=self.attn_scale)
        y = y if self.bug == "merge_no_transpose" else y.transpose(1, 2)
        return self.c_proj(y.contiguous().view(B, T, self.num_heads * self.head_dim))


class KernelAttention(nn.Module):
    def __init__(self, dim=24, heads=3, head_dim=8, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, head_dim, bug
        self.qkv_kernel = nn.Parameter(torch.empty(dim, 3, heads, head_dim))
        self.out_kernel = nn.Parameter(torch.empty(heads, head_dim, dim))
        _trained(self, 4)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        qkv = (x @ self.qkv_kernel.reshape(d, -1)).reshape(b, n, 3, self.heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return y @ self.out_kernel.reshape(-1, d)


class PackedHeads(nn.Module):
    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.d_head, self.bug = heads, hidden // heads, bug
        self.qkv = nn.Parameter(torch.empty(heads, 3 * self.d_head, hidden))
        self.qkv_bias = nn.Parameter(torch.empty(heads, 3 * self.d_head))
        self.dense = nn.Linear(hidden, hidden)
        _trained(self, 5)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        qkv = F.linear(hidden_states, self.qkv.flatten(0, 1), self.qkv_bias.flatten())
        q, k, v = qkv.view(b, n, self.heads, 3 * self.d_head).permute(0, 2, 1, 3).chunk(3, dim=-1)
        causal = torch.ones(n, n, dtype=torch.bool).tril(1 if self.bug == "off_by_one" else 0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return self.dense(y.transpose(1, 2).reshape(b, n, -1))


# --- q, k, v clipped after their projection ----------------------------------------------------------------------
# - `ClippedFused`: DBRX's: a fused Wqkv, `clamp(min=-clip_qkv, max=clip_qkv)` with the value from its config object,
#   split by widths (GQA), repeat_kv, an eager softmax; plants: the clamp at half the config's, the scores / √d_model.
# - `LiteralClamp`: nanoGPT's c_attn clamped to ±1.5 written in the code (no config says it), split, SDPA causal.
# - `InPlaceClip`: OLMo's: `qkv.clamp_(min=-clip, max=clip)` in place, the bound in a dict config, then chunk.


class ClipConfig:
    def __init__(self, d_model=32, n_heads=4, kv_n_heads=2, clip_qkv=0.8):
        self.d_model, self.n_heads, self.kv_n_heads, self.clip_qkv = d_model, n_heads, kv_n_heads, clip_qkv


class ClippedFused(nn.Module):
    def __init__(self, config=None, bug=None):
        super().__init__()
        config = config or ClipConfig()
        self.config, self.bug = config, bug
        self.num_heads, self.kv_heads = config.n_heads, config.kv_n_heads
        self.head_dim = config.d_model // config.n_heads
        self.Wqkv = nn.Linear(config.d_model, config.d_model + 2 * self.kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        _trained(self, 6)

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        clip = self.config.clip_qkv / (2 if self.bug == "half_clip" else 1)
        qkv = self.Wqkv(hidden_states).clamp(min=-clip, max=clip)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=2)
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.num_heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scale = self.config.d_model if self.bug == "d_model" else self.head_dim
        w = (q @ k.transpose(2, 3)) / math.sqrt(scale)
        if attention_mask is not None:
            w = w + attention_mask
        y = (w.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.out_proj(y)


class LiteralClamp(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        _trained(self, 7)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).clamp(-1.5, 1.5).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.bug == "off_by_one":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(T, T, dtype=torch.bool).tril(1))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class InPlaceClip(nn.Module):
    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or {"d_model": 24, "n_heads": 3, "clip_qkv": 1.0}
        d = self.config["d_model"]
        self.bug = bug
        self.att_proj = nn.Linear(d, 3 * d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        _trained(self, 8)

    def forward(self, x):
        B, T, C = x.shape
        h = self.config["n_heads"]
        qkv = self.att_proj(x)
        if self.config["clip_qkv"] is not None:
            qkv.clamp_(min=-self.config["clip_qkv"], max=self.config["clip_qkv"])
        q, k, v = qkv.chunk(3, dim=-1)
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug == "no_scale" else None)
        return self.attn_out(y.transpose(1, 2).reshape(B, T, C))
