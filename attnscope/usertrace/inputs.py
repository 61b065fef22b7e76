"""The inputs of a traced call: sizes (sizes.py), random or file tensors by the callable's signature, the mask.

A module's inputs are `[n_batch, n, d_feat]` (its width read from its Linear layers); a function's are
`[n_batch, n, d_K]` and `[n_batch, n_K, d_V]`, or `[n_batch, n_head, n, d]` with --heads. One tensor
parameter is self-attention (n_K = n_Q); three are query, key and value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.usertrace.sizes import choose_sizes

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.load import Plan

MASK_CONVENTION = ("boolean, True = may attend (the tutorials' masked_fill(mask == 0, -1e9) convention, as "
                   "F.scaled_dot_product_attention; nn.MultiheadAttention's is the opposite)")


@dataclass
class InputOptions:
    """What shapes the inputs: sizes (None: chosen), files, the mask."""

    batch: int | None = None
    nq: int | None = None
    nk: int | None = None
    d_feat: int | None = None
    heads: int | None = None
    dk: int | None = None
    dv: int | None = None
    seed: int = 0
    q: str | None = None
    k: str | None = None
    v: str | None = None
    mask: str | None = None
    causal: str | None = None


@dataclass
class ShapePlan:
    """The sizes known before the inputs: a module's width and heads (read from it), or what was asked for."""

    fixed: dict[str, int]
    n_head: int | None
    why_no_heads: str | None = None

    @staticmethod
    def make(o: InputOptions, module: Any, init: dict[str, Any]) -> ShapePlan:
        from attnscope.usertrace import load

        if module is None:
            return ShapePlan({"n_head": o.heads} if o.heads else {}, o.heads)
        width = module_width(module)
        if o.d_feat is not None and width is not None and o.d_feat != width:
            raise UsageError(f"--d-feat {o.d_feat} but the module reads {width} features; drop --d-feat")
        d_feat = width if width is not None else o.d_feat
        if d_feat is None:
            raise UsageError("cannot tell the module's width d_feat (no Linear layer found); pass --d-feat")
        n_head = load.head_count(module, init, o.heads)
        fixed = {"d_feat": d_feat}
        widths = _projection_widths(module)
        if n_head:
            fixed["n_head"] = n_head
            q_width = widths[0] if widths else d_feat
            if q_width % n_head == 0:
                fixed["d_head"] = q_width // n_head
                if widths and widths[1] != q_width and widths[1] % fixed["d_head"] == 0:
                    fixed["n_kv_head"] = widths[1] // fixed["d_head"]  # grouped-query attention
        why = None if n_head else f"cannot tell how many heads {type(module).__name__} has; pass --heads"
        return ShapePlan(fixed, n_head, why)


def _projection_widths(module: Any) -> tuple[int, int] | None:
    """What the query and key projections write (they differ with grouped-query attention)."""
    from attnscope.usertrace.reference import find_projections

    try:
        linears = find_projections(module).linears
    except UsageError:
        return None
    return linears["q"][1].out_features, linears["k"][1].out_features


def module_width(module: Any) -> int | None:
    """d_feat: what the query projection reads (else the first Linear layer)."""
    from torch import nn

    from attnscope.usertrace.reference import find_projections

    try:
        return find_projections(module).linears["q"][1].in_features
    except UsageError:
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        return linears[0].in_features if linears else None


@dataclass
class Inputs:
    tensors: dict[str, torch.Tensor]  # parameter name -> tensor, in signature order
    roles: dict[str, str]  # parameter name -> Q, K or V (self-attention: Q only)
    mask: torch.Tensor | None
    sizes: dict[str, int]
    ops: dict[str, str]  # parameter name -> how it was made
    notes: list[str] = field(default_factory=list)

    def qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        by_role = {role: self.tensors[name] for name, role in self.roles.items()}
        Q = by_role["Q"]
        K = by_role.get("K", Q)
        return Q, K, by_role.get("V", K)


