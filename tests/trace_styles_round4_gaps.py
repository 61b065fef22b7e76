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


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


# HF GPT-2: Conv1D c_attn fused (torch.addmm(b, x, W)), a causal buffer `bias`, returns (out, present)
class GPT2Attention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_positions=16, bug=None):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n_positions, n_positions, dtype=torch.bool)).view(
            1, 1, n_positions, n_positions), persistent=False)
        self.embed_dim, self.num_heads = n_embd, n_head
        self.head_dim = n_embd // n_head
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.bug = bug

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        if self.bug == "merge":
            return tensor.contiguous().view(tensor.size(0), tensor.size(2), self.embed_dim)
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.embed_dim,))

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.bug != "no_scale":
            attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype)
        q_len, k_len = query.size(-2), key.size(-2)
        causal = self.bias[:, :, k_len - q_len: k_len, :k_len]
        if self.bug == "off_by_one":
            causal = torch.tril(torch.ones(q_len, k_len, dtype=torch.bool), diagonal=1)[None, None]
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(causal, attn_weights, torch.full([], mask_value, dtype=attn_weights.dtype))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        if self.bug == "kv_swap":
            key, value = value, key
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=-2)
            value = torch.cat((layer_past[1], value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output, _ = self._attn(query, key, value, attention_mask)
        attn_output = self.c_proj(self._merge_heads(attn_output))
        return attn_output, present


# HF 4.x: forward(hidden_states, attention_mask=None, position_ids=None, past_key_value=None), a tuple back
class HF4Attention(nn.Module):
    def __init__(self, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, bug=None):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.bug = bug

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if self.bug == "tiled":
            k = k.repeat(1, self.num_key_value_groups, 1, 1)
            v = v.repeat(1, self.num_key_value_groups, 1, 1)
        else:
            k = k[:, :, None].expand(bsz, self.num_key_value_heads, self.num_key_value_groups, q_len,
                                     self.head_dim).reshape(bsz, self.num_heads, q_len, self.head_dim)
            v = v[:, :, None].expand(bsz, self.num_key_value_heads, self.num_key_value_groups, q_len,
                                     self.head_dim).reshape(bsz, self.num_heads, q_len, self.head_dim)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : k.shape[-2]]
            if self.bug == "mask_after":
                attn_weights = F.softmax(attn_weights, dim=-1) * (causal_mask == 0)
            else:
                attn_weights = attn_weights + causal_mask
        if self.bug != "mask_after":
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        attn_output = self.o_proj(attn_output)
        return attn_output, (attn_weights if output_attentions else None), past_key_value


# a weightless function over [B, T, H, D], einsum 'bqhd,bkhd->bhqk' (JAX's, flash-attn's layout)
def dot_product_attention(query, key, value, mask=None, bug=None):
    depth = query.shape[-1]
    query = query / math.sqrt(depth)
    logits = torch.einsum("bqhd,bkhd->bhqk", query, key)
    if mask is not None:
        logits = torch.where(mask, logits, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, value)


# Megatron's core attention: [s, b, np, hn], baddbmm over [b·np, sq, sk], attention_mask True = masked
class MegatronCore(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.np, self.hn = num_attention_heads, hidden_size // num_attention_heads
        self.norm_factor = math.sqrt(self.hn)
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.bug = bug

    def forward(self, hidden_states, attention_mask=None):
        sq, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, self.np, 3 * self.hn)
        query_layer, key_layer, value_layer = torch.split(mixed, self.hn, dim=3)
        output_size = (b, self.np, sq, sq)
        query_layer = query_layer.reshape(sq, b * self.np, -1)
        key_layer = key_layer.reshape(sq, b * self.np, -1)
        matmul_input_buffer = torch.zeros(b * self.np, sq, sq)
        factor = 1.0 / self.norm_factor if self.bug != "no_scale" else 1.0
        matmul_result = torch.baddbmm(matmul_input_buffer, query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=factor)
        attention_scores = matmul_result.view(*output_size)
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(attention_mask, -10000.0)
        attention_probs = torch.softmax(attention_scores, dim=-1 if self.bug != "axis" else -2)
        value_layer = value_layer.reshape(sq, b * self.np, -1)
        attention_probs = attention_probs.view(b * self.np, sq, -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(b, self.np, sq, self.hn)
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(sq, b, self.np * self.hn)
        return self.dense(context_layer)


# fairseq's encoder-decoder attention: query [T, B, C], key and value [S, B, C]
class FairseqCross(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.bug = bug

    def forward(self, query, key, value, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = key.size(0)
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value) if self.bug != "values_from_keys" else self.k_proj(key)
        q = q.view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(src_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.view(src_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            w = w.view(bsz, self.num_heads, tgt_len, src_len)
            w = w.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
            w = w.view(bsz * self.num_heads, tgt_len, src_len)
        w = F.softmax(w, dim=-1 if self.bug != "axis" else -2)
        o = torch.bmm(w, v).transpose(0, 1).reshape(tgt_len, bsz, embed_dim)
        return self.out_proj(o)


# nn.MultiheadAttention taking both masks: key padding [B, S] and the causal rule [T, S]
class WrappedBothMasks(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, batch_first=False):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first)

    def forward(self, x, key_padding_mask=None, attn_mask=None):
        return self.mha(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)[0]
