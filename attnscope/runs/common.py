"""What the `sdpa` and `mha` runs share: options, the result, the memory guard, masks from options,
the heatmap and --save.

No terminal code here: a run returns a `RunResult` that attnscope.render shows. torch is imported inside the
functions, after the memory guard, so a run that cannot fit is refused before torch has even loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.check import Asked, Comparison
    from attnscope.headstats import LayerHeads
    from attnscope.maskview import MaskView
    from attnscope.trace import Step, Trace

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
    all_heads: bool = False  # every head of one batch element (--heatmap-batch), with its statistics
    # today's variants (docs/modern-attention.md)
    window: int | None = None
    softcap: float | None = None
    alibi: bool = False
    rope: bool = False
    rope_base: float | None = None
    cache: int = 0
    show_mask: bool = False


@dataclass
class Heatmap:
    """One [n_Q, n_K] attention pattern with its axis labels."""

    title: str
    matrix: list[list[float]]
    row_labels: list[str]
    col_labels: list[str]

    def _repr_html_(self) -> str:
        """Jupyter draws the pattern as an inline heatmap (notebook.py)."""
        from attnscope.notebook import pattern_svg

        return pattern_svg(self.matrix, self.row_labels, self.col_labels, self.title)


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
    saved_names: list[str] = field(default_factory=list)
    heatmap: Heatmap | None = None
    heads: LayerHeads | None = None  # --all-heads
    kv_cache_bytes: int = 0
    mask_view: MaskView | None = None

    @property
    def check_failed(self) -> bool:
        return any(not c.passed for c in self.comparisons)


# --- shared ----------------------------------------------------------------------------------------


META_ADVICE = "use --meta to see every shape and cost without allocating, or shrink the sizes"


def guard_memory(needed: int, max_memory: int | None, what: str = "this run needs",
                 advice: str = META_ADVICE) -> None:
    """Refuse, with the estimate, a run that would not fit: better one line now than a process killed later.
    `advice` names what the command offers instead (bench has no --meta)."""
    if max_memory is not None:
        if needed > max_memory:
            raise ResourceError(f"{what} about {cost.format_bytes(needed)}, more than --max-memory "
                                f"{cost.format_bytes(max_memory)}; {advice}")
        return
    available = cost.available_memory()
    if available is not None and needed * MACHINE_MARGIN > available:
        raise ResourceError(f"{what} about {cost.format_bytes(needed)} but this machine has "
                            f"{cost.format_bytes(available)} available; {advice}")


# PyTorch's sizes and seeds are 64-bit integers; a larger one gets a C++ backtrace out of torch.
INT64 = 2**63


def check_numbers(o: Any, texts: tuple[str, ...] = ()) -> None:
    """Every option of a run's options dataclass, today's and tomorrow's: an empty file name, or an integer
    beyond PyTorch's 64 bits (a ValueError or a C++ backtrace out of torch), refused in one line. `texts`
    are the string options that are no file names."""
    for option in fields(o):
        value = getattr(o, option.name)
        flag = "--" + option.name.replace("_", "-")
        if value == "" and option.name not in texts:
            raise UsageError(f"{flag} '': an empty file name; give a file, or leave {flag} out")
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise UsageError(f"{flag} {value}: out of range; PyTorch takes 64-bit integers (-2^63 to 2^63 - 1)")


def check_common(o: AttentionOptions) -> None:
    check_numbers(o)
    if o.meta and (o.check or o.save or o.heatmap or o.all_heads):
        used = [name for name, on in (("--check", o.check), ("--save", o.save), ("--heatmap", o.heatmap),
                                      ("--all-heads", o.all_heads)) if on]
        raise UsageError(f"--meta computes shapes only, no numbers; drop --meta or {' and '.join(used)}")
    if (o.k or o.v) and not o.q:
        raise UsageError("--k/--v need --q too (with only --q, attention is self-attention: K = V = Q)")
    if o.pad < 0:
        raise UsageError(f"--pad {o.pad}: the number of padded keys cannot be negative")
    check_variants(o)
    for option in fields(o):  # after the options' own checks, which say more
        value = getattr(o, option.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{option.name.replace('_', '-')} {value}: give a finite number")
    if o.save:
        from attnscope.tensors import check_writable

        check_writable(o.save, o.force)


def check_variants(o: AttentionOptions) -> None:
    """The variant options' own sense, before anything is loaded or computed."""
    if o.softcap is not None and not (math.isfinite(o.softcap) and o.softcap > 0):
        raise UsageError(f"--softcap {o.softcap:g}: the cap must be a positive number (Gemma 2 uses 50)")
    check_positions(o)


