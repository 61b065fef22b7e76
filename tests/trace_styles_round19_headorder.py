"""The order of the per-head steps between the projections and the scores (qk-norm, RoPE, the split into heads, a
swap), for tests/test_trace_round19_headorder.py. Each takes `bug=None`: `kv_swapped` (the key and value
projections' outputs swapped before anything else: the code rotates, and norms, its "keys", the value projection's
output), `kv_swapped_normed` (`EinsumRmsAfter`: swapped after the norm, before RoPE), `split_qk`, `split_kv`,
`split_qv` (two of q, k, v viewed straight into heads without the transpose, the
third split right), which trace names by experiment.

- `RotatedLayerNorm`: transformers-like GQA (`q_proj`, `k_proj`, `v_proj`, an output projection named `proj`,
  which names no role), rotate_half RoPE from cos/sin tables, then an `nn.LayerNorm(head_dim)` with a weight and a
  bias on each rotated head (after RoPE, where Qwen3 and OLMo norm before it), `repeat_kv`, eager softmax.
- `EinsumRmsAfter`: heads by einsum over a weight reshaped `[dim, n_head, d_head]` (`wq`, `wk`, `wv`, `c_proj`),
  GPT-J's interleaved RoPE in `[b, n, h, d]`, an `nn.RMSNorm(head_dim)` with a weight after it (`late=True`) or
  before it (`late=False`), `F.scaled_dot_product_attention(..., enable_gqa=True)`.
- `CohereHeads`: Cohere's qk-norm, a LayerNorm of each head over d_head with a weight `[n_head, d_head]` and no bias
  (`CohereLayerNorm`), on q and k laid `[b, n, h, d]`, before RoPE (`late=False`) or after it; RoPE by a complex
  product (interleaved pairs); an output projection named `mix`.
- `Anonymous`: four Linear layers in a ModuleList (no name says a role, the data flow holds the weights), an
  RMSNorm with a weight per head before RoPE; `bug='kv_swapped_normed'` swaps keys and values after the norm and
  before RoPE (the scores read a projection rotated, never normed; the pattern multiplies the normed one).
- `Olmo2Proj`: OLMo 2's q_norm and k_norm, RMSNorms over the whole projection before the split (`nn.RMSNorm(n_head
  · d_head)`), then the split by `unflatten`/`transpose`, rotate_half RoPE, SDPA with repeated key/value heads.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def _grown(module, seed):
    """Move every weight off its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _angles(n, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d / 2]
    return torch.outer(torch.arange(n, dtype=torch.float64), inv)  # [n, d / 2]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """x `[b, h, n, d]`, cos and sin `[n, d]` (each angle twice, the halves paired)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep):
    b, h, n, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)  # [b, h·n_rep, n, d]


def _wrong_split(t, b, n, heads, d):
    """[b, n, heads·d] viewed straight as [b, heads, n, d], without the transpose."""
    return t.reshape(b, heads, n, d)


