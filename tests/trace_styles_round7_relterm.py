"""Attention that adds a relative-position term of its own to its scores, computed from its queries (or keys) and a
learned table or the positions, for tests/test_trace_round7_relterm.py. Each style is a correct class and bug
subclasses (one catalog mistake each).

- RelKeyAttention: Shaw et al. (2018) as an einsum tutorial writes it: an nn.Embedding of clipped distances j − i,
  `q · kᵀ + einsum(q, rel_k)` before the scale (`* self.scale`).
- RelKeyValueAttention: the same with Shaw et al.'s relative values, `attn · rel_v[j − i]` added to the output.
- RelKeyHeadGain: the same with a learned gain per head on q · kᵀ (a learned temperature a head, no option
  describes it: read as the code's own scale).
- RelKeyQueryGain: the same with a learned gain per head and query position on q · kᵀ (no one number a head).
- XLRelAttention: Transformer-XL's relative attention, batch-first: a fused qkv projection, sinusoidal embeddings of
  the distances klen − 1 .. 0 through r_net, the u and v biases (r_w_bias, r_r_bias), `AC + BD` with BD moved by
  the zero-pad relative shift, scaled after; causal.
- DisentangledAttention: DeBERTa-v3's c2p and p2c terms in a plain form: a table of relative embeddings projected by
  the key and query projections themselves (share_att_key), gathered at clamp(i − j + span), each divided by
  √d_head and added to the scaled content scores.
- RelPartialLearnableAttn: Transformer-XL as its own repository writes it, time-first `[qlen, bsz, d_model]`: scores
  `[qlen, klen, bsz, n_head]` from einsums, the relative shift padding dim 1, the scale applied in place (`mul_`),
  the softmax over dim=1.
- DebertaV2Attention: DeBERTa-v2's form without shared keys: pos_key_proj and pos_query_proj Linear layers of its
  own beside the three projections, no output projection (it lives in the next module), c2p and p2c summed into
  rel_att and added after the scale; transformers' scale √(scale_factor · d_head) with scale_factor=3.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RelKeyAttention(nn.Module):
    def __init__(self, d_model: int = 32, n_head: int = 4, max_dist: int = 3) -> None:
        super().__init__()
        self.n_head, self.d_head, self.max_dist = n_head, d_model // n_head, max_dist
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.rel_k = nn.Embedding(2 * max_dist + 1, self.d_head)
        self.scale = self.d_head ** -0.5

    def relative(self, n_q: int, n_k: int) -> torch.Tensor:
        dist = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None]  # j - i
        return self.rel_k(dist.clamp(-self.max_dist, self.max_dist) + self.max_dist)  # [n_q, n_k, d_head]

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(dim=-1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        k = self.k(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        v = self.v(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        rel = self.relative(n, n)
        scores = (q @ k.transpose(-2, -1) + torch.einsum("bhqd,qkd->bhqk", q, rel)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = self.weights(scores) @ v
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class RelKeyScaleByModel(RelKeyAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = (self.n_head * self.d_head) ** -0.5  # d_model's root, not d_head's


class RelKeySoftmaxOverQueries(RelKeyAttention):
    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(dim=-2)


class RelKeyValueAttention(RelKeyAttention):
    """Shaw et al.'s relative values too: `attn · rel_v[j − i]` added to the output (a term the reference has none
    of, said so rather than blamed on another step)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rel_v = nn.Embedding(2 * self.max_dist + 1, self.d_head)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        k = self.k(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        v = self.v(x).view(b, n, self.n_head, self.d_head).transpose(1, 2)
        dist = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        index = dist.clamp(-self.max_dist, self.max_dist) + self.max_dist
        scores = (q @ k.transpose(-2, -1) + torch.einsum("bhqd,qkd->bhqk", q, self.rel_k(index))) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = self.weights(scores)
        out = attn @ v + torch.einsum("bhqk,qkd->bhqd", attn, self.rel_v(index))
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class RelKeyHeadGain(RelKeyAttention):
    """A learned gain per head on the content scores before the relative keys' term is added: the content product
    is q · kᵀ times no one number, so the term cannot be told apart from it (said in one line, not blamed on the
    scale)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.n_head, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (layer(x).view(b, n, self.n_head, self.d_head).transpose(1, 2) for layer in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * self.gained(n)
        scores += torch.einsum("bhqd,qkd->bhqk", q, self.relative(n, n))
        return self.o((self.weights(scores * self.scale) @ v).transpose(1, 2).reshape(b, n, -1))

    def gained(self, n: int) -> torch.Tensor:
        return self.gain  # [n_head, 1, 1]


class RelKeyQueryGain(RelKeyHeadGain):
    """A learned gain per head and query position on the content scores before the relative keys' term is added:
    the content product is q · kᵀ times no one number a head, so the term cannot be told apart from it (said in one
    line, not blamed on the scale)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.n_head, 16, 1) + 0.5)

    def gained(self, n: int) -> torch.Tensor:
        return self.gain[:, :n]  # [n_head, n_Q, 1]


