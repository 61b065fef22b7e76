"""Attention that splits its heads into frames other than the plain batch-first `[n_batch, n_head, n, d_head]`, in
the forms real libraries write it (round 17's fairseq, round 16b's PatchTST and Flamingo) and Megatron-LM's, for
tests/test_trace_round18_split.py. Each takes `bug=None`: "q", "k", "v" or "all", the heads of that projection (of
all three) split by a view without the transpose or permute that moves the tokens in front of the heads."""

import torch
import torch.nn as nn


def _trained(module):
    """Every weight moved off its initial value (no norm weight of 1, no zero bias), the same way each time."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


class TimeFirstBaddbmm(nn.Module):
    """Megatron-LM's CoreAttention over its own projections: time-first [s, n_batch, hidden] in and out, each
    projection viewed [s, n_batch, n_head, head_dim], then [s, n_batch·n_head, head_dim], transposed to the batched
    heads only inside the products (`baddbmm(.., q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0,
    alpha=1/norm_factor)`, `bmm(probs, v.transpose(0, 1))`), the context viewed back [n_batch, n_head, s, head_dim]
    and permuted time-first."""

    def __init__(self, hidden_size=32, num_attention_heads=4, bug=None):
        super().__init__()
        self.np, self.hn, self.bug = num_attention_heads, hidden_size // num_attention_heads, bug
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.norm_factor = self.hn ** 0.5
        _trained(self)

    def _front(self, t, role):  # [s, n_batch·n_head, head_dim] -> [n_batch·n_head, s, head_dim]
        if self.bug in (role, "all"):
            return t.reshape(t.shape[1], t.shape[0], self.hn)
        return t.transpose(0, 1)

    def forward(self, query, key, value):
        sq, b, hidden = query.shape
        sk = key.shape[0]
        q = self.query(query).view(sq, b, self.np, self.hn).reshape(sq, b * self.np, self.hn)
        k = self.key(key).view(sk, b, self.np, self.hn).reshape(sk, b * self.np, self.hn)
        v = self.value(value).view(sk, b, self.np, self.hn).reshape(sk, b * self.np, self.hn)
        empty = torch.empty(b * self.np, sq, sk, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(empty, self._front(q, "q"), self._front(k, "k").transpose(1, 2), beta=0.0,
                               alpha=1.0 / self.norm_factor)  # [n_batch·n_head, s_q, s_k]
        probs = torch.softmax(scores.view(b, self.np, sq, sk), dim=-1)  # [n_batch, n_head, s_q, s_k]
        context = torch.bmm(probs.view(b * self.np, sq, sk), self._front(v, "v"))  # [n_batch·n_head, s_q, head_dim]
        context = context.view(b, self.np, sq, self.hn).permute(2, 0, 1, 3).contiguous().view(sq, b, hidden)
        return self.dense(context)


class HeadsFirstBatched(nn.Module):
    """attention-is-all-you-need-pytorch's first MultiHeadAttention: batch-first inputs, the heads moved in front of
    the batch, `permute(2, 0, 1, 3).view(-1, len, d_k)` ((n_head·n_batch) x len x d_k), a bmm attention with a
    temperature of √d_k, the output viewed back as [n_head, n_batch, len_q, d_v] and permuted to the rows."""

    def __init__(self, d_model=32, n_head=4, d_k=8, d_v=8, bug=None):
        super().__init__()
        self.n_head, self.d_k, self.d_v, self.bug = n_head, d_k, d_v, bug
        self.w_qs = nn.Linear(d_model, n_head * d_k)
        self.w_ks = nn.Linear(d_model, n_head * d_k)
        self.w_vs = nn.Linear(d_model, n_head * d_v)
        self.fc = nn.Linear(n_head * d_v, d_model)
        self.temperature = d_k ** 0.5
        _trained(self)

    def _heads(self, t, d, role):  # [n_batch, n, n_head·d] -> [n_head·n_batch, n, d]
        sz_b, length, _ = t.shape
        if self.bug in (role, "all"):
            return t.contiguous().view(-1, length, d)
        return t.view(sz_b, length, self.n_head, d).permute(2, 0, 1, 3).contiguous().view(-1, length, d)

    def forward(self, q, k, v):
        sz_b, len_q, _ = q.shape
        q = self._heads(self.w_qs(q), self.d_k, "q")
        k = self._heads(self.w_ks(k), self.d_k, "k")
        v = self._heads(self.w_vs(v), self.d_v, "v")
        attn = torch.bmm(q, k.transpose(1, 2)) / self.temperature  # [n_head·n_batch, n_Q, n_K]
        attn = torch.softmax(attn, dim=2)
        output = torch.bmm(attn, v)  # [n_head·n_batch, n_Q, d_v]
        output = output.view(self.n_head, sz_b, len_q, self.d_v)
        output = output.permute(1, 2, 0, 3).contiguous().view(sz_b, len_q, -1)
        return self.fc(output)


class KeysReady(nn.Module):
    """Batched heads with the keys laid ready for the product, as PatchTST's and some TF ports write it: q and v
    `[n_batch·n_head, n, d]`, k `[n_batch·n_head, d, n]` (one permute that moves the tokens last), `bmm(q, k)` with
    no transpose; a self-attention over x, the output merged back with a view after its transpose."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x):
        B, T, C = x.shape
        h, d = self.heads, C // self.heads
        if self.bug in ("q", "all"):
            q = self.query(x).reshape(B * h, T, d)
        else:
            q = self.query(x).view(B, T, h, d).transpose(1, 2).reshape(B * h, T, d)
        if self.bug in ("k", "all"):
            k = self.key(x).reshape(B * h, d, T)
        else:
            k = self.key(x).view(B, T, h, d).permute(0, 2, 3, 1).reshape(B * h, d, T)
        if self.bug in ("v", "all"):
            v = self.value(x).reshape(B * h, T, d)
        else:
            v = self.value(x).view(B, T, h, d).transpose(1, 2).reshape(B * h, T, d)
        att = torch.bmm(q, k) * d ** -0.5  # [n_batch·n_head, T, T]
        att = att.softmax(dim=-1)
        y = torch.bmm(att, v).view(B, h, T, d)  # [n_batch, n_head, T, d]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class RearrangeWrittenOut(nn.Module):
    """A lucidrains-style cross-attention with einops written out: the text normed before to_q, `rearrange(t,
    'b n (h d) -> b h n d')` as unflatten + movedim, one fused to_kv chunked in two, einsum for both products."""

    def __init__(self, dim=32, dim_head=8, heads=4, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        inner = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        _trained(self)

    def _rearrange(self, t, role):  # 'b n (h d) -> b h n d'
        if self.bug in (role, "all"):
            return t.reshape(t.shape[0], self.heads, t.shape[1], -1)
        return t.unflatten(-1, (self.heads, -1)).movedim(-2, 1)

    def forward(self, x, context):
        x = self.norm(x)
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = self._rearrange(q, "q"), self._rearrange(k, "k"), self._rearrange(v, "v")
        q = q * self.scale
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.movedim(1, -2).flatten(-2)  # 'b h n d -> b n (h d)'
        return self.to_out(out)
