"""RoPE's tables handed in as GPT-J's model hands them: `sin, cos = position_embeddings` (sin first), each
[B, n, rotary_dim / 2], expanded by the code itself and turned interleaved over the first rotary_dim coordinates of
each head (transformers' GPTJAttention, CodeGenAttention). docs/trace.md, "How conventions are read"."""

import torch
import torch.nn as nn


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class SinFirstAttention(nn.Module):
    def __init__(self, dim=64, n_head=4, rotary_dim=8):
        super().__init__()
        self.n_head, self.head_dim, self.rotary_dim = n_head, dim // n_head, rotary_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def rotate(self, x, sin, cos):  # x [B, n, n_head, rotary_dim]; sin, cos [B, n, rotary_dim / 2]
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return x * cos + rotate_every_two(x) * sin

    def forward(self, hidden_states, position_embeddings):
        sin, cos = position_embeddings
        B, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, n, self.n_head, self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        r = self.rotary_dim
        q = torch.cat([self.rotate(q[..., :r], sin, cos), q[..., r:]], dim=-1).transpose(1, 2)
        k = torch.cat([self.rotate(k[..., :r], sin, cos), k[..., r:]], dim=-1).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(B, n, -1))
