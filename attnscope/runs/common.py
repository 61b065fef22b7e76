"""What the `sdpa` and `mha` runs share: options, the result, the memory guard, masks from options,
the heatmap and --save.

No terminal code here: a run returns a `RunResult` that attnscope.render shows. torch is imported inside the
functions, after the memory guard, so a run that cannot fit is refused before torch has even loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
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


def guard_memory(needed: int, max_memory: int | None, what: str = "this run needs") -> None:
    """Refuse, with the estimate, a run that would not fit: better one line now than a process killed later."""
    if max_memory is not None:
        if needed > max_memory:
            raise ResourceError(
                f"{what} about {cost.format_bytes(needed)}, more than --max-memory "
                f"{cost.format_bytes(max_memory)}; use --meta to see every shape and cost without allocating"
            )
        return
    available = cost.available_memory()
    if available is not None and needed * MACHINE_MARGIN > available:
        raise ResourceError(
            f"{what} about {cost.format_bytes(needed)} but this machine has "
            f"{cost.format_bytes(available)} available; use --meta to see every shape and cost without "
            "allocating, or shrink the sizes"
        )


# PyTorch's sizes and seeds are 64-bit integers; a larger one gets a C++ backtrace out of torch.
INT64 = 2**63


def check_common(o: AttentionOptions) -> None:
    for option in fields(o):  # every option, today's and tomorrow's: an empty name or a number beyond torch's
        value = getattr(o, option.name)
        flag = "--" + option.name.replace("_", "-")
        if value == "":
            raise UsageError(f"{flag} '': an empty file name; give a file, or leave {flag} out")
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise UsageError(f"{flag} {value}: out of range; PyTorch takes 64-bit integers (-2^63 to 2^63 - 1)")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} {value}: give a finite number")
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


def check_addressable(needed: int) -> None:
    """--meta allocates nothing, but PyTorch still counts every tensor's bytes in 64 bits."""
    if needed >= INT64:
        raise UsageError(f"these sizes need about {cost.format_bytes(needed)}, beyond the 2^63 bytes PyTorch can "
                         "count even on the meta device; shrink the sizes")


def guard_files(specs: list[str | None], max_memory: int | None) -> None:
    """Before any data is read, the input files' tensors, sized from their headers, must fit together (in
    --max-memory, or in what the machine has). A file whose header alone cannot be read (a legacy .pt) is
    checked by its size when it is loaded."""
    from attnscope.tensors import load_tensor

    needed = 0
    for spec in {spec for spec in specs if spec}:
        try:
            shape = load_tensor(spec, meta=True)
        except UsageError:
            continue  # its load names what is wrong
        needed += shape.numel() * shape.element_size()
    guard_memory(needed, max_memory, what="the input files hold")


def load(spec: str | None, meta: bool = False) -> torch.Tensor | None:
    """A tensor from a file; with --meta only its shape and dtype, from the file's header (no data is read)."""
    from attnscope.tensors import load_tensor

    return load_tensor(spec, meta=meta) if spec else None


def build_mask(o: AttentionOptions, user_mask: torch.Tensor | None, n_Q: int, n_K: int, device: Any,
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
        # Its shape is checked before it meets the causal or padding mask, which would broadcast it first.
        trailing = (n_K, n_Q) if columns else (n_Q, n_K)
        masks.check_broadcast(user_mask, (*user_mask.shape[:-2], *trailing))
        built = masks.combine(built, user_mask.to(device))
    # [n_K] (key padding, or a 1-D mask; [n_Q] in the column layout) as [1, n_K]: the same for every query,
    # in the [.., n_Q, n_K] form every consumer takes (PyTorch's CPU attention refuses a 1-D attn_mask).
    return built.reshape(1, -1) if built is not None and built.dim() < 2 else built


def input_op(spec: str | None, random_op: str) -> str:
    return f"loaded from {spec}" if spec else random_op


def finish(o: AttentionOptions, result: RunResult) -> RunResult:
    """Heatmap and --save, the same for every command."""
    if o.heatmap:
        result.heatmap = heatmap_of(result.trace["attention"], o.heatmap_batch, o.heatmap_head)
    if o.save:
        from attnscope.tensors import save_tensors

        meta = {s.name: {"dims": list(s.dims), "op": s.op} for s in result.trace.steps}
        result.saved = save_tensors(dict(result.trace), o.save, force=o.force, metadata=meta, option="--save")
    return result


def heatmap_of(attention: torch.Tensor, batch: int, head: int) -> Heatmap:
    """Pick one [n_Q, n_K] pattern out of `[n_batch, (n_head,) n_Q, n_K]`; an empty batch has none to pick."""
    index: list[int] = []
    leading = list(attention.shape[:-2])
    labels = [f"q{i}" for i in range(attention.shape[-2])], [f"k{j}" for j in range(attention.shape[-1])]
    wanted = [batch, head][: len(leading)] + [0] * max(0, len(leading) - 2)
    for axis, (size, i) in enumerate(zip(leading, wanted, strict=True)):
        name = ("n_batch", "n_head")[axis] if axis < 2 else f"axis {axis}"
        if size == 0:
            return Heatmap(f"attention ({name} = 0)", [], *labels)
        if not 0 <= i < size:
            option = "--heatmap-batch" if axis == 0 else "--heatmap-head"
            raise UsageError(f"{option} {i} is out of range: valid is 0 to {size - 1}")
        index.append(i)
    matrix = attention[tuple(index)] if index else attention
    where = ", ".join(f"{name}={i}" for name, i in zip(("n_batch", "n_head"), index, strict=False))
    return Heatmap(f"attention{f' at {where}' if where else ''}", matrix.tolist(), *labels)


def check_heads(d_feat: int, heads: int, from_file: bool) -> None:
    """d_head = d_feat / n_head must be whole; name both numbers and the nearest head counts that divide."""
    if d_feat % heads:
        near = " or ".join(f"--heads {h}" for h in cost.divisors_near(d_feat, heads))
        source = f"the inputs' d_feat {d_feat}" if from_file else f"--d-feat {d_feat}"
        raise UsageError(f"{source} is not divisible by --heads {heads} (d_head = d_feat / n_head must be whole); "
                         f"try {near}")


def inputs_bytes(*tensors: torch.Tensor | None) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def flag_overhead(o: AttentionOptions, traced: int) -> int:
    """What the output flags add to a traced run's peak: --save writes contiguous private copies of the
    steps, and --check runs PyTorch's own attention beside it, which (on CPU, or with attention weights
    returned) materializes as much again."""
    return traced * (bool(o.save) + bool(o.check))
