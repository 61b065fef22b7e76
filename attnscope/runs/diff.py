"""`attnscope diff A B` between parsing and rendering: two saved runs (`--save` of any command, a `trace --save`)
compared step by step, in A's order, by name.

Each step both files hold is compared as `--check` compares (check.compare: NaN-aware, a NaN on one side only
never agrees), in the wider of the two dtypes, against `atol + rtol · max|A|` with the looser of the two
dtypes' tolerances (check.TOLERANCES) unless --atol/--rtol say otherwise. The first step that disagrees is the
divergence; where the causes `trace` knows apply (a scale, a transpose, a softmax over the wrong axis, a mask
read the other way round or not applied, a mask of its own), the diagnosis says which, computed from the
numbers of both files. Steps only one file holds are listed, never compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.runs.memory import guard_memory

if TYPE_CHECKING:
    import torch

    from attnscope.tensors.saved import SavedRun


@dataclass
class DiffOptions:
    a: str = ""
    b: str = ""
    atol: float | None = None
    rtol: float | None = None


@dataclass
class DiffRow:
    name: str
    dims: list[str] | None
    shape_a: list[int]
    shape_b: list[int]
    dtype_a: str
    dtype_b: str
    max_abs_diff: float | None
    tolerance: float | None
    status: str  # agrees | differs | shape
    detail: str = ""


@dataclass
class DiffRun:
    a: str
    b: str
    rows: list[DiffRow]
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    first: str | None = None  # the first step that disagrees
    diagnosis: str = ""
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.first is not None


def run_diff(o: DiffOptions) -> DiffRun:
    from attnscope.tensors.saved import read_saved

    for flag, value in (("--atol", o.atol), ("--rtol", o.rtol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} {value:g}: give a tolerance of 0 or more")
    a, b = read_saved(o.a), read_saved(o.b)
    guard_memory(a.nbytes + b.nbytes, None, what="the two runs hold", advice="compare smaller runs")
    common = [name for name in a.entries if name in b.entries]
    if not common:
        raise UsageError(f"{o.a} and {o.b} hold no step of the same name ({_listed(a)} against {_listed(b)}); "
                         "diff compares two runs of the same computation")
    run = DiffRun(o.a, o.b, [], [n for n in a.entries if n not in b.entries],
                  [n for n in b.entries if n not in a.entries],
                  params={"a": o.a, "b": o.b, "atol": o.atol, "rtol": o.rtol})
    loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in common:
        ta, tb = a.load(name), b.load(name)
        loaded[name] = (ta, tb)
        row = _compare(name, ta, tb, a.meta.get(name, {}).get("dims"), o)
        run.rows.append(row)
        if row.status != "agrees" and run.first is None:
            run.first = name
            run.diagnosis = _why(name, row, a, loaded, b)
    inputs = [row.name for row in run.rows if row.status != "agrees" and _is_input(a.meta.get(row.name, {}))]
    if inputs:
        run.notes.append(f"inputs or weights differ too ({', '.join(inputs[:6])}{', ...' if len(inputs) > 6 else ''})"
                         ": the two runs did not start from the same numbers (the same --seed, or the same files)")
    recomputed = [n for n in common if a.meta.get(n, {}).get("recomputed") or b.meta.get(n, {}).get("recomputed")]
    if recomputed:
        run.notes.append(f"{', '.join(recomputed)}: recomputed by trace from a fused kernel's arguments (the kernel "
                         "materializes none of them)")
    return run


def _is_input(meta: dict[str, Any]) -> bool:
    """What a run was given rather than computed: its inputs, a module's weights, the mask."""
    op = str(meta.get("op", ""))
    return op.startswith("input") or "torch.randn" in op or "loaded from" in op or "nn.Linear(" in op


def _listed(run: SavedRun) -> str:
    names = [n or "(one unnamed tensor)" for n in run.entries]
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


