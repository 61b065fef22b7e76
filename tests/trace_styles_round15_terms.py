"""Attention that adds to (or multiplies into) its scores terms, biases and scales it computes itself, in the forms
real libraries write them, at tiny sizes, for tests/test_trace_round15_terms.py (round 15b's SAM, Swin V2 and Q-Former
failures). Each takes `bug=None`, a planted mistake; weights are moved off their initial values in `__init__`.

A term added in another view of the scores (a reshape that keeps the values):
- DecomposedRelPos: SAM's and MViTv2's decomposed 2-D relative positions, the heads kept [B, H, N, N], the scores
  viewed [B, H, qh, qw, kh, kw] to add `rel_h[..., None]` and `rel_w[..., None, :]`, viewed back.
- FlatShaw: Shaw et al.'s relative keys `q · rel_k[j − i]` added to the scores flattened [B, H, N·N].
- AxialKeyPos: heads in the batch [B·H, N, d] (BERT's transpose_for_scores), an axial term of the queries against a
  table of key rows and one of key columns, added with the scores viewed [B·H, N, kh, kw].

A position bias whose values the code changes after it lays it out [H, N, N]:
- ContinuousBias: Swin V2's continuous position bias, an MLP on the log-spaced coordinates, gathered by the relative
  index, viewed [N, N, H], permuted, then `16 · sigmoid`.
- TanhCappedBias: T5's embedding of bucketed relative positions [N, N, H], permuted, capped `c · tanh(bias / c)`.
- GainedTable: BEiT's and Swin V1's relative_position_bias_table gathered and permuted, times a learned gain per
  head; Swin's shifted-window mask `[nW, N, N]` added per window, the batch viewed [B // nW, nW, ..].

A learned temperature, one a head:
- ScaledCosine: OpenCLIP's scaled_cosine, heads in the batch [B·H, L, d], `bmm(normalize(q), normalize(k)ᵀ)` viewed
  [B, H, L, L] times `clamp(logit_scale, max=log 100).exp()`.
- LearnedTemperature: XCiT's and Restormer's `(q @ kᵀ) * self.temperature`, temperature [H, 1, 1], no other scale.
- DividedTemperature: the scores divided by `softplus(self.tau)` [1, H, 1, 1], a boolean mask of its caller's.
- CosineWithBias: cosine attention with its temperature and a relative position bias table (Swin V2 without the MLP),
  a projection a role.

A large number added where the mask hides a key (BERT's extended mask, (1 − mask) · −10000):
- BertRelativeKey: BERT's position_embedding_type='relative_key' (distance_embedding), the mask [B, N] 0/1 extended.
- AdditivePadding: the same mask added to plain scores; WherePadding: `torch.where(keep, 0, -1e4)` added.

DeBERTa's scale √((1 + m) · d_head) with m relative products, a mistake away from the scores:
- Disentangled: DeBERTa's c2p and p2c from a table of relative embeddings, the scale applied to q first.
- DisentangledBmm: DeBERTa-v2's layout, heads in the batch, the scale on kᵀ, torch.gather of the relative products.
- DisentangledEinsum: the same in einsums, the scale applied after.

Plants (bug=...): "no_scale", "softmax_axis", "merge_no_transpose", "kv_swapped", "bias_transposed",
"values_from_keys", "scale_twice", "mask_after_softmax".
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def _merge(out, bug):
    """[B, H, N, d] -> [B, N, H·d]; the plant views it straight."""
    b, h, n, d = out.shape
    return out.reshape(b, n, h * d) if bug == "merge_no_transpose" else out.transpose(1, 2).reshape(b, n, h * d)


def _softmax(scores, bug):
    return scores.softmax(dim=-2 if bug == "softmax_axis" else -1)


def relative_index(h, w):
    """[h·w, h·w] indices into a table of (2h − 1)(2w − 1) relative positions (Swin's relative_position_index)."""
    coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")).flatten(1)  # [2, N]
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # [N, N, 2]
    return (rel[..., 0] + h - 1) * (2 * w - 1) + rel[..., 1] + w - 1


# --- a term in another view -------------------------------------------------------------------------------------


class DecomposedRelPos(nn.Module):
    def __init__(self, dim=32, num_heads=4, hw=(3, 3), bug=None):
        super().__init__()
        self.num_heads, self.hw, self.bug = num_heads, hw, bug
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.randn(2 * hw[0] - 1, head_dim) * 0.5)
        self.rel_pos_w = nn.Parameter(torch.randn(2 * hw[1] - 1, head_dim) * 0.5)
        _trained(self, 1)

    @staticmethod
    def lookup(size, table):
        rel = torch.arange(size)[:, None] - torch.arange(size)[None, :] + size - 1  # [q, k]
        return table[rel]  # [q, k, d]

    def forward(self, x):
        B, N, C = x.shape
        qh, qw = self.hw
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # [B, H, N, d] each
        attn = q @ k.transpose(-2, -1) if self.bug == "no_scale" else (q * self.scale) @ k.transpose(-2, -1)
        r_q = q.reshape(B, self.num_heads, qh, qw, -1)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", r_q, self.lookup(qh, self.rel_pos_h))
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", r_q, self.lookup(qw, self.rel_pos_w))
        attn = attn.view(B, self.num_heads, qh, qw, qh, qw) + rel_h[..., :, None] + rel_w[..., None, :]
        attn = _softmax(attn.view(B, self.num_heads, N, N), self.bug)
        return self.proj(_merge(attn @ v, self.bug))