def make_inputs(o: InputOptions, plan: Plan, shapes: ShapePlan, module: Any,
                guard: Callable[[dict[str, int]], None] | None = None) -> Inputs:
    """The inputs; `guard` sees the sizes before anything is drawn (the memory guard)."""
    import torch

    self_attention, is_module = plan.self_attention, module is not None
    if self_attention and o.nk is not None and o.nk != o.nq:
        raise UsageError(f"{plan.signature} takes one tensor (self-attention), so n_K = n_Q; drop --nk")
    if self_attention and o.dv is not None and o.dv != o.dk:
        raise UsageError(f"{plan.signature} takes one tensor (self-attention), so d_V = d_K; drop --dv")
    sized = [flag for flag, value in (("--batch", o.batch), ("--nq", o.nq), ("--nk", o.nk), ("--dk", o.dk),
                                      ("--dv", o.dv)) if value is not None]
    if o.q and sized:
        raise UsageError(f"{' and '.join(sized)} size random inputs; with --q the files' shapes decide, so drop "
                         f"{' and '.join(sized)}")
    loaded = load_files(o, self_attention)
    notes: list[str] = []
    if loaded:
        tensors, sizes = _from_files(loaded, shapes, module, notes)
        if guard is not None:
            guard(sizes)
    else:
        wanted = ["n_batch", "n_Q"] + ([] if self_attention else ["n_K"])
        wanted += [] if is_module else ["d_K"] + ([] if self_attention else ["d_V"])
        given = {"n_batch": o.batch, "n_Q": o.nq, "n_K": o.nk, "d_K": o.dk, "d_V": o.dv}
        sizes = choose_sizes(shapes.fixed, wanted, given)
        if self_attention:
            sizes["n_K"] = sizes["n_Q"]
            if not is_module:
                sizes["d_V"] = sizes["d_K"]
        if guard is not None:
            guard(sizes)
        dtype = next(iter(module.parameters()), torch.empty(0)).dtype if is_module else torch.float32
        generator = torch.Generator().manual_seed(o.seed)
        tensors = {role: torch.randn(*(sizes[d] for d in role_dims(role, sizes, is_module)), generator=generator,
                                     dtype=dtype) for role in (("Q",) if self_attention else ("Q", "K", "V"))}
    roles = dict(zip(plan.tensors, ("Q",) if self_attention else ("Q", "K", "V"), strict=True))
    mask = None
    if o.mask or o.causal:
        if plan.mask is None:
            raise UsageError(f"--mask/--causal: {plan.signature} has no mask parameter to pass it to")
        mask = build_mask(o.causal, o.mask, sizes["n_Q"], sizes["n_K"])
    files = {"Q": o.q, "K": o.k or o.q, "V": o.v or o.k or o.q}
    ops = {name: f"loaded from {files[role]}" if files[role] else
           f"torch.randn({', '.join(role_dims(role, sizes, is_module))})" for name, role in roles.items()}
    return Inputs({name: tensors[role] for name, role in roles.items()}, roles, mask, sizes, ops, notes)


def role_dims(role: str, sizes: dict[str, int], is_module: bool) -> tuple[str, ...]:
    n = "n_Q" if role == "Q" else "n_K"
    d = "d_feat" if is_module else ("d_V" if role == "V" else "d_K")
    heads = ("n_head",) if not is_module and "n_head" in sizes else ()
    return ("n_batch", *heads, n, d)


def load_files(o: InputOptions, self_attention: bool) -> dict[str, torch.Tensor]:
    from attnscope.tensors import load_tensor

    if (o.k or o.v) and not o.q:
        raise UsageError("--k/--v need --q too (with only --q, K = V = Q)")
    if self_attention and (o.k or o.v):
        raise UsageError("this callable takes one tensor (self-attention: K = V = Q); give only --q")
    loaded: dict[str, torch.Tensor] = {}
    if o.q:
        loaded["Q"] = load_tensor(o.q)
        loaded["K"] = load_tensor(o.k) if o.k else loaded["Q"]
        loaded["V"] = load_tensor(o.v) if o.v else loaded["K"]
    return loaded


