"""Grouped-query attention in a package: `from .config import ModelArgs`, `from .heads import ...`."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelArgs
from .heads import repeat_kv, split_heads


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, bug: str | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.bug = args.n_heads, args.n_kv_heads, bug
        head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = split_heads(self.wq(x), self.n_heads)
        k = split_heads(self.wk(x), self.n_kv_heads)
        v = split_heads(self.wv(x), self.n_kv_heads)
        n_rep = self.n_heads // self.n_kv_heads
        if self.bug == "tiled":  # the groups tiled, not interleaved: head h reads group h % n_kv_heads
            k, v = k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1)
        else:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))