def check_positions(o: Any) -> None:
    """--window, --rope/--rope-base and --cache: their own sense (any options with those fields: trace's too)."""
    if o.window is not None and o.window < 1:
        raise UsageError(f"--window {o.window}: a query must see at least itself, so the window is 1 or more")
    if o.rope_base is not None and not o.rope:
        raise UsageError("--rope-base sets RoPE's base; add --rope to rotate Q and K")
    if o.rope_base is not None and not (math.isfinite(o.rope_base) and o.rope_base > 1):
        raise UsageError(f"--rope-base {o.rope_base:g} must be a number above 1 (LLaMA uses 10000 or 500000)")
    if o.cache < 0:
        raise UsageError(f"--cache {o.cache}: the number of cached positions cannot be negative")
    effective_causal(o)


def effective_causal(o: Any) -> str | None:
    """The causal alignment the run uses: a KV cache puts the new queries after the cached positions, so
    causal aligns lower-right (a decode step is causal); a window alone is causal upper-left."""
    if o.cache:
        if o.causal == "upper-left":
            raise UsageError(f"--cache {o.cache} puts the queries after {o.cache} cached positions, so causal "
                             "aligns lower-right; drop --causal upper-left")
        return "lower-right"
    if o.window is not None and not o.causal:
        return "upper-left"
    return o.causal


def rope_base(o: Any) -> float | None:
    """RoPE's base as the run uses it (10000, LLaMA's, unless --rope-base says otherwise); None without --rope."""
    if not o.rope:
        return None
    return 10000.0 if o.rope_base is None else o.rope_base


def variant_kwargs(o: AttentionOptions) -> dict[str, Any]:
    """The keywords `sdpa` and `MultiHeadAttention` take for what the options asked."""
    from attnscope.rope import Rope

    base = rope_base(o)
    return {"causal": effective_causal(o), "window": o.window, "softcap": o.softcap, "alibi": o.alibi,
            "rope": Rope(base) if base is not None else None}


def asked(o: AttentionOptions, scale: float | None) -> Asked:
    """The same options in the check's own words: it builds its reference from these and the raw inputs."""
    from attnscope.check import Asked

    return Asked(causal=effective_causal(o), window=o.window, pad=o.pad, scale=scale, softcap=o.softcap,
                 alibi=o.alibi, rope_base=rope_base(o))


def structural_bytes(o: AttentionOptions, n_Q: int, n_K: int) -> int:
    """The causal or window mask sdpa builds and holds while it runs: one bool per (query, key)."""
    return n_Q * n_K if effective_causal(o) or o.window is not None else 0


def check_addressable(needed: int) -> None:
    """--meta allocates nothing, but PyTorch still counts every tensor's bytes in 64 bits."""
    if needed >= INT64:
        raise UsageError(f"these sizes need about {cost.format_bytes(needed)}, beyond the 2^63 bytes PyTorch can "
                         "count even on the meta device; shrink the sizes")


