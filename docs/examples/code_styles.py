"""Attention modules in the code styles of issue 41, each correct, traced in docs/trace.md ("How conventions are
read") and by tests/test_trace_conventions.py: GPT-NeoX/Pythia (q, k, v fused per head, a partial rotary
fraction, a causal tril buffer), litgpt (fused per KV group), Falcon (fused multi-query), flash-attn's MHA (packed
[.., 3, H, D], a key_padding_mask [B, S]), diffusers' Attention (head_to_batch_dim, baddbmm with a [B, 1, n_K]
mask), HF's BertSelfAttention (no output projection, a 2-D 0/1 mask extended inside), GQA as a grouped einsum
without a repeat, nn.Parameter weights used as x @ W, a plain function, T5 (unscaled), Meta's interleaved RoPE
with its own tables, RoPE counting positions from 1, a bidirectional local window, nanoGPT's tril buffer, a
causal buffer beside a mask argument, and the column form.
"""

import math
import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class NeoXAttention(nn.Module):
    """GPT-NeoX / Pythia: qkv fused per head [n_head, 3*d_head], partial rotary (rotary_pct), causal tril buffer."""

    def __init__(self, hidden_size=64, num_attention_heads=4, rotary_pct=0.25, max_positions=32, base=10000):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.head_size = hidden_size // num_attention_heads
        self.rotary_ndims = int(self.head_size * rotary_pct)
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool)))
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_ndims, 2).float() / self.rotary_ndims))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(B, T, self.num_attention_heads, 3 * self.head_size)
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size: 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size:].permute(0, 2, 1, 3)
        q_rot, q_pass = query[..., : self.rotary_ndims], query[..., self.rotary_ndims:]
        k_rot, k_pass = key[..., : self.rotary_ndims], key[..., self.rotary_ndims:]
        t = torch.arange(T, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        query = torch.cat((q_rot, q_pass), dim=-1)
        key = torch.cat((k_rot, k_pass), dim=-1)
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_size)
        causal = self.bias[:T, :T]
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1)
        out = torch.matmul(probs, value)
        out = out.permute(0, 2, 1, 3).reshape(B, T, -1)
        return self.dense(out)


