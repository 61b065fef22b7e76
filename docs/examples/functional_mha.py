"""A module calling F.multi_head_attention_forward with its own parameters (in_proj_weight, out_proj), as
nn.MultiheadAttention does inside. docs/trace.md traces it:

    attnscope trace docs/examples/functional_mha.py:FunctionalMHA --init "embed_dim=32, num_heads=4"
"""
import torch
import torch.nn.functional as F
from torch import nn

class FunctionalMHA(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / embed_dim ** 0.5)
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) / 10)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        x = x.transpose(0, 1)  # [n, n_batch, d]: seq first
        out, _ = F.multi_head_attention_forward(
            x, x, x, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias, None, None, False,
            0.0, self.out_proj.weight, self.out_proj.bias, training=self.training, need_weights=False)
        return out.transpose(0, 1)