class FlatShaw(nn.Module):
    def __init__(self, dim=32, heads=4, max_rel=3, bug=None):
        super().__init__()
        self.heads, self.d, self.max_rel, self.bug = heads, dim // heads, max_rel, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.rel_k = nn.Embedding(2 * max_rel + 1, self.d)
        _trained(self, 2)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = (t.view(B, N, self.heads, self.d).transpose(1, 2) for t in (self.to_q(x), self.to_k(x),
                                                                             self.to_v(x)))
        if self.bug == "kv_swapped":
            k, v = v, k
        pos = torch.arange(N)
        rel = self.rel_k((pos[None, :] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel)  # [N, N, d]
        term = torch.einsum("bhid,ijd->bhij", q, rel)
        scores = (q @ k.transpose(-2, -1)).flatten(2) + term.flatten(2)  # [B, H, N·N]
        attn = _softmax(scores.view(B, self.heads, N, N) / math.sqrt(self.d), self.bug)
        return self.to_out(_merge(attn @ v, self.bug))


class AxialKeyPos(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, grid=(3, 3), bug=None):
        super().__init__()
        self.h, self.d, self.grid, self.bug = num_heads, hidden_size // num_heads, grid, bug
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.key_rows = nn.Parameter(torch.randn(grid[0], self.d))
        self.key_cols = nn.Parameter(torch.randn(grid[1], self.d))
        _trained(self, 3)

    def heads(self, x):
        B, N, _ = x.shape
        return x.view(B, N, self.h, self.d).permute(0, 2, 1, 3).reshape(B * self.h, N, self.d)  # [B·H, N, d]

    def forward(self, hidden_states):
        B, N, C = hidden_states.shape
        q, k, v = self.heads(self.query(hidden_states)), self.heads(self.key(hidden_states)), \
            self.heads(self.value(hidden_states))
        scale = 1.0 if self.bug == "no_scale" else self.d ** -0.5
        scores = torch.bmm(q * scale, k.transpose(1, 2))  # [B·H, N, N]
        rows, cols = q @ self.key_rows.t(), q @ self.key_cols.t()  # [B·H, N, kh], [B·H, N, kw]
        scores = (scores.view(B * self.h, N, *self.grid) + rows[..., :, None] + cols[..., None, :]).view(-1, N, N)
        probs = _softmax(scores, self.bug)
        out = torch.bmm(probs, v).view(B, self.h, N, self.d)
        return self.dense(_merge(out, self.bug))


# --- a bias whose values change after it is laid out ----------------------------------------------------------


class ContinuousBias(nn.Module):
    def __init__(self, dim=32, window=(3, 3), num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.window, self.bug = num_heads, window, bug
        self.scale = (dim // num_heads) ** -0.5
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, num_heads, bias=False))
        h = torch.arange(-(window[0] - 1), window[0], dtype=torch.float32) / (window[0] - 1) * 8
        w = torch.arange(-(window[1] - 1), window[1], dtype=torch.float32) / (window[1] - 1) * 8
        table = torch.stack(torch.meshgrid(h, w, indexing="ij"), -1)  # [2h-1, 2w-1, 2]
        self.register_buffer("coords_table", torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8))
        self.register_buffer("index", relative_index(*window))
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 4)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = (q * self.scale) @ k.transpose(-2, -1)
        table = self.cpb_mlp(self.coords_table).view(-1, self.num_heads)
        bias = table[self.index.view(-1)].view(N, N, -1)
        bias = bias.permute(2, 1, 0) if self.bug == "bias_transposed" else bias.permute(2, 0, 1)
        attn = attn + 16 * torch.sigmoid(bias.contiguous()).unsqueeze(0)
        return self.proj(_merge(_softmax(attn, self.bug) @ v, self.bug))


