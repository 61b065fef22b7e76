# Styles for tests/test_trace_round33_keras.py (held-out round 33): a research repo's decoder attention, a fused qkv
# unflattened and permuted, the boolean mask the module builds itself (its causal tril and the key padding, True =
# may attend) handed to F.scaled_dot_product_attention. key_padding_mask: [B, T], True marks a padded key.
# The file says so in comments, not a docstring; `bug=` plants a mistake: 'padding_polarity' drops the `~`.
import torch
import torch.nn.functional as F
from torch import nn


class CausalSDPAttention(nn.Module):
    def __init__(self, dim=48, n_heads=3, bug=None):
        super().__init__()
        self.bug, self.n_heads, self.head_dim = bug, n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        g = torch.Generator().manual_seed(35)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        attn_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
        if key_padding_mask is not None:
            keep = key_padding_mask if self.bug == "padding_polarity" else ~key_padding_mask
            attn_mask = attn_mask & keep[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
