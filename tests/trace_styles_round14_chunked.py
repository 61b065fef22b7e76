"""Attention that never builds the whole scores, in the forms real code writes it (round 14a's lucidrains
memory-efficient attention), for tests/test_trace_round14_chunked.py: blocks of queries and keys, each block's
exp(scores − max) and weighted values, renormalized by the global max (Rabe & Staats); flash-attention's running max
and sum in a PyTorch loop; blocks' softmaxes merged by their logsumexp. Each takes `bug=None`: a planted mistake."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _split(t, h):  # [b, n, h·d] -> [b, h, n, d]
    b, n, _ = t.shape
    return t.view(b, n, h, -1).transpose(1, 2)


def _merge(t):  # [b, h, n, d] -> [b, n, h·d]
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


class MemoryEfficient(nn.Module):
    """Rabe & Staats' chunked attention as lucidrains writes it: to_q, a fused to_kv chunked in two, buckets of
    queries and keys, a key padding mask (True = keep), a causal rule by global positions, blocks wholly in the
    future skipped."""

    def __init__(self, dim=32, heads=4, causal=False, bucket=3, bug=None):
        super().__init__()
        self.heads, self.causal, self.bucket, self.bug = heads, causal, bucket, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, dim * 2, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        q = _split(self.to_q(x), self.heads)
        k, v = (_split(t, self.heads) for t in self.to_kv(x).chunk(2, dim=-1))
        if self.bug == "values_from_keys":
            v = k
        q = q * q.shape[-1] ** -0.5
        out = []
        for qs in range(0, q.shape[-2], self.bucket):
            q_chunk = q[..., qs:qs + self.bucket, :]
            sums, values, maxes = [], [], []
            for ks in range(0, k.shape[-2], self.bucket):
                if self.causal and ks > qs + q_chunk.shape[-2] - 1:  # a block wholly in the future: skipped
                    continue
                weight = torch.einsum("bhid,bhjd->bhij", q_chunk, k[..., ks:ks + self.bucket, :])
                fill = -torch.finfo(weight.dtype).max
                if mask is not None:
                    weight = weight.masked_fill(~mask[:, None, None, ks:ks + self.bucket], fill)
                if self.causal:
                    i = torch.arange(qs, qs + weight.shape[-2])[:, None]
                    j = torch.arange(ks, ks + weight.shape[-1])[None, :]
                    step = 1 if self.bug == "causal_off_by_one" else 0
                    weight = weight.masked_fill(j > i + step, fill)
                weight_max = weight.amax(dim=-1, keepdim=True).detach()
                exp_weight = (weight - weight_max).exp()
                if self.bug == "dropout_on":  # lucidrains' F.dropout(exp_weight, p=dropout), training left on
                    exp_weight = F.dropout(exp_weight, p=0.1)
                sums.append(exp_weight.sum(dim=-1))
                values.append(torch.einsum("bhij,bhjd->bhid", exp_weight, v[..., ks:ks + self.bucket, :]))
                maxes.append(weight_max.squeeze(-1))
            maxes = torch.stack(maxes, dim=-1)
            renorm = (maxes - maxes.amax(dim=-1, keepdim=True)).exp()
            total = (torch.stack(sums, dim=-1) * renorm).sum(dim=-1)
            weighted = (torch.stack(values, dim=-1) * renorm[..., None, :]).sum(dim=-1)
            out.append(weighted / total[..., None])
        return self.to_out(_merge(torch.cat(out, dim=-2)))


class FlashLoop(nn.Module):
    """FlashAttention's forward written in PyTorch over blocks of keys: a running max m, a running sum l and an
    accumulator rescaled as each block comes in; a fused qkv Linear and proj, as timm's blocks hold them."""

    def __init__(self, dim=32, num_heads=4, causal=False, block=4, bug=None):
        super().__init__()
        self.num_heads, self.causal, self.block, self.bug = num_heads, causal, block, bug
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        scale = 1.0 if self.bug == "scale_none" else (C // self.num_heads) ** -0.5
        m = torch.full((B, self.num_heads, N, 1), -math.inf)
        l_sum = torch.zeros(B, self.num_heads, N, 1)
        acc = torch.zeros_like(q)
        rows = torch.arange(N)[:, None]
        for start in range(0, N, self.block):
            s = q @ k[:, :, start:start + self.block].transpose(-2, -1) * scale
            if self.causal:
                cols = torch.arange(start, start + s.shape[-1])[None, :]
                s = s.masked_fill(cols > rows + (1 if self.bug == "causal_off_by_one" else 0), -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            l_sum = alpha * l_sum + p.sum(dim=-1, keepdim=True)
            if self.bug == "dropout_on":  # flash-attention drops the weights, never their sum
                p = F.dropout(p, p=0.1)
            acc = alpha * acc + p @ v[:, :, start:start + self.block]
            m = m_new
        out = acc / l_sum
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class LogSumExpMerge(nn.Module):
    """Blocks of keys attended apart, each block's softmax and its logsumexp, merged by their weights
    exp(lse_block − lse): split-KV (flash-decoding's) in PyTorch, with q_proj/k_proj/v_proj/o_proj."""

    def __init__(self, hidden_size=32, num_heads=4, block=3, bug=None):
        super().__init__()
        self.num_heads, self.block, self.bug = num_heads, block, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        q = _split(self.q_proj(hidden_states), self.num_heads)
        k = _split(self.k_proj(hidden_states), self.num_heads)
        v = _split(self.v_proj(hidden_states), self.num_heads)
        if self.bug == "kv_swapped":
            k, v = v, k
        outs, lses = [], []
        for start in range(0, k.shape[-2], self.block):
            s = q @ k[..., start:start + self.block, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
            lses.append(torch.logsumexp(s, dim=-1))
            outs.append(F.softmax(s, dim=-1) @ v[..., start:start + self.block, :])
        lse = torch.logsumexp(torch.stack(lses, dim=-1), dim=-1)
        weights = torch.exp(torch.stack(lses, dim=-1) - lse[..., None])  # [b, h, n, blocks]
        out = (torch.stack(outs, dim=-1) * weights[..., None, :]).sum(dim=-1)
        return self.o_proj(_merge(out))
