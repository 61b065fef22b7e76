"""Correct code whose output is NaN by its own nature where trace hands its mask in the form the ops were read as,
and plants that make NaN themselves. A run of the reference with a mistake that is NaN where the code's output is
NaN agrees with it there; that is no evidence of the mistake (usertrace/evidence.py).

- `VisionBiasAttention`: HF Pix2Struct's vision attention: a zero `position_bias` the 0/1 keep mask is summed
  into, `1 - position_bias`, `masked_fill(position_bias == 1, finfo.min)` added to unscaled scores, clamped to
  finfo.min. A batch whose second image is all padding leaves its queries no key.
- `LeftPaddedDecoder`: a nanoGPT-like decoder (fused c_attn) summing its causal buffer and the 0/1 padding and
  keeping the cells both allow (`(causal + pad).eq(2)`), `masked_fill(~keep, -inf)`. A left-padded batch leaves
  its first queries no key, and their rows NaN.

- `FoldedHeadsAttention`: CLIP's text attention, heads folded into the batch for `torch.bmm`, an additive mask.

Plants: the scale (un)applied, the heads merged without their transpose, the additive mask added to the weights after
the softmax (every masked weight -inf, the output NaN: a mistake's own NaN, which its rerun must still name).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def _merge(out, bug):
    """[B, H, N, d] -> [B, N, H·d]; the plant views it without the transpose."""
    B, H, N, d = out.shape
    if bug == "merge_no_transpose":
        return out.reshape(B, N, H * d)
    return out.transpose(1, 2).contiguous().view(B, N, H * d)


class VisionBiasAttention(nn.Module):
    """Pix2StructVisionAttention's lines: no scale (T5's init), the keep mask [B, N] (1 = a real patch) summed into a
    zero position bias, `1 - bias`, finfo.min where it is 1."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.key_value_proj_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.query, self.key, self.value, self.output = (nn.Linear(hidden_size, hidden_size, bias=False)
                                                         for _ in range(4))
        trained(self, 26)

    def forward(self, hidden_states, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:2]

        def to_projection_shape(states):
            return states.contiguous().view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        query_states = to_projection_shape(self.query(hidden_states))
        key_states = to_projection_shape(self.key(hidden_states))
        value_states = to_projection_shape(self.value(hidden_states))
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        if self.bug == "scaled":
            scores = scores / math.sqrt(self.key_value_proj_dim)
        position_bias = torch.zeros((1, self.n_heads, seq_length, seq_length), dtype=scores.dtype)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length), dtype=scores.dtype)
        if attention_mask.dim() == 2:
            position_bias = position_bias + attention_mask[:, None, None, :]
        else:
            position_bias = position_bias + attention_mask
        position_bias = 1 - position_bias
        position_bias_masked = position_bias.masked_fill(position_bias == 1, torch.finfo(scores.dtype).min)
        scores = scores + position_bias_masked
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        attn_weights = F.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
        attn_output = torch.matmul(attn_weights, value_states)
        return self.output(_merge(attn_output, self.bug))


class LeftPaddedDecoder(nn.Module):
    """nanoGPT's CausalSelfAttention with a padding mask [B, 1, 1, T] (1 = a real token) summed into its causal
    buffer: a cell is kept where both allow it."""

    def __init__(self, n_embd=32, n_head=4, block_size=16, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
        trained(self, 27)

    def forward(self, x, pad_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        scale = 1.0 if self.bug == "no_scale" else 1.0 / math.sqrt(k.size(-1))
        att = (q @ k.transpose(-2, -1)) * scale
        causal = self.bias[:, :, :T, :T]
        keep = (causal + (pad_mask if pad_mask is not None else 1.0)).eq(2)
        att = F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        return self.c_proj(_merge(y, self.bug))


class FoldedHeadsAttention(nn.Module):
    """CLIP's text attention: q scaled before the product, heads folded into the batch for `torch.bmm`, an additive
    mask [B, 1, T, S] (0 / -inf, the causal rule and the padding in one) added to the scores."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scale = self.head_dim ** -0.5
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        trained(self, 28)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz).view(*proj_shape)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz).view(*proj_shape)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))  # (bsz·heads, tgt, src)
        src_len = key_states.size(1)
        if attention_mask is not None and self.bug != "added_after":
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        if attention_mask is not None and self.bug == "added_after":  # the mask added to the weights
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        return self.out_proj(_merge(attn_output, self.bug))
