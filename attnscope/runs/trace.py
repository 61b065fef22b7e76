"""`attnscope trace` between parsing and rendering: import the user's callable, feed it, record every op,
run the reference on the same inputs, line the two up and explain the first divergence.

No terminal code: `run_trace` returns a `TraceRun` that attnscope.render.usertrace shows. The pieces live in
attnscope.usertrace (load, inputs, call, lineup).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.runs.common import check_numbers, guard_memory
from attnscope.trace import Step
from attnscope.usertrace.inputs import InputOptions

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lineup import Aligned, Divergence
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.record import Failure, Record
    from attnscope.usertrace.sizes import AxisNames


@dataclass
class TraceOptions(InputOptions):
    target: str = ""
    init: str | None = None
    train: bool = False
    max_memory: int | None = None


@dataclass(frozen=True)
class UserStep(Step):
    """A step of the user's code: a Step with the line it ran on (None for an input)."""

    line: int | None = None


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

    @property
    def diverged(self) -> bool:
        return self.divergence is not None


def run_trace(o: TraceOptions) -> TraceRun:
    import torch

    from attnscope.usertrace import load
    from attnscope.usertrace.call import call
    from attnscope.usertrace.inputs import ShapePlan, make_inputs, plan_notes
    from attnscope.usertrace.lineup import line_up
    from attnscope.usertrace.sizes import AxisNames

    check_numbers(o, texts=("target", "init"))
    target = load.find(o.target)
    _check_options(o, target)
    init = load.parse_init(o.init, target)
    torch.manual_seed(o.seed)  # the module's weights, as the user's own init draws them
    if target.kind == "class":
        width = load.width_hint(init, o.d_feat)
        if width:  # its projections, about four d_feat x d_feat matrices, before its __init__ allocates them
            guard_memory(4 * width * width * 4, o.max_memory, what=f"a module {width} wide needs",
                         advice="choose a smaller width")
        module, kwargs = load.construct(target, init, o.d_feat, o.heads)
        label = f"{target.name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    else:
        module, kwargs, label = (target.obj if target.kind == "module" else None), {}, target.name
    notes: list[str] = []
    if module is not None:
        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"{target.name} built a {type(module).__name__}, not a torch.nn.Module")
        load.guarded(target, "train()", lambda: module.train(o.train))
        notes.append("the module ran in training mode (--train): dropout is on, and random" if o.train else
                     "the module ran in eval() mode: dropout is off (--train runs it in training mode, where "
                     "dropout zeroes attention weights at random)")
    fn = module if module is not None else target.obj
    plan = load.plan(module.forward if module is not None else fn,
                     f"{target.name}.forward" if module is not None else target.name, o.train)
    shapes = ShapePlan.make(o, module, init)
    inputs = make_inputs(o, plan, shapes, module, guard=lambda sizes: _guard(o, sizes, module is not None))
    notes += inputs.notes + plan_notes(plan, inputs)

    called = call(target, fn, plan, inputs, module, o.max_memory)
    steps = _steps(inputs, called.records, AxisNames(inputs.sizes))
    mode = "" if module is None else ", training mode" if o.train else ", eval() mode"
    header = _header(target, label, plan, inputs, mode)
    header[-1] += "" if o.q else f"  seed={o.seed}"
    run = TraceRun(header, _params(o, target, kwargs, inputs), steps, notes=notes, failure=called.failure,
                   failure_source=called.source)
    if not called.records:
        run.notes.append(f"no tensor operation ran from {target.path.name}: only ops called from that file are "
                         "recorded (torch functions, Tensor methods and operators)")
    if called.failure is not None:
        return run
    lined = line_up(module, shapes, inputs, called.records, o.train)
    run.reference, run.alignment, run.divergence = lined.reference, lined.rows, lined.divergence
    run.no_reference = lined.no_reference
    run.notes += lined.notes
    return run


def _guard(o: TraceOptions, sizes: dict[str, int], is_module: bool) -> None:
    """Before the inputs are drawn: the reference's steps and about as many of the user's code's must fit, as
    for sdpa/mha (the same estimates, the same refusal)."""
    from attnscope import cost

    n_batch, n_Q, n_K = sizes.get("n_batch", 1), sizes["n_Q"], sizes["n_K"]
    masked = bool(o.causal or o.mask)
    if is_module:
        d_feat, n_head = sizes.get("d_feat", 1), sizes.get("n_head", 1)
        reference = cost.mha_bytes(n_batch, n_Q, n_K, d_feat, n_head, cross=n_Q != n_K, masked=masked,
                                   n_kv_head=sizes.get("n_kv_head"), d_head=sizes.get("d_head"))
    else:
        reference = cost.sdpa_bytes(n_batch * sizes.get("n_head", 1), n_Q, n_K, sizes["d_K"], sizes["d_V"],
                                    masked=masked)
    guard_memory(2 * reference, o.max_memory, what="tracing these sizes needs",
                 advice="shrink the sizes (--batch, --nq, --nk)")


def _check_options(o: TraceOptions, target: Target) -> None:
    if target.kind != "class" and o.init:
        raise UsageError(f"--init builds a class; {target.name} is a {target.kind}, so drop --init")
    if target.kind == "function":
        if o.train:
            raise UsageError("--train sets a module's training mode; a function has none (its dropout parameters, "
                             "if any, are passed as documented)")
        if o.d_feat is not None:
            raise UsageError("--d-feat is a module's width; for a function give --dk (and --dv)")
    elif o.dk is not None or o.dv is not None:
        raise UsageError("--dk/--dv size a function's inputs; a module's width is --d-feat")


def _steps(inputs: Inputs, records: list[Record], names: AxisNames) -> list[UserStep]:
    steps = [UserStep(name, t, names.dims(t.shape), f"input: {inputs.ops[name]}", allocates=True)
             for name, t in inputs.tensors.items()]
    if inputs.mask is not None:
        steps.append(UserStep("mask", inputs.mask, names.dims(inputs.mask.shape),
                              "input: the mask (True = may attend)"))
    for r in records:
        op = f"line {r.line}: {r.details['op']}" + (f" ({r.details['same']})" if "same" in r.details else "")
        steps.append(UserStep(r.label, r.tensor, names.dims(r.tensor.shape), op, r.flops, r.allocates, r.line))
    return steps


def _header(target: Target, label: str, plan: Plan, inputs: Inputs, mode: str) -> list[str]:
    order = ["n_batch", "n_Q", "n_K", "d_K", "d_V", "d_feat", "n_head", "d_head"]
    sizes = "  ".join(f"{k}={inputs.sizes[k]}" for k in sorted(inputs.sizes, key=lambda k: (
        order.index(k) if k in order else len(order), k)))
    kind = "self-attention" if plan.self_attention else (
        "cross-attention" if inputs.sizes.get("n_Q") != inputs.sizes.get("n_K") else "attention")
    return [f"trace {target.path.name}:{label}", f"{plan.signature}: {kind}{mode}", sizes]


def _params(o: TraceOptions, target: Target, kwargs: dict[str, Any], inputs: Inputs) -> dict[str, Any]:
    files = {role: spec for role, spec in (("Q", o.q), ("K", o.k), ("V", o.v)) if spec}
    return {"target": o.target, "file": str(target.path), "name": target.name, "kind": target.kind,
            "init": {k: _jsonable(v) for k, v in kwargs.items()}, "train": o.train, "sizes": dict(inputs.sizes),
            "seed": o.seed, "inputs": files or "random", "mask": o.mask, "causal": o.causal}


def _jsonable(value: Any) -> Any:
    """--init values are literals; those JSON has no word for (tuples, sets, bytes, complex) become lists or text."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
