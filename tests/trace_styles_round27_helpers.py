"""Round 27's two-file style: attention whose mask helper lives in a sibling file of the user's folder
(tests/trace_styles_round27_helpers_masks.py), imported as a plain module beside it. The helper branches on the
mask's rank (`if mask.dim() == 2: ... elif mask.dim() == 3: ...`); a plant in its 3-D branch is reached only by a
mask per query, a form trace gives once the first (key padding) lines up. Plants: the 3-D branch read transposed, the
scale left out."""

import math

import torch.nn as nn
from trace_styles_round27_helpers_masks import extended_bias, split_heads


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    import torch

    g = torch.Generator().manual_seed(27)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


class SiblingMaskAttention(nn.Module):
    """BERT-like self-attention whose 0/1 mask (2-D key padding or 3-D per query) is extended by a helper of the
    sibling file."""

    def __init__(self, hidden=24, heads=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))
        _trained(self)

    def forward(self, hidden_states, attention_mask=None):
        q = split_heads(self.q_proj(hidden_states), self.heads)
        k = split_heads(self.k_proj(hidden_states), self.heads)
        v = split_heads(self.v_proj(hidden_states), self.heads)
        scores = q @ k.transpose(-1, -2)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(q.shape[-1])
        if attention_mask is not None:
            scores = scores + extended_bias(attention_mask, scores.dtype, self.bug)
        probs = scores.softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).flatten(2)
        return self.o_proj(out)
