"""Styles of our own for what a forward's parameters get (round 16b): a relative position embedding not named like
one (Transformer-XL's `r`, XLNet's both-ways embedding, a row-form `rel`), inputs as a list (`inputs[0]`, an
unpacking, Keras' [query, value]), a memory defaulting to None that raises without one, the tokens' positions as a
tensor not named like them, and two mask parameters each taking its part (key padding beside the rule). Each takes
`bug=` for a plant; tests/test_trace_round16_feeds.py checks each against F.scaled_dot_product_attention in
float64."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D, H = 32, 4  # d_model, heads: d_head 8


class Heads(nn.Module):
    """q, k, v, o projections and the plain multi-head attention of their output (what most styles share)."""

    def __init__(self, bug=None):
        super().__init__()
        self.bug = bug
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def split(self, t):  # [B, n, D] -> [B, H, n, d]
        return t.view(t.shape[0], t.shape[1], H, -1).transpose(1, 2)

    def merge(self, t):  # [B, H, n, d] -> [B, n, D]
        if self.bug == "merge":
            return t.reshape(t.shape[0], t.shape[2], D)
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], D)

    def attend(self, q, k, v, bias=None):  # [B, H, n, d] each; an additive bias [.., n_q, n_k]
        scale = D ** -0.5 if self.bug == "scale_d_model" else 1.0 if self.bug == "no_scale" else (D // H) ** -0.5
        s = q @ k.transpose(-1, -2) * scale
        if bias is not None:
            s = s + bias
        return s.softmax(dim=-2 if self.bug == "softmax_axis" else -1) @ v


# --- a relative position embedding, not named like one ---------------------------------------------------------


def rel_shift_time_first(x):  # [q, k, B, H]: Transformer-XL's _rel_shift
    pad = torch.zeros((x.size(0), 1, *x.size()[2:]), dtype=x.dtype)
    padded = torch.cat([pad, x], dim=1).view(x.size(1) + 1, x.size(0), *x.size()[2:])
    return padded[1:].view_as(x)


class XLRelative(nn.Module):
    """Transformer-XL's relative attention, time-first: w [qlen, B, D], r [klen, 1, D] (distances klen-1 .. 0),
    attn_mask [qlen, klen, 1] with 1 = masked, biases u and v per head, its output w + attn_out normed."""

    def __init__(self, bug=None):
        super().__init__()
        self.bug = bug
        self.qkv_net = nn.Linear(D, 3 * D, bias=False)
        self.r_net = nn.Linear(D, D, bias=False)
        self.o_net = nn.Linear(D, D, bias=False)
        self.r_w_bias = nn.Parameter(torch.randn(H, D // H) * 0.5)
        self.r_r_bias = nn.Parameter(torch.randn(H, D // H) * 0.5)

    def forward(self, w, r, attn_mask=None):
        qlen, bsz, rlen = w.size(0), w.size(1), r.size(0)
        q, k, v = torch.chunk(self.qkv_net(w), 3, dim=-1)
        q, k, v = (t.view(t.size(0), bsz, H, D // H) for t in (q, k, v))  # [n, B, H, d]
        rk = self.r_net(r).view(rlen, H, D // H)
        ac = torch.einsum("ibnd,jbnd->ijbn", q + self.r_w_bias, k)
        bd = rel_shift_time_first(torch.einsum("ibnd,jnd->ijbn", q + self.r_r_bias, rk))
        score = (ac + bd) * (1 / math.sqrt(D if self.bug == "scale_d_model" else D // H))
        if attn_mask is not None:
            score = score.masked_fill(attn_mask[:, :, :, None] == 1, -1e30)
        prob = score.softmax(dim=1)
        vec = torch.einsum("ijbn,jbnd->ibnd", prob, k if self.bug == "values_from_keys" else v)
        return self.o_net(vec.reshape(qlen, bsz, D))


class XLNetRelative(nn.Module):
    """XLNet's relative attention, time-first: h [qlen, B, D], r [qlen + klen, B, D] (distances klen .. -(qlen-1)),
    scores laid out [B, H, i, j] by einsum and shifted by rel_shift_bnij; attn_mask [qlen, klen] with 1 = masked."""

    def __init__(self, bug=None):
        super().__init__()
        self.bug = bug
        self.q, self.k, self.v, self.r, self.o = (nn.Linear(D, D, bias=False) for _ in range(5))
        self.r_w_bias = nn.Parameter(torch.randn(H, D // H) * 0.5)
        self.r_r_bias = nn.Parameter(torch.randn(H, D // H) * 0.5)

    @staticmethod
    def rel_shift_bnij(x, klen):
        b, n, i, j = x.shape
        return x.reshape(b, n, j, i)[:, :, 1:, :].reshape(b, n, i, j - 1)[..., :klen]

    def forward(self, h, r, attn_mask=None):
        qlen, bsz = h.shape[:2]
        q, k, v = (p(h).view(qlen, bsz, H, D // H) for p in (self.q, self.k, self.v))
        kr = self.r(r).view(r.shape[0], r.shape[1], H, D // H)
        ac = torch.einsum("ibnd,jbnd->bnij", q + self.r_w_bias, k)
        bd = self.rel_shift_bnij(torch.einsum("ibnd,jbnd->bnij", q + self.r_r_bias, kr), klen=ac.shape[3])
        score = (ac + bd) * (D if self.bug == "scale_d_model" else D // H) ** -0.5
        if attn_mask is not None:
            score = score - 1e30 * attn_mask[None, None].to(score.dtype)
        vec = torch.einsum("bnij,jbnd->ibnd", score.softmax(dim=3), v)
        return self.o(vec.reshape(qlen, bsz, D))


class RowRelative(Heads):
    """A Conformer-like relative attention, batch-first: rel [1, 2n-1, D] (relative positions n-1 .. -(n-1)) projected
    by its own Linear, biases u and v per head, the position scores shifted into place by a pad-and-view."""

    def __init__(self, bug=None):
        super().__init__(bug)
        self.p = nn.Linear(D, D, bias=False)
        self.u = nn.Parameter(torch.randn(H, D // H) * 0.5)
        self.w = nn.Parameter(torch.randn(H, D // H) * 0.5)

    @staticmethod
    def shift(x):  # [B, H, n, 2n-1] -> [B, H, n, n]: column j holds relative position i - j
        b, h, n, m = x.shape
        x = F.pad(x, (1, 0)).view(b, h, m + 1, n)[:, :, 1:].view(b, h, n, m)
        return x[..., : m // 2 + 1]

    def forward(self, x, rel, mask=None):
        q = self.q(x).view(x.shape[0], x.shape[1], H, -1)  # [B, n, H, d]
        k, v = self.split(self.k(x)), self.split(self.v(x))
        p = self.p(rel).view(rel.shape[0], -1, H, D // H).transpose(1, 2)  # [1, H, 2n-1, d]
        ac = (q + self.u).transpose(1, 2) @ k.transpose(-1, -2)
        bd = self.shift((q + self.w).transpose(1, 2) @ p.transpose(-1, -2))
        scale = D ** -0.5 if self.bug == "scale_d_model" else (D // H) ** -0.5
        s = (ac + bd) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return self.o(self.merge(s.softmax(-1) @ v))


# --- inputs as a list ------------------------------------------------------------------------------------------------


class IndexedList(Heads):
    """`inputs` = [Q, K, V], indexed (Music Transformer's call: self.rga([x, x, x], mask)); mask 1 = masked, added as
    mask * -1e9."""

    def forward(self, inputs, mask=None):
        q = self.split(self.q(inputs[0]))
        k = self.split(self.k(inputs[1]))
        v = self.split(self.v(inputs[2]))
        bias = None if mask is None else mask.to(q.dtype) * -1e9
        return self.o(self.merge(self.attend(q, k, v, bias)))


class UnpackedList(Heads):
    """`qkv` unpacked in three."""

    def forward(self, qkv, attn_mask=None):
        query, key, value = qkv
        q, k, v = self.split(self.q(query)), self.split(self.k(key)), self.split(self.v(value))
        bias = None if attn_mask is None else torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(
            ~attn_mask, float("-inf"))
        return self.o(self.merge(self.attend(q, k, v, bias)))


class KerasList(Heads):
    """Keras' Attention-layer call, `inputs` = [query, value], the keys the values' (key = value)."""

    def forward(self, inputs, mask=None):
        query, value = inputs[0], inputs[1]
        q, k, v = self.split(self.q(query)), self.split(self.k(value)), self.split(self.v(value))
        bias = None if mask is None else (1.0 - mask.to(q.dtype)) * -1e9
        return self.o(self.merge(self.attend(q, k, v, bias)))


# --- a memory defaulting to None that raises without one ----------------------------------------------------------


class StreamingY(Heads):
    """torchtune's MultiHeadAttention call: forward(x, y=None, *, mask=None), raising without y (it has no cache);
    the keys viewed at x's length (they are always x's in self-attention)."""

    def forward(self, x, y=None, *, mask=None):
        b, s_x, _ = x.shape
        if y is None:
            raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
        q = self.split(self.q(x))
        k = self.k(y).view(b, s_x, H, -1).transpose(1, 2)
        v = self.v(y).view(b, s_x, H, -1).transpose(1, 2)
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        return self.o(self.merge(self.attend(q, k, v, bias)))


class EncoderStates(Heads):
    """A decoder's attention called with `encoder_hidden_states=x`, asserting it is given; its causal mask made from
    the queries' length for scores of the keys'."""

    def forward(self, hidden_states, encoder_hidden_states=None):
        assert encoder_hidden_states is not None, "encoder_hidden_states is required"
        n = hidden_states.shape[1]
        q = self.split(self.q(hidden_states))
        k, v = self.split(self.k(encoder_hidden_states)), self.split(self.v(encoder_hidden_states))
        causal = torch.ones(n, n, dtype=torch.bool).tril(-1 if self.bug == "off_by_one" else 0)
        bias = torch.zeros(n, n, dtype=q.dtype).masked_fill(~causal, float("-inf"))
        return self.o(self.merge(self.attend(q, k, v, bias)))


class ContextRequired(Heads):
    """`context=None` that raises a TypeError of its own, the keys' sequence length taken from x."""

    def forward(self, x, context=None, mask=None):
        if context is None:
            raise TypeError("context must be a tensor")
        b, n, _ = x.shape
        q = self.split(self.q(x))
        k = self.k(context).reshape(b, n, H, D // H).permute(0, 2, 1, 3)
        v = self.v(context).reshape(b, n, H, D // H).permute(0, 2, 1, 3)
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        return self.o(self.merge(self.attend(q, k, v, bias)))


# --- a memory of groups of tokens --------------------------------------------------------------------------------


class GroupedMedia(nn.Module):
    """A Flamingo-like cross-attention: `media` [B, n_images, n_latents, D], its images' latents flattened into
    the keys, the text's queries normed first."""

    def __init__(self, bug=None):
        super().__init__()
        self.bug = bug
        self.to_q = nn.Linear(D, D, bias=False)
        self.to_kv = nn.Linear(D, 2 * D, bias=False)
        self.to_out = nn.Linear(D, D)

    def forward(self, text, media):
        bsz, n_images, n_latents, dim = media.shape
        keys = media.reshape(bsz, n_images * n_latents, dim)
        k, v = self.to_kv(keys).chunk(2, dim=-1)
        if self.bug == "kv_swapped":
            k, v = v, k
        q, k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in (self.to_q(text), k, v))  # [B, H, n, d]
        w = torch.einsum("bhid,bhjd->bhij", q, k) * (D // H) ** -0.5
        out = torch.einsum("bhij,bhjd->bhid", w.softmax(-1), v)
        return self.to_out(out.transpose(1, 2).flatten(2))


# --- the tokens' positions, not named like them --------------------------------------------------------------------


class RollingSteps(Heads):
    """mistral-src's rolling buffer written at `steps % W` (its positions), a prefill attending to its own keys
    under the additive mask it is given; a one-token step would read the buffer (`steps.shape[0] > 1`)."""

    def __init__(self, window=16, bug=None):
        super().__init__(bug)
        self.window = window
        self.register_buffer("cache_k", torch.zeros(8, window, D), persistent=False)

    def forward(self, x, steps, mask=None):
        b = x.shape[0]
        k = self.k(x)
        slot = (steps[-self.window:] % self.window)[None, :, None].repeat(b, 1, D)
        self.cache_k[:b].scatter_(1, slot, k[:, -self.window:])
        if steps.shape[0] > 1:
            keys = k
        else:
            keys = self.cache_k[:b, : int(steps[-1].item()) + 1]
        q, k, v = self.split(self.q(x)), self.split(keys), self.split(self.v(x))
        return self.o(self.merge(self.attend(q, k, v, None if mask is None else mask[None, None])))


class BucketedSteps(Heads):
    """A learned bias per head and distance, looked up by the positions it is handed (`t`), clipped to +-8."""

    def __init__(self, bug=None):
        super().__init__(bug)
        self.table = nn.Parameter(torch.randn(17, H) * 0.5)

    def forward(self, x, t, mask=None):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        rel = (t[None, :] - t[:, None]).clamp(-8, 8) + 8  # [n, n], key minus query
        bias = self.table[rel].permute(2, 0, 1)  # [H, n, n]
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        return self.o(self.merge(self.attend(q, k, v, bias)))


class RotaryOffsets(Heads):
    """RoPE made inside from the positions it is handed (`offsets`), half-split, base 10000."""

    def rotate(self, t, angle):  # [B, H, n, d], [n, d/2]
        a, b = t.chunk(2, dim=-1)
        cos, sin = angle.cos(), angle.sin()
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def forward(self, x, offsets, mask=None):
        d = D // H
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
        angle = offsets[:, None].to(x.dtype) * inv  # [n, d/2]
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        q, k = self.rotate(q, angle), self.rotate(k, angle)
        if self.bug == "rope_on_values":
            v = self.rotate(v, angle)
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        return self.o(self.merge(self.attend(q, k, v, bias)))


# --- two mask parameters, each its part ----------------------------------------------------------------------------


def _padding_bug(bug, pad):  # [B, n_K] -> [B, 1, 1, n_K], or on the queries' axis
    return pad[:, None, :, None] if bug == "padding_on_queries" else pad[:, None, None, :]


class FairseqPair(Heads):
    """fairseq's pair: attn_mask [n_Q, n_K] added (0 / -inf), key_padding_mask [B, n_K] with True = padded."""

    def forward(self, query, key_padding_mask=None, attn_mask=None):
        q, k, v = self.split(self.q(query)), self.split(self.k(query)), self.split(self.v(query))
        s = q @ k.transpose(-1, -2) * (D // H) ** -0.5
        if attn_mask is not None:
            s = s + attn_mask
        if key_padding_mask is not None:
            s = s.masked_fill(_padding_bug(self.bug, key_padding_mask), float("-inf"))
        return self.o(self.merge(s.softmax(-1) @ v))


class MergedPair(Heads):
    """nn.MultiheadAttention's pair merged into one boolean mask (True = masked) before the scores meet it."""

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        masked = torch.zeros(1, 1, x.shape[1], x.shape[1], dtype=torch.bool)
        if attn_mask is not None:
            masked = masked | attn_mask.view(1, 1, *attn_mask.shape)
        if key_padding_mask is not None:
            masked = masked | _padding_bug(self.bug, key_padding_mask)
        s = (q @ k.transpose(-1, -2) * (D // H) ** -0.5).masked_fill(masked, float("-inf"))
        return self.o(self.merge(s.softmax(-1) @ v))


class KeepPair(Heads):
    """`mask` [n_Q, n_K] True = may attend beside `padding_mask` [B, n_K] with 1 = a real token (keep)."""

    def forward(self, x, mask=None, padding_mask=None):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        s = q @ k.transpose(-1, -2) * (D // H) ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask, -1e9)
        if padding_mask is not None:
            s = s.masked_fill(_padding_bug(self.bug, padding_mask) == 0, -1e9)
        return self.o(self.merge(s.softmax(-1) @ v))
