"""Gated attention whose query projection writes more than the queries, as HF transformers' Qwen3NextAttention writes
it (models/qwen3_next/modeling_qwen3_next.py): `q_proj` makes num_heads * head_dim * 2 features, viewed
[b, n, n_head, 2 * head_dim] and chunked in two, so each head's queries sit beside its gate ([head0 q | head0 gate |
head1 q | ...]); the gate reshaped to [b, n, n_head * head_dim]; q_norm and k_norm over each head's features
(`x * rsqrt(mean(x²) + eps) * (1 + weight)`), RoPE from `position_embeddings` (cos, sin), GQA (repeat_kv), eager
attention, `attn_output * torch.sigmoid(gate)` after the heads merge, then o_proj. And a blocks-layout gate: one
`to_q` making [queries | gate] for all heads, `q, gate = self.to_q(x).chunk(2, dim=-1)`, einsum attention, the gate
multiplied after the merge. Plants: no scale, GQA keys tiled instead of repeated per head, RoPE on interleaved pairs
instead of the two halves, the gate multiplied before the merge in another head layout than the output's."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module, seed: int = 27) -> nn.Module:
    """Weights moved off their initial values (no zero bias, no weight of 1), as a trained model's are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


class Qwen3NextRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):
    """The GPT-J rotation (interleaved pairs): a plant where the code's tables are for the halves."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, rotate=rotate_half):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep, tiled=False):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    if tiled:  # the plant: the kv heads repeated as a whole (kv0 kv1 kv0 kv1), not each in place
        return hidden_states.repeat(1, n_rep, 1, 1)
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    tiled = module.bug == "gqa_tiled"
    key_states = repeat_kv(key, module.num_key_value_groups, tiled)
    value_states = repeat_kv(value, module.num_key_value_groups, tiled)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class Qwen3NextConfig:
    """The fields of transformers' Qwen3NextConfig the attention reads."""

    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.num_key_value_heads, self.head_dim = num_key_value_heads, head_dim


class Qwen3NextGated(nn.Module):
    """HF's Qwen3NextAttention (full attention layer), hidden 32, 4 heads of 8, 2 kv heads."""

    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, bug=None):
        super().__init__()
        self.bug = bug
        self.config = Qwen3NextConfig(hidden_size, num_attention_heads, num_key_value_heads, head_dim)
        self.head_dim = head_dim
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        self.scaling = 1.0 if bug == "no_scale" else self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)
        self.q_norm = Qwen3NextRMSNorm(self.head_dim, eps=1e-6)
        self.k_norm = Qwen3NextRMSNorm(self.head_dim, eps=1e-6)
        _trained(self)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
        )
        gate = gate.reshape(*input_shape, -1)
        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        rotate = rotate_pairs if self.bug == "rope_pairs" else rotate_half
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, rotate=rotate)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling,
        )
        if self.bug == "gate_heads_first":  # the plant: the gate [b, n, H*d] read as [b, H, n, d] before the merge
            b, n, h, d = attn_output.shape
            attn_output = attn_output.transpose(1, 2) * torch.sigmoid(gate).view(b, h, n, d)
            attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        else:
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            attn_output = attn_output * torch.sigmoid(gate)
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class BlockGated(nn.Module):
    """lucidrains-like: `to_q` makes [queries | gate] for all heads, chunked in two; einsum attention, causal by a
    boolean mask of its own; the gate multiplied after the merge."""

    def __init__(self, dim=32, heads=4, dim_head=8, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner * 2, bias=True)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)
        _trained(self, seed=5)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q, gate = self.to_q(x).chunk(2, dim=-1)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, n, h, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        scale = 1.0 if self.bug == "no_scale" else self.scale
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * scale
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        sim = sim.masked_fill(future, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        if self.bug == "gate_heads_first":  # the gate [b, n, H*d] viewed as [b, H, n, d] against out [b, H, n, d]
            out = out * F.silu(gate).reshape(b, h, n, -1)
            return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out * F.silu(gate))


class HeadDimOnly(Qwen3NextGated):
    """Qwen3-Next's attention keeping head_dim and no config: the head count is read from the widths."""

    def __init__(self, bug=None):
        super().__init__(bug=bug)
        del self.config
