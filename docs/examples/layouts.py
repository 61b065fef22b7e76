"""Weights laid out as checkpoints and tutorials lay them out, traced in docs/trace.md ("How conventions are read"):
CodeGen's fused qkv_proj (4 blocks, each q | v | k), BEiT's qkv with its bias cat(q_bias, zeros, v_bias), Karpathy's MultiHeadAttention of Head modules (one softmax per
head, outputs concatenated), and Flax's MultiHeadDotProductAttention (DenseGeneral kernels [d, n_head, d_head] in,
[n_head, d_head, d] out, contracted by einsum).
"""

import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class CodeGenAttention(nn.Module):
    """CodeGen: qkv_proj's output in mp_num = 4 blocks, each holding q | v | k for n_head / 4 heads."""
    swapped = False

    def __init__(self, embed_dim=64, num_heads=8):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        head_dim, mp_num = self.embed_dim // self.num_heads, 4
        qkv = self.qkv_proj(x).reshape(b, n, mp_num, -1)
        query, value, key = torch.split(qkv, self.embed_dim // mp_num, dim=-1)
        if self.swapped:
            key, value = value, key
        query, key, value = (t.reshape(b, n, self.num_heads, head_dim).transpose(1, 2) for t in (query, key, value))
        scores = query @ key.transpose(-1, -2) / math.sqrt(head_dim)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out_proj((weights @ value).transpose(1, 2).reshape(b, n, self.embed_dim))


class CodeGenKVSwapped(CodeGenAttention):
    """The same split, its parts then used the other way round: the keys from what the code named value."""
    swapped = True


class Head(nn.Module):
    def __init__(self, n_embd, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(16, 16)))

    def forward(self, x):
        T = x.shape[1]
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = F.softmax(wei.masked_fill(self.tril[:T, :T] == 0, float("-inf")), dim=-1)
        return wei @ self.value(x)


class MultiHeadAttention(nn.Module):
    """Karpathy's "Let's build GPT": a ModuleList of heads, each with its own key, query and value."""
    head = Head

    def __init__(self, num_heads=4, head_size=8, n_embd=32):
        super().__init__()
        self.heads = nn.ModuleList([self.head(n_embd, head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class HeadScaledByC(Head):
    def forward(self, x):  # the video's first version: C**-0.5, C = n_embd, not head_size
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * C ** -0.5
        wei = F.softmax(wei.masked_fill(self.tril[:T, :T] == 0, float("-inf")), dim=-1)
        return wei @ self.value(x)


class ScaledByC(MultiHeadAttention):
    head = HeadScaledByC


class DenseGeneral(nn.Module):
    def __init__(self, shape_in, features):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(*shape_in, *features) / math.sqrt(math.prod(shape_in)))
        self.bias = nn.Parameter(torch.randn(*features) / 10)


class FlaxAttention(nn.Module):
    """Flax's MultiHeadDotProductAttention, ported: kernels [d, n_head, d_head] and [n_head, d_head, d].
    bug="values_from_keys" projects the values with key.kernel, value.kernel left unused."""

    def __init__(self, num_heads=4, qkv_features=32, bug=None):
        super().__init__()
        head_dim, self.bug = qkv_features // num_heads, bug
        self.query = DenseGeneral((qkv_features,), (num_heads, head_dim))
        self.key = DenseGeneral((qkv_features,), (num_heads, head_dim))
        self.value = DenseGeneral((qkv_features,), (num_heads, head_dim))
        self.out = DenseGeneral((num_heads, head_dim), (qkv_features,))

    def forward(self, inputs_q, mask=None):
        query = torch.einsum("...d,dhk->...hk", inputs_q, self.query.kernel) + self.query.bias
        key = torch.einsum("...d,dhk->...hk", inputs_q, self.key.kernel) + self.key.bias
        values = self.key if self.bug == "values_from_keys" else self.value  # the slip: key.kernel twice
        value = torch.einsum("...d,dhk->...hk", inputs_q, values.kernel) + values.bias
        query = query / math.sqrt(query.shape[-1])
        weights = torch.einsum("...qhd,...khd->...hqk", query, key)
        if mask is not None:
            weights = torch.where(mask, weights, torch.finfo(weights.dtype).min)
        x = torch.einsum("...hqk,...khd->...qhd", weights.softmax(-1), value)
        return torch.einsum("...hk,hko->...o", x, self.out.kernel) + self.out.bias


class ZeroKeyBias(nn.Module):
    """BEiT's (and Swin v2's, data2vec's) qkv: no bias in the Linear, q_bias and v_bias learned, the keys' a zero."""
    renamed = False

    def __init__(self, dim=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.renamed:
            q, v, k = qkv[0], qkv[1], qkv[2]
        else:
            q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * (C // self.num_heads) ** -0.5) @ k.transpose(-2, -1)
        return self.proj((attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, C))


class ZeroKeyBiasRenamed(ZeroKeyBias):
    """The unpacking names qkv[1] v and qkv[2] k: the values read the block whose bias is the zero."""
    renamed = True