def _compare(name: str, ta: torch.Tensor, tb: torch.Tensor, dims: Any, o: DiffOptions) -> DiffRow:
    import torch

    from attnscope.check.comparison import compare, tolerance

    dtype_a, dtype_b = (str(t.dtype).removeprefix("torch.") for t in (ta, tb))
    dims = list(dims) if isinstance(dims, list) and len(dims) == ta.dim() else None
    if ta.shape != tb.shape:
        return DiffRow(name, dims, list(ta.shape), list(tb.shape), dtype_a, dtype_b, None, None, "shape",
                       f"shape {list(ta.shape)} in A, {list(tb.shape)} in B")
    floating = ta.is_floating_point() and tb.is_floating_point()
    wide = torch.promote_types(ta.dtype, tb.dtype) if floating else torch.float64
    atol, rtol = tolerance(ta.dtype, tb.dtype) if floating else (0.0, 0.0)  # masks and integers: exactly
    atol = atol if o.atol is None else o.atol
    rtol = rtol if o.rtol is None else o.rtol
    ta, tb = ta.to(wide), tb.to(wide)
    c = compare(name, "A", tb, ta)
    finite = ta[torch.isfinite(ta)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    tol = atol + rtol * scale
    status = "agrees" if c.max_abs_diff <= tol else "differs"
    return DiffRow(name, dims, list(ta.shape), list(tb.shape), dtype_a, dtype_b, c.max_abs_diff, tol, status, c.detail)


def _which_masks(name: str, a: SavedRun, b: SavedRun) -> str:
    """Where one run masks its scores and the other does not (a run with --causal against one without), the
    divergence from the masked step on is that: say which run masks, and how. '' where both or neither mask."""
    import torch

    has = {side: "masked_scores" in run.entries for side, run in (("A", a), ("B", b))}
    if has["A"] == has["B"] or name in ("masked_scores", *_BEFORE_MASK) or name.endswith(("_feat", "_split")):
        return ""
    side, other = ("A", "B") if has["A"] else ("B", "A")
    masked = (a if has["A"] else b).load("masked_scores")
    allowed = ~torch.isneginf(masked.double())
    return (f"{side} masks its scores and {other} does not: {side}'s masked_scores {_mask_words(allowed)}, and "
            f"{other} holds no masked_scores; the runs were asked for different masks (--causal, --window or --mask "
            f"given to {side}'s run only), so every step from the mask on differs. Give both the same mask options "
            "to compare the rest")


_BEFORE_MASK = ("Q", "K", "V", "scores", "cos", "sin", "Q_rot", "K_rot", "K_rep", "V_rep", "K_cat", "V_cat")


def _mask_words(allowed: torch.Tensor) -> str:
    """A saved mask in words: causal (which alignment), a sliding window, or how many cells it masks."""
    import torch

    from attnscope import masks
    from attnscope.spec import AttentionSpec

    n_Q, n_K = allowed.shape[-2:]
    for align in ("upper-left", "lower-right"):
        for window in (None, *range(1, n_K)):
            built, _ = masks.structural(AttentionSpec(causal=align, window=window), n_Q, n_K)
            if built is not None and bool(torch.equal(allowed, built.expand_as(allowed))):
                return (f"are under a sliding window of {window} ({align}, --window {window})" if window else
                        f"are under a causal mask ({align}, --causal" + ("" if align == "upper-left" else
                                                                          " lower-right") + ")")
    return f"mask {int((~allowed).sum())} of its {allowed.numel()} scores"


def _why(name: str, row: DiffRow, a: SavedRun, loaded: dict[str, tuple[torch.Tensor, torch.Tensor]],
         b: SavedRun) -> str:
    """The diagnosis trace would give, B's tensors standing for the user's and A's steps for the reference's."""
    if row.status == "shape":
        return row.detail
    masking = _which_masks(name, a, b)
    if masking:
        return masking
    from attnscope.trace import Trace
    from attnscope.usertrace.align import candidates
    from attnscope.usertrace.diagnose import diagnose
    from attnscope.usertrace.diagnosis import Context
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.refruns import reference_allowed

    trace, records, sizes = Trace(), list[Record](), dict[str, int]()
    for step, (ta, tb) in loaded.items():
        dims = a.meta.get(step, {}).get("dims")
        if not ta.is_floating_point() or not isinstance(dims, list) or len(dims) != ta.dim():
            continue
        trace.add(step, ta.double(), tuple(dims), str(a.meta.get(step, {}).get("op", "")))
        record = Record(len(records), "saved", "saved", tb.double(), 0, [], "method", True, 0, (), [step],
                        {"who": f"B's {step}"})
        records.append(record)
        sizes.update({d: int(n) for d, n in zip(dims, ta.shape, strict=True) if "·" not in d})
    if name not in trace:
        return row.detail
    kind = "module" if "d_head" in sizes else "function"
    ctx = Context(kind, sizes, trace, records, reference_allowed(trace), comparing=True)
    found = diagnose(name, ctx, candidates(records, trace[name], name))
    return found.text.replace("none of the usual causes fits", "none of the causes trace knows fits")
