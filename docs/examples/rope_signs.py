"""RoPE and softmax conventions of nanochat and GPT-OSS (docs/trace.md, "How conventions are read"):

- `NanochatAttention`: nanochat's `apply_rotary_emb`, `y1 = x1 * cos + x2 * sin; y2 = x1 * (-sin) + x2 * cos`, each
  pair turned by −θ, with its own tables as buffers, a weight-free `F.rms_norm` on q and k after RoPE and GQA by
  SDPA's `enable_gqa`. bug="tiled" repeats the key/value heads with `.repeat` (tiled, where query head h reads
  key/value head h // 2); bug="kv_swapped" hands SDPA the values as keys and the rotated, normed keys as values.
- `NanochatCosSin`: the same as nanochat's `CausalSelfAttention.forward(x, cos_sin, kv_cache)` takes it, RoPE's tables
  handed as one `(cos, sin)` pair, each [1, T, 1, head_dim / 2], which the model slices from its buffers.
- `GptOssAttention`: transformers' GPT-OSS attention (models/gpt_oss, its `eager_attention_forward`): biases,
  `repeat_kv`, tables [B, T, head_dim / 2] that `_apply_rotary_emb` broadcasts over each half of the head, and
  attention sinks, a learned logit a head joined to the scores as one more column before the softmax and dropped
  after. bug="kv_swapped" swaps the keys and values.
"""

import torch
import torch.nn.functional as F
from torch import nn


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3)


def rotary_tables(seq_len, head_dim, base=10000):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]  # [1, T, 1, head_dim / 2]


class NanochatAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.bug = n_head, n_kv_head, n_embd // n_head, bug
        self.c_q = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        cos, sin = rotary_tables(64, self.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = (t.transpose(1, 2) for t in ((q, v, k) if self.bug == "kv_swapped" else (q, k, v)))
        if self.bug == "tiled":
            k, v = k.repeat(1, self.n_head // self.n_kv_head, 1, 1), v.repeat(1, self.n_head // self.n_kv_head, 1, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.bug != "tiled")
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class NanochatCosSin(NanochatAttention):
    def forward(self, x, cos_sin, kv_cache=None):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class GptOssAttention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, bug=None):
        super().__init__()
        self.head_dim, self.bug = head_dim, bug
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(num_attention_heads * head_dim, hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.randn(num_attention_heads))

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states, key_states = _apply_rotary_emb(query_states, cos, sin), _apply_rotary_emb(key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        if self.bug == "kv_swapped":
            key_states, value_states = value_states, key_states
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(query_states.shape[0], -1, query_states.shape[-2], -1)
        combined_logits = torch.cat([attn_weights, sinks], dim=-1)
        combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
        scores = probs[..., :-1]  # we drop the sink here
        attn_output = torch.matmul(scores, value_states).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1)), scores