class TanhCappedBias(nn.Module):
    def __init__(self, d_model=32, n_heads=4, num_buckets=8, cap=2.0, bug=None):
        super().__init__()
        self.n_heads, self.d, self.num_buckets, self.cap, self.bug = n_heads, d_model // n_heads, num_buckets, cap, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)
        _trained(self, 5)
        with torch.no_grad():
            self.relative_attention_bias.weight.mul_(8.0)  # large enough that the cap shows

    def compute_bias(self, n):
        pos = torch.arange(n)
        rel = pos[None, :] - pos[:, None]  # [n_Q, n_K], key − query
        buckets = (rel.sign() + 1) * (self.num_buckets // 4) + rel.abs().clamp(max=self.num_buckets // 4 - 1)
        values = self.relative_attention_bias(buckets.clamp(0, self.num_buckets - 1))  # [n, n, H]
        values = values.permute(2, 1, 0) if self.bug == "bias_transposed" else values.permute(2, 0, 1)
        return self.cap * torch.tanh(values.unsqueeze(0) / self.cap)

    def forward(self, hidden_states):
        B, N, _ = hidden_states.shape

        def shape(t):
            return t.view(B, N, self.n_heads, self.d).transpose(1, 2)

        q, k, v = shape(self.q(hidden_states)), shape(self.k(hidden_states)), shape(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(3, 2)) / math.sqrt(self.d) + self.compute_bias(N)
        attn = _softmax(scores, self.bug)
        return self.o(_merge(torch.matmul(attn, v), self.bug))


class GainedTable(nn.Module):
    def __init__(self, dim=32, num_heads=4, window=(3, 3), bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window[0] - 1) * (2 * window[1] - 1),
                                                                    num_heads))
        self.bias_gain = nn.Parameter(torch.linspace(0.5, 2.0, num_heads))
        self.register_buffer("relative_position_index", relative_index(*window))
        _trained(self, 6)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.bug == "scale_twice":
            q = q * self.scale
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        bias = bias.permute(2, 1, 0) if self.bug == "bias_transposed" else bias.permute(2, 0, 1)
        attn = attn + (bias.contiguous() * self.bias_gain.view(-1, 1, 1)).unsqueeze(0)
        if mask is not None:  # one additive mask a window [nW, N, N], the batch B // nW images of nW windows
            n_w = mask.shape[0]
            windows = attn.view(B // n_w, n_w, self.num_heads, N, N)
            if self.bug == "mask_after_softmax":
                return self.proj(_merge((_softmax(windows, None) + mask[None, :, None]).view(B, -1, N, N) @ v, None))
            attn = (windows + mask[None, :, None]).view(B, -1, N, N)
        return self.proj(_merge(_softmax(attn, self.bug) @ v, self.bug))


# --- a learned temperature per head ---------------------------------------------------------------------------


class ScaledCosine(nn.Module):
    def __init__(self, dim=32, num_heads=4, logit_scale_max=math.log(1.0 / 0.01), bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.logit_scale_max, self.bug = num_heads, dim // num_heads, \
            logit_scale_max, bug
        self.in_proj = nn.Linear(dim, dim * 3)
        self.out_proj = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.log(torch.tensor([3.0, 7.0, 12.0, 25.0])).view(num_heads, 1, 1))
        _trained(self, 7)

    def forward(self, x):
        N, L, C = x.shape
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        if self.bug == "values_from_keys":
            v = k
        q, k, v = (t.reshape(N, L, self.num_heads, -1).transpose(1, 2).reshape(N * self.num_heads, L, -1)
                   for t in (q, k, v))
        attn = torch.bmm(F.normalize(q, dim=-1), F.normalize(k, dim=-1).transpose(-1, -2))
        logit_scale = torch.clamp(self.logit_scale, max=self.logit_scale_max).exp()
        attn = (attn.view(N, self.num_heads, L, L) * logit_scale).view(-1, L, L)
        out = torch.bmm(_softmax(attn, self.bug), v).view(N, self.num_heads, L, -1)
        return self.out_proj(_merge(out, self.bug))


class LearnedTemperature(nn.Module):
    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 8)
        with torch.no_grad():
            self.temperature.copy_(torch.tensor([0.15, 0.3, 0.45, 0.8]).view(-1, 1, 1))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = (q @ k.transpose(-2, -1)) * self.temperature
        return self.proj(_merge(_softmax(attn, self.bug) @ v, self.bug))