def guard_files(specs: list[str | None], max_memory: int | None) -> None:
    """Before any data is read, the input files' tensors, sized from their headers, must fit together (in
    --max-memory, or in what the machine has). A file whose header alone cannot be read (a legacy .pt) counts
    by its size on disk, about what loading it takes."""
    from attnscope.tensors import HeaderUnreadable, load_tensor

    needed = 0
    for spec in {spec for spec in specs if spec}:
        try:
            shape = load_tensor(spec, meta=True)
        except HeaderUnreadable as exc:
            needed += exc.size
            continue
        except UsageError:
            continue  # its load names what is wrong
        needed += shape.numel() * shape.element_size()
    guard_memory(needed, max_memory, what="the input files hold")


def load(spec: str | None, meta: bool = False) -> torch.Tensor | None:
    """A tensor from a file; with --meta only its shape and dtype, from the file's header (no data is read)."""
    from attnscope.tensors import load_tensor

    return load_tensor(spec, meta=meta) if spec else None


def build_mask(o: AttentionOptions, user_mask: torch.Tensor | None, n_Q: int, n_K: int, device: Any,
               columns: bool = False, scores_shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """The mask file and padding, combined (both must allow a key); causal and window masks are sdpa's own
    (`variant_kwargs`). The file's mask is checked against the scores' shape and put under the dtype rule
    first. In the column layout the scores are [n_K, n_Q]: padding is transposed, and causal is added here."""
    from attnscope import masks

    built = None
    if user_mask is not None:
        # Checked before it meets the padding mask, which would broadcast it first; without the scores' shape,
        # against its own batch dims and [n_Q, n_K].
        trailing = (n_K, n_Q) if columns else (n_Q, n_K)
        masks.check_broadcast(user_mask, scores_shape or (*user_mask.shape[:-2], *trailing))
        built = masks.normalize(user_mask.to(device))
    if o.pad:
        padding = masks.key_padding_mask(n_K, o.pad, device)  # [n_K]
        built = masks.combine(built, padding.unsqueeze(-1) if columns else padding)
    if columns and o.causal:
        built = masks.combine(built, masks.causal_mask(n_Q, n_K, o.causal, device).transpose(0, 1))  # type: ignore[arg-type]
    # [n_K] (key padding, or a 1-D mask; [n_Q] in the column layout) as [1, n_K]: the same for every query,
    # in the [.., n_Q, n_K] form every consumer takes (PyTorch's CPU attention refuses a 1-D attn_mask).
    return built.reshape(1, -1) if built is not None and built.dim() < 2 else built


def random_inputs(shapes: Mapping[str, tuple[int, ...]], seed: int, device: str) -> dict[str, torch.Tensor]:
    """One generator for all, drawn in order, so a seed gives the same inputs every time."""
    import torch

    if device == "meta":
        return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def input_op(spec: str | None, random_op: str) -> str:
    return f"loaded from {spec}" if spec else random_op


# What --save writes beside the steps, described in the file as the steps are.
SavedExtra = dict[str, tuple["torch.Tensor", tuple[str, ...], str]]  # name -> (tensor, dims, op)


def finish(o: AttentionOptions, result: RunResult, extra: SavedExtra | None = None) -> RunResult:
    """Heatmap and --save, the same for every command. --save writes every step and `extra` (inputs that are
    not steps, the mask, a module's parameters), so that anyone can run the same computation again."""
    if o.heatmap:
        result.heatmap = heatmap_of(result.trace.step("attention"), o.heatmap_batch, o.heatmap_head)
    if o.all_heads:
        result.heads = heads_of(result.trace.step("attention"), o.heatmap_batch, effective_causal(o))
    if o.save:
        from attnscope.tensors import save_tensors

        tensors = dict(result.trace)
        meta: dict[str, Any] = {s.name: {"dims": list(s.dims), "op": s.op} for s in result.trace.steps}
        for name, (tensor, dims, op) in (extra or {}).items():
            tensors[name], meta[name] = tensor, {"dims": list(dims), "op": op}
        result.saved = save_tensors(tensors, o.save, force=o.force, metadata=meta, option="--save")
        result.saved_names = list(tensors)
    return result


def mask_extra(o: AttentionOptions, mask: torch.Tensor | None, n_Q: int, n_K: int,
               columns: bool = False) -> SavedExtra:
    """The masks a run used, for --save: `mask` as the attention took it (the --mask file and --pad; in the
    column layout, causal too) and `causal_mask`, the causal and window part sdpa builds itself."""
    from attnscope import masks

    extra: SavedExtra = {}
    if mask is not None:
        axes = ("n_K", "n_Q") if columns else ("n_Q", "n_K")
        dims = (*("n_batch", "n_head")[: max(0, mask.dim() - 2)], *axes)[-mask.dim():]
        extra["mask"] = (mask, dims, "--mask and --pad combined, as the attention took it (True = may attend; "
                                     "a float mask is added to the scores)")
    if not columns:
        allowed, described = masks.structural(n_Q, n_K, masks.alignment(effective_causal(o)), o.window)
        if allowed is not None:
            extra["causal_mask"] = (allowed, ("n_Q", "n_K"), f"{described}: True = may attend")
    return extra


def heatmap_of(step: Step, batch: int, head: int) -> Heatmap:
    """Pick one [n_Q, n_K] pattern out of the attention step: `batch` indexes its first leading axis, `head`
    its n_head axis (the last leading one, where there is one), any other leading axis is taken at 0."""
    index: list[int] = []
    where: list[str] = []
    leading = step.dims[:-2]
    labels = [f"q{i}" for i in range(step.shape[-2])], [f"k{j}" for j in range(step.shape[-1])]
    for axis, (name, size) in enumerate(zip(leading, step.shape[:-2], strict=True)):
        if size == 0:  # an empty batch has no pattern to pick
            return Heatmap(f"{step.name} ({name} = 0)", [], *labels)
        is_head = name == "n_head"
        i = head if is_head else batch if axis == 0 else 0
        if not 0 <= i < size:
            option = "--heatmap-head" if is_head else "--heatmap-batch"
            raise UsageError(f"{option} {i} is out of range: {name} is {size}, so valid is 0 to {size - 1}")
        index.append(i)
        where.append(f"head {i}" if is_head else f"batch element {i}" if axis == 0 else f"{name} index {i}")
    if head and "n_head" not in leading:
        raise UsageError(f"--heatmap-head {head}: this attention has no head axis "
                         f"([{', '.join(step.dims)}]); drop --heatmap-head")
    matrix = step.tensor[tuple(index)] if index else step.tensor
    title = f"{step.name}[{', '.join(map(str, index))}] ({', '.join(where)})" if index else step.name
    if step.dims[-2:] == ("n_K", "n_Q"):  # the column layout: drawn with queries as rows, like every other
        matrix, title = matrix.transpose(0, 1), f"{title}, transposed"
    return Heatmap(title, matrix.tolist(), [f"q{i}" for i in range(matrix.shape[0])],
                   [f"k{j}" for j in range(matrix.shape[1])])


def heads_of(step: Step, batch: int, causal: str | None) -> LayerHeads:
    """Every head of batch element `batch` of an `[n_batch, n_head, n_Q, n_K]` attention step, with its
    statistics; query i sits at position i + n_K - n_Q where causal aligns lower-right (a KV cache), else i."""
    from attnscope.headstats import LayerHeads

    if step.dims[-3:-2] != ("n_head",) or len(step.dims) != 4:
        raise UsageError(f"--all-heads draws every head, and this attention has no head axis "
                         f"([{', '.join(step.dims)}]); drop --all-heads")
    n_batch, _, n_Q, n_K = step.shape
    if n_batch and not 0 <= batch < n_batch:
        raise UsageError(f"--heatmap-batch {batch} is out of range: n_batch is {n_batch}, so valid is 0 to "
                         f"{n_batch - 1}")
    offset = n_K - n_Q if causal == "lower-right" else 0
    if not n_batch:  # an empty batch has no heads to draw
        return LayerHeads.of(step.tensor.reshape(0, n_Q, n_K), f"{step.name} (n_batch = 0)", offset=offset)
    return LayerHeads.of(step.tensor[batch], f"{step.name}[{batch}] (batch element {batch})", offset=offset,
                         batch=batch)  # [n_head, n_Q, n_K]


def check_heads(d_feat: int, heads: int, from_file: bool, d_head: int | None = None,
                has_d_head: bool = True) -> None:
    """d_head = d_feat / n_head must be whole unless --d-head gives it; name both numbers and the nearest head
    counts that divide (and --d-head where the command has it: bench has not)."""
    if d_head is None and d_feat % heads:
        near = " or ".join(f"--heads {h}" for h in cost.divisors_near(d_feat, heads))
        source = f"the inputs' d_feat {d_feat}" if from_file else f"--d-feat {d_feat}"
        raise UsageError(f"{source} is not divisible by --heads {heads} (d_head = d_feat / n_head must be whole); "
                         f"try {near}{', or give --d-head' if has_d_head else ''}")


def check_kv_heads(heads: int, kv_heads: int | None) -> None:
    """Grouped-query attention: every key/value head serves a whole group of query heads (`mha`, `bench mha`)."""
    if kv_heads is not None and heads % kv_heads:
        near = " or ".join(f"--kv-heads {h}" for h in cost.divisors_near(heads, kv_heads))
        raise UsageError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}: each key/value head "
                         f"serves a whole group of query heads; try {near}")


