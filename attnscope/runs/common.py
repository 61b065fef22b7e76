"""What the `sdpa` and `mha` runs share: options, the result, the memory guard, masks from options,
the heatmap and --save.

No terminal code here: a run returns a `RunResult` that attnscope.render shows. torch is imported inside the
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
    saved_names: list[str] = field(default_factory=list)
    heatmap: Heatmap | None = None

    @property
    def check_failed(self) -> bool:
        return any(not c.passed for c in self.comparisons)


# --- shared ----------------------------------------------------------------------------------------


META_ADVICE = "use --meta to see every shape and cost without allocating, or shrink the sizes"


def guard_memory(needed: int, max_memory: int | None, advice: str = META_ADVICE) -> None:
    """Refuse, with the estimate, a run that would not fit: better one line now than a process killed later.
    `advice` names what the command offers instead (bench has no --meta)."""
    if max_memory is not None:
        if needed > max_memory:
            raise ResourceError(f"this run needs about {cost.format_bytes(needed)}, more than --max-memory "
                                f"{cost.format_bytes(max_memory)}; {advice}")
        return
    available = cost.available_memory()
    if available is not None and needed * MACHINE_MARGIN > available:
        raise ResourceError(f"this run needs about {cost.format_bytes(needed)} but this machine has "
                            f"{cost.format_bytes(available)} available; {advice}")


def check_common(o: AttentionOptions) -> None:
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


def load(spec: str | None) -> torch.Tensor | None:
    from attnscope.tensors import load_tensor

    return load_tensor(spec) if spec else None


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
        built = masks.combine(built, user_mask.to(device))
    return built


def causal_text(causal: str | None) -> str:
    """For the header: which causal alignment the mask used (the steps' shapes are the same either way)."""
    return f"  causal={causal}" if causal else ""


def input_op(spec: str | None, random_op: str) -> str:
    return f"loaded from {spec}" if spec else random_op


# What --save writes beside the steps, described in the file as the steps are.
SavedExtra = dict[str, tuple["torch.Tensor", tuple[str, ...], str]]  # name -> (tensor, dims, op)


def finish(o: AttentionOptions, result: RunResult, extra: SavedExtra | None = None) -> RunResult:
    """Heatmap and --save, the same for every command. --save writes every step and `extra` (inputs that are
    not steps, the mask, a module's parameters), so that anyone can run the same computation again."""
    if o.heatmap:
        result.heatmap = heatmap_of(result.trace.step("attention"), o.heatmap_batch, o.heatmap_head)
    if o.save:
        from attnscope.tensors import save_tensors

        tensors = dict(result.trace)
        meta: dict[str, Any] = {s.name: {"dims": list(s.dims), "op": s.op} for s in result.trace.steps}
        for name, (tensor, dims, op) in (extra or {}).items():
            tensors[name], meta[name] = tensor, {"dims": list(dims), "op": op}
        result.saved = save_tensors(tensors, o.save, force=o.force, metadata=meta)
        result.saved_names = list(tensors)
    return result


def mask_extra(mask: torch.Tensor | None) -> SavedExtra:
    """The mask a run used, for --save: True = may attend, broadcast over the scores' leading axes."""
    if mask is None:
        return {}
    dims = (*("n_batch", "n_head")[: max(0, mask.dim() - 2)], "n_Q", "n_K")[-mask.dim():]
    return {"mask": (mask, dims, "the mask used: causal, padding and --mask combined (True = may attend)")}


def heatmap_of(step: Step, batch: int, head: int) -> Heatmap:
    """Pick one [n_Q, n_K] pattern out of the attention step: `batch` indexes its first leading axis, `head`
    its n_head axis (the last leading one, where there is one), any other leading axis is taken at 0."""
    index: list[int] = []
    where: list[str] = []
    leading = step.dims[:-2]
    for axis, (name, size) in enumerate(zip(leading, step.shape[:-2], strict=True)):
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
