"""Styles for tests/test_trace_round56.py, written afresh.

Llama45: Llama 3.1's attention in transformers 4.45's form (modeling_llama.LlamaAttention): the layer keeps its own
rotary embedding, made from its config's rope_theta and its llama3 rope_scaling (long wavelengths divided by the
factor, a smooth ramp between the low and high frequency wavelengths: _compute_llama3_parameters), and when it is
handed no position_embeddings it makes cos and sin itself from position_ids, which it reads
(`position_ids.shape[0]`); GQA by repeat_kv, a 4-D additive causal mask, o_proj.
bug='rotate_every_two' rotates GPT-J's way with Llama's cat(freqs, freqs) tables; bug='default_base' builds the
rotary embedding at base 10000, the config's rope_theta not handed on, the llama3 scaling still applied."""

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Llama31Config:
    """The fields of transformers 4.45's LlamaConfig this layer reads, Llama 3.1's RoPE at small sizes."""

    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 500000.0
    max_position_embeddings: int = 131072
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192})


def llama3_inv_freq(base, dim, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context=8192):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base, *scaling):
        super().__init__()
        self.register_buffer("inv_freq", llama3_inv_freq(base, dim, *scaling), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class Llama45(nn.Module):
    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config = config or Llama31Config()
        hidden_size, num_heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.num_key_value_heads, self.bug = num_heads, config.num_key_value_heads, bug
        num_key_value_heads = config.num_key_value_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        scaling = config.rope_scaling
        self.rotary_emb = RotaryEmbedding(self.head_dim, 10000.0 if bug == "default_base" else config.rope_theta,
                                          scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                                          scaling["original_max_position_embeddings"])

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids) if position_embeddings is None else position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        turn = rotate_every_two if self.bug == "rotate_every_two" else rotate_half
        q, k = q * cos + turn(q) * sin, k * cos + turn(k) * sin
        groups = self.num_heads // self.num_key_value_heads
        k, v = (t[:, :, None].expand(-1, -1, groups, -1, -1).reshape(bsz, self.num_heads, q_len, self.head_dim)
                for t in (k, v))
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : k.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)
