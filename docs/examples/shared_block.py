"""A hybrid model's shared attention block (HF Zamba's and Zamba2's, docs/trace.md, "An output of another width"):
q, k and v read cat(hidden, embeddings), twice the model's width, and o_proj writes the model's width back; its scale
is (head_dim / 2) ** -0.5, and its forward takes `position_embeddings=None`, read only where its config asks for
RoPE (`use_mem_rope=True`, which without --rope is refused in one line):

    attnscope trace docs/examples/shared_block.py:SharedAttention --causal --scale 0.3535533905932738
    attnscope trace docs/examples/shared_block.py:SharedAttention --init "use_mem_rope=True" --causal \
        --scale 0.3535533905932738 --rope
"""

import torch
import torch.nn as nn


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class SharedAttention(nn.Module):
    def __init__(self, hidden_size=16, num_heads=2, use_mem_rope=False):
        super().__init__()
        self.head_dim = 2 * hidden_size // num_heads
        self.scaling = (self.head_dim / 2) ** -0.5
        self.use_mem_rope = use_mem_rope
        self.q_proj = nn.Linear(2 * hidden_size, 2 * hidden_size, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, 2 * hidden_size, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, 2 * hidden_size, bias=False)
        self.o_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [n_batch, n_head, n, d_head]
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.use_mem_rope:
            cos, sin = (t.unsqueeze(1) for t in position_embeddings)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(2, 3) * self.scaling  # [n_batch, n_head, n_Q, n_K]
        if attention_mask is not None:
            scores = scores + attention_mask
        out = scores.softmax(-1) @ v  # [n_batch, n_head, n_Q, d_head]
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1))  # [n_batch, n, d_model]
