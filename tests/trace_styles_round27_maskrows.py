"""Masks that leave a row keyless, scores that are large without a mask, and a causal square the code slices itself:
a flash-attn-like attention taking key padding [batch, seq] (True = a real token) filled with -inf, so that a
sequence with no real token gives NaN rows, its convention; an HF BERT-like self-attention extending a 0/1 key
padding to `(1 - mask) * finfo.min`, so that such a sequence gives uniform rows; HF T5's attention merging that
padding into a zero position bias first (read as a bias to add, then found in its 0/1 form); the same beside a
large negative offset per head of the model's own (about -1e5: no mask, softmax-invariant); an HF CTRL-like
attention cutting `mask[ns - nd:ns, :ns]` out of the causal square its model builds over past and new positions,
with a `layer_past` cache.
Plants: the padding read the other way round, the heads merged without their transpose, the scale, the square's
slice one row off.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(27)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


class FlashPaddedAttention(nn.Module):
    """flash-attn's MHA fallback style: one Wqkv, `key_padding_mask` [batch, seq] True = keep, masked with -inf."""

    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _trained(self)

    def forward(self, x, key_padding_mask=None):
        batch, seqlen, _ = x.shape
        qkv = self.Wqkv(x).view(batch, seqlen, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)  # [batch, seq, heads, head_dim]
        softmax_scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.einsum("bthd,bshd->bhts", q, k * (1.0 if self.bug == "no_scale" else softmax_scale))
        if key_padding_mask is not None:
            keep = key_padding_mask if self.bug == "polarity" else ~key_padding_mask
            scores = scores.masked_fill(keep[:, None, None, :], float("-inf"))
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        output = torch.einsum("bhts,bshd->bthd", attention, v)
        return self.out_proj(output.reshape(batch, seqlen, -1))


class BertPaddedSelfAttention(nn.Module):
    """HF BERT's eager self-attention with the extended mask made inside: 0/1 key padding, `(1 - m) * finfo.min`."""

    def __init__(self, hidden_size=24, num_attention_heads=3, bug=None):
        super().__init__()
        self.num_attention_heads, self.bug = num_attention_heads, bug
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            extended = attention_mask[:, None, None, :].to(dtype=attention_scores.dtype)
            if self.bug == "polarity":
                extended = 1.0 - extended
            attention_scores = attention_scores + (1.0 - extended) * torch.finfo(attention_scores.dtype).min
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        batch, seq = hidden_states.shape[:2]
        if self.bug == "merge_no_transpose":
            context_layer = context_layer.contiguous().view(batch, seq, self.all_head_size)
        else:
            context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
            context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return self.dense(context_layer)


class T5KeepAttention(nn.Module):
    """HF T5's attention in a layer without a relative attention bias: unscaled scores, a zero position bias the
    0/1 key padding [batch, seq] (1 = a real token) is added to, then `(1 - bias) * finfo.min`, as T5's stack
    extends its mask."""

    def __init__(self, d_model=32, num_heads=4, d_kv=8, bug=None):
        super().__init__()
        self.n_heads, self.key_value_proj_dim, self.bug = num_heads, d_kv, bug
        self.inner_dim = num_heads * d_kv
        self.q = nn.Linear(d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, d_model, bias=False)
        _trained(self)

    def forward(self, hidden_states, mask=None):
        batch_size, seq_length = hidden_states.shape[:2]

        def shape(states):
            return states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        query_states, key_states = shape(self.q(hidden_states)), shape(self.k(hidden_states))
        value_states = shape(self.v(hidden_states))
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        if self.bug == "scaled":
            scores = scores / math.sqrt(self.key_value_proj_dim)
        position_bias = torch.zeros((1, self.n_heads, seq_length, seq_length), dtype=scores.dtype)
        if mask is not None:
            position_bias = position_bias + mask[:, None, None, :].to(scores.dtype)
            position_bias = (1.0 - position_bias) * torch.finfo(scores.dtype).min
        scores = scores + position_bias
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)
        return self.o(attn_output)


class OffsetScoresAttention(nn.Module):
    """0/1 key padding [batch, seq] (1 = a real token) merged into a zero position bias, then `(1 - bias) *
    finfo.min` (T5's way), beside a large negative offset per head of the model's own (about -1e5, no mask:
    softmax-invariant), added after the mask in float64."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.head_offset = nn.Parameter(torch.full((num_heads, 1, 1), -1.0e5))
        _trained(self)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape

        def heads(t):
            return t.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        q, k = heads(self.q_proj(hidden_states)), heads(self.k_proj(hidden_states))
        v = heads(self.v_proj(hidden_states))
        scale = 1.0 if self.bug == "no_scale" else self.head_dim ** -0.5
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * scale
        position_bias = torch.zeros((1, self.num_heads, q_len, q_len), dtype=attn_weights.dtype)
        if attention_mask is not None:  # 0/1 key padding, 1 = a real token, merged into the position bias
            position_bias = position_bias + attention_mask[:, None, None, :]
            position_bias = (1.0 - position_bias) * torch.finfo(attn_weights.dtype).min
        attn_weights = attn_weights + position_bias
        attn_weights = attn_weights.double() + self.head_offset.double()  # in float64: the offset is large
        attn_weights = F.softmax(attn_weights, dim=-1).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class CTRLLikeAttention(nn.Module):
    """HF CTRL's MultiHeadAttention: the model's `mask = triu(ones(past + seq, past + seq), 1)` (1 = masked), cut
    `mask[ns - nd:ns, :ns]` to the new rows here, times -1e4; `layer_past` a stacked (key, value)."""

    def __init__(self, d_model_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.d_model_size, self.bug = num_heads, d_model_size, bug
        self.depth = d_model_size // num_heads
        self.Wq = nn.Linear(d_model_size, d_model_size)
        self.Wk = nn.Linear(d_model_size, d_model_size)
        self.Wv = nn.Linear(d_model_size, d_model_size)
        self.dense = nn.Linear(d_model_size, d_model_size)
        _trained(self)

    def split_into_heads(self, x, batch_size):
        x = x.reshape(batch_size, -1, self.num_heads, self.depth)
        return x.permute([0, 2, 1, 3])

    def forward(self, x, mask, layer_past=None):
        batch_size = x.shape[0]
        q = self.split_into_heads(self.Wq(x), batch_size)
        k = self.split_into_heads(self.Wk(x), batch_size)
        v = self.split_into_heads(self.Wv(x), batch_size)
        if layer_past is not None:
            past_key, past_value = layer_past[0], layer_past[1]
            k = torch.cat((past_key, k), dim=-2)
            v = torch.cat((past_value, v), dim=-2)
        present = torch.stack((k, v))
        matmul_qk = torch.matmul(q, k.permute(0, 1, 3, 2))
        scaled_attention_logits = matmul_qk / math.sqrt(k.shape[-1])
        nd, ns = scaled_attention_logits.size(-2), scaled_attention_logits.size(-1)
        if self.bug == "slice_off_by_one":
            scaled_attention_logits += mask[ns - nd - 1:ns - 1, :ns] * -1e4
        else:
            scaled_attention_logits += mask[ns - nd:ns, :ns] * -1e4
        attention_weights = torch.softmax(scaled_attention_logits, dim=-1)
        output = torch.matmul(attention_weights, v)
        output = output.permute([0, 2, 1, 3]).reshape(batch_size, -1, self.d_model_size)
        return self.dense(output), present