class DividedTemperature(nn.Module):
    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.d, self.bug = n_head, d_model // n_head, bug
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.tau = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.5]).view(1, n_head, 1, 1))
        _trained(self, 9)

    def forward(self, x, mask=None):
        B, N, _ = x.shape
        q, k = (t.view(B, N, self.n_head, self.d).transpose(1, 2) for t in (self.w_q(x), self.w_k(x)))
        v = (self.w_k(x) if self.bug == "values_from_keys" else self.w_v(x)).view(B, N, self.n_head, self.d)
        scores = torch.matmul(q, k.transpose(-2, -1)) / F.softplus(self.tau)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.w_o(_merge(torch.matmul(_softmax(scores, self.bug), v.transpose(1, 2)), self.bug))


class CosineWithBias(nn.Module):
    def __init__(self, dim=32, window=(3, 3), num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.logit_scale = nn.Parameter(torch.log(torch.tensor([5.0, 10.0, 20.0, 40.0])).view(num_heads, 1, 1))
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window[0] - 1) * (2 * window[1] - 1),
                                                                    num_heads))
        self.register_buffer("relative_position_index", relative_index(*window))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self, 10)

    def forward(self, x):
        B_, N, C = x.shape
        q, k, v = (t.reshape(B_, N, self.num_heads, -1).transpose(1, 2) for t in (self.q_proj(x), self.k_proj(x),
                                                                                  self.v_proj(x)))
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        return self.o_proj(_merge(_softmax(attn, self.bug) @ v, self.bug))


# --- a large number added where the mask hides a key ----------------------------------------------------------


