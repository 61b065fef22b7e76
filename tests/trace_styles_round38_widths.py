"""Styles for tests/test_trace_round38_widths.py: MobileBERT's self-attention as transformers writes it
(`MobileBertSelfAttention`), whose value projection reads the block's full width (hidden_size) while its query and key
projections read the bottleneck's (true_hidden_size), three inputs and no output projection; and an attention that
asserts a mask form of its own that trace never writes. `bug=` plants a mistake."""

from __future__ import annotations

import math

import torch
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


class MobileSelf(nn.Module):
    """q = query(query_tensor), k = key(key_tensor) read `true_hidden` features, v = value(value_tensor) reads
    `hidden`; BERT's transpose_for_scores, an additive mask, softmax, the heads merged. 'heads_last' splits every
    projection as (head_size, heads) and merges back the same way (a checkpoint's layout, SuperGlue's: a convention);
    'q_heads_last' splits the queries alone so (heads.split_transposed); 'scale_all' divides by √all_head_size;
    'no_permute' merges without the permute; 'mask_after' adds the mask after the softmax."""

    def __init__(self, hidden=48, true_hidden=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.size, self.bug = heads, true_hidden // heads, bug
        self.all_head_size = heads * self.size
        self.query = nn.Linear(true_hidden, self.all_head_size)
        self.key = nn.Linear(true_hidden, self.all_head_size)
        self.value = nn.Linear(hidden, self.all_head_size)
        _moved(self, 38)

    def transpose_for_scores(self, x, strided=False):
        if self.bug == "heads_last" or strided:
            return x.view(*x.size()[:-1], self.size, self.heads).permute(0, 3, 1, 2)
        return x.view(*x.size()[:-1], self.heads, self.size).permute(0, 2, 1, 3)

    def forward(self, query_tensor, key_tensor, value_tensor, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(query_tensor), self.bug == "q_heads_last")
        key_layer = self.transpose_for_scores(self.key(key_tensor))
        value_layer = self.transpose_for_scores(self.value(value_tensor))
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        scores = scores / math.sqrt(self.all_head_size if self.bug == "scale_all" else self.size)
        if attention_mask is not None and self.bug != "mask_after":
            scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        if attention_mask is not None and self.bug == "mask_after":
            probs = probs + attention_mask
        context = torch.matmul(probs, value_layer)
        if self.bug == "heads_last":
            context = context.permute(0, 2, 3, 1).contiguous()
        elif self.bug != "no_permute":
            context = context.permute(0, 2, 1, 3).contiguous()
        return context.reshape(context.size(0), query_tensor.size(1), self.all_head_size)


class GlueAttention(nn.Module):
    """SuperGlue-like message passing: descriptors channel-first `[B, d_model, N]`, pointwise Conv1d projections, each
    head every num_heads-th channel (`view(B, dim, heads, N)`, the checkpoint's own layout), einsum scores over dim,
    merged back the same way. 'merge_head_major' merges `x.transpose(1, 2)` first (heads.merge_wrong_permute);
    'value_from_source' feeds the value projection the key input (kv.values_from_keys); 'scale_model' divides by
    √d_model (scale.d_model)."""

    def __init__(self, num_heads=4, d_model=32, bug=None):
        super().__init__()
        self.dim, self.num_heads, self.bug = d_model // num_heads, num_heads, bug
        self.merge = nn.Conv1d(d_model, d_model, kernel_size=1)
        self.proj = nn.ModuleList([nn.Conv1d(d_model, d_model, kernel_size=1) for _ in range(3)])
        _moved(self, 40)

    def forward(self, query, key, value):
        b = query.size(0)
        sources = (query, key, key) if self.bug == "value_from_source" else (query, key, value)
        q, k, v = [layer(x).view(b, self.dim, self.num_heads, -1) for layer, x in zip(self.proj, sources, strict=True)]
        dim = q.shape[1] * (self.num_heads if self.bug == "scale_model" else 1)
        prob = torch.softmax(torch.einsum("bdhn,bdhm->bhnm", q, k) / dim ** 0.5, dim=-1)
        x = torch.einsum("bhnm,bdhm->bdhn", prob, v)
        if self.bug == "merge_head_major":
            x = x.transpose(1, 2)
        return self.merge(x.contiguous().view(b, self.dim * self.num_heads, -1))


class OwnMaskForm(nn.Module):
    """A causal-capable attention that asserts its mask is 5-D, `[n_batch, n_head, 1, n_Q, n_K]`, a form trace never
    writes: with --causal it raises on every mask trace hands it."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        _moved(self, 39)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            assert mask.dim() == 5, "mask must be [b, h, 1, q, k]"
            scores = scores.masked_fill(~mask[:, :, 0], float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@torch.jit.script
def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = x.shape
    return x.view(batch, length, heads, width // heads).transpose(1, 2)


@torch.jit.script
def dot_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.matmul(q, k.transpose(-1, -2)) * scale


class ScriptedAttention(nn.Module):
    """Sockeye-like: its helpers compiled with @torch.jit.script (their ops run inside TorchScript, unseen unless
    trace runs them as Python). 'unscaled' hands the scores a scale of 1 (scale.none)."""

    def __init__(self, d=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        _moved(self, 41)

    def forward(self, x):
        q, k, v = (split_heads(p(x), self.heads) for p in (self.q, self.k, self.v))
        scale = 1.0 if self.bug == "unscaled" else q.shape[-1] ** -0.5
        probs = torch.softmax(dot_scores(q, k, scale), dim=-1)
        return self.o((probs @ v).transpose(1, 2).reshape(x.shape))


class FastQkv(nn.Module):
    """LayoutLMv2-like: one fused `qkv_linear` without bias, its only Linear, `q_bias` and `v_bias` added after the
    chunk, no output projection, queries scaled first, the relative bias `rel_pos` [B, H, n, n] added to the scores,
    a padding mask True = masked. 'bias_transposed' adds rel_pos transposed (t5.transposed)."""

    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.size, self.bug = heads, hidden // heads, bug
        self.qkv_linear = nn.Linear(hidden, 3 * hidden, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(1, 1, hidden))
        self.v_bias = nn.Parameter(torch.zeros(1, 1, hidden))
        _moved(self, 42)

    def forward(self, hidden_states, attention_mask=None, rel_pos=None):
        b = hidden_states.shape[0]
        q, k, v = torch.chunk(self.qkv_linear(hidden_states), 3, dim=-1)
        q, v = q + self.q_bias, v + self.v_bias
        q, k, v = (t.view(b, -1, self.heads, self.size).transpose(1, 2) for t in (q, k, v))
        q = q / math.sqrt(self.size)
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores + (rel_pos.transpose(-1, -2) if self.bug == "bias_transposed" else rel_pos)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask.to(torch.bool), torch.finfo(scores.dtype).min)
        context = torch.matmul(torch.softmax(scores, dim=-1), v)
        return context.permute(0, 2, 1, 3).reshape(b, -1, self.heads * self.size)


class PerDimScaled(nn.Module):
    """TimesFM-like: the queries times `softplus(scaling) · 1.442695041 / √head_dim`, a learned factor per coordinate
    of each head, then attention with scaling 1 and the model's additive 4-D mask. 'keys_from_values' makes the keys
    with the value projection (kv.keys_from_values); 'extra_scale' scales the scores by 1/√head_dim as well
    (scale.none against the gain's whole scale)."""

    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, hidden // heads, bug
        self.scaling = nn.Parameter(torch.zeros(self.head_dim))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))
        _moved(self, 43)

    def _scale_query(self, query):
        scale = nn.functional.softplus(self.scaling).mul(1.442695041 / math.sqrt(self.head_dim))
        return query * scale[None, None, None, :]

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        shape = (b, n, self.heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = (self.v_proj if self.bug == "keys_from_values" else self.k_proj)(hidden_states).view(shape)
        key = key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query = self._scale_query(query)
        scaling = self.head_dim ** -0.5 if self.bug == "extra_scale" else 1.0
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.softmax(weights, dim=-1)
        return self.o_proj(torch.matmul(weights, value).transpose(1, 2).reshape(b, n, -1))
