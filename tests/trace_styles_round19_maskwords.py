"""Attention whose words, flags and data flow each say something of its mask, in the forms real libraries write
them, for tests/test_trace_round19_maskwords.py: words of a helper's parameter that the forward hands the mask
turned round, a comment on a variable holding it turned round, the TensorFlow tutorial's `mask * -1e9`
with no words at all, a causal switch beside key padding, a sliding window the forward builds itself. Each takes
`bug=None`: a planted mistake, which trace names by experiment."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def masked_softmax(scores, pad):
    """pad: bool, True = masked out (the convention of nn.MultiheadAttention's key_padding_mask)."""
    return scores.masked_fill(pad, float("-inf")).softmax(dim=-1)


class HfEncoderHelper(nn.Module):
    """A transformers-like encoder self-attention whose softmax helper takes the padding the other way round.

    attention_mask: 1 for tokens that are not masked, 0 for tokens that are masked.
    """

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.num_attention_heads, self.bug = num_attention_heads, bug
        self.attention_head_size = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)  # [b, h, n, d]

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))  # [b, h, n_Q, n_K]
        scores = scores / math.sqrt(self.attention_head_size)
        if self.bug == "scale_twice":
            scores = scores / math.sqrt(self.attention_head_size)
        pad = attention_mask == 1 if self.bug == "polarity" else attention_mask == 0
        if self.bug == "on_queries":
            pad = pad.transpose(-1, -2)
        if self.bug == "after_softmax":
            probs = scores.softmax(dim=-1).masked_fill(pad, 0.0)
        else:
            probs = masked_softmax(scores, pad)
        context = torch.matmul(probs, value_layer).permute(0, 2, 1, 3)  # [b, n, h, d]
        return self.dense(context.reshape(*context.shape[:2], -1))


class TfTutorialPort(nn.Module):
    def __init__(self, d_model=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.depth, self.bug = num_heads, d_model // num_heads, bug
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def split_heads(self, x, batch_size):
        x = x.reshape(batch_size, -1, self.num_heads, self.depth)  # [b, n, h, depth]
        return x.permute(0, 2, 1, 3)  # [b, h, n, depth]

    def forward(self, v, k, q, mask):
        batch_size = q.shape[0]
        q = self.split_heads(self.wq(q), batch_size)
        k = self.split_heads(self.wk(k), batch_size)
        v = self.split_heads(self.wv(v), batch_size)
        if self.bug == "kv_swapped":
            k, v = v, k
        matmul_qk = torch.matmul(q, k.transpose(-1, -2))  # [b, h, n_Q, n_K]
        dk = float(self.depth if self.bug == "scale_d_head" else math.sqrt(self.depth))
        scaled_attention_logits = matmul_qk / dk
        if mask is not None:
            if self.bug == "on_queries":
                mask = mask.transpose(-1, -2)
            scaled_attention_logits += ((1 - mask) if self.bug == "polarity" else mask) * -1e9
        attention_weights = torch.softmax(scaled_attention_logits, dim=-1)
        output = torch.matmul(attention_weights, v).permute(0, 2, 1, 3)  # [b, n_Q, h, depth]
        return self.dense(output.reshape(batch_size, -1, self.num_heads * self.depth))


class TfTutorialStated(TfTutorialPort):
    """The same port, with the tutorial's words: the mask is 1 where a position is masked (the look-ahead mask, the
    padding mask), added to the scaled logits times -1e9."""


class FairseqPadCausal(nn.Module):
    """fairseq-like multi-head attention, time-first [n, b, d], heads folded into the batch for bmm, and its own
    causal switch beside the key padding.

    key_padding_mask: mask to exclude keys that are pads, of shape (batch, src_len), where padding elements are
    indicated by 1s.
    """

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key_padding_mask=None, is_causal: bool = False):
        tgt_len, bsz, embed_dim = query.shape
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q, k, v = (t.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
                   for t in (q, k, v))  # [b·h, n, d_head]
        attn_weights = torch.bmm(q, k.transpose(1, 2))  # [b·h, n_Q, n_K]
        if is_causal:
            ahead = torch.ones(tgt_len, tgt_len, dtype=torch.bool).triu(0 if self.bug == "causal_off_by_one" else 1)
            attn_weights = attn_weights.masked_fill(ahead, float("-inf"))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, tgt_len)
            pad = key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool)  # [b, 1, 1, n_K]
            if self.bug == "polarity":
                pad = ~pad
            if self.bug == "on_queries":
                pad = pad.transpose(-1, -2)
            attn_weights = attn_weights.masked_fill(pad, float("-inf")).view(bsz * self.num_heads, tgt_len, tgt_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)  # [b·h, n, d_head]
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class MistralOwnWindow(nn.Module):
    """A mistral-src-like layer that builds its sliding window itself when told to be causal: query i sees key j
    for i - window < j <= i. A comment names what it fills."""

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, sliding_window=4, bug=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.sliding_window, self.bug = sliding_window, bug
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, causal: bool = False):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # [b, h, n, d_head]
        k = self.wk(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [b, h_kv, n, d_head]
        v = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)  # [b, h, n, d_head]
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5  # [b, h, n_Q, n_K]
        if causal:
            i = torch.arange(n)
            width = self.sliding_window + (1 if self.bug == "window_off_by_one" else 0)
            # outside: True = masked (a key ahead, or as far back as the window or more)
            outside = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= width)
            scores = scores.masked_fill(outside, float("-inf"))
        weights = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.wo((weights @ v).transpose(1, 2).reshape(b, n, -1))


class CommentedKeep(nn.Module):
    """An x-transformers-like attend: `mask` is bool, True = may attend, as F.scaled_dot_product_attention takes it;
    the code names the padding it fills, which a comment describes."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, (dim // heads) ** -0.5, bug
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)  # [b, h, n_Q, n_K]
        if self.bug != "scale_none":
            sim = sim * self.scale
        if mask is not None:
            # pad: True = masked out
            pad = ~mask
            sim = sim.masked_fill(pad, 0.0 if self.bug == "fill_zero" else -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)  # [b, h, n, d_head]
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class RefusesCausal(nn.Module):
    """A bidirectional encoder layer whose own switch refuses to be causal."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, is_causal=False):
        if is_causal:
            raise NotImplementedError("this encoder is bidirectional")
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


def kept_attention(query, key, value, mask=None):
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])  # [b, h, n_Q, n_K]
    probs = scores.softmax(dim=-1) if mask is None else masked_softmax(scores, ~mask)
    return probs @ value
