"""Perceiver resamplers whose latents are a forward argument (docs/trace.md, "Perceiver's latents"): the queries
projected from the latents, the keys and values from the context joined to those latents along the tokens.
transformers' Idefics2 perceiver attention (`k_proj(torch.concat([context, latents], dim=-2))`, 4 query heads
sharing 2 key/value heads) and a lucidrains-like PerceiverResampler attention (`forward(x, latents)`, a fused
`to_kv(torch.cat((x, latents), dim=-2))`); Perceiver AR's prefix attention, its keys joined after `to_kv`."""

import math

import torch
from torch import nn


class Idefics2Perceiver(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_key_value_heads=2, head_dim=8, bug=None):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim, self.bug = num_heads, num_key_value_heads, head_dim, bug
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, latents, context):
        bsz, q_len, _ = latents.size()
        hidden_states = torch.concat([context, latents], dim=-2)
        kv_len = hidden_states.shape[1]
        q = self.q_proj(latents).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, kv_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = (self.k_proj if self.bug == "values_from_keys" else self.v_proj)(hidden_states)
        v = v.view(bsz, kv_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        n_rep = self.num_heads // self.num_key_value_heads  # repeat_kv: [b, kv_heads, n, d] -> [b, heads, n, d]
        k, v = (t[:, :, None].expand(bsz, self.num_key_value_heads, n_rep, kv_len, self.head_dim)
                .reshape(bsz, self.num_heads, kv_len, self.head_dim) for t in (k, v))
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)  # [b, heads, n_Q, n_K]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()  # [b, n_Q, heads, d]
        return self.o_proj(out.reshape(bsz, q_len, self.num_heads * self.head_dim))


class Resampler(nn.Module):
    def __init__(self, dim=32, heads=4, dim_head=8):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x, latents):
        q = self.to_q(latents)
        k, v = self.to_kv(torch.cat((x, latents), dim=-2)).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [b, h, n, d]
        sim = torch.einsum("b h i d, b h j d -> b h i j", q * self.scale, k)
        attn = (sim - sim.amax(dim=-1, keepdim=True).detach()).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).flatten(2))  # [b, n, h·d]


class PrefixAR(nn.Module):
    """Perceiver AR's causal prefix attention (lucidrains-like): the queries from the last tokens x, the keys and
    values from the prefix and x each through `to_kv`, joined after it; a causal rule aligned lower-right over the
    joined keys, heads two at a time."""

    def __init__(self, dim=32, heads=4, dim_head=8, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.norm, self.context_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x, context):
        x, context = self.norm(x), self.context_norm(context)
        q = self.to_q(x)
        k_x, v_x = self.to_kv(x).chunk(2, dim=-1)
        k_c, v_c = self.to_kv(context).chunk(2, dim=-1)
        k, v = torch.cat((k_c, k_x), dim=1), torch.cat((v_c, v_x), dim=1)  # [b, n_K, h·d]: the prefix, then x
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [b, h, n, d]
        i, j = q.shape[-2], k.shape[-2]
        masked = torch.ones(i, j, dtype=torch.bool).triu(1 if self.bug == "upper_left" else j - i + 1)
        out = []
        for qc, kc, vc in zip(q.split(2, dim=1), k.split(2, dim=1), v.split(2, dim=1), strict=True):
            sim = torch.einsum("b h i d, b h j d -> b h i j", qc * self.scale, kc)
            attn = sim.masked_fill(masked, -torch.finfo(sim.dtype).max).softmax(dim=-1)
            out.append(torch.einsum("b h i j, b h j d -> b h i d", attn, vc))
        return self.to_out(torch.cat(out, dim=1).transpose(1, 2).flatten(2))
