"""Code styles for tests/test_trace_round4_gaps.py: time-first inputs, Keras kernels of another head width, contexts of
another width, a function's non-square weights, one head in training mode. Each is correct with bug=None; a
planted bug by name."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# fairseq's MultiheadAttention: one in_proj_weight [3d, d] and its bias, time-first [T, B, C], heads folded into
# the batch [B·H, T, d] by bmm, attn_mask [T, S] added in place, key_padding_mask [B, S] True = padded
class FairseqStyle(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) * 0.2)
        self.in_proj_bias = nn.Parameter(torch.randn(3 * embed_dim) * 0.1)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.bug = bug

    def forward(self, query, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q = q * self.scaling
        if self.bug == "scale_twice":
            q = q * self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))  # [B·H, T, S]
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:  # [B, S], True = padded
            src_len = attn_weights.size(-1)
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            fill = 0.0 if self.bug == "fill0" else float("-inf")
            attn_weights = attn_weights.masked_fill(key_padding_mask[:, None, None, :].to(torch.bool), fill)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1 if self.bug != "axis" else 1)
        attn = torch.bmm(attn_weights, v)  # [B·H, T, d]
        if self.bug == "merge":
            attn = attn.contiguous().view(tgt_len, bsz, embed_dim)
        else:
            attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


# Megatron's / Transformer-XL's core: [s, b, h] hidden states, separate projections, an einsum over [s, b, n, d]
# and a boolean mask of its own (no mask parameter: --causal describes the reference)
class SeqFirstEinsum(nn.Module):
    def __init__(self, hidden_size=24, num_attention_heads=3, bug=None):
        super().__init__()
        self.n, self.d = num_attention_heads, hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.bug = bug

    def forward(self, hidden_states):
        s, b, _ = hidden_states.shape
        q = self.query(hidden_states).view(s, b, self.n, self.d)
        k = self.key(hidden_states).view(s, b, self.n, self.d)
        v = self.value(hidden_states).view(s, b, self.n, self.d)
        if self.bug == "kv_swap":
            k, v = v, k
        scores = torch.einsum("ibnd,jbnd->bnij", q, k)  # [b, n, s, s]
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(dim=-1)
        context = torch.einsum("bnij,jbnd->ibnd", probs, v)  # [s, b, n, d]
        return self.dense(context.reshape(s, b, self.n * self.d))


# nn.MultiheadAttention as it comes, batch_first=False: time-first, its attn_mask [T, S]
class WrappedTimeFirst(nn.Module):
    def __init__(self, d_model=32, nhead=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, nhead, bias=True)

    def forward(self, src, attn_mask=None):
        return self.attn(src, src, src, attn_mask=attn_mask, need_weights=False)[0]


# Keras' MultiHeadAttention with key_dim != d_model / num_heads: kernels [d, H, key_dim], the output's [H, key_dim, d]
class KerasWide(nn.Module):
    def __init__(self, d_model=24, num_heads=3, key_dim=12, bug=None):
        super().__init__()
        self.key_dim = key_dim
        self.query_kernel = nn.Parameter(torch.randn(d_model, num_heads, key_dim) * 0.2)
        self.key_kernel = nn.Parameter(torch.randn(d_model, num_heads, key_dim) * 0.2)
        self.value_kernel = nn.Parameter(torch.randn(d_model, num_heads, key_dim) * 0.2)
        self.output_kernel = nn.Parameter(torch.randn(num_heads, key_dim, d_model) * 0.2)
        self.bug = bug

    def forward(self, query, attention_mask=None):
        q = torch.einsum("abc,cde->abde", query, self.query_kernel)  # [B, T, N, H]
        k = torch.einsum("abc,cde->abde", query, self.key_kernel)
        v = torch.einsum("abc,cde->abde", query, self.value_kernel)
        if self.bug != "no_scale":
            q = q * (1.0 / math.sqrt(float(self.key_dim)))
        scores = torch.einsum("aecd,abcd->acbe", k, q)  # [B, N, T, S]
        if attention_mask is not None:
            scores = scores + (1.0 - attention_mask.unsqueeze(1).float()) * -1e9
        weights = torch.softmax(scores, dim=-1)
        out = torch.einsum("acbe,aecd->abcd", weights, v)
        return torch.einsum("abcd,cde->abe", out, self.output_kernel)


# cross-attention with nn.Parameter weights only, the context of another width (diffusers' cross_attention_dim),
# n_head·d_head another width again
class ParamContext(nn.Module):
    def __init__(self, d_model=24, d_context=20, heads=4, dim_head=8, bug=None):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head ** -0.5
        self.W_q = nn.Parameter(torch.randn(d_model, inner) * 0.2)
        self.W_k = nn.Parameter(torch.randn(d_context, inner) * 0.2)
        self.W_v = nn.Parameter(torch.randn(d_context, inner) * 0.2)
        self.W_o = nn.Parameter(torch.randn(inner, d_model) * 0.2)
        self.bug = bug

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        b, n, _ = x.shape
        m = context.shape[1]
        q = (x @ self.W_q).view(b, n, self.heads, -1).transpose(1, 2)
        k = (context @ self.W_k).view(b, m, self.heads, -1).transpose(1, 2)
        v = (context @ self.W_v).view(b, m, self.heads, -1).transpose(1, 2)
        if self.bug == "kv_swap":
            k, v = v, k
        sim = q @ k.transpose(-2, -1) * (self.scale if self.bug != "no_scale" else 1.0)
        if mask is not None:
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(b, n, -1) @ self.W_o


# nn.MultiheadAttention with kdim/vdim: keys and values read a context of another width
class WrappedKdim(nn.Module):
    def __init__(self, embed_dim=32, kdim=20, num_heads=4):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, kdim=kdim, vdim=kdim, batch_first=True)

    def forward(self, x, encoder_hidden_states=None, attn_mask=None):
        return self.mha(x, encoder_hidden_states, encoder_hidden_states, attn_mask=attn_mask, need_weights=False)[0]


# a function taking its weights and its head count: W_q [d_model, n_head·d_head], n_head·d_head != d_model
def attention_heads(x, W_q, W_k, W_v, W_o, n_head):
    b, t, _ = x.shape
    q, k, v = x @ W_q, x @ W_k, x @ W_v
    d_head = q.shape[-1] // n_head
    q, k, v = (z.view(b, t, n_head, d_head).transpose(1, 2) for z in (q, k, v))
    att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_head), dim=-1)
    return (att @ v).transpose(1, 2).reshape(b, t, -1) @ W_o


def attention_sized(x, W_q, W_k, W_v, W_o, n_head=2, d_head=10):
    b, t, _ = x.shape
    q, k, v = x @ W_q, x @ W_k, x @ W_v
    q, k, v = (z.view(b, t, n_head, d_head).transpose(1, 2) for z in (q, k, v))
    att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_head), dim=-1)
    return (att @ v).transpose(1, 2).reshape(b, t, n_head * d_head) @ W_o


def attention_sized_unscaled(x, W_q, W_k, W_v, W_o, n_head=2, d_head=10):
    b, t, _ = x.shape
    q, k, v = x @ W_q, x @ W_k, x @ W_v
    q, k, v = (z.view(b, t, n_head, d_head).transpose(1, 2) for z in (q, k, v))
    att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    return (att @ v).transpose(1, 2).reshape(b, t, n_head * d_head) @ W_o


def attention_linear(x, w_q, w_k, w_v, w_o, num_heads=2, head_dim=10):
    b, t, _ = x.shape
    q, k, v = F.linear(x, w_q), F.linear(x, w_k), F.linear(x, w_v)
    q, k, v = (z.view(b, t, num_heads, head_dim).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(y.transpose(1, 2).reshape(b, t, num_heads * head_dim), w_o)


# one head, no head axis, dropout on the pattern: --train
class OneHeadDropout(nn.Module):
    def __init__(self, d=16, p=0.25, bug=None):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.bug = bug

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        a = self.drop(s.softmax(-1))
        return a @ v
