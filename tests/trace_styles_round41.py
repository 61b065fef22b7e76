"""Styles for tests/test_trace_round41.py: CLIP's (and OWL-ViT's) attention of transformers 4.3x, handed a
`causal_attention_mask` and an `attention_mask`, each `[bsz, 1, tgt_len, src_len]` and size-checked, both added to
the scores; TrOCR's cross-attention (`kdim` = the encoder's width, its k_proj made before its q_proj, q scaled at
its projection, the heads folded into the batch for `bmm`); and Jukebox's `block_attn` (a fused Conv1D-style
c_attn of `int(attention_multiplier * width)` features, the sequence cut into blocks attended apart under a causal
tril, `w * mask + -1e9 * (1 - mask)`, the scale head_dim^-0.25 on q and on k). `bug=` plants a mistake."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


class TwoMasks(nn.Module):
    """CLIPAttention (transformers 4.3x): q = q_proj(x) * scale; `_shape` to [b, h, n, d] and folded to
    [b·h, n, d]; `bmm`; causal_attention_mask, then attention_mask, each checked to be [b, 1, n, n] and added.
    'causal_after' adds the causal mask to the weights after the softmax; 'no_scale' drops the scale."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim, self.bug = embed_dim, num_heads, embed_dim // num_heads, bug
        self.scale = 1.0 if bug == "no_scale" else self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 411)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def _added(self, weights, mask, bsz, tgt_len, src_len):
        if mask.size() != (bsz, 1, tgt_len, src_len):
            raise ValueError(f"Attention mask should be of size {(bsz, 1, tgt_len, src_len)}, but is {mask.size()}")
        weights = weights.view(bsz, self.num_heads, tgt_len, src_len) + mask
        return weights.view(bsz * self.num_heads, tgt_len, src_len)

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None, output_attentions=False):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if causal_attention_mask is not None and self.bug != "causal_after":
            attn_weights = self._added(attn_weights, causal_attention_mask, bsz, tgt_len, src_len)
        if attention_mask is not None:
            attn_weights = self._added(attn_weights, attention_mask, bsz, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        if causal_attention_mask is not None and self.bug == "causal_after":
            attn_weights = self._added(attn_weights, causal_attention_mask, bsz, tgt_len, src_len)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim))
        return attn_output, None


class WideMemory(nn.Module):
    """TrOCRAttention as a decoder's cross-attention: k_proj = Linear(kdim, d) and v_proj = Linear(vdim, d) made
    first, then q_proj; q scaled at its projection; `bmm` over [b·h, n, d]; a 4-D additive attention_mask.
    'kv_swapped' reads its keys from v_proj, its values from k_proj."""

    def __init__(self, embed_dim=32, num_heads=4, kdim=24, vdim=24, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim, self.bug = embed_dim, num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(kdim, embed_dim)
        self.v_proj = nn.Linear(vdim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 412)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, output_attentions=False):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        current = key_value_states if key_value_states is not None else hidden_states
        keys, values = (self.v_proj, self.k_proj) if self.bug == "kv_swapped" else (self.k_proj, self.v_proj)
        key_states = self._shape(keys(current), -1, bsz)
        value_states = self._shape(values(current), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, tgt_len, src_len)}")
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim)), None


class BlockConfig:
    """The fields of Jukebox's prior config that its attention reads."""

    def __init__(self, hidden_size=32, n_heads=2, attention_multiplier=1.0, blocks=3):
        self.hidden_size, self.n_heads = hidden_size, n_heads
        self.attention_multiplier, self.blocks = attention_multiplier, blocks


class Conv1D(nn.Module):
    """Jukebox's and GPT-2's Conv1D: a weight [in, out], `addmm`."""

    def __init__(self, input_width, output_width):
        super().__init__()
        self.output_width = output_width
        self.weight = nn.Parameter(torch.randn(input_width, output_width) * input_width ** -0.5)
        self.bias = nn.Parameter(torch.zeros(output_width))

    def forward(self, hidden_states):
        size_out = (*hidden_states.size()[:-1], self.output_width)
        out = torch.addmm(self.bias, hidden_states.view(-1, hidden_states.size(-1)), self.weight)
        return out.view(*size_out)


class BlockAttn(nn.Module):
    """JukeboxAttention's block_attn: q, k, v = c_attn(x).chunk(3); the n_ctx tokens cut into `blocks` blocks moved
    into the batch; keys split straight to [b, h, d, n] (`permute(0, 2, 3, 1)`); `q @ k` times scale² with scale =
    head_dim^-0.25; an autoregressive `ones(n, n).tril()` applied as `w * mask + -1e9 * (1 - mask)`; the heads merged
    back, each block to its place; c_proj. 'multiplied' applies the mask as `w * mask` alone."""

    def __init__(self, config, n_ctx=9, bug=None):
        super().__init__()
        self.embed_dim, self.n_heads, self.bug = config.hidden_size, config.n_heads, bug
        hidden_dim = int(config.attention_multiplier * self.embed_dim)  # a width's factor, no scale
        self.head_dim = hidden_dim // config.n_heads
        self.scale = self.head_dim ** -0.25
        self.c_attn = Conv1D(self.embed_dim, hidden_dim * 3)
        self.c_proj = Conv1D(hidden_dim, self.embed_dim)
        self.block_ctx = n_ctx // config.blocks
        _moved(self, 413)

    def split_heads(self, hidden_states, is_key=False):
        shape = (*hidden_states.size()[:-1], self.n_heads, hidden_states.size(-1) // self.n_heads)
        hidden_states = hidden_states.view(*shape)
        return hidden_states.permute(0, 2, 3, 1) if is_key else hidden_states.permute(0, 2, 1, 3)

    def merge_heads(self, hidden_states):
        hidden_states = hidden_states.permute(0, 2, 1, 3).contiguous()
        return hidden_states.view(*hidden_states.size()[:-2], hidden_states.size(-2) * hidden_states.size(-1))

    def dense_attn(self, query, key, value):
        query, key, value = self.split_heads(query), self.split_heads(key, is_key=True), self.split_heads(value)
        weights = torch.matmul(query, key)
        weights.mul_(self.scale * self.scale)
        mask = torch.ones(query.size(-2), key.size(-1)).tril().view(1, 1, query.size(-2), key.size(-1))
        weights = weights * mask if self.bug == "multiplied" else weights * mask + -1e9 * (1 - mask)
        probs = F.softmax(weights, dim=-1)
        return self.merge_heads(torch.matmul(probs, value))

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).chunk(3, dim=2)
        batch, seq_len, width = value.shape
        blocked = [t.view(batch * seq_len // self.block_ctx, self.block_ctx, width) for t in (query, key, value)]
        return self.c_proj(self.dense_attn(*blocked).view(batch, seq_len, width))


def block_reference(module: BlockAttn, x: torch.Tensor) -> torch.Tensor:
    """BlockAttn's output as a formula: each block of tokens attends causally within itself, scores / √head_dim
    (F.scaled_dot_product_attention's own scale), float64."""
    b, n, _ = x.shape
    q, k, v = (x @ module.c_attn.weight + module.c_attn.bias).chunk(3, dim=-1)
    blocks = n // module.block_ctx
    q, k, v = (t.reshape(b * blocks, module.block_ctx, module.n_heads, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.transpose(1, 2).reshape(b, n, -1)
    return out @ module.c_proj.weight + module.c_proj.bias

