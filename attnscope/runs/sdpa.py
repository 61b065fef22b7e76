"""`attnscope sdpa` between parsing and rendering: build the inputs and the mask, guard memory, run the
traced attention, check it against PyTorch, save it. torch is imported after the memory guard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.errors import UsageError
from attnscope.readings.maskview import check_sizes
from attnscope.runs.common import (
    AttentionOptions,
    RunResult,
    asked,
    build_mask,
    check_addressable,
    check_common,
    effective_causal,
    finish,
    finish_variants,
    flag_overhead,
    guard_files,
    guard_memory,
    input_op,
    inputs_bytes,
    load,
    mask_extra,
    random_inputs,
    rope_base,
    structural_bytes,
    variant_kwargs,
    variants_line,
)

if TYPE_CHECKING:
    import torch

    from attnscope.check import Comparison
    from attnscope.trace import Trace


@dataclass
class SdpaOptions(AttentionOptions):
    batch: int = 3
    nq: int = 30
    nk: int | None = None  # default 50, or --cache + --nq
    dk: int = 128
    dv: int = 256
    x: str | None = None
    wq: str | None = None
    wk: str | None = None
    wv: str | None = None
    layout: str = "row"
    scale: float | None = None


DEFAULT_NK = 50


def run_sdpa(o: SdpaOptions) -> RunResult:
    _check_sdpa_options(o)
    files = {"Q": o.q, "K": o.k, "V": o.v, "X": o.x, "W_Q": o.wq, "W_K": o.wk, "W_V": o.wv}
    random_inputs = not any(files.values())
    n_K = _keys(o)
    causal = effective_causal(o)
    if random_inputs:
        offset = n_K - o.nq if causal == "lower-right" else 0
        needed = cost.sdpa_bytes(o.batch, o.nq, n_K, o.dk, o.dv, masked=bool(causal or o.pad or o.mask),
                                 rope=o.rope, softcap=o.softcap is not None, alibi=o.alibi, offset=offset)
        if o.meta:
            check_addressable(needed)
        else:
            guard_memory(needed + flag_overhead(o, needed), o.max_memory)
    import torch

    from attnscope.tensors import load_tensor

    if not o.meta:
        guard_files([*files.values(), o.mask], o.max_memory)
    user_mask = load(o.mask, o.meta)  # with --meta, the headers only
    loaded = {name: load_tensor(spec, meta=o.meta) for name, spec in files.items() if spec}
    if "Q" in loaded:  # self-attention when only --q (and --k) are given
        loaded.setdefault("K", loaded["Q"])
        loaded.setdefault("V", loaded["K"])

    with torch.no_grad():
        if not random_inputs:
            estimate, estimate_mask = _sdpa_trace(o, {n: t.to("meta") for n, t in loaded.items()}, user_mask, "meta")
            peak = cost.traced_peak_bytes(estimate.steps, _held(o, estimate, estimate_mask))
            if not o.meta:
                guard_memory(peak + flag_overhead(o, peak), o.max_memory)
            inputs = loaded
        else:
            inputs = _random_sdpa_inputs(o, n_K, "meta" if o.meta else "cpu")
        trace, mask = _sdpa_trace(o, inputs, user_mask, "meta" if o.meta else "cpu")

    col = o.layout == "col"
    comparisons: list[Comparison] = []
    if (o.check or col) and not o.meta:
        from attnscope import check

        comparisons = check.check_sdpa(trace, inputs, user_mask, asked(o, o.scale), o.layout)
        note = check.input_note({**inputs, "mask": user_mask})
        if note:
            trace.notes.append(note)
        if col:
            trace.notes.append(f"column layout: out equals the row form's out transposed "
                               f"(max |diff| = {comparisons[0].max_abs_diff:.2e})")
            comparisons = comparisons if o.check else []

    Q, K, V = trace["Q"], trace["K"], trace["V"]
    n_Q, d_K = (Q.shape[-1], Q.shape[-2]) if col else (Q.shape[-2], Q.shape[-1])
    n_K, d_V = (K.shape[-1], V.shape[-2]) if col else (K.shape[-2], V.shape[-1])
    batch = list(trace["scores"].shape[:-2])
    params: dict[str, Any] = {"batch": batch, "nq": n_Q, "nk": n_K, "dk": d_K, "dv": d_V, "seed": o.seed,
                              "layout": o.layout, "scale": o.scale, "causal": causal, "pad": o.pad,
                              "mask": o.mask, "meta": o.meta, "window": o.window, "softcap": o.softcap,
                              "alibi": o.alibi, "rope": o.rope, "rope_base": rope_base(o), "cache": o.cache,
                              "inputs": {n: s for n, s in files.items() if s} or "random"}
    params["batch_shape"] = batch  # a list in every command's JSON (here `batch` is one too: any leading dims)
    formula = ("out = V · softmax(Kᵀ Q / √d_K), softmax over keys (dim -2)" if col
               else "out = softmax(Q Kᵀ / √d_K) V")
    if o.scale is not None:
        formula = formula.replace("/ √d_K", f"· {o.scale:g}")
    sizes = "".join(f"{name}={n}  " for name, n in zip(trace.step("scores").dims, batch, strict=False))
    header = f"SDPA  {formula}\n{sizes}n_Q={n_Q}  n_K={n_K}  d_K={d_K}  d_V={d_V}"
    header += f"  seed={o.seed}" if random_inputs else ""
    header += variants_line(o, n_Q, n_K)
    extra = _held(o, trace, mask)
    result = RunResult("sdpa", header, params, trace, cost.traced_peak_bytes(trace.steps, extra),
                       cost.fused_peak_bytes(trace.steps, extra), comparisons)
    result.kv_cache_bytes = inputs_bytes(K, V)
    finish_variants(o, result, n_Q, n_K, user_mask)
    return finish(o, result, mask_extra(o, mask, n_Q, n_K, columns=col))


def _keys(o: SdpaOptions) -> int:
    """n_K of random inputs: --nk, or the cached positions plus the new queries with --cache."""
    if not o.cache:
        return DEFAULT_NK if o.nk is None else o.nk
    if o.nk is not None:
        check_sizes(o.nq, o.nk, o.cache)
    return o.cache + o.nq


def _held(o: SdpaOptions, trace: Trace, mask: torch.Tensor | None) -> int:
    """What the run holds beside its steps: the mask it built, and the causal/window mask sdpa builds."""
    scores = trace.step("scores").shape
    return inputs_bytes(mask) + (structural_bytes(o, scores[-2], scores[-1]) if o.layout == "row" else 0)


def _check_sdpa_options(o: SdpaOptions) -> None:
    check_common(o)
    projection = [o.x, o.wq, o.wk, o.wv]
    if any(projection) and not all(projection):
        raise UsageError("the matrix form needs all four of --x, --wq, --wk and --wv")
    if o.x and (o.q or o.k or o.v):
        raise UsageError("give either --q/--k/--v or --x with --wq/--wk/--wv, not both")
    if o.x and o.layout == "col":
        raise UsageError("--x/--wq/--wk/--wv use the row layout (X [n, p] @ W [p, d]); drop --layout col")
    if o.layout not in ("row", "col"):
        raise UsageError(f"--layout {o.layout}: use row or col")
    variants = [flag for flag, on in (("--rope", o.rope), ("--window", o.window is not None),
                                      ("--softcap", o.softcap is not None), ("--alibi", o.alibi),
                                      ("--cache", o.cache)) if on]
    if o.layout == "col" and variants:
        raise UsageError(f"--layout col shows the textbook column form; {', '.join(variants)} work in the row "
                         "layout: drop --layout col")


def _random_sdpa_inputs(o: SdpaOptions, n_K: int, device: str) -> dict[str, torch.Tensor]:
    shapes = {"Q": (o.nq, o.dk), "K": (n_K, o.dk), "V": (n_K, o.dv)}
    if o.layout == "col":
        shapes = {name: (d, n) for name, (n, d) in shapes.items()}
    return random_inputs({name: (o.batch, *shape) for name, shape in shapes.items()}, o.seed, device)


def _sdpa_trace(o: SdpaOptions, inputs: dict[str, torch.Tensor], user_mask: torch.Tensor | None,
                device: str) -> tuple[Trace, torch.Tensor | None]:
    """The traced run, and the mask it built from the file and padding (the causal and window masks and
    the other variants are sdpa's own keywords)."""
    from attnscope.attention import sdpa
    from attnscope.cost import broadcast_shapes
    from attnscope.textbook import project, sdpa_columns

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
        if o.cache:
            check_sizes(n_Q, n_K, o.cache)
        try:
            batch: tuple[int, ...] | None = broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
        except ValueError:
            batch = None  # sdpa says which batch dims do not broadcast
        scores = None if batch is None else (*batch, *((n_K, n_Q) if col else (n_Q, n_K)))
        mask = build_mask(o, user_mask, n_Q, n_K, device, columns=col, scores_shape=scores)
    if col:
        trace = sdpa_columns(Q, K, V, mask, o.scale)
    else:
        trace = sdpa(Q, K, V, mask, o.scale, enable_gqa=Q.dim() >= 4, **variant_kwargs(o))
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
        trace.set_op(name, input_op(spec, f"torch.randn(n_batch, {', '.join(rand[name])})"))
    return trace, mask
