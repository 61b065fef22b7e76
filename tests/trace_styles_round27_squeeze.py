"""Attention whose forward takes a flag with no default beside its input and its mask, as HF's SqueezeBert, BERT-era and
GPT-2-era layers write it: a SqueezeBert-like block over [B, C, W] (a fused 1x1 Conv1d `qkv` cut in three, heads [B,
H, d, W], einsum scores, a 4-D additive mask [B, 1, 1, W] it adds with no test for None, the weights returned only
`if output_attentions`); a rows block of nn.Linear layers with two required flags, `use_cache` (a tuple of keys and
values kept or None) and `return_weights`, handed on unread to a helper that tests it; an NCW block of three 1x1
Conv1d layers that reads its mask `[B, 1, 1, W]` as 1 = keep, 0 = padding (`(1.0 - mask) * -10000.0`) and returns a
dict; a GPT-2-like rows block handing a required mask and `is_causal` straight to F.scaled_dot_product_attention (the
flag its causal switch under --causal). Plants: no scale, the softmax over the queries, the heads merged without
their permute, the values read from the key projection."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values (no zero bias, no weight of 1), as a trained model's are."""
    g = torch.Generator().manual_seed(27)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


class FusedSqueeze(nn.Module):
    """SqueezeBert-like: [B, C, W] in and out, one fused 1x1 conv, heads kept as [B, H, d, W]."""

    def __init__(self, channels=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Conv1d(channels, 3 * channels, kernel_size=1)
        self.proj = nn.Conv1d(channels, channels, kernel_size=1)
        _trained(self)

    def forward(self, hidden, extended_mask, output_attentions):
        B, C, W = hidden.shape
        q, k, v = self.qkv(hidden).chunk(3, dim=1)
        q, k, v = (t.reshape(B, self.heads, C // self.heads, W) for t in (q, k, v))  # [B, H, d, W]
        scores = torch.einsum("bhdq,bhdk->bhqk", q, k)
        if self.bug != "no_scale":
            scores = scores * (C // self.heads) ** -0.5
        scores = scores + extended_mask
        probs = scores.softmax(dim=-2 if self.bug == "softmax_queries" else -1)
        context = torch.einsum("bhqk,bhdk->bhdq", probs, v).reshape(B, C, W)
        return (self.proj(context), probs) if output_attentions else (self.proj(context),)


def _attend(scores, v, return_weights, dim=-1):
    """The rows block's helper: the flag is read here, not in the forward."""
    w = torch.softmax(scores, dim=dim)
    out = w @ v
    return (out, w) if return_weights else (out, None)


class FlagRows(nn.Module):
    """[B, n, d] rows, separate Linear projections, a required `use_cache` and `return_weights`, an additive mask
    with no default."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        _trained(self)

    def forward(self, hidden_states, attention_bias, use_cache, return_weights):
        b, n, d = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.h, d // self.h).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        present = (k, v) if use_cache else None
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + attention_bias
        out, weights = _attend(scores, v, return_weights, -2 if self.bug == "softmax_queries" else -1)
        if self.bug == "merge_no_transpose":
            out = out.reshape(b, n, d)
        else:
            out = out.transpose(1, 2).reshape(b, n, d)
        return self.out_proj(out), present, weights


class ConvKeep(nn.Module):
    """NCW, three 1x1 Conv1d layers, heads [B, H, W, d] for the queries and values and [B, H, d, W] for the keys,
    a keep-mask `attention_mask` [B, 1, 1, W] (1 = a token, 0 = padding) turned into a bias itself, a dict returned."""

    def __init__(self, cin=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.q = nn.Conv1d(cin, cin, 1)
        self.k = nn.Conv1d(cin, cin, 1)
        self.v = nn.Conv1d(cin, cin, 1)
        _trained(self)

    def forward(self, x, attention_mask, output_attentions):
        B, C, W = x.shape
        d = C // self.n_head
        q = self.q(x).view(B, self.n_head, d, W).permute(0, 1, 3, 2)  # [B, H, W, d]
        k = self.k(x).view(B, self.n_head, d, W)  # [B, H, d, W]
        v = (self.k if self.bug == "value_from_key" else self.v)(x).view(B, self.n_head, d, W).permute(0, 1, 3, 2)
        s = torch.matmul(q, k) / math.sqrt(d) + (1.0 - attention_mask) * -10000.0
        p = F.softmax(s, dim=-1)
        ctx = torch.matmul(p, v)  # [B, H, W, d]
        ctx = (ctx if self.bug == "merge_no_permute" else ctx.permute(0, 1, 3, 2)).reshape(B, C, W)
        result = {"context": ctx}
        if output_attentions:
            result["scores"] = s
        return result


class CausalRows(nn.Module):
    """[B, n, d] rows, a fused Linear, F.scaled_dot_product_attention handed the required mask and `is_causal` as
    they come (neither tested here): the flag is the code's own causal switch."""

    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.h = n_heads
        self.c_attn, self.c_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        _trained(self)

    def forward(self, x, attn_mask, is_causal):
        b, n, d = x.shape
        q, k, v = self.c_attn(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.c_proj(y.transpose(1, 2).reshape(b, n, d))
