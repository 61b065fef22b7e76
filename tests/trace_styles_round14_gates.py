"""Attention with an output gate before the output projection, in the forms real libraries write it (round 14a's
gated attention), for tests/test_trace_round14_gates.py. Each takes `bug=None`: a planted mistake upstream of the
gate, which trace names by experiment."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GatingAttention(nn.Module):
    """AlphaFold's GatingAttention, as its PyTorch ports write it: einsums over [batch, query, head, channel], the
    queries scaled first, a bias list, the gate from the query data multiplied in place into the weighted average."""

    def __init__(self, c_in=32, c_hidden=8, n_head=4, bug=None):
        super().__init__()
        self.c_hidden, self.n_head, self.bug = c_hidden, n_head, bug
        self.linear_q = nn.Linear(c_in, c_hidden * n_head, bias=False)
        self.linear_k = nn.Linear(c_in, c_hidden * n_head, bias=False)
        self.linear_v = nn.Linear(c_in, c_hidden * n_head, bias=False)
        self.gating_linear = nn.Linear(c_in, c_hidden * n_head)
        self.output_linear = nn.Linear(c_hidden * n_head, c_in)

    def forward(self, q_data, m_data):
        b, nq, _ = q_data.shape
        q = self.linear_q(q_data).view(b, nq, self.n_head, self.c_hidden) * self.c_hidden ** -0.5
        k = self.linear_k(m_data).view(b, m_data.shape[1], self.n_head, self.c_hidden)
        v = self.linear_v(m_data).view(b, m_data.shape[1], self.n_head, self.c_hidden)
        if self.bug == "kv_swapped":
            k, v = v, k
        logits = torch.einsum("bqhc,bkhc->bhqk", q, k)
        if self.bug == "scale_twice":
            logits = logits / math.sqrt(self.c_hidden)
        weights = torch.softmax(logits, dim=-1)
        weighted_avg = torch.einsum("bhqk,bkhc->bqhc", weights, v)
        gate_values = torch.sigmoid(self.gating_linear(q_data)).view(b, nq, self.n_head, self.c_hidden)
        weighted_avg *= gate_values
        return self.output_linear(weighted_avg.reshape(b, nq, -1))


class QueryGated(nn.Module):
    """Qwen3-Next's gated full attention: q_proj writes each head's queries and its gate side by side, chunked in
    two; attn_output * sigmoid(gate) after the heads merge, then o_proj."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, self.head_dim)
        query_states, gate = torch.chunk(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim * 2), 2,
                                         dim=-1)
        gate = gate.reshape(bsz, q_len, -1)
        query_states = query_states.transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        scaling = 1.0 if self.bug == "scale_none" else self.head_dim ** -0.5
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * scaling
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        if self.bug == "merge_no_transpose":
            attn_output = attn_output.reshape(bsz, q_len, -1)
        else:
            attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        attn_output = attn_output * torch.sigmoid(gate)
        return self.o_proj(attn_output)


class HeadwiseGate(nn.Module):
    """A timm-style block with one gate a head (the gated-attention papers' headwise gate), multiplied into each
    head's SDPA output before the merge."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.qkv = nn.Linear(dim, dim * 3)
        self.gate = nn.Linear(dim, num_heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        scale = (C // self.num_heads) ** -0.5
        if self.bug == "scale_twice":
            q = q * scale
        x_attn = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [B, H, N, D]
        x_attn = x_attn * torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)  # [B, H, N, 1]
        if self.bug == "merge_no_transpose":
            x_attn = x_attn.reshape(B, N, C)
        else:
            x_attn = x_attn.transpose(1, 2).reshape(B, N, C)
        return self.proj(x_attn)


class SiluGated(nn.Module):
    """An elementwise gate of its own Linear after the merge, through SiLU (Mega- and Forgetting-Transformer-like
    output gates), lucidrains-style names."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_gates = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads
        q, k, v = (t.view(b, n, h, d // h).transpose(1, 2) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        if self.bug == "kv_swapped":
            k, v = v, k
        sim = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        out = sim.softmax(dim=-1) @ v
        out = out.transpose(1, 2).reshape(b, n, d)
        out = out * F.silu(self.to_gates(x))
        return self.to_out(out)
