"""Multi-head attention in conventions that are right for their models, each traced against a reference
told of it (docs/trace.md, "Biases, qk-norm and the scale"):

    attnscope trace docs/examples/conventions.py:BloomAttention --causal --alibi
    attnscope trace docs/examples/conventions.py:TimmAttention --causal --qk-norm
    attnscope trace docs/examples/conventions.py:Llama4NormAttention --causal
    attnscope trace docs/examples/conventions.py:Llama4NopeAttention --causal
    attnscope trace docs/examples/conventions.py:LocalWindowAttention --window 4 --window-side both
    attnscope trace docs/examples/conventions.py:T5Attention --causal --scale 1 --nq 6 \
        --position-bias docs/examples/t5_bias.npy
"""

import math

import torch
import torch.nn as nn


def alibi_slopes(n_head):
    """BLOOM's slopes: 2^(-8/n_head), its powers, one a head."""
    start = 2 ** (-8 / n_head)
    return torch.tensor([start ** (h + 1) for h in range(n_head)])


class Attention(nn.Module):
    """The plain causal multi-head attention the three below change one line of."""

    def __init__(self, d_feat=32, n_head=4):
        super().__init__()
        self.n_head, self.d_head = n_head, d_feat // n_head
        self.q_proj = nn.Linear(d_feat, d_feat)
        self.k_proj = nn.Linear(d_feat, d_feat)
        self.v_proj = nn.Linear(d_feat, d_feat)
        self.o_proj = nn.Linear(d_feat, d_feat)

    def heads(self, x):
        B, T, _ = x.shape
        split = [p(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)  # [B, n_head, T, d_head]
                 for p in (self.q_proj, self.k_proj, self.v_proj)]
        return split

    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # [B, n_head, T, T]

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.heads(x)
        scores = self.scores(q, k)
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))
        scores = scores.masked_fill(~allowed, float("-inf"))
        y = scores.softmax(dim=-1) @ v  # [B, n_head, T, d_head]
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # [B, T, d_feat]


class BloomAttention(Attention):
    """BLOOM's ALiBi: scores + m_h · j (the paper's -m_h · (i - j) less a constant per row)."""

    def scores(self, q, k):
        T = q.shape[-2]
        return super().scores(q, k) + alibi_slopes(self.n_head)[:, None, None] * torch.arange(T)


class TimmAttention(Attention):
    """timm's qk_norm=True with an RMSNorm: q and k normalized over d_head before the scores."""

    def __init__(self, d_feat=32, n_head=4):
        super().__init__(d_feat, n_head)
        self.q_norm = nn.RMSNorm(self.d_head, eps=1e-6)
        self.k_norm = nn.RMSNorm(self.d_head, eps=1e-6)
        with torch.no_grad():  # weights as training leaves them, not ones
            self.q_norm.weight.normal_(1.0, 0.3)
            self.k_norm.weight.normal_(1.0, 0.3)

    def scores(self, q, k):
        return super().scores(self.q_norm(q), self.k_norm(k))


class T5Attention(Attention):
    """T5: no 1/sqrt(d_head), a position bias added to the scores (here the one in t5_bias.npy)."""

    def scores(self, q, k):
        T = q.shape[-2]
        return q @ k.transpose(-2, -1) + 0.1 * (torch.arange(T)[None, :] - torch.arange(T)[:, None]).float()


class L2Norm(nn.Module):
    """Llama 4's Llama4TextL2Norm: an RMSNorm without weights, x · rsqrt(mean(x²) + eps)."""

    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Llama4NormAttention(Attention):
    """Llama 4's qk-norm: q and k normalized by a norm that holds no weights (read from what it computes)."""

    def __init__(self, d_feat=32, n_head=4):
        super().__init__(d_feat, n_head)
        self.qk_norm = L2Norm(1e-5)

    def scores(self, q, k):
        return super().scores(self.qk_norm(q), self.qk_norm(k))


class Llama4NopeAttention(Attention):
    """Llama 4's NoPE layers' attention temperature tuning: each query scaled by log1p(floor((i + 1) / floor_scale))
    · attn_scale + 1 at its position i (floor_scale 8192 in Llama 4; 2 here, so that a short text shows it)."""

    def __init__(self, d_feat=32, n_head=4, floor_scale=2, attn_scale=0.5):
        super().__init__(d_feat, n_head)
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def scores(self, q, k):
        positions = torch.arange(q.shape[-2], dtype=torch.float32)
        attn_scales = torch.log1p(torch.floor((positions + 1) / self.floor_scale)) * self.attn_scale + 1
        return super().scores(q * attn_scales[:, None], k)


class LocalWindowAttention(Attention):
    """ModernBERT's local layers: forward takes attention_mask and sliding_window_mask (additive, [.., n, n]) and
    reads the window's alone."""

    def forward(self, x, attention_mask=None, sliding_window_mask=None):
        B, T, C = x.shape
        q, k, v = self.heads(x)
        scores = self.scores(q, k) + sliding_window_mask
        y = scores.softmax(dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))