class LitGPTAttention(nn.Module):
    """litgpt: qkv fused per KV group [n_query_groups, q_per_kv + 2, head_size]."""

    def __init__(self, n_embd=64, n_head=4, n_query_groups=2):
        super().__init__()
        self.n_head, self.n_query_groups = n_head, n_query_groups
        self.head_size = n_embd // n_head
        self.attn = nn.Linear(n_embd, (n_head + 2 * n_query_groups) * self.head_size, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.attn(x)
        q_per_kv = self.n_head // self.n_query_groups
        total_qkv = q_per_kv + 2
        qkv = qkv.view(B, T, self.n_query_groups, total_qkv, self.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        v = v.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        q = q.reshape(B, -1, T, self.head_size)
        k = k.reshape(B, -1, T, self.head_size)
        v = v.reshape(B, -1, T, self.head_size)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class FalconAttention(nn.Module):
    """Falcon-7B: fused multi-query [n_head + 2, head_dim]."""

    def __init__(self, hidden_size=64, n_head=4):
        super().__init__()
        self.num_heads = n_head
        self.head_dim = hidden_size // n_head
        self.query_key_value = nn.Linear(hidden_size, hidden_size + 2 * self.head_dim, bias=False)
        self.dense = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(B, T, self.num_heads + 2, self.head_dim)
        q = fused[..., :-2, :].transpose(1, 2)
        k = fused[..., [-2], :].transpose(1, 2)
        v = fused[..., [-1], :].transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.dense(out.transpose(1, 2).reshape(B, T, -1))


class FlashMHA(nn.Module):
    """flash-attn's MHA: Wqkv, packed [b, s, 3, h, d], key_padding_mask [B, S] (True = keep)."""

    def __init__(self, embed_dim=64, num_heads=4, causal=False):
        super().__init__()
        self.num_heads, self.causal = num_heads, causal
        self.head_dim = embed_dim // num_heads
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, key_padding_mask=None):
        B, S, _ = x.shape
        qkv = self.Wqkv(x).view(B, S, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(self.head_dim)
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
        if self.causal:
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        attn = scores.softmax(dim=-1)
        out = torch.einsum("bhts,bshd->bthd", attn, v).reshape(B, S, -1)
        return self.out_proj(out)


class DiffusersAttention(nn.Module):
    """diffusers' Attention: head_to_batch_dim, baddbmm with an additive mask [B, 1, n_K]."""

    def __init__(self, query_dim=64, heads=4, dim_head=16):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(query_dim, inner, bias=False)
        self.to_v = nn.Linear(query_dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])

    def head_to_batch_dim(self, tensor):
        b, s, dim = tensor.shape
        tensor = tensor.reshape(b, s, self.heads, dim // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(b * self.heads, s, dim // self.heads)

    def batch_to_head_dim(self, tensor):
        b, s, dim = tensor.shape
        tensor = tensor.reshape(b // self.heads, self.heads, s, dim).permute(0, 2, 1, 3)
        return tensor.reshape(b // self.heads, s, dim * self.heads)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        if attention_mask is not None:  # [B, 1, n_K] additive -> [B*heads, 1, n_K]
            attention_mask = attention_mask.repeat_interleave(self.heads, dim=0)
        query = self.head_to_batch_dim(self.to_q(hidden_states))
        key = self.head_to_batch_dim(self.to_k(encoder_hidden_states))
        value = self.head_to_batch_dim(self.to_v(encoder_hidden_states))
        if attention_mask is None:
            baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype)
            beta = 0
        else:
            baddbmm_input, beta = attention_mask, 1
        scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=self.scale)
        probs = scores.softmax(dim=-1)
        out = torch.bmm(probs, value)
        out = self.batch_to_head_dim(out)
        return self.to_out[1](self.to_out[0](out))


class BertSelfAttention(nn.Module):
    """HF BertSelfAttention: no output projection, a 2-D 0/1 attention_mask extended inside."""

    def __init__(self, hidden_size=64, num_attention_heads=4):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, x):
        new_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            extended = (1.0 - attention_mask[:, None, None, :].to(attention_scores.dtype)) * -10000.0
            attention_scores = attention_scores + extended
        attention_probs = attention_scores.softmax(dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class GroupedEinsum(nn.Module):
    """GQA as a grouped einsum: no repeat of K and V."""

    def __init__(self, dim=64, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        g = self.n_heads // self.n_kv_heads
        q = self.wq(x).view(B, T, self.n_kv_heads, g, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", q, k) * self.head_dim ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = scores.softmax(dim=-1)
        out = torch.einsum("bhgqk,bkhd->bqhgd", attn, v).reshape(B, T, -1)
        return self.wo(out)


class ParamAttention(nn.Module):
    """nn.Parameter weights used as X @ W."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.W_Q = nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
        self.W_K = nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
        self.W_V = nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
        self.W_O = nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)

    def forward(self, x):
        B, T, _ = x.shape
        q = (x @ self.W_Q).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        k = (x @ self.W_K).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        v = (x @ self.W_V).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        a = (q @ k.transpose(-2, -1) / self.d_head ** 0.5).softmax(-1)
        o = (a @ v).transpose(1, 2).reshape(B, T, -1)
        return o @ self.W_O


def attention(q, k, v, mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask == 0, float("-inf"))
    return s.softmax(-1) @ v


class T5Attention(nn.Module):
    """T5: unscaled scores."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.n_heads, self.key_value_proj_dim = n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape
        shape = lambda s: s.view(B, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        q, k, v = shape(self.q(hidden_states)), shape(self.k(hidden_states)), shape(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(3, 2))
        attn = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(B, -1, self.n_heads * self.key_value_proj_dim)
        return self.o(out)


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


class MetaRope(nn.Module):
    """Meta's interleaved RoPE, its tables built inside."""

    def __init__(self, dim=64, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.freqs_cis = precompute_freqs_cis(self.head_dim, 64)

    def forward(self, x):
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        xk = self.wk(x).view(B, T, self.n_heads, self.head_dim)
        xv = self.wv(x).view(B, T, self.n_heads, self.head_dim)
        fc = self.freqs_cis[:T].view(1, T, 1, -1)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq = torch.view_as_real(xq_ * fc).flatten(3)
        xk = torch.view_as_real(xk_ * fc).flatten(3)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class RopeFrom1(nn.Module):
    """Half-split RoPE with positions starting at 1."""

    def __init__(self, dim=64, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        pos = torch.arange(1, T + 1).float()
        emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
        q = q * emb.cos() + rotate_half(q) * emb.sin()
        k = k * emb.cos() + rotate_half(k) * emb.sin()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LocalWindow(nn.Module):
    """Bidirectional local window: |i - j| <= w."""

    def __init__(self, dim=64, n_heads=4, window=2):
        super().__init__()
        self.n_heads, self.head_dim, self.window = n_heads, dim // n_heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        i = torch.arange(T)
        local = (i[:, None] - i[None, :]).abs() <= self.window
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=local)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TrilBuffer(nn.Module):
    """nanoGPT-like with a causal buffer from tril and a mask argument that is padding."""

    def __init__(self, dim=64, n_heads=4, block_size=32):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class BufferAndMask(nn.Module):
    """Its own causal buffer, built with tril(diagonal=1) (a bug), and a padding mask argument as well."""

    def __init__(self, dim=64, n_heads=4, block_size=32, diagonal=0):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size), diagonal=diagonal))

    def forward(self, x, mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        att = att.masked_fill(self.bias[:T, :T] == 0, float("-inf"))
        if mask is not None:
            att = att.masked_fill(mask == 0, float("-inf"))
        y = att.softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def attention_cols(Q, K, V):
    """The column form: one token a column, out = V softmax(Kᵀ Q / √d_K), the softmax over the keys."""
    A = (K.transpose(-2, -1) @ Q) / math.sqrt(Q.shape[-2])
    return V @ A.softmax(dim=-2)


class DictCfg(nn.Module):
    """Its head count only in a dict it keeps under a name of its own (`self.hp`)."""
    def __init__(self, d=64):
        super().__init__()
        self.hp = {"num_heads": 4, "dim": d}
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        H = self.hp["num_heads"]
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class NoHeadsSaid(nn.Module):
    """Its head count only as a literal in its forward: read from the queries it hands the kernel."""
    def __init__(self, d=64):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Attend(nn.Module):
    """x-transformers-like: no weights, q, k, v [B, H, n, d], mask [B, n_K] key padding."""
    def __init__(self, dropout=0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        scale = q.shape[-1] ** -0.5
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if mask is not None:
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


class FusedKVGroups(nn.Module):
    """q alone; k and v fused per KV group [n_group, 2, d_head]."""
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.g, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)
        kv = self.kv(x).view(B, T, self.g, 2, self.d)
        k, v = kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)
        k = k.repeat_interleave(self.h // self.g, dim=1)
        v = v.repeat_interleave(self.h // self.g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))
