"""Code that takes q, k and v already projected, of the model's width, and splits the heads itself: the PyTorch
tutorials' `multi_head_attention(q, k, v, num_heads, mask=None)`, a JAX port's einsum over `[B, T, H, D]`, a
module with `self.n_head` and no weights. It is multi-head attention whose projections are the identity.

Its head count is what the code says: a size parameter of the function or the forward (`num_heads`, `n_head`,
`head_dim`, `d_head`, a `d_model`; required, with a default, or keyword-only) or the weightless module's own
(`self.n_head`, a config's). trace holds it in a module of four identity projections (`W_q`, `W_k`, `W_v`, `W_o`,
d_feat x d_feat), whose forward hands the code its inputs as they are and the sizes (--heads, else the default,
else 4 heads); the reference is attnscope's MultiHeadAttention holding them, so its `Q_split`, `scores`, ...,
`x_rsh2` are the code's, and its `x` (the identity of the merge) what the code returns.

Code that takes the heads split already (`[n_batch, n_head, n, d_head]`, the head count only checked) is read so
by the run: runs/trace.py traces it both ways where the first does not line up, and keeps the reading the code's
tensors say (`split_better`).
"""

from __future__ import annotations

import inspect
from typing import Any

from attnscope.errors import UsageError
from attnscope.usertrace.weightargs import size_params

ROLES = ("W_q", "W_k", "W_v", "W_o")
CHOSEN_HEADS = 4
HEAD_WIDTHS = (6, 8, 10)  # a head's width where nothing says it: even (RoPE turns pairs), never the head count


def says_heads(fn: Any) -> bool:
    """Whether `fn`'s signature holds a head count or a head's width (`num_heads`, `head_dim`, any kind but
    positional-only), so that it splits heads itself."""
    return any(size in ("n_head", "d_head") for size, _ in size_params(fn).values())


def holding(fn: Any, name: str, heads: int | None, width: int | None, own_heads: int | None = None,
            own_head_width: int | None = None, inner: Any = None, projected: bool = True,
            given_forward: dict[str, Any] | None = None) -> tuple[Any, str]:
    """An nn.Module of four identity projections whose forward calls `fn` with the inputs as they are and its size
    parameters given (the head count: --heads, else `own_heads` (the module's), else the parameter's default, else
    4; a head's width and the model's from the same), and the note that says so. `inner`: the user's weightless
    module `fn` is the forward of (kept as a child, so that train() reaches it). `projected` False: no projections,
    for the reading with the heads split already (traced as a function is, whole_options). `given_forward`:
    --forward's arguments, whose size parameters (`num_heads=2`) say the sizes as --heads does."""
    import torch
    from torch import nn

    sized = size_params(fn)
    told = {sized[k][0]: v for k, v in (given_forward or {}).items()
            if k in sized and isinstance(v, int) and not isinstance(v, bool) and v > 0}
    if heads and told.get("n_head", heads) != heads:
        raise UsageError(f"--heads {heads} but --forward gives {told['n_head']} heads; give one of them")
    source = "--heads" if heads else "--forward" if "n_head" in told else None
    heads = heads or told.get("n_head")
    width = told.get("d_feat") or width
    defaults = {size: value for size, value in sized.values() if value is not None}
    n_head = heads or own_heads or defaults.get("n_head")
    d_head = told.get("d_head") or own_head_width or defaults.get("d_head")
    d_feat = width or defaults.get("d_feat")
    chosen = n_head is None
    if n_head is None and d_feat and d_head and d_feat % d_head == 0:
        n_head, chosen = d_feat // d_head, False
    if n_head is None:
        n_head = next((h for h in (CHOSEN_HEADS, 2, 3, 5) if d_feat is None or d_feat % h == 0), 1)
    if d_feat is not None and d_feat % n_head:
        raise UsageError(f"a width of {d_feat} does not split into {n_head} heads: give a width (--d-feat) that "
                         f"{n_head} divides, or another --heads")
    if d_feat is not None and d_head is not None and d_head * n_head != d_feat:
        if "d_head" in told or own_head_width:  # a head's width said, which the width and the heads contradict
            raise UsageError(f"{n_head} heads of {d_head} make a width of {n_head * d_head}, not {d_feat}: give "
                             "sizes that agree (--d-feat, --heads, --forward)")
        d_head = None  # a default's: the width and the head count decide
    if d_feat is not None and d_head is None:
        d_head = d_feat // n_head
    if d_head is None:
        d_head = next(w for w in HEAD_WIDTHS if w != n_head)
    d_feat = d_feat or n_head * d_head
    given = {param: {"n_head": n_head, "d_head": d_head, "d_feat": d_feat}[size] for param, (size, _) in sized.items()}
    signature = inspect.signature(fn)
    # the size parameters keep their place, defaulting to what they are given (--forward may give them again)
    params = [p.replace(default=given[p.name]) if p.name in given else p for p in signature.parameters.values()]
    if any(any(q.kind == q.POSITIONAL_OR_KEYWORD and q.default is q.empty for q in params[i + 1:])
           for i, p in enumerate(params) if p.name in given):
        params = [p for p in params if p.name not in given]  # a required parameter after a size: left out

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **(given | kwargs))

    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[me, *params])  # type: ignore[attr-defined]
    forward.__name__ = forward.__qualname__ = getattr(fn, "__name__", "forward")
    holder = type(name, (nn.Module,), {"forward": forward})()
    for role in ROLES if projected else ():
        linear = nn.Linear(d_feat, d_feat, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.eye(d_feat))
        holder.add_module(role, linear)
    if inner is not None:
        holder.add_module("inner", inner)
    holder.n_head, holder.d_head, holder.d_feat = n_head, d_head, d_feat
    holder.identity_projections, holder.heads_by_code = projected, True
    said = ", ".join(f"{param} = {value}" for param, value in given.items())
    source = (source if source and heads else "your module's own" if own_heads else "its default" if not chosen
              else "chosen: --heads gives another")
    said = f"; it was given {said}" if said else ""
    if not projected:
        return holder, (f"your code takes q, k and v with their heads split already, [n_batch, n_head, n, d_head]: "
                        f"traced as a function is, n_head = {n_head} ({source}){said}")
    return holder, (f"your code takes q, k and v of the model's width d_feat and splits the heads itself: traced as "
                    f"multi-head attention whose projections are the identity, n_head = {n_head} ({source}){said}")


