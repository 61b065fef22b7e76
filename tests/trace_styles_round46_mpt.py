"""MPT attention as llm-foundry writes it (llmfoundry/models/layers/attention.py, torch impl):
a fused Wqkv chunked q | k | v, heads split by rearrange ('b s (h d) -> b h s d', the keys straight
to 'b h d s'), softmax_scale = 1/sqrt(d_head), ALiBi from gen_slopes (alibi_bias_max = 8; for a
head count that is no power of 2 the slopes of the next power, odd ones first) as one row
m_h * (j - (S - 1)) for every query, and its own causal mask filled with finfo.min."""
import math

import torch
import torch.nn.functional as F
from torch import nn


def rearrange_split(x, n_heads, keys=False):
    # einops.rearrange(x, 'b s (h d) -> b h s d', h=n_heads)   (keys: 'b s (h d) -> b h d s')
    b, s, hd = x.shape
    x = x.view(b, s, n_heads, hd // n_heads)
    return x.permute(0, 2, 3, 1) if keys else x.permute(0, 2, 1, 3)


def rearrange_merge(x):
    # einops.rearrange(x, 'b h s d -> b s (h d)')
    b, h, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, h * d)


def gen_slopes(n_heads, alibi_bias_max=8, device=None, bug=None):
    if bug == "pow2_slopes":
        # written for a power-of-2 head count only
        m = torch.arange(1, n_heads + 1, dtype=torch.float32, device=device)
        m = m.mul(alibi_bias_max / n_heads)
        slopes = 1.0 / torch.pow(2, m)
        return slopes.view(1, n_heads, 1, 1)
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        # if n_heads is not a power of two,
        # Huggingface and FasterTransformer calculate slopes normally,
        # then return this strided concatenation of slopes
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, device=None, dtype=None, bug=None):
    if bug == "alibi_sign":
        # distance of each key from the last one
        alibi_bias = (seq_len - 1 - torch.arange(seq_len, dtype=torch.int32, device=device)).view(1, 1, 1, seq_len)
    else:
        alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, 1, seq_len)
    if full:
        # generate 1 x Heads x SeqLen x SeqLen alibi bias mask
        # otherwise the mask is 1 x Heads x 1 x SeqLen (which is broadcast to the appropriate size)
        alibi_bias = alibi_bias - torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)

    slopes = gen_slopes(n_heads, alibi_bias_max, device=device, bug=bug)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(query, key, value, n_heads, softmax_scale=None, attn_bias=None,
                                           key_padding_mask=None, is_causal=False, dropout_p=0.0, training=False,
                                           needs_weights=False, bug=None):
    q = rearrange_split(query, n_heads)
    k = rearrange_split(key, n_heads, keys=True)
    v = rearrange_split(value, n_heads)

    min_val = torch.finfo(q.dtype).min

    b, _, s_q, d = q.shape
    s_k = k.size(-1)

    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)

    attn_weight = q.matmul(k) * softmax_scale

    if attn_bias is not None and bug != "alibi_after_softmax":
        # clamp to 0 necessary for torch 2.0 compile()
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        attn_weight = attn_weight + attn_bias

    if key_padding_mask is not None:
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)

    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32)
        if bug == "triu":
            causal_mask = causal_mask.triu()
        else:
            causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)

    attn_weight = torch.softmax(attn_weight, dim=-1)

    if attn_bias is not None and bug == "alibi_after_softmax":
        attn_weight = attn_weight + attn_bias[:, :, max(0, attn_bias.size(2) - s_q):, max(0, attn_bias.size(3) - s_k):]

    if dropout_p:
        attn_weight = F.dropout(attn_weight, p=dropout_p, training=training)

    out = attn_weight.to(v.dtype).matmul(v)
    out = rearrange_merge(out)

    if needs_weights:
        return out, attn_weight
    return out, None


class MultiheadAttention(nn.Module):
    """Multi-head self attention (llm-foundry's, attn_impl='torch', alibi=True)."""

    def __init__(self, d_model=48, n_heads=6, softmax_scale=None, attn_pdrop=0.0, alibi_bias_max=8, bug=None):
        super().__init__()
        self.bug = bug
        self.d_model = d_model
        self.n_heads = n_heads
        self.alibi_bias_max = alibi_bias_max
        self.softmax_scale = softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = attn_pdrop

        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model)
        # for param init fn; enables shape based init of fused layers
        fuse_splits = (d_model, 2 * d_model)
        self.Wqkv._fused = (0, fuse_splits)
        self.out_proj = nn.Linear(self.d_model, self.d_model)
        self.out_proj._is_residual = True

    def forward(self, x, attention_mask=None, is_causal=True, needs_weights=False):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)

        key_padding_mask = attention_mask

        # the model builds and caches this as self.attn_bias; built here for one layer
        attn_bias = build_alibi_bias(self.n_heads, x.shape[1], alibi_bias_max=self.alibi_bias_max,
                                     device=x.device, dtype=x.dtype, bug=self.bug)

        context, attn_weights = scaled_multihead_dot_product_attention(
            query, key, value, self.n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            dropout_p=self.attn_dropout_p,
            training=self.training,
            needs_weights=needs_weights,
            bug=self.bug,
        )
        return self.out_proj(context), attn_weights