def sinusoid(pos: torch.Tensor, d_model: int) -> torch.Tensor:
    inv_freq = 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model))
    angles = pos[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # [klen, d_model]


class XLRelAttention(nn.Module):
    def __init__(self, d_model: int = 32, n_head: int = 4, d_head: int = 8) -> None:
        super().__init__()
        self.n_head, self.d_head, self.d_model = n_head, d_head, d_model
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.r_w_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.3)
        self.r_r_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.3)
        self.scale = 1 / (d_head ** 0.5)

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        b, h, q, k = x.shape
        padded = torch.cat([x.new_zeros(b, h, q, 1), x], dim=-1).view(b, h, k + 1, q)
        return padded[:, :, 1:].view(b, h, q, k)

    def fill(self, score: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        return score.masked_fill(future, -1e30)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        bsz, qlen, _ = w.shape
        heads = self.qkv_net(w)
        q, k, v = torch.chunk(heads, 3, dim=-1)
        q = q.view(bsz, qlen, self.n_head, self.d_head)
        k = k.view(bsz, qlen, self.n_head, self.d_head)
        v = v.view(bsz, qlen, self.n_head, self.d_head)
        pos_seq = torch.arange(qlen - 1, -1, -1.0)
        r_k = self.r_net(sinusoid(pos_seq, self.d_model)).view(qlen, self.n_head, self.d_head)
        AC = torch.einsum("bind,bjnd->bnij", q + self.r_w_bias, k)
        BD = self.rel_shift(torch.einsum("bind,jnd->bnij", q + self.r_r_bias, r_k))
        score = (AC + BD) * self.scale
        future = torch.triu(torch.ones(qlen, qlen, dtype=torch.bool), diagonal=1)
        prob = self.weights(self.fill(score, future))
        out = torch.einsum("bnij,bjnd->bind", prob, v).reshape(bsz, qlen, self.n_head * self.d_head)
        return self.o_net(out)

    def weights(self, score: torch.Tensor) -> torch.Tensor:
        return F.softmax(score, dim=-1)


class XLUnscaled(XLRelAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 1.0


class XLSoftmaxOverQueries(XLRelAttention):
    def weights(self, score: torch.Tensor) -> torch.Tensor:
        return F.softmax(score, dim=2)


class DisentangledAttention(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4, span: int = 4, summed: bool = False) -> None:
        super().__init__()
        self.heads, self.size, self.span, self.summed = heads, hidden // heads, span, summed
        self.query_proj = nn.Linear(hidden, hidden)
        self.key_proj = nn.Linear(hidden, hidden)
        self.value_proj = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.rel_embeddings = nn.Parameter(torch.randn(2 * span, hidden) * 0.5)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.heads, self.size).permute(0, 2, 1, 3)

    def root(self) -> float:
        return math.sqrt(self.size)

    def masked(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.split(self.query_proj(hidden_states))
        k = self.split(self.key_proj(hidden_states))
        v = self.split(self.value_proj(hidden_states))
        n = hidden_states.shape[1]
        rel = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # i - j
        idx = torch.clamp(rel + self.span, 0, 2 * self.span - 1)
        pos_key = self.split(self.key_proj(self.rel_embeddings)[None])  # [1, heads, 2·span, size]
        pos_query = self.split(self.query_proj(self.rel_embeddings)[None])
        root = self.root()
        scores = torch.matmul(q, k.transpose(-1, -2)) / root
        c2p = torch.matmul(q, pos_key.transpose(-1, -2))  # [b, h, n, 2·span]
        c2p = torch.gather(c2p, -1, idx.expand(q.shape[0], self.heads, n, n))
        p2c = torch.matmul(k, pos_query.transpose(-1, -2))  # [b, h, n_k, 2·span]
        p2c = torch.gather(p2c, -1, idx.expand(q.shape[0], self.heads, n, n)).transpose(-1, -2)
        if self.summed:  # each term added to the scores in turn
            scores = scores + c2p / root + p2c / root
        else:
            scores = scores + (c2p / root + p2c / root)
        if attention_mask is not None:
            scores = self.masked(scores, attention_mask)
        probs = scores.softmax(-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).flatten(2)
        return self.dense(context)


class DisentangledScaleByHidden(DisentangledAttention):
    def root(self) -> float:
        return math.sqrt(self.heads * self.size)


class DisentangledFilledWithZero(DisentangledAttention):
    def masked(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~mask, 0.0)


class DebertaV2Attention(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4, span: int = 3, scale_factor: int = 1) -> None:
        super().__init__()
        self.heads, self.head_size, self.span = heads, hidden // heads, span
        self.scale_factor = scale_factor  # transformers' 1 + len(pos_att_type): 3 with c2p and p2c
        self.query_proj = nn.Linear(hidden, hidden)
        self.key_proj = nn.Linear(hidden, hidden)
        self.value_proj = nn.Linear(hidden, hidden)
        self.pos_key_proj = nn.Linear(hidden, hidden)
        self.pos_query_proj = nn.Linear(hidden, hidden)
        self.rel_embeddings = nn.Parameter(torch.randn(2 * span, hidden) * 0.5)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1, self.heads, self.head_size).permute(0, 2, 1, 3)

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        return nn.functional.softmax(scores, dim=-1)

    def root(self, query_layer: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.tensor(query_layer.size(-1), dtype=torch.float) * self.scale_factor)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        query_layer = self.transpose_for_scores(self.query_proj(hidden_states))
        key_layer = self.transpose_for_scores(self.key_proj(hidden_states))
        value_layer = self.transpose_for_scores(self.value_proj(hidden_states))
        scale = self.root(query_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2) / scale)
        n = hidden_states.size(1)
        relative = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        c2p_pos = torch.clamp(relative + self.span, 0, 2 * self.span - 1)
        index = c2p_pos.expand(query_layer.size(0), self.heads, n, n)
        pos_key = self.transpose_for_scores(self.pos_key_proj(self.rel_embeddings).unsqueeze(0))
        pos_query = self.transpose_for_scores(self.pos_query_proj(self.rel_embeddings).unsqueeze(0))
        c2p = torch.gather(torch.matmul(query_layer, pos_key.transpose(-1, -2)), -1, index)
        p2c = torch.gather(torch.matmul(key_layer, pos_query.transpose(-1, -2)), -1, index).transpose(-1, -2)
        rel_att = c2p / scale + p2c / scale
        attention_scores = attention_scores + rel_att
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(~attention_mask, torch.finfo(attention_scores.dtype).min)
        context = torch.matmul(self.probabilities(attention_scores), value_layer)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)


