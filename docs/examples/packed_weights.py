"""A packed q/k/v weight the code cuts itself before it projects (torch's F._in_projection), and nn.MultiheadAttention
used as a library with its masks in its own conventions. docs/trace.md traces them:

    attnscope trace docs/examples/packed_weights.py:InProjection --causal
    attnscope trace docs/examples/packed_weights.py:InProjection --causal --init "bug='kv_swapped'"   # exit 1
    attnscope trace docs/examples/packed_weights.py:EncoderBlock --mask docs/examples/pad_2x9.npy --batch 2
"""
import torch
import torch.nn.functional as F
from torch import nn


class InProjection(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / embed_dim ** 0.5)
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) / 10)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q, k, v = F.linear(x, w_q, b_q), F.linear(x, w_k, b_k), F.linear(x, w_v, b_v)
        if self.bug == "kv_swapped":
            k, v = v, k
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # [b, h, n, d_head]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, n, e))


class EncoderBlock(nn.Module):
    def __init__(self, d_model=32, nhead=4):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        with torch.no_grad():
            self.self_attn.in_proj_bias.normal_(0, 0.1)
            self.self_attn.out_proj.bias.normal_(0, 0.1)

    def forward(self, src, mask, key_padding_mask=None):
        out, _ = self.self_attn(src, src, src, attn_mask=~mask, key_padding_mask=key_padding_mask,
                                need_weights=False)
        return out
