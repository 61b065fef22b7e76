"""Styles for tests/test_trace_r14_relpos.py: attention that adds a relative-position term of its own to its scores,
written the way their libraries write them, at tiny sizes. The masks: True = keep (ESPnet's 1 = valid).

- EspnetRel: ESPnet's RelPositionMultiHeadedAttention as a Conformer layer calls it (the module makes its own
  relative sinusoids [1, 2T-1, d], linear_pos, pos_bias_u/v, rel_shift by pad and view), `(matrix_ac + matrix_bd)
  / sqrt(d_k)`, masked_fill(min), softmax, masked_fill(0.0) after it.
- NemoRel: NeMo's form of it with the scale folded into q first (`q * d_k ** -0.5` before both products), einsum for
  the products, a learned table of 2T-1 relative embeddings, masked_fill(-10000.0), softmax, masked_fill(0.0).
- EspnetRelRaw: the class traced by itself, `forward(query, key, value, pos_emb, mask)`, pos_emb [1, 2T-1, d] its
  caller's; SpanRelRaw: one whose pos_emb must hold 2T+1 rows (positions -T .. T).
- ShawRel: Shaw et al.'s relative keys (a table of 2·max_rel+1 embeddings per head dim, distances clipped),
  `(q · kᵀ + q · rel_k[j - i]) / sqrt(d)`, masked_fill(finfo.min), softmax, then `* mask` (the masked weights zeroed).

Plants (bug=...): "split_no_transpose" (q, k, v viewed straight as [b, h, T, d]), "mask_fill_0" (the masked scores
filled with 0 before the softmax, the masked weights still zeroed after it).
"""

import math

import torch
from torch import nn


def _trained(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def _split(t, b, h, d, bug):
    if bug == "split_no_transpose":
        return t.view(b, h, -1, d)
    return t.view(b, -1, h, d).transpose(1, 2)


def _relative_sinusoids(T, d, dtype):
    """ESPnet's new-style table: positions T-1 .. -(T-1), [1, 2T-1, d]."""
    pos = torch.arange(T - 1, -T, -1, dtype=dtype).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=dtype) * -(math.log(10000.0) / d))
    pe = torch.zeros(2 * T - 1, d, dtype=dtype)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe.unsqueeze(0)


def _rel_shift(x):
    """[b, h, T, 2T-1] relative scores -> [b, h, T, T] absolute (pad a zero column, view, drop the first row)."""
    b, h, t, n = x.shape
    padded = torch.cat([x.new_zeros(b, h, t, 1), x], dim=-1).view(b, h, n + 1, t)
    return padded[:, :, 1:].view_as(x)[:, :, :, : n // 2 + 1]


class EspnetRel(nn.Module):
    def __init__(self, n_feat=32, n_head=4, bug=None, span=None):
        super().__init__()
        self.h, self.d_k, self.bug = n_head, n_feat // n_head, bug
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(n_feat, n_feat) for _ in range(3))
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_head, self.d_k))
        _trained(self, 11)

    def forward(self, x, mask=None):
        return self.attend(x, x, x, _relative_sinusoids(x.shape[1], self.h * self.d_k, x.dtype), mask)

    def attend(self, query, key, value, pos_emb, mask=None):
        b, T, _ = query.shape
        q = _split(self.linear_q(query), b, self.h, self.d_k, self.bug).transpose(1, 2)  # (b, T, h, d_k)
        k = _split(self.linear_k(key), b, self.h, self.d_k, self.bug)
        v = _split(self.linear_v(value), b, self.h, self.d_k, self.bug)
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        matrix_ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        matrix_bd = _rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        if mask is not None:
            masked = mask.unsqueeze(1).unsqueeze(1).eq(0)  # (b, 1, 1, T)
            fill = 0.0 if self.bug == "mask_fill_0" else torch.finfo(scores.dtype).min
            attn = torch.softmax(scores.masked_fill(masked, fill), dim=-1).masked_fill(masked, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(out)


class EspnetRelRaw(EspnetRel):
    """The same class traced by itself, as ESPnet's encoder layer calls it: forward(query, key, value, pos_emb,
    mask), pos_emb (#batch, 2*time1-1, size) made by the encoder's RelPositionalEncoding."""

    def forward(self, query, key, value, pos_emb, mask=None):
        return self.attend(query, key, value, pos_emb, mask)


class SpanRelRaw(EspnetRel):
    """A relative embedding over positions -T .. T (2T+1 rows), which no shape trace makes up fits."""

    def forward(self, query, key, value, pos_emb, mask=None):
        width = self.h * self.d_k
        p = self.linear_pos(pos_emb).view(1, 2 * query.shape[1] + 1, width)
        return self.attend(query, key, value, p[:, 1:-1], mask)


class NemoRel(nn.Module):
    def __init__(self, d_model=32, n_heads=4, max_len=16, bug=None):
        super().__init__()
        self.h, self.d_k, self.bug, self.max_len = n_heads, d_model // n_heads, bug, max_len
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.linear_out = nn.Linear(d_model, d_model)
        self.rel_table = nn.Parameter(torch.randn(2 * max_len - 1, d_model) * 0.5)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))
        _trained(self, 13)

    def forward(self, x, att_mask=None):
        b, T, _ = x.shape
        q = _split(self.linear_q(x), b, self.h, self.d_k, self.bug) * self.d_k ** -0.5
        k = _split(self.linear_k(x), b, self.h, self.d_k, self.bug)
        v = _split(self.linear_v(x), b, self.h, self.d_k, self.bug)
        rel = self.rel_table[self.max_len - T: self.max_len + T - 1]  # distances T-1 .. -(T-1)
        p = self.linear_pos(rel).view(-1, self.h, self.d_k)
        matrix_ac = torch.einsum("bhid,bhjd->bhij", q + self.pos_bias_u.unsqueeze(1) * self.d_k ** -0.5, k)
        matrix_bd = _rel_shift(torch.einsum("bhid,rhd->bhir", q + self.pos_bias_v.unsqueeze(1) * self.d_k ** -0.5, p))
        scores = matrix_ac + matrix_bd
        if att_mask is not None:
            masked = ~att_mask.bool()[:, None, None, :]
            attn = torch.softmax(scores.masked_fill(masked, 0.0 if self.bug == "mask_fill_0" else -10000.0), dim=-1)
            attn = attn.masked_fill(masked, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.linear_out(out.transpose(1, 2).reshape(b, T, -1))


class ShawRel(nn.Module):
    def __init__(self, dim=32, heads=4, max_rel=3, bug=None):
        super().__init__()
        self.heads, self.d, self.max_rel, self.bug = heads, dim // heads, max_rel, bug
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)
        self.rel_k = nn.Embedding(2 * max_rel + 1, self.d)
        _trained(self, 17)

    def forward(self, x, attention_mask=None):
        b, T, _ = x.shape
        q, k, v = (_split(f(x), b, self.heads, self.d, self.bug) for f in (self.query, self.key, self.value))
        pos = torch.arange(T)
        distance = (pos[None, :] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel
        rel = self.rel_k(distance)  # [T, T, d]
        scores = (q @ k.transpose(-1, -2) + torch.einsum("bhqd,qkd->bhqk", q, rel)) / math.sqrt(self.d)
        if attention_mask is not None:
            keep = attention_mask.bool()[:, None, None, :]
            fill = 0.0 if self.bug == "mask_fill_0" else torch.finfo(scores.dtype).min
            attn = scores.masked_fill(~keep, fill).softmax(-1) * keep
        else:
            attn = scores.softmax(-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, T, -1))