class BertRelativeKey(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, max_position_embeddings=16, bug=None):
        super().__init__()
        self.h, self.d, self.max_pos, self.bug = num_attention_heads, hidden_size // num_attention_heads, \
            max_position_embeddings, bug
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.distance_embedding = nn.Embedding(2 * max_position_embeddings - 1, self.d)
        _trained(self, 11)

    def transpose_for_scores(self, x):
        return x.view(*x.shape[:-1], self.h, self.d).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        B, N, _ = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, N)
        extended = (1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)) * -10000.0
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        position_ids_l = torch.arange(N, dtype=torch.long).view(-1, 1)
        position_ids_r = torch.arange(N, dtype=torch.long).view(1, -1)
        positional_embedding = self.distance_embedding(position_ids_l - position_ids_r + self.max_pos - 1)
        attention_scores = attention_scores + torch.einsum("bhld,lrd->bhlr", query_layer, positional_embedding)
        attention_scores = attention_scores / math.sqrt(self.d) + extended
        probs = _softmax(attention_scores, self.bug)
        return _merge(torch.matmul(probs, value_layer), self.bug)


class AdditivePadding(nn.Module):
    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self, 12)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        q, k, v = (lin(x).view(B, N, self.h, -1).transpose(1, 2) for lin in (self.q_lin, self.k_lin, self.v_lin))
        scores = q @ k.transpose(-1, -2) / math.sqrt(C // self.h)
        if mask is not None:
            scores = scores + (1.0 - mask.float()).view(B, 1, 1, N) * -10000.0
        return self.out_lin(_merge(_softmax(scores, self.bug) @ v, self.bug))


class WherePadding(AdditivePadding):
    def forward(self, x, mask=None):
        B, N, C = x.shape
        q, k, v = (lin(x).view(B, N, self.h, -1).transpose(1, 2) for lin in (self.q_lin, self.k_lin, self.v_lin))
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * (C // self.h) ** -0.5
        if mask is not None:
            scores = scores + torch.where(mask[:, None, None, :], 0.0, -1e4)
        return self.out_lin(_merge(_softmax(scores, self.bug) @ v, self.bug))


# --- DeBERTa's scale, a mistake away from the scores ----------------------------------------------------------


def _relative_positions(n, span):
    pos = torch.arange(n)
    return (pos[:, None] - pos[None, :]).clamp(-span, span - 1)  # [n, n], query − key


class Disentangled(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, span=4, bug=None):
        super().__init__()
        self.h, self.d, self.span, self.bug = num_heads, hidden_size // num_heads, span, bug
        self.in_proj = nn.Linear(hidden_size, hidden_size * 3, bias=False)
        self.pos_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.pos_q_proj = nn.Linear(hidden_size, hidden_size)
        self.rel_embeddings = nn.Parameter(torch.randn(2 * span, hidden_size))
        self.out = nn.Linear(hidden_size, hidden_size)
        _trained(self, 13)

    def heads(self, x):
        return x.view(*x.shape[:-1], self.h, self.d).transpose(-3, -2)  # [.., H, n, d]

    def forward(self, hidden_states):
        B, N, _ = hidden_states.shape
        q, k, v = (self.heads(t) for t in self.in_proj(hidden_states).chunk(3, dim=-1))
        if self.bug == "values_from_keys":
            v = k
        scale = math.sqrt(self.d * 3)
        q = q / scale
        scores = q @ k.transpose(-1, -2)
        rel = _relative_positions(N, self.span)
        pos_key, pos_query = self.heads(self.pos_proj(self.rel_embeddings)), self.heads(
            self.pos_q_proj(self.rel_embeddings)) / scale  # [H, 2·span, d]
        c2p = torch.gather(q @ pos_key.transpose(-1, -2), -1, (rel + self.span).expand(B, self.h, N, N))
        p2c = torch.gather(k @ pos_query.transpose(-1, -2), -1, (-rel + self.span).clamp(0, 2 * self.span - 1)
                           .expand(B, self.h, N, N)).transpose(-1, -2)
        probs = _softmax(scores + c2p + p2c, self.bug)
        return self.out(_merge(probs @ v, self.bug))


class DisentangledBmm(Disentangled):
    def flat(self, x):
        return self.heads(x).reshape(-1, x.shape[-2], self.d)  # [B·H, n, d]

    def forward(self, hidden_states):
        B, N, _ = hidden_states.shape
        q, k, v = (self.flat(t) for t in self.in_proj(hidden_states).chunk(3, dim=-1))
        if self.bug == "values_from_keys":
            v = k
        scale = torch.sqrt(torch.tensor(self.d, dtype=torch.float) * 3)
        scores = torch.bmm(q, k.transpose(-1, -2) / scale.to(q.dtype))
        rel = _relative_positions(N, self.span)
        pos_key = self.heads(self.pos_proj(self.rel_embeddings)).repeat(B, 1, 1)  # [B·H, 2·span, d]
        pos_query = self.heads(self.pos_q_proj(self.rel_embeddings)).repeat(B, 1, 1)
        c2p = torch.gather(torch.bmm(q, pos_key.transpose(-1, -2)), -1, (rel + self.span).expand(B * self.h, N, N))
        p2c = torch.gather(torch.bmm(k, pos_query.transpose(-1, -2)), -1,
                           (-rel + self.span).clamp(0, 2 * self.span - 1).expand(B * self.h, N, N)).transpose(-1, -2)
        scores = (scores + (c2p + p2c) / scale.to(q.dtype)).view(B, self.h, N, N)
        probs = _softmax(scores, self.bug)
        out = torch.bmm(probs.view(-1, N, N), v).view(B, self.h, N, self.d)
        return self.out(_merge(out, self.bug))


class DisentangledEinsum(Disentangled):
    def forward(self, hidden_states):
        B, N, _ = hidden_states.shape
        q, k, v = (self.heads(t) for t in self.in_proj(hidden_states).chunk(3, dim=-1))
        if self.bug == "values_from_keys":
            v = k
        rel = _relative_positions(N, self.span)
        pos_key = self.heads(self.pos_proj(self.rel_embeddings))[:, rel + self.span]  # [H, N, N, d]
        pos_query = self.heads(self.pos_q_proj(self.rel_embeddings))[:, (-rel + self.span).clamp(
            0, 2 * self.span - 1)]  # [H, N(k), N(q), d]
        c2p = torch.einsum("bhid,hijd->bhij", q, pos_key)
        p2c = torch.einsum("bhjd,hjid->bhij", k, pos_query)
        scores = (torch.einsum("bhid,bhjd->bhij", q, k) + c2p + p2c) / math.sqrt(3 * self.d)
        probs = _softmax(scores, self.bug)
        return self.out(_merge(torch.einsum("bhij,bhjd->bhid", probs, v), self.bug))


class LearnedScalarScale(nn.Module):
    """PatchTST's learnable scale (`lsa=True`): one parameter for every head, `(q @ k) * self.scale`, k already
    transposed; `value` sets it (a trained model's), the plant starts it at d_model^-0.5 instead of d_head^-0.5."""

    def __init__(self, d_model=32, n_heads=4, value=None, bug=None):
        super().__init__()
        self.n_heads, self.d = n_heads, d_model // n_heads
        self.W_Q, self.W_K, self.W_V = (nn.Linear(d_model, d_model) for _ in range(3))
        self.to_out = nn.Linear(d_model, d_model)
        _trained(self, 9)
        start = d_model ** -0.5 if bug == "scale_d_model" else self.d ** -0.5 if value is None else value
        self.scale = nn.Parameter(torch.tensor(start))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.W_Q(x).view(b, n, self.n_heads, self.d).transpose(1, 2)
        k = self.W_K(x).view(b, n, self.n_heads, self.d).permute(0, 2, 3, 1)  # [B, H, D, n]
        v = self.W_V(x).view(b, n, self.n_heads, self.d).transpose(1, 2)
        attn = (torch.matmul(q, k) * self.scale).softmax(dim=-1)
        return self.to_out(_merge(attn @ v, None))
