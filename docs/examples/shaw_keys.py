"""Shaw et al.'s relative keys handed to the attention as an argument, as HF's SpeechT5Attention takes them
(docs/trace.md, "A relative key table"): `position_bias` [n_Q, n_K, d_head] (docs/examples/shaw_keys_6x6x8.npy),
q_i · P[i, j] added to score (i, j), the queries scaled first. `bug='transposed'` reads the table as P[j, i]."""

import torch
from torch import nn


class ShawKeysAttention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, hidden_states, position_bias=None):
        bsz, n, c = hidden_states.size()
        q = (self.q_proj(hidden_states) * self.scaling).view(bsz, n, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, n, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, n, self.num_heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)  # [bsz, num_heads, n, n]
        if position_bias is not None:
            table = position_bias.transpose(0, 1) if self.bug == "transposed" else position_bias
            scores = scores + torch.einsum("bhid,ijd->bhij", q, table)  # q_i · P[i, j]
        out = scores.softmax(-1) @ v  # [bsz, num_heads, n, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(bsz, n, c))
