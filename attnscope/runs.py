"""What the `sdpa` and `mha` commands do, between parsing options and rendering: build the inputs and the
mask, guard memory, run the traced attention, check it against PyTorch, save it.

No terminal code here: a run returns a `RunResult` that render.py shows. torch is imported inside the
functions, after the memory guard, so a run that cannot fit is refused before torch has even loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.check import Comparison
    from attnscope.trace import Trace

# Headroom when the limit is what the machine has: the estimate is good to a few percent, the rest of
# the system is not ours to count on.
MACHINE_MARGIN = 1.2


@dataclass
class AttentionOptions:
    """Options `sdpa` and `mha` share."""

    seed: int = 0
    q: str | None = None
    k: str | None = None
    v: str | None = None
    causal: str | None = None  # "upper-left" or "lower-right"
    mask: str | None = None
    pad: int = 0
    check: bool = False
    meta: bool = False
    max_memory: int | None = None
    save: str | None = None
    force: bool = False
    heatmap: bool = False
    heatmap_batch: int = 0
    heatmap_head: int = 0


@dataclass
class SdpaOptions(AttentionOptions):
    batch: int = 3
    nq: int = 30
    nk: int = 50
    dk: int = 128
    dv: int = 256
    x: str | None = None
    wq: str | None = None
    wk: str | None = None
    wv: str | None = None
    layout: str = "row"
    scale: float | None = None


@dataclass
class MhaOptions(AttentionOptions):
    batch: int = 128
    nq: int = 32
    nk: int | None = None
    d_feat: int = 200
    heads: int = 5
    bias: bool = True
    dropout: float = 0.0


@dataclass
class Heatmap:
    """One [n_Q, n_K] attention pattern with its axis labels."""

    title: str
    matrix: list[list[float]]
    row_labels: list[str]
    col_labels: list[str]


@dataclass
class RunResult:
    command: str
    header: str
    params: dict[str, Any]
    trace: Trace
    peak_bytes: int
    fused_bytes: int
    comparisons: list[Comparison] = field(default_factory=list)
    saved: Path | None = None
    heatmap: Heatmap | None = None

    @property
    def check_failed(self) -> bool:
        return any(not c.passed for c in self.comparisons)


# --- shared ----------------------------------------------------------------------------------------


def guard_memory(needed: int, max_memory: int | None) -> None:
    """Refuse, with the estimate, a run that would not fit: better one line now than a process killed later."""
    if max_memory is not None:
        if needed > max_memory:
            raise ResourceError(
                f"this run needs about {cost.format_bytes(needed)}, more than --max-memory "
                f"{cost.format_bytes(max_memory)}; use --meta to see every shape and cost without allocating"
            )
        return
    available = cost.available_memory()
    if available is not None and needed * MACHINE_MARGIN > available:
        raise ResourceError(
            f"this run needs about {cost.format_bytes(needed)} but this machine has "
            f"{cost.format_bytes(available)} available; use --meta to see every shape and cost without "
            "allocating, or shrink the sizes"
        )


def _check_common(o: AttentionOptions) -> None:
    if o.meta and (o.check or o.save or o.heatmap):
        used = [name for name, on in (("--check", o.check), ("--save", o.save), ("--heatmap", o.heatmap)) if on]
        raise UsageError(f"--meta computes shapes only, no numbers; drop --meta or {' and '.join(used)}")
    if (o.k or o.v) and not o.q:
        raise UsageError("--k/--v need --q too (with only --q, attention is self-attention: K = V = Q)")
    if o.pad < 0:
        raise UsageError(f"--pad {o.pad}: the number of padded keys cannot be negative")
    if o.save:
        from attnscope.tensors import check_writable

        check_writable(o.save, o.force)


def _load(spec: str | None) -> torch.Tensor | None:
    from attnscope.tensors import load_tensor

    return load_tensor(spec) if spec else None


def _build_mask(o: AttentionOptions, user_mask: torch.Tensor | None, n_Q: int, n_K: int, device: Any,
                columns: bool = False) -> torch.Tensor | None:
    """Causal, padding and file masks, combined (all must allow a key). In the column layout the scores are
    [n_K, n_Q], so the built masks are transposed to match."""
    from attnscope import masks

    built = None
    if o.causal:
        causal = masks.causal_mask(n_Q, n_K, o.causal, device)  # type: ignore[arg-type]
        built = causal.transpose(0, 1) if columns else causal
    if o.pad:
        padding = masks.key_padding_mask(n_K, o.pad, device)  # [n_K]
        built = masks.combine(built, padding.unsqueeze(-1) if columns else padding)
    if user_mask is not None:
        built = masks.combine(built, user_mask.to(device))
    return built


def _input_op(spec: str | None, random_op: str) -> str:
    return f"loaded from {spec}" if spec else random_op


def _finish(o: AttentionOptions, result: RunResult) -> RunResult:
    """Heatmap and --save, the same for every command."""
    if o.heatmap:
        result.heatmap = heatmap_of(result.trace["attention"], o.heatmap_batch, o.heatmap_head)
    if o.save:
        from attnscope.tensors import save_tensors

        meta = {s.name: {"dims": list(s.dims), "op": s.op} for s in result.trace.steps}
        result.saved = save_tensors(dict(result.trace), o.save, force=o.force, metadata=meta)
    return result


def heatmap_of(attention: torch.Tensor, batch: int, head: int) -> Heatmap:
    """Pick one [n_Q, n_K] pattern out of `[n_batch, (n_head,) n_Q, n_K]`."""
    index: list[int] = []
    leading = list(attention.shape[:-2])
    wanted = [batch, head][: len(leading)] + [0] * max(0, len(leading) - 2)
    for axis, (size, i) in enumerate(zip(leading, wanted, strict=True)):
        if not 0 <= i < size:
            option = "--heatmap-batch" if axis == 0 else "--heatmap-head"
            raise UsageError(f"{option} {i} is out of range: valid is 0 to {size - 1}")
        index.append(i)
    matrix = attention[tuple(index)] if index else attention
    where = ", ".join(f"{name}={i}" for name, i in zip(("n_batch", "n_head"), index, strict=False))
    return Heatmap(f"attention{f' at {where}' if where else ''}", matrix.tolist(),
                   [f"q{i}" for i in range(matrix.shape[0])], [f"k{j}" for j in range(matrix.shape[1])])


# --- sdpa ------------------------------------------------------------------------------------------


def run_sdpa(o: SdpaOptions) -> RunResult:
    _check_sdpa_options(o)
    files = {"Q": o.q, "K": o.k, "V": o.v, "X": o.x, "W_Q": o.wq, "W_K": o.wk, "W_V": o.wv}
    random_inputs = not any(files.values())
    masked = bool(o.causal or o.pad or o.mask)
    if random_inputs and not o.meta:
        needed = cost.sdpa_bytes(o.batch, o.nq, o.nk, o.dk, o.dv, masked=masked)
        guard_memory(needed + _flag_overhead(o, needed), o.max_memory)
    import torch

    from attnscope.tensors import load_tensor

    user_mask = _load(o.mask)
    loaded = {name: load_tensor(spec) for name, spec in files.items() if spec}
    if "Q" in loaded:  # self-attention when only --q (and --k) are given
        loaded.setdefault("K", loaded["Q"])
        loaded.setdefault("V", loaded["K"])

    with torch.no_grad():
        if not random_inputs:
            estimate, estimate_mask = _sdpa_trace(o, {n: t.to("meta") for n, t in loaded.items()}, user_mask, "meta")
            peak = cost.traced_peak_bytes(estimate.steps, _inputs_bytes(estimate_mask))
            if not o.meta:
                guard_memory(peak + _flag_overhead(o, peak), o.max_memory)
            inputs = loaded
        else:
            inputs = _random_sdpa_inputs(o, "meta" if o.meta else "cpu")
        trace, mask = _sdpa_trace(o, inputs, user_mask, "meta" if o.meta else "cpu")

    comparisons: list[Comparison] = []
    if o.check or o.layout == "col":
        from attnscope import check

        if o.layout == "col":
            comparisons = check.check_sdpa_columns(trace, mask, o.scale)
            if not o.meta:
                trace.notes.append(f"column layout: out equals the row form's out transposed "
                                   f"(max |diff| = {comparisons[0].max_abs_diff:.2e})")
            comparisons = comparisons if o.check else []
        else:
            comparisons = check.check_sdpa(trace, mask, o.scale)

    Q, K, V = trace["Q"], trace["K"], trace["V"]
    col = o.layout == "col"
    n_Q, d_K = (Q.shape[-1], Q.shape[-2]) if col else (Q.shape[-2], Q.shape[-1])
    n_K, d_V = (K.shape[-1], V.shape[-2]) if col else (K.shape[-2], V.shape[-1])
    batch = list(trace["scores"].shape[:-2])
    params: dict[str, Any] = {"batch": batch, "nq": n_Q, "nk": n_K, "dk": d_K, "dv": d_V, "seed": o.seed,
                              "layout": o.layout, "scale": o.scale, "causal": o.causal, "pad": o.pad,
                              "mask": o.mask, "meta": o.meta,
                              "inputs": {n: s for n, s in files.items() if s} or "random"}
    formula = ("out = V · softmax(Kᵀ Q / √d_K), softmax over keys (dim -2)" if col
               else "out = softmax(Q Kᵀ / √d_K) V")
    if o.scale is not None:
        formula = formula.replace("/ √d_K", f"· {o.scale:g}")
    sizes = "".join(f"{name}={n}  " for name, n in zip(trace.step("scores").dims, batch, strict=False))
    header = f"SDPA  {formula}\n{sizes}n_Q={n_Q}  n_K={n_K}  d_K={d_K}  d_V={d_V}"
    header += f"  seed={o.seed}" if random_inputs else ""
    extra = _inputs_bytes(mask)
    result = RunResult("sdpa", header, params, trace, cost.traced_peak_bytes(trace.steps, extra),
                       cost.fused_peak_bytes(trace.steps, extra), comparisons)
    return _finish(o, result)


def _check_sdpa_options(o: SdpaOptions) -> None:
    _check_common(o)
    projection = [o.x, o.wq, o.wk, o.wv]
    if any(projection) and not all(projection):
        raise UsageError("the matrix form needs all four of --x, --wq, --wk and --wv")
    if o.x and (o.q or o.k or o.v):
        raise UsageError("give either --q/--k/--v or --x with --wq/--wk/--wv, not both")
    if o.x and o.layout == "col":
        raise UsageError("--x/--wq/--wk/--wv use the row layout (X [n, p] @ W [p, d]); drop --layout col")
    if o.layout not in ("row", "col"):
        raise UsageError(f"--layout {o.layout}: use row or col")


def _flag_overhead(o: AttentionOptions, traced: int) -> int:
    """What the output flags add to a traced run's peak: --save writes contiguous private copies of the
    steps, and --check runs PyTorch's own attention beside it, which (on CPU, or with attention weights
    returned) materializes as much again."""
    return traced * (bool(o.save) + bool(o.check))


def _random_sdpa_inputs(o: SdpaOptions, device: str) -> dict[str, torch.Tensor]:
    import torch

    generator = torch.Generator().manual_seed(o.seed) if device != "meta" else None
    shapes = {"Q": (o.nq, o.dk), "K": (o.nk, o.dk), "V": (o.nk, o.dv)}
    if o.layout == "col":
        shapes = {name: (d, n) for name, (n, d) in shapes.items()}
    return {name: torch.randn(o.batch, *shape, generator=generator, device=device)
            for name, shape in shapes.items()}


def _sdpa_trace(o: SdpaOptions, inputs: dict[str, torch.Tensor], user_mask: torch.Tensor | None,
                device: str) -> tuple[Trace, torch.Tensor | None]:
    """The traced run, and the mask it used (the check needs the same mask)."""
    from attnscope.attention import project, sdpa, sdpa_columns

    prefix = None
    if "X" in inputs:
        prefix = project(inputs["X"], inputs["W_Q"], inputs["W_K"], inputs["W_V"])
        Q, K, V = prefix["Q"], prefix["K"], prefix["V"]
    else:
        Q, K, V = inputs["Q"], inputs["K"], inputs["V"]
    col = o.layout == "col"
    mask = None
    if Q.dim() >= 2 and K.dim() >= 2:  # else sdpa names the bad rank
        n_Q, n_K = (Q.shape[-1], K.shape[-1]) if col else (Q.shape[-2], K.shape[-2])
        mask = _build_mask(o, user_mask, n_Q, n_K, device, columns=col)
    trace = sdpa_columns(Q, K, V, mask, o.scale) if col else sdpa(Q, K, V, mask, o.scale)
    if prefix is not None:
        for step in trace.steps[3:]:
            prefix.add_step(step)
        prefix.notes.extend(trace.notes)
        for name, spec in (("X", o.x), ("W_Q", o.wq), ("W_K", o.wk), ("W_V", o.wv)):
            prefix.set_op(name, f"loaded from {spec}")
        return prefix, mask
    dims = ("d_K", "n_Q") if col else ("n_Q", "d_K")
    rand = {"Q": dims, "K": ("d_K", "n_K") if col else ("n_K", "d_K"), "V": ("d_V", "n_K") if col else ("n_K", "d_V")}
    for name, spec in (("Q", o.q), ("K", o.k or o.q), ("V", o.v or o.k or o.q)):
        trace.set_op(name, _input_op(spec, f"torch.randn(n_batch, {', '.join(rand[name])})"))
    return trace, mask


# --- mha -------------------------------------------------------------------------------------------


def run_mha(o: MhaOptions) -> RunResult:
    _check_mha_options(o)
    cross = o.nk is not None and o.nk != o.nq
    n_K = o.nk if o.nk is not None else o.nq
    masked = bool(o.causal or o.pad or o.mask)
    if not o.q and not o.meta:
        needed = cost.mha_bytes(o.batch, o.nq, n_K, o.d_feat, o.heads, bias=o.bias, cross=cross, masked=masked)
        guard_memory(needed + _flag_overhead(o, needed), o.max_memory)
    import torch

    from attnscope.attention import MultiHeadAttention

    user_mask = _load(o.mask)
    Q, K, V = _load(o.q), _load(o.k), _load(o.v)
    device = "meta" if o.meta else "cpu"
    dtype_note = None
    if Q is not None and Q.dim() != 3:  # before reading d_feat from it: the rank is what is wrong
        raise UsageError(f"--q {o.q} is {list(Q.shape)} but multi-head attention takes [n_batch, n, d_feat]")
    d_feat = int(Q.shape[-1]) if Q is not None else o.d_feat
    check_heads(d_feat, o.heads, from_file=Q is not None)
    if Q is None:
        generator = torch.Generator().manual_seed(o.seed) if not o.meta else None
        Q = torch.randn(o.batch, o.nq, d_feat, generator=generator, device=device)
        K = torch.randn(o.batch, n_K, d_feat, generator=generator, device=device) if cross else Q
        V = torch.randn(o.batch, n_K, d_feat, generator=generator, device=device) if cross else Q
    else:
        from attnscope.attention import common_dtype

        K = Q if K is None else K
        V = K if V is None else V
        dtype, dtype_note = common_dtype(Q, K, V)  # integers -> float32, mixed floats -> the wider one
        Q, K, V = (t.to(dtype) for t in (Q, K, V))
        if o.meta:
            Q, K, V = Q.to("meta"), K.to("meta"), V.to("meta")
    n_batch = int(Q.shape[0]) if Q.dim() == 3 else 0
    n_Q, n_K = (int(Q.shape[1]), int(K.shape[1])) if Q.dim() == 3 and K.dim() == 3 else (0, 0)
    mask = _build_mask(o, user_mask, n_Q, n_K, device) if n_Q else None

    with torch.no_grad():
        if o.q and not o.meta:  # file inputs: the estimate needs their shapes, so it comes after loading
            shadow = MultiHeadAttention(d_feat, o.heads, bias=o.bias, device="meta", dtype=Q.dtype)
            estimate = shadow(Q.to("meta"), K.to("meta"), V.to("meta"),
                              mask.to("meta") if mask is not None else None)
            needed = cost.traced_peak_bytes(estimate.steps, _inputs_bytes(Q, K, V, mask) + _param_bytes(shadow))
            guard_memory(needed + _flag_overhead(o, needed), o.max_memory)
        torch.manual_seed(o.seed)
        # the weights take the inputs' dtype: a float64 file runs in float64, as sdpa does
        module = MultiHeadAttention(d_feat, o.heads, bias=o.bias, dropout_p=o.dropout, device=device, dtype=Q.dtype)
        module.train(o.dropout > 0)  # dropout is applied only when asked for
        trace = module(Q, K, V, mask)
        if o.q and dtype_note:
            trace.notes.append(dtype_note)

    comparisons: list[Comparison] = []
    if o.check:
        from attnscope import check

        comparisons = check.check_mha(module, trace, Q, K, V, mask)

    extra = _inputs_bytes(Q, K, V, mask) + _param_bytes(module)
    params: dict[str, Any] = {"batch": n_batch, "nq": n_Q, "nk": n_K, "d_feat": d_feat, "heads": o.heads,
                              "d_head": module.d_head, "bias": o.bias, "dropout": o.dropout, "seed": o.seed,
                              "causal": o.causal, "pad": o.pad, "mask": o.mask, "meta": o.meta,
                              "inputs": {n: s for n, s in (("Q", o.q), ("K", o.k), ("V", o.v)) if s} or "random"}
    kind = "cross-attention" if K is not Q else "self-attention"
    header = (f"MHA ({kind})  x = W_o(merge_heads(softmax(Q_split K_splitᵀ / √d_head) V_split))\n"
              f"n_batch={n_batch}  n_Q={n_Q}  n_K={n_K}  d_feat={d_feat}  n_head={o.heads}  "
              f"d_head={module.d_head}  seed={o.seed}")
    result = RunResult("mha", header, params, trace, cost.traced_peak_bytes(trace.steps, extra),
                       cost.fused_peak_bytes(trace.steps, extra), comparisons)
    return _finish(o, result)


def _check_mha_options(o: MhaOptions) -> None:
    _check_common(o)
    if not 0.0 <= o.dropout < 1.0:
        raise UsageError(f"--dropout {o.dropout:g} is outside [0, 1): it is the probability of zeroing a weight")
    if o.check and o.dropout > 0:
        raise UsageError("--check compares exact numbers and dropout makes them random; drop --dropout or --check")
    if not o.q:
        check_heads(o.d_feat, o.heads, from_file=False)


def check_heads(d_feat: int, heads: int, from_file: bool) -> None:
    """d_head = d_feat / n_head must be whole; name both numbers and the nearest head counts that divide."""
    if d_feat % heads:
        near = " or ".join(f"--heads {h}" for h in cost.divisors_near(d_feat, heads))
        source = f"the inputs' d_feat {d_feat}" if from_file else f"--d-feat {d_feat}"
        raise UsageError(f"{source} is not divisible by --heads {heads} (d_head = d_feat / n_head must be whole); "
                         f"try {near}")


def _inputs_bytes(*tensors: torch.Tensor | None) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