class DebertaV2SoftmaxOverQueries(DebertaV2Attention):
    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        return nn.functional.softmax(scores, dim=-2)


class DebertaV2ScaleByHidden(DebertaV2Attention):
    def root(self, query_layer: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.tensor(self.heads * self.head_size * self.scale_factor, dtype=torch.float))


class RelPartialLearnableAttn(nn.Module):
    def __init__(self, n_head: int = 4, d_model: int = 32, d_head: int = 8) -> None:
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.r_w_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.2)
        self.r_r_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.2)
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)))
        self.scale = 1 / (d_head ** 0.5)

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1).view(x.size(1) + 1, x.size(0), *x.size()[2:])
        return x_padded[1:].view_as(x)

    def prob(self, score: torch.Tensor) -> torch.Tensor:
        return F.softmax(score, dim=1)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        qlen, bsz = w.size(0), w.size(1)
        pos_seq = torch.arange(qlen - 1, -1, -1.0)
        sinusoid_inp = torch.outer(pos_seq, self.inv_freq)
        r = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        w_head_q, w_head_k, w_head_v = torch.chunk(self.qkv_net(w), 3, dim=-1)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(qlen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(qlen, bsz, self.n_head, self.d_head)
        r_head_k = self.r_net(r).view(qlen, self.n_head, self.d_head)
        AC = torch.einsum("ibnd,jbnd->ijbn", (w_head_q + self.r_w_bias, w_head_k))
        BD = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", (w_head_q + self.r_r_bias, r_head_k)))
        attn_score = AC + BD
        attn_score.mul_(self.scale)
        attn_mask = torch.triu(torch.ones(qlen, qlen), diagonal=1).bool()
        attn_score = attn_score.masked_fill(attn_mask[:, :, None, None], -float("inf"))
        attn_vec = torch.einsum("ijbn,jbnd->ibnd", (self.prob(attn_score), w_head_v))
        return self.o_net(attn_vec.contiguous().view(qlen, bsz, self.n_head * self.d_head))


class RelPartialScaleByModel(RelPartialLearnableAttn):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 1 / (self.d_model ** 0.5)


class RelPartialSoftmaxOverBatch(RelPartialLearnableAttn):
    def prob(self, score: torch.Tensor) -> torch.Tensor:
        return F.softmax(score, dim=2)
