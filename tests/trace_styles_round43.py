"""Styles for tests/test_trace_round43.py: masks a module writes into a bias of its own by `masked_fill`, where the
fill's value, not the op, says which way round the module reads its mask (each class's docstring says its own).
PhiMixFormer is phi-1.5's MixFormer `MHA` (its remote code): a fused Wqkv viewed `[b, s, 3, h, d]`, a key padding
`[b, s]` written into a bias by `torch.full((b, s), -10000.0).masked_fill_(key_padding_mask, 0.0)` and added, its
own causal bias `triu(full(-10000.0), 1)`. ZeroPadBias writes its key padding into a bias of zeros, -inf where the
mask holds. KeepBiasInverted writes the complement of its mask, `full(-1e9).masked_fill(~padding, 0.0)`, its
parameter named `padding`. `bug=` plants a mistake: 'diagonal' (the causal bias `triu(.., 0)`: no query sees its own
key, mask.off_by_one), 'scaled_twice' (scale.twice), 'scale_model' (divided by √d_model, scale.d_model), 'merge'
(the heads' outputs viewed straight, heads.merge_without_transpose)."""

from __future__ import annotations

import math

import torch
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias), the same in each instance of a class."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class PhiMixFormer(nn.Module):
    """phi-1.5's MixFormer MHA, causal, without its rotary (`rotary_dim=0`)."""

    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.head_dim, self.bug = n_head, n_embd // n_head, bug
        self.Wqkv = nn.Linear(n_embd, 3 * n_embd)
        self.out_proj = nn.Linear(n_embd, n_embd)
        _moved(self, 431)

    def forward(self, x, attention_mask=None):
        batch_size, seqlen, _ = x.shape
        qkv = self.Wqkv(x).view(batch_size, seqlen, 3, self.n_head, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        if self.bug == "scaled_twice":
            q = q * softmax_scale
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if attention_mask is not None:
            padding_mask = torch.full((batch_size, seqlen), -10000.0, dtype=scores.dtype, device=scores.device)
            padding_mask.masked_fill_(attention_mask.bool(), 0.0)
            scores = scores + padding_mask[:, None, None, :]  # "b s -> b 1 1 s"
        causal_mask = torch.triu(torch.full((seqlen, seqlen), -10000.0, device=scores.device),
                                 0 if self.bug == "diagonal" else 1)
        scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
        output = torch.einsum("bhts,bshd->bthd", attention, v)
        if self.bug == "merge":
            output = output.transpose(1, 2).contiguous()
        return self.out_proj(output.reshape(batch_size, seqlen, -1))


class ZeroPadBias(nn.Module):
    """A bidirectional encoder attention taking a key padding `[b, s]` with True = masked out, written into a bias of
    zeros with -inf where True."""

    def __init__(self, d_model=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(d_model, d_model) for _ in range(4))
        _moved(self, 432)

    def forward(self, hidden, pad_mask=None):
        b, s, d = hidden.shape
        q, k, v = (lin(hidden).view(b, s, self.heads, -1).transpose(1, 2) for lin in (self.q_lin, self.k_lin,
                                                                                     self.v_lin))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d if self.bug == "scale_model" else d // self.heads)
        if pad_mask is not None:
            bias = torch.zeros(b, 1, 1, s, dtype=scores.dtype).masked_fill(pad_mask[:, None, None, :],
                                                                          float("-inf"))
            scores = scores + bias
        weights = scores.softmax(dim=-1)
        out = weights @ v
        out = out.reshape(b, s, d) if self.bug == "merge" else out.transpose(1, 2).reshape(b, s, d)
        return self.out_lin(out)


class KeepBiasInverted(nn.Module):
    """An encoder attention whose key padding `[b, s]` is True = pad, turned round and written into a bias:
    `full(-1e9).masked_fill(~pad, 0.0)`, 0 where a key is kept."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        _moved(self, 433)

    def forward(self, x, padding=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        scale = (c // self.num_heads) ** -0.5
        attn = (q * scale) @ k.transpose(-2, -1)
        if self.bug == "scaled_twice":
            attn = attn * scale
        if padding is not None:
            bias = torch.full((b, n), -1e9, dtype=attn.dtype).masked_fill(~padding, 0.0)
            attn = attn + bias[:, None, None, :]
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))