def _from_files(loaded: dict[str, torch.Tensor], shapes: ShapePlan, module: Any,
                notes: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    from attnscope.attention import common_dtype

    Q, K, V = loaded["Q"], loaded["K"], loaded["V"]
    for name, t in (("--q", Q), ("--k", K), ("--v", V)):
        if module is not None and (t.dim() != 3 or t.shape[-1] != shapes.fixed["d_feat"]):
            raise UsageError(f"{name} is {list(t.shape)} but the module takes [n_batch, n, d_feat] with d_feat = "
                             f"{shapes.fixed['d_feat']}")
        if module is None and t.dim() < 2:
            raise UsageError(f"{name} is {list(t.shape)}; attention inputs are [.., n, d]")
    if module is not None:
        dtype = next(iter(module.parameters())).dtype
        if any(t.dtype != dtype for t in (Q, K, V)):
            notes.append(f"the inputs were converted to {str(dtype).removeprefix('torch.')}, the module's dtype")
    else:
        dtype, note = common_dtype(Q, K, V)
        if note:
            notes.append(note)
    converted = {id(t): t.to(dtype) for t in (Q, K, V)}  # K is Q when only --q: it stays the same tensor
    tensors = {"Q": converted[id(Q)], "K": converted[id(K)], "V": converted[id(V)]}
    sizes = dict(shapes.fixed)
    sizes.update({"n_Q": int(Q.shape[-2]), "n_K": int(K.shape[-2])})
    if Q.dim() >= 3:
        sizes["n_batch"] = int(Q.shape[0])
    if module is None:
        sizes.update({"d_K": int(Q.shape[-1]), "d_V": int(V.shape[-1])})
        if Q.dim() == 4:
            sizes["n_head"] = int(Q.shape[1])
    return tensors, sizes


def build_mask(causal: str | None, mask_file: str | None, n_Q: int, n_K: int) -> torch.Tensor | None:
    """The mask handed to the user's code and to the reference alike: boolean, True = may attend (the
    tutorials' `masked_fill(mask == 0, -1e9)` convention, and F.scaled_dot_product_attention's). A
    causal mask is `[1, n_Q, n_K]`, the Annotated Transformer's `subsequent_mask` shape: it broadcasts
    against `[n_batch, n_Q, n_K]` and `[n_batch, n_head, n_Q, n_K]` scores, and after the
    `mask.unsqueeze(1)` that code does for the heads. A file is passed as it is, after the mask rule (0/1
    integers become boolean; floats stay additive)."""
    from attnscope import masks
    from attnscope.tensors import load_tensor

    built = masks.causal_mask(n_Q, n_K, causal).unsqueeze(0) if causal else None  # type: ignore[arg-type]
    loaded = load_tensor(mask_file) if mask_file else None
    return masks.combine(built, loaded)


def plan_notes(plan: Plan, inputs: Inputs) -> list[str]:
    """What the parameters that are not tensors were given, and dims that share a size."""
    notes = []
    shared: dict[int, list[str]] = {}
    for name, size in inputs.sizes.items():
        shared.setdefault(size, []).append(name)
    for names in shared.values():
        if len(names) > 1 and set(names) != {"n_Q", "n_K"} and set(names) != {"d_K", "d_V"}:
            notes.append(f"{' and '.join(names)} are both {inputs.sizes[names[0]]}: an axis of that size reads "
                         f"{'|'.join(names)}; sizes that differ tell them apart")
    if plan.mask and inputs.mask is None:
        notes.append(f"{plan.mask} = None (give --causal or --mask FILE to pass a mask)")
    elif plan.mask:
        notes.append(f"{plan.mask}: {MASK_CONVENTION}")
    if plan.nones:
        notes.append(f"{', '.join(plan.nones)} = None")
    if plan.zeros:
        notes.append(f"{', '.join(plan.zeros)} = 0.0 (no dropout, so the numbers can be compared)")
    return notes
