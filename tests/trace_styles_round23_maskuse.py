"""Round 23's mask read from its use: the argument that takes a --mask file is named without "mask" (a graph's
adjacency, a BERT-like `valid` key padding made into an additive bias, a prefix LM's `visible` pattern handed to
F.scaled_dot_product_attention), and trace reads it as the mask where the code applies it to its scores. Plants:
the mask after the softmax, on the queries, transposed; the keys and values swapped. And a module whose optional
argument is no mask (a temperature): the file then goes to no argument."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


class GraphAttention(nn.Module):
    """A dense graph transformer layer (a GAT/Graphormer-like node attention): `adj` [n, n], 1 where node i may
    attend to node j, the others filled with -inf."""

    def __init__(self, dim=16, heads=2, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.W_q, self.W_k, self.W_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.W_o = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, h, adj=None):
        B, N, D = h.shape
        q, k, v = (w(h).view(B, N, self.heads, -1).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        e = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads)
        if adj is not None and self.bug != "after_softmax":
            e = e.masked_fill(adj == 0, float("-inf"))
        a = torch.softmax(e, dim=-1)
        if adj is not None and self.bug == "after_softmax":
            a = a.masked_fill(adj == 0, 0.0)
        return self.W_o((a @ v).transpose(1, 2).reshape(B, N, D))


class ValidTokens(nn.Module):
    """A BERT-like self-attention whose key padding `valid` [B, S] (1 = a real token) is made into an additive bias
    itself, as get_extended_attention_mask does: (1 - valid) · finfo.min, added to the scores."""

    def __init__(self, hidden_size=16, num_attention_heads=2, bug=None):
        super().__init__()
        self.h, self.bug = num_attention_heads, bug
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.dense = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def forward(self, hidden_states, valid=None):
        B, S, H = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, S, self.h, -1).permute(0, 2, 1, 3)
                   for p in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(H // self.h)
        if valid is not None:
            keep = valid[:, None, :, None] if self.bug == "on_queries" else valid[:, None, None, :]
            scores = scores + (1.0 - keep.to(scores.dtype)) * torch.finfo(scores.dtype).min
        probs = F.softmax(scores, dim=-1)
        return self.dense(torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(B, S, H))


class PrefixLM(nn.Module):
    """A prefix LM's attention (a T5/UniLM-like visibility pattern handed to F.scaled_dot_product_attention):
    `visible` [n, n], True where query i sees key j; the fused projection of nanoGPT."""

    def __init__(self, n_embd=16, n_head=2, bug=None):
        super().__init__()
        self.n_head, self.bug = n_head, bug
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        _trained(self)

    def forward(self, x, visible=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        if self.bug == "kv_swapped":
            k, v = v, k
        if visible is not None and self.bug == "transposed":
            visible = visible.transpose(-1, -2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Tempered(nn.Module):
    """An attention with an optional temperature, and no mask at all: a --mask file has no argument to go to."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, temperature=None):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        t = math.sqrt(D // self.heads) if temperature is None else temperature
        a = (q @ k.transpose(-1, -2) / t).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(B, N, D))
