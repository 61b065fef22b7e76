"""Styles for tests/test_trace_round22_kvroles.py: which projection makes the keys and which the values, read from
the data flow. Correct code: a real shared-KV design (no value weight at all, `v = k`), a value weight held as an
nn.Parameter beside Linear layers, Linformer's sequence projections written on the left (`E.t() @ x`, the tokens'
axis contracted) before or after the key and value projections. Plants: the values taken from the keys where a value
projection exists and is left unused, the keys made by the value projection. Each takes `bug`."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(*linears: nn.Linear) -> None:
    """Move each Linear off its initial values."""
    with torch.no_grad():
        for i, linear in enumerate(linears):
            linear.weight.mul_(1.2 + 0.1 * i)
            if linear.bias is not None:
                linear.bias.add_(0.04 * (i + 1))


class BertSelf(nn.Module):
    """BERT's BertSelfAttention with BertSelfOutput's dense: query/key/value Linear layers, transpose_for_scores."""

    def __init__(self, hidden_size: int = 32, num_attention_heads: int = 4, bug: str = ""):
        super().__init__()
        self.num_attention_heads, self.attention_head_size = num_attention_heads, hidden_size // num_attention_heads
        self.bug = bug
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.dense = nn.Linear(hidden_size, hidden_size)
        _trained(self.query, self.key, self.value, self.dense)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        keys_by = self.value if self.bug == "keys_from_values" else self.key
        values_by = self.key if self.bug == "values_from_keys" else self.value
        key_layer = self.transpose_for_scores(keys_by(hidden_states))
        value_layer = self.transpose_for_scores(values_by(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return self.dense(context_layer.view(context_layer.size()[:-2] + (-1,)))  # [B, n, hidden]


class SharedKeyValue(nn.Module):
    """A shared-KV design: no value weight at all, the keys' projection read as the values (`value_layer =
    key_layer`), the scores `q @ k.transpose(-1, -2)`."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str = ""):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        _trained(self.to_q, self.to_k, self.to_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)  # [b, h, n, d_head]
        k = self.to_k(x).view(b, n, self.heads, -1).transpose(1, 2)
        v = k
        scale = 1.0 if self.bug == "no_scale" else q.shape[-1] ** -0.5
        attn = (q @ k.transpose(-1, -2) * scale).softmax(dim=-1)  # [b, h, n, n]
        return self.to_out((attn @ v).transpose(1, 2).reshape(b, n, d))


class ParamValue(nn.Module):
    """A from-scratch port: Linear layers for q, k and the output, the value weight an nn.Parameter [d_in, d_out]
    used as `x @ self.w_v`; F.scaled_dot_product_attention."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str = ""):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.w_v = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))
        self.o_proj = nn.Linear(dim, dim)
        _trained(self.q_proj, self.k_proj, self.o_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, -1).transpose(1, 2)  # [b, n, d] -> [b, h, n, d_head]

        q = heads(self.q_proj(x))
        k = heads(x @ self.w_v) if self.bug == "keys_from_values" else heads(self.k_proj(x))
        v = k if self.bug == "values_from_keys" else heads(x @ self.w_v)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))


class FairseqCross(nn.Module):
    """fairseq-like encoder-decoder attention, batch first: forward(query, key, value), q_proj(query) scaled by
    head_dim^-0.5, the keys and values from the encoder's states."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4, bug: str = ""):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        _trained(self.q_proj, self.k_proj, self.v_proj, self.out_proj)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        bsz, tgt_len, embed_dim = query.shape
        q = self.q_proj(query) * self.scaling
        k = self.v_proj(key) if self.bug == "keys_from_values" else self.k_proj(key)
        v = self.v_proj(value)
        q, k, v = (t.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        attn_probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # [bsz, heads, tgt_len, src_len]
        attn = (attn_probs @ v).transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn)


class ClonedLinears(nn.Module):
    """The Annotated Transformer's MultiHeadedAttention as self-attention: `clones(nn.Linear(d, d), 4)`, no name
    saying a role; the plant makes the keys with the third Linear (the values'), the second left unused."""

    def __init__(self, h: int = 4, d_model: int = 32, bug: str = ""):
        super().__init__()
        self.d_k, self.h, self.bug = d_model // h, h, bug
        self.linears = nn.ModuleList([copy.deepcopy(nn.Linear(d_model, d_model)) for _ in range(4)])
        _trained(*self.linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nbatches = x.size(0)
        split = [lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2) for lin in self.linears[:3]]
        query, key, value = split
        if self.bug == "keys_from_values":
            key = self.linears[2](x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(self.d_k)
        p_attn = scores.softmax(dim=-1)
        out = torch.matmul(p_attn, value).transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        return self.linears[-1](out)


class LinformerLeft(nn.Module):
    """Linformer (Wang et al.'s E and F, [n, k]) written as matrix products on the left: the input projected along
    its tokens, `E.t() @ x`, before the key and value projections (`shared`: after the keys' projection, one E for
    the keys and the values, Linformer's share_kv, `E.t() @ k`)."""

    def __init__(self, dim: int = 32, seq_len: int = 8, k: int = 4, heads: int = 4, shared: bool = False,
                 bug: str = ""):
        super().__init__()
        self.heads, self.k, self.shared, self.bug = heads, k, shared, bug
        g = torch.Generator().manual_seed(7)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.E = nn.Parameter(torch.randn(seq_len, k, generator=g) / math.sqrt(seq_len))
        if not shared:
            self.to_v = nn.Linear(dim, dim, bias=False)
            self.F = nn.Parameter(torch.randn(seq_len, k, generator=g) / math.sqrt(seq_len))
        self.to_out = nn.Linear(dim, dim)
        _trained(self.to_q, self.to_k, self.to_out, *((self.to_v,) if not shared else ()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        if self.shared:
            keys = self.E.t() @ self.to_k(x)  # [k, n] @ [b, n, d] -> [b, k, d]
            values = keys
        else:
            keys = self.to_k(self.E.t() @ x)  # the input's tokens projected to k, then its features
            values = self.to_v(self.F.t() @ x)
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, self.k, self.heads, -1).transpose(1, 2) for t in (keys, values))
        scale = d ** -0.5 if self.bug == "scale_dim" else q.shape[-1] ** -0.5
        attn = torch.einsum("bhid,bhjd->bhij", q, k).mul(scale).softmax(dim=-1)
        return self.to_out(torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2).reshape(b, n, d))