class RotatedLayerNorm(nn.Module):
    """q, k, v projected and split `[b, h, n, d]`, rotated, then LayerNormed per head with a weight and a bias."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.bug, self.n_head, self.n_kv_head, self.head_dim = bug, n_head, n_kv_head, dim // n_head
        d = self.head_dim
        self.q_proj = nn.Linear(dim, n_head * d)
        self.k_proj = nn.Linear(dim, n_kv_head * d)
        self.v_proj = nn.Linear(dim, n_kv_head * d)
        self.proj = nn.Linear(n_head * d, dim)
        self.q_norm = nn.LayerNorm(d)
        self.k_norm = nn.LayerNorm(d)
        _grown(self, 1)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.bug == "kv_swapped":
            key, value = value, key
        shapes = ((query, self.n_head), (key, self.n_kv_head), (value, self.n_kv_head))
        q, k, v = (t.view(b, n, h, self.head_dim).transpose(1, 2) for t, h in shapes)  # [b, h, n, d]
        wrong = {"split_qk": "qk", "split_kv": "kv", "split_qv": "qv"}.get(self.bug, "")
        if "q" in wrong:
            q = _wrong_split(query, b, n, self.n_head, self.head_dim)
        if "k" in wrong:
            k = _wrong_split(key, b, n, self.n_kv_head, self.head_dim)
        if "v" in wrong:
            v = _wrong_split(value, b, n, self.n_kv_head, self.head_dim)
        angles = _angles(n, self.head_dim).to(q.dtype)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # [n, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = self.q_norm(q), self.k_norm(k)  # on the rotated heads
        group = self.n_head // self.n_kv_head
        k, v = repeat_kv(k, group), repeat_kv(v, group)  # [b, n_head, n, d]
        scores = q @ k.transpose(2, 3) / self.head_dim ** 0.5  # [b, n_head, n, n]
        causal = torch.full((n, n), float("-inf"), dtype=q.dtype).triu(1)
        weights = (scores + causal).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)  # [b, n, n_head·d]
        return self.proj(out)


def _interleaved(x, angles):
    """GPT-J's rotate_every_two on x `[b, n, h, d]`, angles `[n, d / 2]`."""
    cos = angles.cos().repeat_interleave(2, -1)[None, :, None, :].to(x.dtype)  # [1, n, 1, d]
    sin = angles.sin().repeat_interleave(2, -1)[None, :, None, :].to(x.dtype)
    turned = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + turned * sin


class EinsumRmsAfter(nn.Module):
    """Projections by einsum straight into heads `[b, n, h, d]`; interleaved RoPE; an RMSNorm with a weight over
    each head after the rotation (or before it); the kernel groups the key/value heads itself."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, late=True, bug=None):
        super().__init__()
        self.bug, self.late, self.h, self.kv, self.d = bug, late, n_head, n_kv_head, dim // n_head
        self.wq = nn.Linear(dim, n_head * self.d, bias=False)
        self.wk = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.wv = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.c_proj = nn.Linear(n_head * self.d, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.d, eps=1e-6)
        self.k_norm = nn.RMSNorm(self.d, eps=1e-6)
        _grown(self, 2)

    def _heads(self, x, linear, heads, wrong):
        b, n, _ = x.shape
        weight = linear.weight.t().reshape(x.shape[-1], heads, self.d)  # [dim, h, d]
        if wrong:  # the projection viewed straight as [b, h, n, d], then laid [b, n, h, d] as the rest are
            return torch.einsum("bnc,chd->bnhd", x, weight).reshape(b, heads, n, self.d).transpose(1, 2)
        return torch.einsum("bnc,chd->bnhd", x, weight)  # [b, n, h, d]

    def forward(self, x):
        b, n, _ = x.shape
        wrong = {"split_qk": "qk", "split_kv": "kv", "split_qv": "qv"}.get(self.bug, "")
        kw, vw = (self.wv, self.wk) if self.bug == "kv_swapped" else (self.wk, self.wv)
        q = self._heads(x, self.wq, self.h, "q" in wrong)
        k = self._heads(x, kw, self.kv, "k" in wrong)
        v = self._heads(x, vw, self.kv, "v" in wrong)
        angles = _angles(n, self.d)
        if not self.late:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.bug == "kv_swapped_normed":  # after the norm, before RoPE
            k, v = v, k
        q, k = _interleaved(q, angles), _interleaved(k, angles)
        if self.late:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)  # [b, h, n, d]
        return self.c_proj(y.transpose(1, 2).reshape(b, n, self.h * self.d))


class CohereLayerNorm(nn.Module):
    """transformers' CohereLayerNorm: the mean taken out, no bias, a weight of any shape over the last axes."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.to(torch.float32) * hidden_states).to(dtype)