def whole_options(o: Any, holder: Any) -> Any:
    """The options for the reading with the heads split already: 4-D inputs of the holder's heads and head width."""
    import dataclasses

    return dataclasses.replace(o, heads=holder.n_head, dk=holder.d_head, dv=holder.d_head, d_feat=None)


def is_holder(module: Any) -> bool:
    """Whether `module` is a holder of identity projections (the code splits the heads)."""
    return bool(getattr(module, "identity_projections", False))


def read(module: Any) -> bool:
    """Whether `module` is a holder, of either reading."""
    return bool(getattr(module, "heads_by_code", False))


def projections(module: Any) -> dict[str, tuple[str, Any]]:
    """The holder's identity projections by role, as reference.Projections holds them (matched by "identity")."""
    return {role: (f"(identity {name})", getattr(module, name)) for role, name in zip("qkvo", ROLES, strict=True)}


def describe(d_feat: int, n_head: int, d_head: int, variants: str) -> str:
    """The reference, in words, for code whose projections are the identity (`variants` leads with its scale's
    words, `, scores / √d_head` or none)."""
    return (f"attnscope MultiHeadAttention (d_feat={d_feat}, n_head={n_head}, d_head={d_head}"
            f"{variants}) with identity projections: your q, k and v split into heads as they are, compared up to "
            "the merge of the heads (x: no output projection)")


def weightless(module: Any, init: dict[str, Any], asked: int | None) -> tuple[int | None, int | None] | None:
    """A weightless module's own head count and head width (`self.n_head`, a config's `num_heads`, its `head_dim`),
    where it says either or its forward takes one; None for a module with weights, or one that says neither (a
    tutorial's ScaledDotProductAttention, its heads split already: traced as a function is). --heads (`asked`)
    other than the module's own is refused in one line."""
    from attnscope.usertrace import load

    if any(True for _ in module.parameters()):
        return None
    heads, width = load.head_count(module, init, None), load.head_size(module, init)
    if heads is None and width is None and not says_heads(module.forward):
        return None
    if heads is not None:
        load.head_count(module, init, asked)  # --heads other than its own: refused
    return heads, width


def split_better(split: Any, whole: Any) -> bool:
    """Whether the reading with the heads split by the code (`split`, a TraceRun) is the code's rather than the one
    with its inputs split already (`whole`): it runs, and its code holds the heads it splits (a tensor of the
    reference's split queries or scores: equal, or differing in values), or the other reading does not run."""
    if split.failure is not None or split.no_reference is not None:
        return whole.failure is not None or whole.no_reference is not None
    batched = ("n_batch" in split.params.get("sizes", {})) == ("n_batch" in whole.params.get("sizes", {}))
    if whole.failure is not None or whole.no_reference is not None or not batched:
        return True  # the other reading runs only on one sequence: its heads read as the batch
    if split.divergence is None:
        return True
    if whole.divergence is None:
        return False
    held = {row.reference for row in split.alignment if row.record is not None}
    return bool(held & {"Q_split", "K_split", "V_split", "scores", "attention"})
