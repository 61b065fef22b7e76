"""Code whose inputs or mask come another way than trace draws them first (docs/trace.md, "Masks in every
convention" and "What each parameter of your forward gets"): OpenNMT's `forward(key, value, query, mask)`, BART's
`key_value_states=None` with its 4-D mask checked by size, AI2 OLMo's decode step (its bias as floats, cut out of
the whole sequence's, its cache of keys before RoPE) and mistral-inference's (its cache [B, n, n_kv, d]), each a `bug`.
pad_2x9.npy is key padding [n_batch=2, n_K=9], True = may attend."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def split(t, heads):
    return t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)


def merge(t):
    return t.transpose(1, 2).contiguous().view(t.shape[0], t.shape[2], -1)


class KeyValueQuery(nn.Module):
    """OpenNMT-py's MultiHeadedAttention, shrunk: forward(key, value, query, mask) with mask 1 = pad, [B, 1, T]."""

    def __init__(self, model_dim=32, head_count=4, bug=None):
        super().__init__()
        self.head_count, self.bug = head_count, bug
        self.linear_keys = nn.Linear(model_dim, model_dim)
        self.linear_values = nn.Linear(model_dim, model_dim)
        self.linear_query = nn.Linear(model_dim, model_dim)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(self, key, value, query, mask=None):
        key = split(self.linear_keys(key), self.head_count)
        value = split(self.linear_values(value), self.head_count)
        query = split(self.linear_query(query), self.head_count) / math.sqrt(key.shape[-1])
        if self.bug == "kv_swapped":
            key, value = value, key
        scores = torch.matmul(query, key.transpose(2, 3))
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1), -1e18)
        return self.final_linear(merge(torch.matmul(scores.softmax(-1), value)))


class CrossOrSelf(nn.Module):
    """HF BART's attention: key_value_states=None is self-attention, the encoder's output cross-attention; the
    additive mask must be [bsz, 1, tgt_len, src_len]."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.scaling = (embed_dim // num_heads) ** -0.5
        self.k_proj, self.v_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.q_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        source = hidden_states if key_value_states is None else key_value_states
        q = split(self.q_proj(hidden_states) * self.scaling, self.num_heads)
        k = split(self.v_proj(source) if self.bug == "keys_from_values" else self.k_proj(source), self.num_heads)
        v = split(self.k_proj(source) if self.bug == "values_from_keys" else self.v_proj(source), self.num_heads)
        weights = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, source.shape[1]):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, tgt_len, source.shape[1])}, but is "
                                 f"{attention_mask.size()}")
            weights = weights + attention_mask
        return self.out_proj(merge(weights.softmax(-1) @ v))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class OlmoDecode(nn.Module):
    """AI2 OLMo's attention: the cache joined before RoPE, the bias cast to floats, cut to the new queries' rows."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, d_model // n_heads, bug
        self.att_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)

    def rotary(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(key_len).float(), inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        sin, cos = positions.sin(), positions.cos()
        first = 0 if self.bug == "query_positions" else key_len - query_len
        q = q * cos[first:first + query_len] + rotate_half(q) * sin[first:first + query_len]
        return q, k * cos + rotate_half(k) * sin

    def forward(self, x, attention_bias=None, layer_past=None):
        q, k, v = (split(t, self.n_heads) for t in self.att_proj(x).chunk(3, dim=-1))
        if layer_past is not None:
            joined = ((k, layer_past[0]), (v, layer_past[1])) if self.bug == "cache_order" else \
                ((layer_past[0], k), (layer_past[1], v))
            k, v = (torch.cat(pair, dim=-2) for pair in joined)
        query_len, key_len = q.shape[-2], k.shape[-2]
        q, k = self.rotary(q, k)
        if attention_bias is not None:
            attention_bias = attention_bias[:, :, key_len - query_len:key_len, :key_len].to(q.dtype)
            attention_bias.masked_fill_(attention_bias == float("-inf"), torch.finfo(q.dtype).min)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, is_causal=attention_bias is None)
        return self.attn_out(merge(att))


class MistralDecode(nn.Module):
    """mistral-inference's attention, shrunk: the cache `(k, v)` kept [B, n_cache, n_kv_heads, head_dim] and joined on
    dim 1 before the heads are moved, the kv heads repeated for the query heads, SDPA with a lower-right causal mask.
    bug="cache_order" joins the new keys first; bug="is_causal" hands SDPA is_causal=True (upper-left) instead."""

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, bug=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cache=None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if cache is not None:
            first = self.bug == "cache_order"
            xk = torch.cat([xk, cache[0]] if first else [cache[0], xk], dim=1)
            xv = torch.cat([xv, cache[1]] if first else [cache[1], xv], dim=1)
        repeats = self.n_heads // self.n_kv_heads
        keys, values = xk.repeat_interleave(repeats, dim=2), xv.repeat_interleave(repeats, dim=2)
        q, k, v = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.bug == "is_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            n_k = k.shape[2]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(seqlen, n_k, dtype=torch.bool).tril(
                n_k - seqlen))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class ImageCrossAttention(nn.Module):
    """Mllama's text-to-image cross-attention, shrunk: forward(hidden_states, cross_attention_states=None, cache=None,
    attention_mask=None, use_cache=None); with no image states it reads the image's keys and values from its cache."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.q_proj, self.k_proj = nn.Linear(hidden_size, hidden_size), nn.Linear(hidden_size, hidden_size)
        self.v_proj, self.o_proj = nn.Linear(hidden_size, hidden_size), nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, cross_attention_states=None, cache=None, attention_mask=None, use_cache=None):
        q = split(self.q_proj(hidden_states), self.num_heads)
        if cross_attention_states is not None:
            k = split(self.k_proj(cross_attention_states), self.num_heads)
            v = split(self.v_proj(cross_attention_states), self.num_heads)
        else:
            k, v = cache.layers[0].keys, cache.layers[0].values
        weights = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if attention_mask is not None:
            weights = weights + attention_mask
        return self.o_proj(merge(weights.softmax(-2 if self.bug == "softmax_queries" else -1) @ v))
