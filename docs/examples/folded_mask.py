"""A mask in the shape the code's own check asks for (docs/trace.md, "The shape the code asks its mask in"): HF's
bmm-era attention (ProphetNet's, BART's before SDPA) folds its heads into the batch and asserts that its additive
`attention_mask` is `[bsz * num_heads, 1, src_len]`.

    attnscope trace docs/examples/folded_mask.py:BmmAttention --batch 2 --mask docs/examples/pad_2x9.npy
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class BmmAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        source = hidden_states if key_value_states is None else key_value_states
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling, tgt_len, bsz).view(*proj_shape)
        key_states = self._shape(self.k_proj(source), -1, bsz).view(*proj_shape)
        value_states = self._shape(self.v_proj(source), -1, bsz).view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        assert attention_mask is None or attention_mask.size() == (self.num_heads * bsz, 1, src_len)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_output = torch.bmm(F.softmax(attn_weights, dim=-1), value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim))
