"""The reference a user's code is lined up with, run on the same inputs.

- a module: its four Linear layers (q, k, v, out) copied into attnscope's `MultiHeadAttention`, matched
  by name (`W_q`, `q_proj`, `query`, `to_q`, `out_proj`, `o`, ... ) or else, when it has exactly four, by
  the order they were registered in (`self.linears = clones(nn.Linear(d, d), 4)`); the reference steps are
  `Q_feat K_feat V_feat Q_split K_split V_split scores [masked_scores] attention x_raw x_rsh2 x`;
- a function: attnscope's `sdpa`, steps `scores [masked_scores] attention out`.
Both scale the scores by 1/sqrt(d_head) (resp. d_K), as `torch.nn.MultiheadAttention` and
`F.scaled_dot_product_attention` do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from attnscope.errors import UsageError
from attnscope.trace import Trace

ROLES = ("q", "k", "v", "o")
ROLE_WORDS = {
    "q": {"q", "query", "queries", "wq"},
    "k": {"k", "key", "keys", "wk"},
    "v": {"v", "value", "values", "wv"},
    "o": {"o", "out", "output", "wo", "dense"},
}
NOISE = {"w", "proj", "projection", "linear", "lin", "to", "fc", "layer", "weight", "in", "attn", "attention",
         "self", "l", "dense_layer", "c"}
MHA_STEPS = ("Q_feat", "K_feat", "V_feat", "Q_split", "K_split", "V_split", "scores", "masked_scores", "attention",
             "x_raw", "x_rsh2", "x")
SDPA_STEPS = ("scores", "masked_scores", "attention", "out")


@dataclass
class Projections:
    """The user's Linear layers by role, and how they were matched."""

    linears: dict[str, tuple[str, nn.Linear]]
    matched_by: str  # "name" or "registration order"

    def describe(self) -> str:
        pairs = ", ".join(f"{role}={name}" for role, (name, _) in self.linears.items())
        return f"{pairs} (matched by {self.matched_by})"


def role_of(name: str) -> str | None:
    """`W_q` -> q, `out_proj` -> o, `to_out.0` -> o, `linears.2` -> None."""
    parts = name.lower().split(".")
    while parts and parts[-1].isdigit():
        parts.pop()
    if not parts:
        return None
    words = [w for w in re.split(r"[_\-]", parts[-1]) if w and w not in NOISE]
    found = {role for role, vocabulary in ROLE_WORDS.items() if any(w in vocabulary for w in words)}
    return found.pop() if len(found) == 1 else None


def find_projections(module: nn.Module) -> Projections:
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    by_role: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, linear in linears:
        role = role_of(name)
        if role:
            by_role.setdefault(role, []).append((name, linear))
    if all(len(by_role.get(role, [])) == 1 for role in ROLES):
        return Projections({role: by_role[role][0] for role in ROLES}, "name")
    if len(linears) == 4:
        return Projections(dict(zip(ROLES, linears, strict=True)), "registration order")
    listed = ", ".join(f"{n} [{m.in_features} → {m.out_features}]" for n, m in linears) or "none"
    raise UsageError(f"no reference for {type(module).__name__}: trace copies four Linear layers (q, k, v and "
                     f"the output, named like W_q/q_proj/query and W_o/out_proj, or exactly four in that order) into "
                     f"attnscope's MultiHeadAttention; its Linear layers are {listed}")


def build_mha(module: nn.Module, n_head: int) -> tuple[nn.Module, Projections]:
    """attnscope's MultiHeadAttention holding the user's weights (biases a layer lacks are zero)."""
    from attnscope.multihead import MultiHeadAttention

    found = find_projections(module)
    q, k, v, o = (found.linears[role][1] for role in ROLES)
    d_feat = q.in_features
    names = {role: found.linears[role][0] for role in ROLES}
    if k.in_features != d_feat or v.in_features != d_feat or o.out_features != d_feat:
        raise UsageError(f"{names['q']}, {names['k']}, {names['v']} must all read d_feat features and "
                         f"{names['o']} write them back: found {q.in_features}, {k.in_features}, {v.in_features} in, "
                         f"{o.out_features} out")
    if q.out_features % n_head or o.in_features != q.out_features or k.out_features != v.out_features:
        raise UsageError(f"{names['q']} writes {q.out_features} features, which {n_head} heads do not split "
                         f"evenly, or {names['o']} reads {o.in_features}; a multi-head layout needs "
                         "q.out = o.in = n_head·d_head")
    d_head = q.out_features // n_head
    if k.out_features % d_head:
        raise UsageError(f"{names['k']} writes {k.out_features} features, not a whole number of heads of {d_head}")
    n_kv_head = k.out_features // d_head
    if n_head % n_kv_head:
        raise UsageError(f"{n_head} query heads cannot share {n_kv_head} key/value heads evenly")
    qkv_bias = any(m.bias is not None for m in (q, k, v))
    weight = q.weight
    reference = MultiHeadAttention(d_feat, n_head, bias=qkv_bias, out_bias=o.bias is not None,
                                   d_head=d_head if d_head * n_head != d_feat else None, n_kv_head=n_kv_head,
                                   device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for mine, theirs in ((reference.W_q, q), (reference.W_k, k), (reference.W_v, v), (reference.W_o, o)):
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(mine.bias))
    return reference.eval(), found


def run_mha(reference: nn.Module, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
            mask: torch.Tensor | None) -> Trace:
    with torch.no_grad():
        trace: Trace = reference(Q, K, V, mask)
    return trace


def run_sdpa(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None) -> Trace:
    from attnscope.attention import sdpa

    with torch.no_grad():
        return sdpa(Q, K, V, mask)


def steps(trace: Trace, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name in trace]
