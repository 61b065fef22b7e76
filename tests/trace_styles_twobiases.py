"""Styles for tests/test_trace_twobiases.py: code that masks by adding finite biases, two of them, so a cell both
mask is pushed down twice as far. GPT2First is the first GPT-2 code (2019's pytorch-pretrained-BERT and
transformers 2.x `Attention._attn`): fused `c_attn` split by `x.split`, the keys split as `[b, h, d, s]`, the causal
rule `w * b - 1e4 * (1 - b)` from a `tril` buffer, then the padding `(1.0 - mask) * -10000.0` added: -20000 where a
padded key is also in the future. `bug=` plants a mistake: 'axis' (the softmax over the queries, `dim=-2`:
softmax.axis), 'scale_model' (divided by √d_model, scale.d_model)."""

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


class GPT2First(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_ctx=16, bug=None):
        super().__init__()
        self.n_head, self.split_size, self.bug = n_head, n_embd, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        _moved(self, 76)

    def _attn(self, q, k, v, attention_mask=None):
        w = torch.matmul(q, k)
        w = w / math.sqrt(self.split_size if self.bug == "scale_model" else v.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        b = self.bias[:, :, ns - nd:ns, :ns]
        w = w * b - 1e4 * (1 - b)
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.Softmax(dim=-2 if self.bug == "axis" else -1)(w)
        return torch.matmul(w, v)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], x.size(-2) * x.size(-1))

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x, attention_mask=None):
        x = self.c_attn(x)
        query, key, value = x.split(self.split_size, dim=2)
        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)
        if attention_mask is not None:  # [b, s], 1 = a real token
            attention_mask = (1.0 - attention_mask[:, None, None, :].to(query.dtype)) * -10000.0
        a = self._attn(query, key, value, attention_mask)
        return self.c_proj(self.merge_heads(a))