class CohereHeads(nn.Module):
    """q and k laid `[b, n, h, d]` and normed by CohereLayerNorm((h, d)) before RoPE (or after it), RoPE as a
    complex product of neighbouring pairs, heads grouped by repeat_interleave, an output projection named `mix`."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, late=False, bug=None):
        super().__init__()
        self.bug, self.late, self.h, self.kv, self.d = bug, late, n_head, n_kv_head, dim // n_head
        self.q_proj = nn.Linear(dim, n_head * self.d, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.mix = nn.Linear(n_head * self.d, dim, bias=False)
        self.q_norm = CohereLayerNorm((n_head, self.d))
        self.k_norm = CohereLayerNorm((n_kv_head, self.d))
        _grown(self, 3)

    def _turn(self, x):  # x [b, n, h, d]
        n = x.shape[1]
        z = torch.view_as_complex(x.double().unflatten(-1, (self.d // 2, 2)).contiguous())  # [b, n, h, d / 2]
        angles = _angles(n, self.d)[None, :, None, :]
        return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2).to(x.dtype)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.bug == "kv_swapped":
            k, v = v, k
        wrong = {"split_qk": "qk", "split_kv": "kv", "split_qv": "qv"}.get(self.bug, "")
        laid = []
        for t, heads, role in ((q, self.h, "q"), (k, self.kv, "k"), (v, self.kv, "v")):
            # [b, n, h, d], or viewed straight as [b, h, n, d] and read as though it were [b, n, h, d]
            laid.append(t.view(b, heads, n, self.d).transpose(1, 2) if role in wrong else t.view(b, n, heads, self.d))
        q, k, v = laid
        if not self.late:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._turn(q), self._turn(k)
        if self.late:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, n, d]
        group = self.h // self.kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.d ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.matmul(scores.softmax(-1), v)  # [b, h, n, d]
        return self.mix(out.transpose(1, 2).reshape(b, n, -1))


class Olmo2Proj(nn.Module):
    """OLMo 2's norms over the whole projection before the split, then rotate_half RoPE and SDPA over repeated
    key/value heads; the output projection `o_proj`."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.bug, self.h, self.kv, self.d = bug, n_head, n_kv_head, dim // n_head
        self.q_proj = nn.Linear(dim, n_head * self.d, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.o_proj = nn.Linear(n_head * self.d, dim, bias=False)
        self.q_norm = nn.RMSNorm(n_head * self.d, eps=1e-6)
        self.k_norm = nn.RMSNorm(n_kv_head * self.d, eps=1e-6)
        _grown(self, 4)

    def forward(self, x):
        b, n, _ = x.shape
        keys, values = (self.v_proj, self.k_proj) if self.bug == "kv_swapped" else (self.k_proj, self.v_proj)
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(keys(x)), values(x)
        wrong = {"split_qk": "qk", "split_kv": "kv", "split_qv": "qv"}.get(self.bug, "")
        q, k, v = (_wrong_split(t, b, n, t.shape[-1] // self.d, self.d) if role in wrong
                   else t.unflatten(-1, (-1, self.d)).transpose(1, 2)  # [b, h, n, d]
                   for t, role in ((q, "q"), (k, "k"), (v, "v")))
        angles = _angles(n, self.d).to(q.dtype)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.h // self.kv
        y = F.scaled_dot_product_attention(q, repeat_kv(k, group), repeat_kv(v, group), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))


class Anonymous(nn.Module):
    """q, k, v and the output from `self.lins`, by position; heads split by view/transpose, RMSNorm, RoPE, SDPA."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.bug, self.h, self.kv, self.d = bug, n_head, n_kv_head, dim // n_head
        widths = (n_head * self.d, n_kv_head * self.d, n_kv_head * self.d)
        self.lins = nn.ModuleList([nn.Linear(dim, w, bias=False) for w in widths] + [nn.Linear(widths[0], dim)])
        self.norms = nn.ModuleList([nn.RMSNorm(self.d, eps=1e-6), nn.RMSNorm(self.d, eps=1e-6)])
        _grown(self, 5)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, -1, self.d).transpose(1, 2) for lin in self.lins[:3])  # [b, h, n, d]
        q, k = self.norms[0](q), self.norms[1](k)
        if self.bug == "kv_swapped_normed":
            k, v = v, k
        angles = _angles(n, self.d).to(q.dtype)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.lins[3](y.transpose(1, 2).reshape(b, n, -1))
