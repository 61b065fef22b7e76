"""A forward that takes its own causal switch (docs/trace.md, "A causal switch of your code's own"): a nanoGPT-like
block whose caller says whether it is causal, handed on to F.scaled_dot_product_attention's is_causal."""

import torch.nn.functional as F
from torch import nn


class SwitchedAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.bug = n_head, n_embd, bug

    def forward(self, x, causal: bool = False):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.bug == "kv_swapped":
            k, v = v, k
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
