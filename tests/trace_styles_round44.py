"""Styles for tests/test_trace_round44.py, from held-out round 44. LightGlue is transformers' own
`LightGlueAttention` (models/lightglue/modeling_lightglue.py), its weights moved: RoPE's pair handed in as
`position_embeddings=None` by default, and when None the code rotates nothing (LightGlue's keypoint encoding is
the caller's); its `rotate_half` pairs adjacent coordinates, so the pair is laid out interleaved
(`repeat_interleave(2)`). `bug=` plants a mistake: 'rope_on_values' (the values turned too: rope.on_values),
'ignored' (the tables never used: rope.not_applied)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LightGlueConfig  # noqa: F401  (the config --init builds)
from transformers.models.lightglue import modeling_lightglue as hf


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias), the same in each instance of a class."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class LightGlue(hf.LightGlueAttention):
    def __init__(self, config, layer_idx=0, bug=None):
        super().__init__(config, layer_idx)
        self.bug = bug
        _moved(self, 441)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, **kwargs):
        if self.bug is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None and self.bug != "ignored":
            cos, sin = position_embeddings
            query_states, key_states = hf.apply_rotary_pos_emb(query_states, key_states, cos, sin)
            if self.bug == "rope_on_values":
                value_states, _ = hf.apply_rotary_pos_emb(value_states, value_states, cos, sin)
        attn_output, attn_weights = hf.eager_attention_forward(self, query_states, key_states, value_states,
                                                               attention_mask, scaling=self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights
