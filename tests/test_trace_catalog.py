"""`attnscope trace` names a planted mistake only by experiment (issue 41, part B): every entry of the catalog
(usertrace/experiments.py) is planted in at least three code styles written here, each in the way people write it:

- `bert`: BERT's self-attention (query/key/value/dense, `transpose_for_scores`), grouped-query where asked;
- `fused`: one fused q|k|v Linear split by width (nanoGPT, litgpt's grouped widths), `view` + `transpose`;
- `diffusers`: diffusers' `Attention` with `head_to_batch_dim`: heads folded into the batch, `[n_batch·n_head, n, d]`;
- `function`: a plain function of q, k, v `[n_batch, n_head, n, d]`.

The four share the attention's lines (scores, bias, mask, softmax, mix), so a mistake is planted the same way in
each. Every correct style is checked against F.scaled_dot_product_attention holding its weights (a reference that
shares no attnscope code) and exits 0; every planted one computes another output than its correct self, exits 1,
and `first_divergence.experiment` names the catalog's entry: the rerun of the reference with that mistake gave
back the code's own tensors.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, write

from attnscope.usertrace.experiments import CATALOG

HEADER = '''import math
import torch
import torch.nn as nn
import torch.nn.functional as F


def rope(x, start=0, base=10000.0, table="cat", rotary=None, over=None):
    """transformers' rotate_half RoPE (table="il": the angles laid out for the interleaved pairing)."""
    T, d = x.shape[-2], x.shape[-1]
    r = d if rotary is None else rotary
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float32) / (over or r))
    angle = torch.arange(start, start + T, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((angle, angle), -1) if table == "cat" else angle.repeat_interleave(2, -1)
    part, rest = x[..., :r], x[..., r:]
    x1, x2 = part.chunk(2, -1)
    return torch.cat((part * emb.cos() + torch.cat((-x2, x1), -1) * emb.sin(), rest), -1)


def rope_il(x, start=0, base=10000.0):
    """GPT-J's interleaved pairing: (0, 1), (2, 3), ..."""
    T, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = (torch.arange(start, start + T, dtype=torch.float32)[:, None] * inv).repeat_interleave(2, -1)
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return x * angle.cos() + turned * angle.sin()


def alibi(n_head, T, S, symmetric=False):
    """ALiBi's -m_h * (i - j), the new queries at S - T on."""
    m = torch.tensor([2 ** (-8 * (h + 1) / n_head) for h in range(n_head)])
    i, j = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
    distance = (i - j).abs() if symmetric else i - j
    return -m[:, None, None] * distance.float()


def t5(T, S):
    i, j = torch.arange(T)[:, None].float(), torch.arange(S)[None, :].float()
    return 0.5 * torch.sin(0.9 * i - 0.4 * j) + 0.2 * (j - i)
'''

CORE = '''P = 0 if kv_cache is None else kv_cache[0].shape[-2]
pass  # ROPE
if kv_cache is not None:
    k = torch.cat([fold(kv_cache[0]), k], dim=-2)  # CATK
    v = torch.cat([fold(kv_cache[1]), v], dim=-2)  # CATV
S = k.shape[-2]
k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # REPK
v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)  # REPV
scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # SCORES
pass  # BIAS
allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # MASK
scores = scores.masked_fill(~allowed, float("-inf"))  # FILL
weights = scores.softmax(dim=-1)  # SOFTMAX
pass  # AFTER
y = weights @ v  # MIX'''


def core(indent: int) -> str:
    return "\n".join(" " * indent + line for line in CORE.splitlines())


STYLES = {
    "bert": HEADER + '''

class Attention(nn.Module):
    def __init__(self, d_feat=32, n_head=4, n_kv_head=4):
        super().__init__()
        self.n_head, self.n_kv_head, self.d_head = n_head, n_kv_head, d_feat // n_head
        self.query = nn.Linear(d_feat, d_feat)
        self.key = nn.Linear(d_feat, n_kv_head * self.d_head)
        self.value = nn.Linear(d_feat, n_kv_head * self.d_head)
        self.dense = nn.Linear(d_feat, d_feat)
        pass  # LARGE

    def transpose_for_scores(self, x, n):
        B, T, _ = x.shape
        return x.view(B, T, n, self.d_head).permute(0, 2, 1, 3)  # SPLIT

    def forward(self, hidden_states, kv_cache=None):
        B, T, C = hidden_states.shape
        H = self.n_head
        heads = fold = lambda t: t
        q = self.transpose_for_scores(self.query(hidden_states), self.n_head)
        k = self.transpose_for_scores(self.key(hidden_states), self.n_kv_head)
        v = self.transpose_for_scores(self.value(hidden_states), self.n_kv_head)
''' + core(8) + '''
        y = y.permute(0, 2, 1, 3).contiguous().view(B, T, C)  # MERGE
        return self.dense(y)
''',
    "fused": HEADER + '''

class Attention(nn.Module):
    def __init__(self, d_feat=32, n_head=4, n_kv_head=4):
        super().__init__()
        self.n_head, self.n_kv_head, self.d_head = n_head, n_kv_head, d_feat // n_head
        self.c_attn = nn.Linear(d_feat, d_feat + 2 * n_kv_head * self.d_head)
        self.c_proj = nn.Linear(d_feat, d_feat)
        pass  # LARGE

    def forward(self, x, kv_cache=None):
        B, T, C = x.shape
        H = self.n_head
        heads = fold = lambda t: t
        kv = self.n_kv_head * self.d_head
        q, k, v = self.c_attn(x).split([C, kv, kv], dim=2)
        q = q.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # SPLIT
        k = k.view(B, T, self.n_kv_head, self.d_head).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.d_head).transpose(1, 2)
''' + core(8) + '''
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # MERGE
        return self.c_proj(y)
''',
    "diffusers": HEADER + '''

class Attention(nn.Module):
    def __init__(self, query_dim=32, heads=4, dim_head=8):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_v = nn.Linear(query_dim, heads * dim_head, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * dim_head, query_dim), nn.Dropout(0.0)])
        pass  # LARGE

    def head_to_batch_dim(self, t):
        B, T, C = t.shape
        return t.reshape(B, T, self.heads, C // self.heads).permute(0, 2, 1, 3).reshape(B * self.heads, T, -1)  # SPLIT

    def batch_to_head_dim(self, t):
        BH, T, D = t.shape
        return t.reshape(BH // self.heads, self.heads, T, D).permute(0, 2, 1, 3).reshape(BH // self.heads, T, -1)  # MERGE

    def forward(self, hidden_states, kv_cache=None):
        B, T, C = hidden_states.shape
        H = self.heads
        heads = lambda b: b.repeat(B, 1, 1) if b.dim() == 3 else b
        fold = lambda c: c.reshape(B * H, c.shape[-2], c.shape[-1])
        q = self.head_to_batch_dim(self.to_q(hidden_states))
        k = self.head_to_batch_dim(self.to_k(hidden_states))
        v = self.head_to_batch_dim(self.to_v(hidden_states))
''' + core(8) + '''
        y = self.batch_to_head_dim(y)
        return self.to_out[1](self.to_out[0](y))
''',
    "classic": HEADER + '''

class Attention(nn.Module):
    def __init__(self, d_feat=32, n_head=4):
        super().__init__()
        self.h, self.d_k = n_head, d_feat // n_head
        self.W_q, self.W_k = nn.Linear(d_feat, d_feat), nn.Linear(d_feat, d_feat)
        self.W_v, self.W_o = nn.Linear(d_feat, d_feat), nn.Linear(d_feat, d_feat)

    def forward(self, query, key, value, kv_cache=None):
        B, T, C = query.shape
        H = self.h
        heads = fold = lambda t: t
        q = self.W_q(query).view(B, -1, H, self.d_k).transpose(1, 2)
        k = self.W_k(key).view(B, -1, H, self.d_k).transpose(1, 2)
        v = self.W_v(value).view(B, -1, H, self.d_k).transpose(1, 2)
''' + core(8) + '''
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.W_o(y)
''',
    "sdpa": HEADER + '''

class Attention(nn.Module):
    """A module without weights, its heads split already (the textbook's ScaledDotProductAttention)."""

    def forward(self, q, k, v, kv_cache=None):
        B, H, T = q.shape[0], q.shape[1], q.shape[-2]
        heads = fold = lambda t: t
''' + core(8) + '''
        return y
''',
    "function": HEADER + '''

def attention(q, k, v, kv_cache=None):
    B, H, T = q.shape[0], q.shape[1], q.shape[-2]
    heads = fold = lambda t: t
''' + core(4) + '''
    return y
''',
}
TARGET = {"bert": "Attention", "fused": "Attention", "diffusers": "Attention", "function": "attention",
          "classic": "Attention", "sdpa": "Attention"}
ARGS = {"bert": ("--init", "d_feat=32, n_head=4"), "fused": ("--init", "d_feat=32, n_head=4"),
        "diffusers": ("--init", "query_dim=32, heads=4, dim_head=8"),
        "function": ("--dk", "8", "--dv", "8", "--heads", "4", "--nq", "6", "--nk", "6", "--batch", "2"),
        "classic": ("--init", "d_feat=32, n_head=4", "--nq", "6", "--nk", "6"),
        "sdpa": ("--dk", "8", "--dv", "8", "--heads", "4", "--nq", "6", "--nk", "6", "--batch", "2")}
GQA_ARGS = {"bert": ("--init", "d_feat=32, n_head=4, n_kv_head=2"),
            "fused": ("--init", "d_feat=32, n_head=4, n_kv_head=2"),
            "function": ("--dk", "8", "--dv", "8", "--heads", "4", "--kv-heads", "2", "--nq", "6", "--nk", "6",
                         "--batch", "2")}
LARGE = {"bert": "self.query.weight.data.mul_(300.0); self.key.weight.data.mul_(300.0)",
         "fused": "self.c_attn.weight.data[: 2 * d_feat].mul_(300.0)",
         "diffusers": "self.to_q.weight.data.mul_(300.0); self.to_k.weight.data.mul_(300.0)"}
SPLIT = {"bert": ("view(B, T, n, self.d_head).permute(0, 2, 1, 3)", "view(B, n, T, self.d_head)"),
         "fused": ("q.view(B, T, self.n_head, self.d_head).transpose(1, 2)",
                   "q.reshape(B, self.n_head, T, self.d_head)"),
         "diffusers": ("t.reshape(B, T, self.heads, C // self.heads).permute(0, 2, 1, 3).reshape",
                       "t.reshape(B, self.heads, T, C // self.heads).reshape")}
MERGE = {"bert": ("y.permute(0, 2, 1, 3).contiguous().view(B, T, C)", "y.contiguous().view(B, T, C)"),
         "fused": ("y.transpose(1, 2).contiguous().view(B, T, C)", "y.contiguous().view(B, T, C)"),
         "diffusers": ("t.reshape(BH // self.heads, self.heads, T, D).permute(0, 2, 1, 3).reshape",
                       "t.reshape")}
# heads.merge_wrong_permute: x_raw permuted another way before the merge's view (einops' 'b h n d -> b n (d h)')
PERMUTED = {"bert": (MERGE["bert"][0], "y.permute(0, 2, 3, 1).contiguous().view(B, T, C)"),
            "fused": (MERGE["fused"][0], "y.transpose(-1, -2).contiguous().view(B, T, C)"),
            "diffusers": (MERGE["diffusers"][0], "t.reshape(BH // self.heads, self.heads, T, D).permute(0, 2, 3, 1)"
                                                 ".reshape")}
ROPE = "pass  # ROPE"
SCORES = "scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # SCORES"
BIAS, AFTER = "pass  # BIAS", "pass  # AFTER"
MASK = "allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # MASK"
FILL = 'scores = scores.masked_fill(~allowed, float("-inf"))  # FILL'
MIX = "y = weights @ v  # MIX"
REP = ("k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # REPK",
       "v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)  # REPV")
MODULES = ("bert", "fused", "diffusers")
ALL = (*MODULES, "function")
ROTATED = (ROPE, "q, k = rope(q, P), rope(k, P)")
CAUSAL = ("--causal",)
OWN_BASE = (ROPE, "q, k = rope(q, P, base=1000000.0), rope(k, P, base=1000000.0)")  # --rope-base 1000000's
HALF = "q, k = rope(q, P, rotary=q.shape[-1] // 2), rope(k, P, rotary=q.shape[-1] // 2)"  # GPT-NeoX's rotary_pct
DECODE = ("--causal", "lower-right", "--cache", "3")
BLOOM = (BIAS, "scores = scores + heads(alibi(H, T, S))")
T5 = [(SCORES, "scores = q @ k.transpose(-2, -1)  # SCORES"), (BIAS, "scores = scores + heads(t5(T, S))")]
T5_ARGS = ("--causal", "--scale", "1", "--position-bias", "T5", "--nq", "6")
GROUPED = [(REP[0], "G = q.shape[-3] // k.shape[-3]"), (REP[1], "pass"),
           (SCORES, "scores = (q.view(B, G, k.shape[-3], T, q.shape[-1]) @ k.unsqueeze(1).transpose(-2, -1))"
                    ".flatten(1, 2) / math.sqrt(q.shape[-1])"),
           (MIX, "y = (weights.view(B, G, v.shape[-3], T, S) @ v.unsqueeze(1)).flatten(1, 2)")]
LEAVE = {"gqa.group_order": [  # the right grouped einsum: query heads h·G .. h·G + G - 1 read key/value head h
    (REP[0], "G = q.shape[-3] // k.shape[-3]"), (REP[1], "pass"),
    (SCORES, "scores = (q.view(B, k.shape[-3], G, T, q.shape[-1]) @ k.unsqueeze(2).transpose(-2, -1))"
             ".flatten(1, 2) / math.sqrt(q.shape[-1])"),
    (MIX, "y = (weights.view(B, v.shape[-3], G, T, S) @ v.unsqueeze(2)).flatten(1, 2)")]}

# entry: (styles, the correct code's changes and options, the mistake's changes)
PLANTS: dict[str, tuple[tuple[str, ...], tuple[list[tuple[str, str]], tuple[str, ...]], list[tuple[str, str]]]] = {
    "scale.none": (("bert", "fused", "function"), ([], CAUSAL), [(SCORES, "scores = q @ k.transpose(-2, -1)")]),
    "scale.twice": (("diffusers", "classic", "function"), ([], CAUSAL), [(BIAS, "scores = scores / math.sqrt(q.shape[-1])")]),
    "scale.d_head": (("bert", "diffusers", "sdpa"), ([], CAUSAL), [(SCORES, "scores = q @ k.transpose(-2, -1) / q.shape[-1]")]),
    "scale.d_model": (MODULES, ([], CAUSAL), [(SCORES, "scores = q @ k.transpose(-2, -1) / math.sqrt(C)")]),
    "scale.n": (("fused", "classic", "function"), ([], CAUSAL), [(SCORES, "scores = q @ k.transpose(-2, -1) / math.sqrt(S)")]),
    "scale.multiplied": (("bert", "diffusers", "sdpa"), ([], CAUSAL), [(SCORES, "scores = q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1])")]),
    "softmax.axis": (("fused", "diffusers", "function"), ([], CAUSAL), [("softmax(dim=-1)", "softmax(dim=-2)")]),
    "pattern.transposed": (("bert", "diffusers", "function"), ([], CAUSAL), [(MIX, "y = weights.transpose(-2, -1) @ v")]),
    "mask.polarity": (("bert", "diffusers", "function"), ([], CAUSAL), [(FILL, 'scores = scores.masked_fill(allowed, float("-inf"))')]),
    "mask.after_softmax": (("fused", "classic", "sdpa"), ([], CAUSAL), [(FILL, "pass"), (AFTER, "weights = weights * allowed")]),
    "mask.not_applied": (("bert", "fused", "function"), ([], CAUSAL), [(FILL, "pass")]),
    "mask.multiplied": (("bert", "diffusers", "function"), ([], CAUSAL), [(FILL, "scores = scores * allowed")]),
    "mask.filled_with_0": (("fused", "diffusers", "sdpa"), ([], CAUSAL), [(FILL, "scores = scores.masked_fill(~allowed, 0.0)")]),
    "mask.off_by_one": (("bert", "classic", "function"), ([], CAUSAL), [("tril(S - T)  # MASK", "tril(S - T + 1)  # MASK")]),
    "mask.on_queries": (("bert", "fused", "function"),
                        ([("kv_cache=None):", "kv_cache=None, mask=None):"), (MASK, "allowed = mask.view(B, 1, 1, S)")],
                         ("--nq", "6", "--mask", "PAD")),
                        [("allowed = mask.view(B, 1, 1, S)", "allowed = mask.view(B, 1, S, 1)")]),
    "mask.transposed": (("bert", "diffusers", "function"), ([], CAUSAL), [("tril(S - T)  # MASK", "tril(S - T).T  # MASK")]),
    "mask.upper_left": (MODULES, ([], DECODE), [("tril(S - T)  # MASK", "tril()  # MASK")]),
    "kv.swapped": (("classic", "function", "sdpa"), ([], CAUSAL), [(SCORES, SCORES.replace("k.transpose", "v.transpose")),
                                       (MIX, "y = weights @ k")]),
    "kv.values_from_keys": (("bert", "diffusers", "function"), ([], CAUSAL), [(MIX, "y = weights @ k")]),
    "gqa.tiled": (("bert", "fused", "function"), ([], CAUSAL),
                  [(REP[0], "k = k.repeat(1, q.shape[-3] // k.shape[-3], 1, 1)"),
                   (REP[1], "v = v.repeat(1, q.shape[-3] // v.shape[-3], 1, 1)")]),
    "gqa.group_order": (("bert", "fused", "function"), ([], CAUSAL),
                        [(REP[0], "G = q.shape[-3] // k.shape[-3]"), (REP[1], "pass"), *GROUPED[2:]]),
    "heads.split_without_permute": (MODULES, ([], CAUSAL), []),
    "heads.merge_without_transpose": (MODULES, ([], CAUSAL), []),
    "heads.merge_wrong_permute": (MODULES, ([], CAUSAL), []),
    "rope.pairing": (("bert", "diffusers", "function"), ([ROTATED], ("--causal", "--rope")),
                     [(ROTATED[1], 'q, k = rope(q, P, table="il"), rope(k, P, table="il")')]),
    "rope.positions": (MODULES, ([ROTATED], (*DECODE, "--rope")), [(ROTATED[1], "q, k = rope(q, 0), rope(k, 0)")]),
    # a base of the code's own is a convention where nothing says another (test_trace_more_styles.py); here
    # --rope-base says one, and the code rotates with another
    "rope.base": (("fused", "diffusers", "function"), ([OWN_BASE], ("--causal", "--rope", "--rope-base", "1000000")),
                  [(OWN_BASE[1], "q, k = rope(q, P, base=500000.0), rope(k, P, base=500000.0)")]),
    "rope.fraction": (("bert", "fused", "sdpa"), ([(ROPE, HALF)], ("--causal", "--rope")),
                      [(HALF, HALF.replace("// 2)", "// 2, over=q.shape[-1])"))]),
    "rope.not_applied": (("bert", "diffusers", "function"), ([ROTATED], ("--causal", "--rope")), [(ROTATED[1], "pass")]),
    "rope.untold": (("fused", "diffusers", "function"), ([], CAUSAL), [ROTATED]),
    "rope.on_values": (("bert", "fused", "function"), ([ROTATED], ("--causal", "--rope")),
                       [(ROTATED[1], "q, k, v = rope(q, P), rope(k, P), rope(v, P)")]),
    "cache.order": (MODULES, ([], DECODE), [("[fold(kv_cache[0]), k]", "[k, fold(kv_cache[0])]"),
                                            ("[fold(kv_cache[1]), v]", "[v, fold(kv_cache[1])]")]),
    "float16.overflow": (MODULES, ([("pass  # LARGE", "LARGE")], CAUSAL),
                         [(SCORES, "scores = (q.half() @ k.half().transpose(-2, -1)).float() / math.sqrt(q.shape[-1])")]),
    "alibi.sign": (("bert", "diffusers", "function"), ([BLOOM], ("--causal", "--alibi")), [(BLOOM[1], "scores = scores - heads(alibi(H, T, S))")]),
    "alibi.slopes": (("fused", "diffusers", "function"), ([BLOOM], ("--causal", "--alibi")), [(BLOOM[1], "scores = scores + heads(alibi(H, T, S).flip(0))")]),
    "alibi.query_positions": (("bert", "fused", "function"), ([BLOOM, (MASK, "allowed = torch.ones(T, S, dtype=torch.bool)")], ("--alibi",)),
                              [(BLOOM[1], "scores = scores + heads(alibi(H, T, S, symmetric=True))")]),
    "t5.transposed": (("bert", "diffusers", "function"), (T5, T5_ARGS), [("heads(t5(T, S))", "heads(t5(T, S).T)")]),
    "t5.after_softmax": (("fused", "diffusers", "function"), (T5, T5_ARGS), [("scores = scores + heads(t5(T, S))", "pass"),
                                              (AFTER, "weights = weights + heads(t5(T, S))")]),
    "dropout.left_on": (("bert", "fused", "diffusers"), ([], CAUSAL), [(AFTER, "weights = F.dropout(weights, 0.25)")]),
}
GQA = ("gqa.tiled", "gqa.group_order")


def source(style: str, changes: list[tuple[str, str]]) -> str:
    body = STYLES[style]
    for old, new in changes:
        new = LARGE[style] if new == "LARGE" else new
        assert old in body, (style, old)
        body = body.replace(old, new, 1)
    return body


def planted(entry: str, style: str) -> list[tuple[str, str]]:
    if entry == "heads.split_without_permute":
        return [SPLIT[style]]
    if entry == "heads.merge_without_transpose":
        return [MERGE[style]]
    if entry == "heads.merge_wrong_permute":
        return [PERMUTED[style]]
    return PLANTS[entry][2]


def options(tmp_path, style: str, entry: str, told: tuple[str, ...]) -> tuple[str, ...]:
    base = GQA_ARGS[style] if entry in GQA else ARGS[style]
    if "--batch" in base and "--mask" in told:
        base = base[:-2]
    extra = []
    for a in told:
        if a == "PAD":
            keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)  # [n_batch, 1, 1, n_K]: keys 4, 5 and 5 padded
            keep[0, ..., 4:] = False
            keep[1, ..., 5:] = False
            torch.save(keep, tmp_path / "pad.pt")
            a = str(tmp_path / "pad.pt")
        elif a == "T5":
            torch.save(t5_bias(6, 6), tmp_path / "t5.pt")
            a = str(tmp_path / "t5.pt")
        extra.append(a)
    if "--mask" in told:
        extra += ["--batch", "2"]
    return (*base, *extra)


def t5_bias(T: int, S: int) -> torch.Tensor:
    i, j = torch.arange(T)[:, None].float(), torch.arange(S)[None, :].float()
    return 0.5 * torch.sin(0.9 * i - 0.4 * j) + 0.2 * (j - i)


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"catalog_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def output(style: str, path: str, entry: str) -> torch.Tensor:
    """The code's own output on fixed inputs (weights from one seed)."""
    module = load(path)
    torch.manual_seed(0)
    with torch.no_grad():
        if style in ("function", "sdpa"):
            kv = 2 if entry in GQA else 4
            q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, kv, 6, 8), torch.randn(2, kv, 6, 8)
            return module.attention(q, k, v) if style == "function" else module.Attention()(q, k, v)
        if style == "classic":
            return module.Attention().eval()(*torch.randn(3, 2, 6, 32))
        layer = module.Attention(**({"n_kv_head": 2} if entry in GQA else {})).eval()
        return layer(torch.randn(2, 6, 32))


CORRECT: set[tuple[object, ...]] = set()
CASES = [(entry, style) for entry, (styles, _, _) in PLANTS.items() for style in styles]


def test_every_catalog_entry_is_planted_in_three_styles():
    from test_trace_round7_catalog import PLANTED  # the entries round 7 added, planted there
    from test_trace_round7_scaleshare import PLANTED as SHARES  # scale.half, in three styles of its own
    from test_trace_round20_norms import PLANTED as NORMS  # qknorm.*, in styles of their own
    from test_trace_round22_kvroles import PLANTED as KEYS  # kv.keys_from_values, in styles of its own
    from test_trace_round29_alibifeed import PLANTED as AFTER  # alibi.after_softmax, in styles of its own
    from test_trace_round30_qorder import PLANTED as QUERIES  # gqa.query_order, heads.split_transposed

    names = {experiment.name for experiment in CATALOG}
    planted = set(PLANTS) | set(PLANTED) | set(SHARES) | set(NORMS) | set(KEYS) | set(AFTER) | set(QUERIES)
    assert names == planted, names ^ planted
    assert all(len({target for target, _, _ in cases}) >= 3
               for cases in (*SHARES.values(), *NORMS.values(), *KEYS.values(), *AFTER.values(), *QUERIES.values()))
    assert all(len(styles) >= 3 for styles, _, _ in PLANTS.values())


@pytest.mark.parametrize("style", ["bert", "fused", "diffusers", "function"])
def test_each_correct_style_is_pytorchs_attention(tmp_path, style):
    """The style as written, causal, against F.scaled_dot_product_attention holding its weights."""
    path = write(tmp_path, source(style, []), f"{style}.py")
    module = load(path)
    torch.manual_seed(0)
    with torch.no_grad():
        if style == "function":
            q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
            torch.testing.assert_close(module.attention(q, k, v),
                                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return
        layer = module.Attention().eval()
        x = torch.randn(2, 6, 32)
        if style == "bert":
            linears = (layer.query, layer.key, layer.value, layer.dense)
        elif style == "fused":
            w, b = layer.c_attn.weight, layer.c_attn.bias
            linears = tuple(torch.nn.Linear(32, 32) for _ in range(3)) + (layer.c_proj,)
            for i, lin in enumerate(linears[:3]):
                lin.weight.copy_(w[32 * i: 32 * (i + 1)])
                lin.bias.copy_(b[32 * i: 32 * (i + 1)])
        else:
            linears = (layer.to_q, layer.to_k, layer.to_v, layer.to_out[0])
        q, k, v = (lin(x).view(2, 6, 4, 8).transpose(1, 2) for lin in linears[:3])
        expected = linears[3](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 32))
        torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize(("entry", "style"), CASES, ids=[f"{e}-{s}" for e, s in CASES])
def test_each_planted_mistake_is_named_by_the_experiment_that_reproduces_it(tmp_path, runner, entry, style):
    _, (correct, told), _ = PLANTS[entry]
    args = options(tmp_path, style, entry, told)
    right = write(tmp_path, source(style, correct + LEAVE.get(entry, [])), "right.py")
    key = (style, repr(correct + LEAVE.get(entry, [])), told, entry in GQA)
    if key not in CORRECT:  # each correct version once: it exits 0
        result, out = trace(runner, f"{right}:{TARGET[style]}", *args)
        assert result.exit_code == 0, result.output
        CORRECT.add(key)
    wrong = write(tmp_path, source(style, correct + planted(entry, style)), "wrong.py")
    if "--mask" not in told and "--cache" not in told:  # the plant is real: the code's own output changes
        mine, theirs = output(style, right, entry), output(style, wrong, entry)
        assert not torch.allclose(mine, theirs, equal_nan=True, atol=1e-4), (entry, style)
    result, out = trace(runner, f"{wrong}:{TARGET[style]}", *args)
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert first["experiment"] == entry, (entry, style, first)
    assert first["evidence"].startswith("by experiment: ") and "to tolerance" in first["evidence"], first
    assert "none of the usual causes fits" not in first["diagnosis"]


def test_scores_divided_by_the_model_width_say_both_roots(tmp_path, runner):
    """The issue's own words: d_model = 64, d_head = 16 (4 heads): divided by √d_model = 8 instead of √d_head = 4."""
    body = source("bert", [(SCORES, "scores = q @ k.transpose(-2, -1) / math.sqrt(C)")])
    path = write(tmp_path, body, "wide.py")
    result, out = trace(runner, f"{path}:Attention", "--init", "d_feat=64, n_head=4", "--causal")
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert first["reference"] == "scores" and first["experiment"] == "scale.d_model", first
    assert "divided by √d_model = 8 instead of divided by √d_head = 4" in first["evidence"], first
    assert math.isclose(first["ratio"], 0.5, rel_tol=1e-6)


def test_a_scale_given_with_scale_is_the_one_the_message_names(tmp_path, runner):
    """T5 is not scaled (--scale 1); code that divides by √d_head is told so against --scale 1, not against
    the default 1/√d_head."""
    body = source("bert", [(BIAS, "scores = scores + heads(t5(T, S))")])
    path = write(tmp_path, body, "t5.py")
    torch.save(t5_bias(6, 6), tmp_path / "t5.pt")
    result, out = trace(runner, f"{path}:Attention", *ARGS["bert"], "--causal", "--scale", "1", "--position-bias",
                        str(tmp_path / "t5.pt"), "--nq", "6")
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert "--scale 1" in first["diagnosis"], first
    assert "divided by √d_head = 2.83" in first["diagnosis"] and "not scaled" in first["diagnosis"], first


def test_two_mistakes_at_once_are_named_both(tmp_path, runner):
    """No one entry reproduces a scale and a mask mistake together; the two joined in one rerun do (pairs.py):
    both are named, joined by "+" in the catalog's order."""
    body = source("bert", [(SCORES, "scores = q @ k.transpose(-2, -1) / math.sqrt(C)"),
                           (FILL, "scores = scores.masked_fill(~allowed, 0.0)")])
    path = write(tmp_path, body, "two.py")
    result, out = trace(runner, f"{path}:Attention", *ARGS["bert"], "--causal")
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert first["experiment"] == "scale.d_model+mask.filled_with_0", first
    assert first["diagnosis"].startswith("two mistakes at once:") and first["evidence"].startswith("by experiment")


COLUMNS = '''import math
import torch


def attention_cols(Q, K, V, mask=None):
    A = K.transpose(-2, -1) @ Q / math.sqrt(Q.shape[-2])  # [n_K, n_Q]: one query a column
    A = A.masked_fill(~mask, float("-inf"))
    A2 = torch.softmax(A, dim=-2)  # each column sums to 1 over the keys
    return V @ A2  # [d_V, n_Q]
'''
COLUMN_PLANTS = {
    "scale.none": [("A = K.transpose(-2, -1) @ Q / math.sqrt(Q.shape[-2])", "A = K.transpose(-2, -1) @ Q")],
    "mask.multiplied": [('A = A.masked_fill(~mask, float("-inf"))', "A = A * mask")],
    "mask.after_softmax": [('A = A.masked_fill(~mask, float("-inf"))', "pass"), ("return V @ A2", "return V @ (A2 * mask)")],
    "softmax.axis": [("dim=-2)", "dim=-1)")],
    "kv.values_from_keys": [("return V @ A2", "return K @ A2")],
}


@pytest.mark.parametrize("entry", COLUMN_PLANTS)
def test_the_column_form_is_rerun_in_its_own_layout(tmp_path, runner, entry):
    """One token a column (`--layout col`): the reference is rerun in the row form and compared in the column's."""
    q, k, v = torch.randn(2, 8, 6), torch.randn(2, 8, 6), torch.randn(2, 8, 6)
    right = load(write(tmp_path, COLUMNS, "cols.py"))
    allowed = torch.ones(6, 6, dtype=torch.bool).tril().T  # [n_K, n_Q]: key j seen by the queries from j on
    expected = F.scaled_dot_product_attention(q.mT, k.mT, v.mT, is_causal=True).mT
    torch.testing.assert_close(right.attention_cols(q, k, v, allowed), expected)
    path = write(tmp_path, source_of(COLUMNS, COLUMN_PLANTS[entry]), "wrong_cols.py")
    result, out = trace(runner, f"{path}:attention_cols", "--layout", "col", "--causal")
    assert result.exit_code == 1, result.output
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]


def source_of(body: str, changes: list[tuple[str, str]]) -> str:
    for old, new in changes:
        assert old in body, old
        body = body.replace(old, new)
    return body
