"""Round 3 of the held-out code styles (issue 41), each written as its project writes attention, with the bugs
people make there planted by `bug=` (tests/test_trace_round3.py traces each). Every style here exposed a failure of
`attnscope trace` before its fix: xformers' [B, M, H, K] layout with an additive `attn_bias`; Mistral's reference
(interleaved RoPE, repeat_interleave, a sliding window built by tril/triu/log); openai/whisper's scale split between
q and k; T5's relative bias in a plain function; a GPT-2-style decode step joining `layer_past`; a bidirectional
local window built by hand; cross-attention masked with -1e9; GPT-J's partial interleaved rotary; GQA contracted in
groups by einsum, merged in its own order."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# xformers-style: [B, M, H, K] layout, an additive bias argument
def memory_efficient_attention(query, key, value, attn_bias=None, scale=None, bug=None):
    scale = 1 / query.shape[-1] ** 0.5 if scale is None else scale
    query = query * scale
    query = query.transpose(1, 2)  # [B, H, M, K]
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    attn = query @ key.transpose(-2, -1)
    if attn_bias is not None:
        attn = attn + attn_bias
    attn = attn.softmax(-1)
    if bug == "dropout":
        attn = F.dropout(attn, 0.3)
    return (attn @ value).transpose(1, 2)


class XFormersBlock(nn.Module):
    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.bug = bug

    def forward(self, x, attn_bias=None):
        B, M, C = x.shape
        qkv = self.qkv(x).reshape(B, M, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.unbind(2)  # [B, M, H, K]
        if self.bug == "kv_swap":
            k, v = v, k
        scale = None if self.bug != "scale_dmodel" else C ** -0.5
        out = memory_efficient_attention(q, k, v, attn_bias=attn_bias, scale=scale, bug=self.bug)
        return self.proj(out.reshape(B, M, C))



# Mistral's reference: interleaved RoPE via view_as_complex, repeat_interleave GQA, sliding-window mask
class MistralArgs:
    def __init__(self, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, sliding_window=3, rope_theta=10000.0):
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.head_dim, self.sliding_window, self.rope_theta = head_dim, sliding_window, rope_theta


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(keys, values, repeats, dim, bug=None):
    if bug == "tiled":
        return keys.repeat(1, 1, repeats, 1), values.repeat(1, 1, repeats, 1)
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=dim)
    values = torch.repeat_interleave(values, repeats=repeats, dim=dim)
    return keys, values


class MistralAttention(nn.Module):
    def __init__(self, args=None, bug=None):
        super().__init__()
        args = args or MistralArgs()
        self.args = args
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.sliding_window = args.sliding_window
        self.scale = args.head_dim ** -0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.bug = bug

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.args.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        freqs_cis = precompute_freqs_cis(self.args.head_dim, seqlen, self.args.rope_theta)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, value = repeat_kv(xk, xv, self.repeats, dim=2, bug=self.bug)
        query, key, value = xq.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scale
        tensor = torch.full((seqlen, seqlen), 1.0)
        mask = torch.tril(tensor, diagonal=0)
        mask = torch.triu(mask, diagonal=-self.sliding_window + (1 if self.bug != "window_off" else 0))
        mask = torch.log(mask)
        if self.bug == "mask_after":
            scores = F.softmax(scores.float(), dim=-1).type_as(query) * mask.exp()
        else:
            scores = scores + mask[None, None, ...]
            scores = F.softmax(scores.float(), dim=-1).type_as(query)
        output = torch.matmul(scores, value)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)



# openai/whisper: split scale d_head ** -0.25 on q and k, k without bias, k permuted to [b, h, d, n]
class WhisperMHA(nn.Module):
    def __init__(self, n_state=32, n_head=4, bug=None):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)
        self.bug = bug

    def forward(self, x, xa=None, mask=None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        if self.bug == "scale_half":
            scale = (n_state // self.n_head) ** -0.5
        if self.bug == "scale_dmodel":
            scale = n_state ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        w = F.softmax(qk.float(), dim=-1).to(q.dtype)
        if self.bug == "values_from_keys":
            v = k.transpose(-1, -2)
        out = (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)
        return self.out(out)



# T5's relative position bias in a plain function, no scale
def t5_attention(q, k, v, position_bias, mask=None, bug=None):
    scores = torch.matmul(q, k.transpose(3, 2))
    if bug == "scaled":
        scores = scores / math.sqrt(q.shape[-1])
    if bug == "transposed":
        position_bias = position_bias.transpose(-1, -2)
    if bug != "after":
        scores = scores + position_bias
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
    if bug == "after":
        attn_weights = attn_weights + position_bias
    return torch.matmul(attn_weights, v)


def t5_correct(q, k, v, position_bias, mask=None):
    return t5_attention(q, k, v, position_bias, mask)


def t5_scaled(q, k, v, position_bias, mask=None):
    return t5_attention(q, k, v, position_bias, mask, bug="scaled")


def t5_transposed(q, k, v, position_bias, mask=None):
    return t5_attention(q, k, v, position_bias, mask, bug="transposed")


def t5_after(q, k, v, position_bias, mask=None):
    return t5_attention(q, k, v, position_bias, mask, bug="after")



# GPT-2-style decode step: layer_past tuple, concatenation, F.sdpa
class DecodeAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, bug=None):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.bug = bug

    def _split_heads(self, t):
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).permute(0, 2, 1, 3)

    def forward(self, hidden_states, layer_past=None):
        query, key, value = self.c_attn(hidden_states).split(hidden_states.size(-1), dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        if layer_past is not None:
            past_key, past_value = layer_past
            if self.bug == "cache_order":
                key = torch.cat((key, past_key), dim=-2)
                value = torch.cat((value, past_value), dim=-2)
            else:
                key = torch.cat((past_key, key), dim=-2)
                value = torch.cat((past_value, value), dim=-2)
        if self.bug == "kv_swap":
            key, value = value, key
        T, S = query.size(-2), key.size(-2)
        if self.bug == "upper_left":
            y = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        else:
            mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
            y = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        B, H, T, D = y.shape
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.c_proj(y)



# bidirectional local window built by hand (ModernBERT-like), window = local_attention
class LocalBidirectional(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, local_attention=4, bug=None):
        super().__init__()
        self.num_heads = num_heads
        self.local_attention = local_attention
        self.Wqkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.Wo = nn.Linear(hidden_size, hidden_size, bias=False)
        self.bug = bug

    def forward(self, hidden_states):
        B, T, D = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(B, T, 3, self.num_heads, D // self.num_heads)
        q, k, v = qkv.transpose(3, 1).unbind(dim=2)  # [B, H, T, d]
        rows = torch.arange(T).unsqueeze(0)
        distance = torch.abs(rows - rows.T)
        half = self.local_attention // 2
        window = distance <= half if self.bug != "off_by_one" else distance < half
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        if self.bug == "polarity":
            scores = scores.masked_fill(window, float("-inf"))
        elif self.bug == "mask_after":
            scores = scores.softmax(-1).masked_fill(~window, 0.0)
        else:
            scores = scores.masked_fill(~window, float("-inf"))
        probs = scores if self.bug == "mask_after" else scores.softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(B, T, D)
        return self.Wo(out)



# cross-attention: queries from x, a fused to_kv over another input, padding on the context
class CrossAttention(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self.bug = bug

    def forward(self, x, context, context_mask=None):
        B, N, D = x.shape
        h = self.heads
        q = self.to_q(x).view(B, N, h, -1).transpose(1, 2)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        k = k.view(B, context.shape[1], h, -1).transpose(1, 2)
        v = v.view(B, context.shape[1], h, -1).transpose(1, 2)
        if self.bug == "kv_swap":
            k, v = v, k
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (q.shape[-1] ** -0.5)
        if context_mask is not None:
            sim = sim.masked_fill(~context_mask[:, None, None, :], -1e9)
        attn = sim.softmax(dim=-1 if self.bug != "axis" else -2)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        out = out.transpose(1, 2).reshape(B, N, D)
        return self.to_out(out)



# GPT-J: partial rotary (rotary_dim) paired interleaved (rotate_every_two), sin/cos made in the module
def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GPTJAttention(nn.Module):
    def __init__(self, embed_dim=64, num_attention_heads=4, rotary_dim=8, bug=None):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.head_dim = embed_dim // num_attention_heads
        self.rotary_dim = rotary_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.bug = bug
        self.register_buffer("causal", torch.tril(torch.ones(64, 64, dtype=torch.bool)))

    def _rope(self, x, sin, cos):
        sin = torch.repeat_interleave(sin[None, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[None, :, None, :], 2, 3)
        turn = rotate_every_two if self.bug != "pairing" else rotate_half
        return (x * cos) + (turn(x) * sin)

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_attention_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_attention_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_attention_heads, self.head_dim)
        rot = self.rotary_dim
        over = rot if self.bug != "fraction" else self.head_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / over))
        angles = torch.einsum("i,j->ij", torch.arange(T).float(), inv_freq)
        sin, cos = torch.sin(angles), torch.cos(angles)
        q = torch.cat([self._rope(q[..., :rot], sin, cos), q[..., rot:]], dim=-1)
        k = torch.cat([self._rope(k[..., :rot], sin, cos), k[..., rot:]], dim=-1)
        if self.bug == "rope_v":
            v = torch.cat([self._rope(v[..., :rot], sin, cos), v[..., rot:]], dim=-1)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        w = torch.matmul(q.float(), k.transpose(-1, -2).float())
        w = w.masked_fill(~self.causal[:T, :T], torch.finfo(w.dtype).min)
        w = w / math.sqrt(self.head_dim)
        w = F.softmax(w, dim=-1)
        out = torch.matmul(w, v).permute(0, 2, 1, 3).reshape(B, T, -1)
        return self.out_proj(out)



# GQA contracted in groups by einsum, keys never repeated (no repeat_kv), output through its own proj
class GroupedGQA(nn.Module):
    def __init__(self, d_model=64, n_heads=8, n_kv_heads=2, bug=None):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.d_head = d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * self.d_head, bias=False)
        self.wkv = nn.Linear(d_model, 2 * n_kv_heads * self.d_head, bias=False)
        self.wo = nn.Linear(n_heads * self.d_head, d_model, bias=False)
        self.bug = bug

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        G = self.n_heads // self.n_kv_heads
        q = self.wq(x)
        if self.bug == "group_order":
            q = q.view(B, T, G, self.n_kv_heads, self.d_head).transpose(2, 3)  # [B, T, kv, G, d]
        else:
            q = q.view(B, T, self.n_kv_heads, G, self.d_head)
        k, v = self.wkv(x).view(B, T, 2, self.n_kv_heads, self.d_head).unbind(2)
        s = torch.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(self.d_head)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = s.softmax(-1)
        o = torch.einsum("bkgts,bskd->btkgd", p, v)
        return self.wo(o.reshape(B, T, -1))
