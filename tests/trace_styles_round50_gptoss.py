"""GPT-OSS attention as openai/gpt-oss writes it (gpt_oss/torch/model.py: AttentionBlock and sdpa): tokens
as rows [n_tokens, hidden] (no batch axis), one fused qkv Linear cut by slices, queries viewed
[n_tokens, n_kv_heads, q_mult, head_dim] against keys expanded over q_mult, half-split RoPE of its own
(torch.chunk), a learned sink logit per head joined to the scores before the softmax and dropped after,
a sliding window on every other layer (layer_idx % 2 == 0). The block's RMSNorm and residual are left out."""
import math
from dataclasses import dataclass

import torch


@dataclass
class ModelConfig:
    hidden_size: int = 48
    head_dim: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    sliding_window: int = 4
    rope_theta: float = 150000.0


def _apply_rotary_emb(x, cos, sin, bug=None):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if bug == "rope_interleaved":
        x1, x2 = x[..., ::2], x[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        return torch.stack((o1, o2), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim, base, dtype=torch.float32, bug=None):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.dtype = dtype
        self.bug = bug

    def _compute_concentration_and_inv_freq(self):
        freq = self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim)
        concentration = 1.0
        inv_freq = 1.0 / freq
        return concentration, inv_freq

    def _compute_cos_sin(self, num_tokens):
        concentration, inv_freq = self._compute_concentration_and_inv_freq()
        t = torch.arange(num_tokens, dtype=torch.float32)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        cos = freqs.cos() * concentration
        sin = freqs.sin() * concentration
        return cos, sin

    def forward(self, query, key):
        num_tokens = query.shape[0]
        cos, sin = self._compute_cos_sin(num_tokens)

        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_dim)
        query = _apply_rotary_emb(query, cos, sin, self.bug)
        query = query.reshape(query_shape)

        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_dim)
        key = _apply_rotary_emb(key, cos, sin, self.bug)
        key = key.reshape(key_shape)
        return query, key


def sdpa(Q, K, V, S, sm_scale, sliding_window=0, bug=None):
    # sliding_window == 0 means no sliding window
    n_tokens, n_heads, q_mult, d_head = Q.shape
    assert K.shape == (n_tokens, n_heads, d_head)
    assert V.shape == (n_tokens, n_heads, d_head)
    K = K[:, :, None, :].expand(-1, -1, q_mult, -1)
    V = V[:, :, None, :].expand(-1, -1, q_mult, -1)
    S = S.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if sliding_window > 0:
        diagonal = -sliding_window - 1 if bug == "window_wide" else -sliding_window
        mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=diagonal)
    QK = torch.einsum("qhmd,khmd->hmqk", Q, K)
    QK *= sm_scale
    QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]
    attn = torch.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1)


class AttentionBlock(torch.nn.Module):
    def __init__(self, config: ModelConfig = None, layer_idx: int = 0, bug=None):
        super().__init__()
        config = config if config is not None else ModelConfig()
        self.bug = bug
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        # Only apply sliding window to every other layer
        if bug == "window_on_odd":
            self.sliding_window = config.sliding_window if layer_idx % 2 == 1 else 0
        else:
            self.sliding_window = config.sliding_window if layer_idx % 2 == 0 else 0
        self.sinks = torch.nn.Parameter(torch.empty(config.num_attention_heads))
        qkv_dim = config.head_dim * (config.num_attention_heads + 2 * config.num_key_value_heads)
        self.qkv = torch.nn.Linear(config.hidden_size, qkv_dim)
        self.out = torch.nn.Linear(config.head_dim * config.num_attention_heads, config.hidden_size)
        self.sm_scale = 1 / math.sqrt(config.head_dim)
        self.rope = RotaryEmbedding(self.head_dim, config.rope_theta, torch.float32, bug=bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        q = qkv[:, : self.num_attention_heads * self.head_dim].contiguous()
        k = qkv[
            :,
            self.num_attention_heads * self.head_dim : (self.num_attention_heads + self.num_key_value_heads)
            * self.head_dim,
        ].contiguous()
        v = qkv[
            :,
            (self.num_attention_heads + self.num_key_value_heads) * self.head_dim : (
                self.num_attention_heads + 2 * self.num_key_value_heads
            )
            * self.head_dim,
        ].contiguous()

        if self.bug == "q_group_order":
            q = q.view(
                -1, self.num_attention_heads // self.num_key_value_heads, self.num_key_value_heads, self.head_dim
            ).transpose(1, 2).contiguous()
        else:
            q = q.view(
                -1, self.num_key_value_heads, self.num_attention_heads // self.num_key_value_heads, self.head_dim
            )
        k = k.view(-1, self.num_key_value_heads, self.head_dim)
        v = v.view(-1, self.num_key_value_heads, self.head_dim)
        q, k = self.rope(q, k)
        t = sdpa(q, k, v, self.sinks, self.sm_scale, self.sliding_window, bug=self.bug)
        t = self.out(t)
        return t
