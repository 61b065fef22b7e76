"""OpenAI whisper's MultiHeadAttention (whisper/model.py, the eager `qkv_attention` path): q and k each scaled by
d_head ** -0.25, a key projection without bias, an additive -inf triu mask sliced `mask[:n_ctx, :n_ctx]`, and the
masked scores returned beside the output (`return self.out(wv), qk`), -inf where the mask is. Round 26 of the
held-out styles: the returned scores' -inf read as "the code's output is not finite", the mask retried as finfo.min,
and the note of that form raised KeyError 'additive_min'. `bug=` plants a mistake."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class WhisperAttention(nn.Module):
    def __init__(self, n_state: int = 48, n_head: int = 4, bug: str = ""):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.05)

    def forward(self, x: Tensor, xa: Tensor | None = None, mask: Tensor | None = None,
                kv_cache: dict | None = None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale   # [b, h, n_ctx, d]
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1)           # [b, h, d, n_k]
        if self.bug != "k_unscaled":
            k = k * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)           # [b, h, n_k, d]
        qk = q @ k                                                              # [b, h, n_ctx, n_k]
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.float()
        w = F.softmax(qk, dim=-2 if self.bug == "softmax_queries" else -1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()   # [b, n_ctx, n_state]
