"""Attention modules that go on after the merge of their heads, in the styles the code is written in, each correct and
with bugs planted after the merge the way people make them (a result assigned to a name nobody reads, an activation
called out of place, a residual taken twice):

- `MAB` / `SAB`: the Set Transformer's (Lee et al. 2019, juho-lee/set_transformer's modules.py): heads folded into the
  batch by split and cat, `O = Q_ + A.bmm(V_)`, heads merged by cat, `O = ln0(O)`, `O = O + relu(fc_o(O))`,
  `O = ln1(O)`. Plants: ln0's result kept under another name (`ln0_unused`), `F.relu(H)` called and dropped
  (`relu_dropped`).
- `BitNetAttention`: transformers' BitNet: an RMSNorm of its own (`attn_sub_norm`) on the merged heads before
  `o_proj`. Plant: the normed heads assigned to another name and the raw ones projected (`subnorm_unused`).
- `GatedAttention`: an output gate from the input (`o_proj(attn * sigmoid(gate(x)))`, the gated-attention papers'
  elementwise gate), with the block's residual `x + attn`. Plants: the gated heads assigned to another name
  (`gate_unused`), the residual added twice (`residual_twice`).
Every weight is moved off its initial value (the norms' weights off 1, the biases off 0).
"""

# ruff: noqa: E741 - the Set Transformer names its output O, as its code does

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(27)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


class MAB(nn.Module):
    def __init__(self, dim_Q=16, dim_K=16, dim_V=16, num_heads=4, ln=True, bug=None):
        super().__init__()
        self.dim_V, self.num_heads, self.bug = dim_V, num_heads, bug
        self.fc_q = nn.Linear(dim_Q, dim_V)
        self.fc_k = nn.Linear(dim_K, dim_V)
        self.fc_v = nn.Linear(dim_K, dim_V)
        if ln:
            self.ln0 = nn.LayerNorm(dim_V)
            self.ln1 = nn.LayerNorm(dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)
        _trained(self)

    def forward(self, Q, K):
        Q = self.fc_q(Q)
        K, V = self.fc_k(K), self.fc_v(K)

        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), 0)
        K_ = torch.cat(K.split(dim_split, 2), 0)
        V_ = torch.cat(V.split(dim_split, 2), 0)

        A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V), 2)
        O = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        if self.bug == "ln0_unused":
            O_normed = self.ln0(O)  # noqa: F841 - the plant: ln0's result kept under a name nobody reads
        else:
            O = O if getattr(self, "ln0", None) is None else self.ln0(O)
        if self.bug == "relu_dropped":
            H = self.fc_o(O)
            F.relu(H)  # the plant: F.relu is not in place
            O = O + H
        else:
            O = O + F.relu(self.fc_o(O))
        O = O if getattr(self, "ln1", None) is None else self.ln1(O)
        return O


class SAB(nn.Module):
    def __init__(self, dim_in=16, dim_out=16, num_heads=4, ln=True, bug=None):
        super().__init__()
        self.mab = MAB(dim_in, dim_in, dim_out, num_heads, ln=ln, bug=bug)

    def forward(self, X):
        return self.mab(X, X)


class BitNetRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class BitNetAttention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, bug=None):
        super().__init__()
        self.head_dim = hidden_size // num_attention_heads
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.bug = bug
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)
        self.attn_sub_norm = BitNetRMSNorm(hidden_size)
        _trained(self)

    def forward(self, hidden_states):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        if self.bug == "subnorm_unused":
            normed_output = self.attn_sub_norm(attn_output)  # noqa: F841 - the plant
        else:
            attn_output = self.attn_sub_norm(attn_output)
        attn_output = self.o_proj(attn_output)
        return attn_output


class GatedAttention(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_gate = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, n, d)
        gate = torch.sigmoid(self.to_gate(x))
        if self.bug == "gate_unused":
            gated = out * gate  # noqa: F841 - the plant
        else:
            out = out * gate
        h = x + self.to_out(out)
        if self.bug == "residual_twice":
            h = h + x
        return h

