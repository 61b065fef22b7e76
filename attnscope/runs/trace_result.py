"""What `attnscope trace` returns: the run's record (`TraceRun`, its `UserStep`s with their dims), the header lines
and the JSON parameters that say how it ran. attnscope.render.usertrace shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.runs.options import ROPE_BASE
from attnscope.runs.trace_options import causal_used
from attnscope.trace import Step

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.runs.trace_options import TraceOptions
    from attnscope.usertrace.feeds import Feeds
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import Aligned, Divergence
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.record import Failure, Record
    from attnscope.usertrace.reference import Spec
    from attnscope.usertrace.sizes import AxisNames


@dataclass(frozen=True)
class UserStep(Step):
    """A step of the user's code: a Step with the line it ran on (None for an input), and whether attnscope
    recomputed it (a step a fused kernel computes without materializing it)."""

    line: int | None = None
    recomputed: bool = False


@dataclass
class TraceRun:
    header: list[str]
    params: dict[str, Any]
    steps: list[UserStep]
    reference: str = ""
    alignment: list[Aligned] = field(default_factory=list)
    divergence: Divergence | None = None
    failure: Failure | None = None
    failure_source: str | None = None
    no_reference: str | None = None
    notes: list[str] = field(default_factory=list)
    saved: Path | None = None
    reference_attention: Any = None  # the reference's attention step (its dims: the `attention` row's), for the page
    split_heads: bool | None = None  # code that splits heads itself: read so (True) or with its heads split (False)

    @property
    def diverged(self) -> bool:
        return self.divergence is not None


def run_header(target: Target, label: str, plan: Plan, inputs: Inputs, mode: str, spec: Spec) -> list[str]:
    order = ["n_batch", "n_Q", "n_K", "n_cache", "d_K", "d_V", "d_feat", "n_head", "n_kv_head", "d_head"]
    sizes = "  ".join(f"{k}={inputs.sizes[k]}" for k in sorted(inputs.sizes, key=lambda k: (
        order.index(k) if k in order else len(order), k)))
    kind = "self-attention" if plan.self_attention else (
        "cross-attention" if inputs.sizes.get("n_Q") != inputs.sizes.get("n_K") else "attention")
    kind = "cross-attention, the queries from your module's own tensors" if inputs.own and \
        inputs.own_from == "module" else kind
    kind = "joint attention" if inputs.own and inputs.own_from == "joined" else kind
    kind = "self-attention, the queries from some of its tokens" if inputs.own and inputs.own_from == "selected" \
        else kind
    kind += "" if not spec.cache else ", a decode step"
    described = ", ".join(part for part in (spec.describe(), "column layout" if spec.layout == "col" else "") if part)
    variants = f"; reference: {described}" if described else ""
    return [f"trace {target.path.name}:{label}", f"{plan.signature}: {kind}{mode}{variants}", sizes]


def run_params(o: TraceOptions, target: Target, kwargs: dict[str, Any], inputs: Inputs) -> dict[str, Any]:
    files = {role: spec for role, spec in (("Q", o.q), ("K", o.k), ("V", o.v)) if spec}
    return {"target": o.target, "file": str(target.path), "code_file": str(target.source), "name": target.name,
            "kind": target.kind,
            "init": {k: _jsonable(v) for k, v in kwargs.items()}, "train": o.train, "sizes": dict(inputs.sizes),
            "seed": o.seed, "inputs": files or "random", "mask": o.mask, "causal": causal_used(o), "window": o.window,
            "rope": o.rope, "rope_base": (o.rope_base or ROPE_BASE) if o.rope else None,
            "rope_pairing": (o.rope_pairing or "half-split") if o.rope else None,
            "kv_heads": o.kv_heads, "cache": o.cache, "save": o.save, "alibi": o.alibi,
            "position_bias": o.position_bias, "qk_norm": o.qk_norm, "scale": o.scale, "forward": o.forward,
            "rope_base_asked": o.rope_base is not None, "causal_asked": o.causal is not None and o.causal_asked,
            "layout": o.layout, "grid": list(o.grid) if o.grid is not None else None}


def _jsonable(value: Any) -> Any:
    """--init values are literals (or calls of the file's classes, written as text); those JSON has no word
    for (tuples, sets, bytes, complex) become lists or text."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def run_steps(inputs: Inputs, records: list[Record], rows: list[Aligned], fed: Feeds, plan: Plan) -> list[UserStep]:
    """The inputs and every recorded op, each with named dims (dims.py: from its size, the reference step
    it lines up with, or where it comes from)."""
    from attnscope.usertrace.dims import name_records
    from attnscope.usertrace.sizes import AxisNames

    names = AxisNames(inputs.sizes, _extra_names(inputs))
    handed = inputs.handed()  # as the code is handed them: an image [n_batch, n_h, n_w, d_feat] where it takes one
    dims_of = {name: _input_dims(inputs, name, names) for name in inputs.tensors}
    dims_of = {name: dims if handed[name].dim() == len(dims) else (*dims[:-1], "n_h", "n_w")
               if inputs.layout == "col" else (*dims[:-2], "n_h", "n_w", dims[-1])  # a feature map, channels first
               for name, dims in dims_of.items()}
    steps = [UserStep(name, t, dims_of[name], f"input: {_made(inputs, name, dims_of[name])}", allocates=True)
             for name, t in handed.items()]
    given = {name: (dims_of[name], t) for name, t in handed.items()}
    for name, tensor, dims, op in fed.steps:
        steps.append(UserStep(name, tensor, dims, op))
        given[fed.labels.get(id(tensor), name)] = (dims, tensor)
    if inputs.allowed is not None and plan.mask:
        dims = _mask_dims(inputs.allowed.shape, inputs.sizes, names, inputs.layout)
        said = "additive, 0 = may attend" if inputs.allowed.is_floating_point() else "True = may attend"
        steps.append(UserStep("mask", inputs.allowed, dims, f"input: {plan.mask}, {said} (given to your code as it "
                                                            "reads it: see the note)"))
        given[plan.mask] = (dims, inputs.allowed)
    named = name_records(records, rows, names, given)
    for r in (r for r in records if "stacked" not in r.details):  # the heads' tensors stacked: for the line-up
        op = f"line {r.line}: {r.details['op']}" + (f" ({r.details['same']})" if "same" in r.details else "")
        steps.append(UserStep(r.label, r.tensor, named[r.index], op, r.flops, r.allocates, r.line,
                              recomputed="recomputed" in r.details))
    return steps


def _mask_dims(shape: tuple[int, ...], sizes: dict[str, int], names: AxisNames, layout: str) -> tuple[str, ...]:
    """The mask's dims: its last two axes are n_Q and n_K (n_K and n_Q in the column layout) where they have
    those sizes (in self-attention they share one), a broadcast axis of 1 stays 1 (a padding mask
    [n_batch, 1, 1, n_K]); a first axis of n_batch·n_head's size, of three, holds the heads folded into the batch
    (HF ProphetNet's `[n_batch·n_head, 1, n_K]`)."""
    dims = list(names.dims(shape))
    for axis, name in ((-2, "n_K"), (-1, "n_Q")) if layout == "col" else ((-2, "n_Q"), (-1, "n_K")):
        if len(shape) >= -axis and shape[axis] == sizes.get(name) and shape[axis] != 1:
            dims[axis] = name
    n_batch, n_head = sizes.get("n_batch", 1), sizes.get("n_head", 1)
    if len(shape) == 3 and n_head > 1 and shape[0] == n_batch * n_head:  # the heads folded into the batch
        dims[0] = "n_batch·n_head"
    return tuple(dims)


def _input_dims(inputs: Inputs, name: str, names: AxisNames) -> tuple[str, ...]:
    """An input's dims, by its role: the queries' axis is n_Q, the keys' n_K (by their sizes when a file gave
    another rank)."""
    from attnscope.usertrace.inputs import role_dims

    dims = role_dims(inputs.side(name), inputs.sizes, "d_feat" in inputs.sizes, inputs.layout)
    tensor = inputs.tensors[name]
    if tensor.dim() != len(dims):
        return names.dims(tensor.shape)
    return tuple(_axis(dim, int(n), inputs.sizes) for dim, n in zip(dims, tensor.shape, strict=True))


def _axis(dim: str, size: int, sizes: dict[str, int]) -> str:
    """`dim` where the input's axis has its size; else the dims of its kind (a length, a width) that do, or the size
    itself: a reading after the inputs were made (the queries a perceiver's latents, `forward(x, latents)`) moves
    n_Q and n_K off the inputs' own lengths, and the context's length is then neither."""
    if sizes.get(dim) == size:
        return dim
    kind = ("n_Q", "n_K") if dim in ("n_Q", "n_K") else tuple(name for name in sizes if name.startswith("d_"))
    return "|".join(name for name in kind if sizes.get(name) == size) or str(size)


def _made(inputs: Inputs, name: str, dims: tuple[str, ...]) -> str:
    """How an input was made, with the dims the table gives it where a reading moved n_Q or n_K off its sizes."""
    from attnscope.usertrace.inputs import role_dims

    op = inputs.ops[name]
    moved = dims != role_dims(inputs.side(name), inputs.sizes, "d_feat" in inputs.sizes, inputs.layout)
    return f"torch.randn({', '.join(dims)})" if moved and op.startswith("torch.randn(") and len(dims) == \
        inputs.tensors[name].dim() else op


def _extra_names(inputs: Inputs) -> dict[str, int]:
    """Sizes a user's tensor may have that are no dim: a fused projection's width, heads per group, half a head."""
    sizes = inputs.sizes
    extra = dict(inputs.extra_names)
    if "n_kv_head" in sizes and sizes["n_kv_head"]:
        extra["n_group"] = sizes["n_head"] // sizes["n_kv_head"]
    d = sizes.get("d_head", sizes.get("d_K"))
    if d and d % 2 == 0:
        extra["d_head/2" if "d_head" in sizes else "d_K/2"] = d // 2
    return extra
