"""Styles for tests/test_trace_round36_forms.py: Swin V2's window attention written without its output projection
(a fused qkv Linear, cosine scores times a clamped learned temperature, a continuous position bias from an MLP), and
torchtune's `MultiHeadAttention`, which takes its projections as modules (`q_proj=nn.Linear(...)`) and repeats its
key/value heads by expand then flatten. `bug=` plants a mistake."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias, no unit gain)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _relative_index(n):
    coords = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")).flatten(1)  # [2, n²]
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (n - 1)
    return rel[..., 0] * (2 * n - 1) + rel[..., 1]  # [n², n²]


class SwinV2Window(nn.Module):
    """Swin V2's `WindowAttention(x [B·nW, N, C], mask)` without its `proj`: q̂ · k̂ᵀ · exp(min(logit_scale, log 100)),
    plus 16 · sigmoid(cpb_mlp(table)) gathered by the relative index. 'bias_transposed' permutes the bias (2, 1, 0),
    'kv_swapped' exchanges k and v, 'softmax_axis' normalizes over the queries, 'extra_sqrt_d' also divides by
    √d_head (a convention trace notes: a temperature times a constant)."""

    def __init__(self, dim=32, window=3, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 16, bias=True), nn.ReLU(inplace=True),
                                     nn.Linear(16, num_heads, bias=False))
        r = torch.arange(-(window - 1), window, dtype=torch.float32) / (window - 1) * 8
        table = torch.stack(torch.meshgrid(r, r, indexing="ij"), -1).unsqueeze(0)  # [1, 2w-1, 2w-1, 2]
        self.register_buffer("relative_coords_table", torch.sign(table) * torch.log2(table.abs() + 1) / math.log2(8))
        self.register_buffer("relative_position_index", _relative_index(window))
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        _moved(self, 36)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        attn = attn * logit_scale
        if self.bug == "extra_sqrt_d":
            attn = attn / math.sqrt(C // self.num_heads)
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(N, N, -1)
        bias = bias.permute(2, 1, 0) if self.bug == "bias_transposed" else bias.permute(2, 0, 1).contiguous()
        attn = attn + 16 * torch.sigmoid(bias).unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return (attn @ v).transpose(1, 2).reshape(B_, N, C)


class TorchtuneAttention(nn.Module):
    """torchtune's `MultiHeadAttention(embed_dim=..., q_proj=..., k_proj=..., v_proj=..., output_proj=...)`: the
    projections come in as modules; k/v heads expanded per query head and flattened; SDPA causal. 'tiled' repeats the
    key/value heads in turn, 'merge_no_transpose' views [b, h, s, d] as [b, s, h·d]."""

    def __init__(self, *, embed_dim, num_heads, num_kv_heads, head_dim, q_proj, k_proj, v_proj, output_proj,
                 is_causal=True, attn_dropout=0.0, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.is_causal, self.attn_dropout, self.bug = is_causal, attn_dropout, bug
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = q_proj, k_proj, v_proj, output_proj
        _moved(self, 37)

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        y = x if y is None else y
        s_y = y.shape[1]
        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.num_heads != self.num_kv_heads:
            q_per_kv = self.num_heads // self.num_kv_heads
            if self.bug == "tiled":
                k, v = k.repeat(1, q_per_kv, 1, 1), v.repeat(1, q_per_kv, 1, 1)
            else:
                k = k.unsqueeze(2).expand(b, self.num_kv_heads, q_per_kv, s_y, self.head_dim).flatten(1, 2)
                v = v.unsqueeze(2).expand(b, self.num_kv_heads, q_per_kv, s_y, self.head_dim).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                             is_causal=mask is None and self.is_causal)
        if self.bug == "merge_no_transpose":
            return self.output_proj(out.contiguous().view(b, s_x, -1))
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))


class CpmAntAttention(nn.Module):
    """CPM-Ant's `forward(hidden_q, hidden_kv, attention_mask [b, len_q, len_k], position_bias)`: the bias added after
    the scale, the mask filled with -inf before the softmax and with 0 after it. 'bias_after_softmax' adds the bias
    to the weights (the second fill still after it)."""

    def __init__(self, dim_model=32, num_heads=4, dim_head=8, bug=None):
        super().__init__()
        self.num_heads, self.dim_head, self.bug = num_heads, dim_head, bug
        self.project_q = nn.Linear(dim_model, num_heads * dim_head, bias=False)
        self.project_k = nn.Linear(dim_model, num_heads * dim_head, bias=False)
        self.project_v = nn.Linear(dim_model, num_heads * dim_head, bias=False)
        self.attention_out = nn.Linear(num_heads * dim_head, dim_model, bias=False)
        self.softmax = nn.Softmax(dim=-1)
        _moved(self, 38)

    def forward(self, hidden_q, hidden_kv, attention_mask, position_bias):
        batch_size, len_q, len_k = hidden_q.size(0), hidden_q.size(1), hidden_kv.size(1)
        query = self.project_q(hidden_q).view(batch_size, len_q, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        key = self.project_k(hidden_kv).view(batch_size, len_k, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        value = self.project_v(hidden_kv).view(batch_size, len_k, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        score = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.dim_head)
        if self.bug != "bias_after_softmax":
            score = score + position_bias
        masked = attention_mask.view(batch_size, 1, len_q, len_k) == torch.tensor(False)
        score = torch.masked_fill(score, masked, torch.scalar_tensor(float("-inf"), dtype=score.dtype))
        score = self.softmax(score)
        if self.bug == "bias_after_softmax":
            score = score + position_bias
        score = torch.masked_fill(score, masked, torch.scalar_tensor(0, dtype=score.dtype))
        score = torch.matmul(score, value).permute(0, 2, 1, 3).contiguous()
        return self.attention_out(score.view(batch_size, len_q, self.num_heads * self.dim_head))


class Former(nn.Module):
    """Peter Bloem's `former` SelfAttention: `tokeys`, `toqueries`, `tovalues`, `unifyheads`, heads folded into the
    batch for bmm. 'kv_swapped' projects the keys with `tovalues` and the values with `tokeys`."""

    def __init__(self, emb=32, heads=4, bug=None):
        super().__init__()
        self.emb, self.heads, self.bug = emb, heads, bug
        self.tokeys = nn.Linear(emb, emb, bias=False)
        self.toqueries = nn.Linear(emb, emb, bias=False)
        self.tovalues = nn.Linear(emb, emb, bias=False)
        self.unifyheads = nn.Linear(emb, emb)
        _moved(self, 39)

    def forward(self, x):
        b, t, e = x.size()
        h, s = self.heads, e // self.heads
        keys, values = (self.tovalues(x), self.tokeys(x)) if self.bug == "kv_swapped" else (self.tokeys(x),
                                                                                             self.tovalues(x))
        queries = self.toqueries(x)
        keys = keys.view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries.view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        values = values.view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        dot = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(s)
        dot = F.softmax(dot, dim=2)
        out = torch.bmm(dot, values).view(b, h, t, s).transpose(1, 2).contiguous().view(b, t, s * h)
        return self.unifyheads(out)


class KeyMultiplied(nn.Module):
    """Falcon-H1's attention: `k_proj(x) * key_multiplier`, its model's scale key_multiplier / √d_head (given with
    --scale), HF's eager attention handed `scaling`. 'queries_prescaled' also scales the queries by `scaling` first."""

    def __init__(self, hidden_size=48, num_heads=4, key_multiplier=0.75, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.scaling, self.key_multiplier = self.head_dim ** -0.5, key_multiplier
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        _moved(self, 40)

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states)
        query = (query * self.scaling if self.bug == "queries_prescaled" else query).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2) * self.key_multiplier
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        weights = torch.softmax(torch.matmul(query, key.transpose(2, 3)) * self.scaling, dim=-1)
        out = torch.matmul(weights, value).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1))