def inputs_bytes(*tensors: torch.Tensor | None) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def flag_overhead(o: AttentionOptions, traced: int) -> int:
    """What the output flags add to a traced run's peak: --save writes contiguous private copies of the
    steps, and --check runs PyTorch's own attention beside it, which (on CPU, or with attention weights
    returned) materializes as much again, twice as much where its reference is the float64 formula."""
    formula = o.rope or o.alibi or o.softcap is not None
    return traced * (bool(o.save) + (2 if formula else 1) * bool(o.check))


def finish_variants(o: AttentionOptions, result: RunResult, n_Q: int, n_K: int,
                    user_mask: torch.Tensor | None) -> None:
    """--show-mask: the combined mask of this run as a grid, with its alignment and translations."""
    if o.show_mask:
        from attnscope.maskview import view

        if user_mask is not None and user_mask.device.type == "meta":  # --meta read the file's header only
            user_mask = None
            result.trace.notes.append(f"--show-mask under --meta: {o.mask} is read for its shape only, so the grid "
                                      "leaves its values out")
        result.mask_view = view(n_Q, n_K, causal=effective_causal(o), window=o.window, pad=o.pad,
                                user_mask=user_mask, cache=o.cache)


def variants_line(o: AttentionOptions, n_Q: int, n_K: int) -> str:
    """A header line for the masks and variants in play, the causal alignment spelled out."""
    parts = []
    causal = effective_causal(o)
    if causal:
        offset = n_K - n_Q if causal == "lower-right" else 0
        parts.append(f"causal {causal} (query i sees keys j ≤ i{f' + {offset}' if offset else ''})")
    if o.window is not None:
        parts.append(f"window {o.window}")
    if o.cache:
        parts.append(f"KV cache: {o.cache} cached + {n_Q} new positions")
    if o.rope:
        parts.append(f"RoPE base {rope_base(o):g}")
    if o.alibi:
        parts.append("ALiBi")
    if o.softcap is not None:
        parts.append(f"softcap {o.softcap:g}")
    if o.pad:
        parts.append(f"last {o.pad} keys padded")
    if o.mask:
        parts.append(f"mask {o.mask}")
    lines = [""]
    for part in parts:  # break between items, never inside one
        lines[-1:] = [f"{lines[-1]}  {part}".strip()] if len(lines[-1]) + len(part) < 76 else [lines[-1], part]
    return "".join("\n" + line for line in lines if line)