class FsmtAttention(nn.Module):
    """FSMT's (fairseq's) `Attention.forward(query, key, key_padding_mask, attn_mask)`, time-first: in self-attention
    its keys and values come from `query`, `key` never read; `key_padding_mask` True = padded, beside an additive
    `attn_mask`. 'padding_after_softmax' fills the padded weights with 0 after the softmax."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim, self.bug = embed_dim, num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _moved(self, 41)

    def forward(self, query, key, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        key_states = self.k_proj(query).view(-1, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        value_states = self.v_proj(query).view(-1, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        query_states = self.q_proj(query) * self.scaling
        query_states = query_states.view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        key_states = key_states.reshape(bsz * self.num_heads, -1, self.head_dim)
        value_states = value_states.reshape(bsz * self.num_heads, -1, self.head_dim)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attn_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        padded = key_padding_mask.unsqueeze(1).unsqueeze(2) if key_padding_mask is not None else None
        if padded is not None and self.bug != "padding_after_softmax":
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(padded, torch.finfo(attn_weights.dtype).min)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        if padded is not None and self.bug == "padding_after_softmax":
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len).masked_fill(padded, 0.0)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn_output), None


class LabmlAttention(nn.Module):
    """labml.ai's `MultiHeadAttention(query=, key=, value=, mask=)`: time-first `[seq, batch, d_model]`, scores
    einsum'd `ibhd,jbhd->ijbh`, softmax over dim=1, its mask `[seq_q, seq_k, batch]` checked by asserts.
    'softmax_last' normalizes over the heads' axis."""

    def __init__(self, heads=4, d_model=32, bug=None):
        super().__init__()
        self.heads, self.d_k, self.bug = heads, d_model // heads, bug
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)
        self.scale = 1 / math.sqrt(self.d_k)
        _moved(self, 42)

    def prepare_mask(self, mask, query_shape, key_shape):
        assert mask.shape[0] == 1 or mask.shape[0] == query_shape[0]
        assert mask.shape[1] == key_shape[0]
        assert mask.shape[2] == 1 or mask.shape[2] == query_shape[1]
        return mask.unsqueeze(-1)

    def forward(self, *, query, key, value, mask=None):
        seq_len, batch_size, _ = query.shape
        if mask is not None:
            mask = self.prepare_mask(mask, query.shape, key.shape)
        query = self.query(query).view(seq_len, batch_size, self.heads, self.d_k)
        key = self.key(key).view(*key.shape[:-1], self.heads, self.d_k)
        value = self.value(value).view(*value.shape[:-1], self.heads, self.d_k)
        scores = torch.einsum("ibhd,jbhd->ijbh", query, key) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = torch.softmax(scores, dim=-1 if self.bug == "softmax_last" else 1)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value).reshape(seq_len, batch_size, -1)
        return self.output(x)
