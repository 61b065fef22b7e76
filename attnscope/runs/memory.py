"""The memory guard: a run that would not fit is refused up front, with its estimate and what to do instead,
rather than killed halfway. The estimates themselves are cost.py's arithmetic; here they meet --max-memory or
what the machine has available."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope import cost
from attnscope.errors import ResourceError, UsageError
from attnscope.runs.options import INT64

if TYPE_CHECKING:
    import torch

    from attnscope.runs.options import AttentionOptions
    from attnscope.spec import AttentionSpec

# Headroom when the limit is what the machine has: the estimate is good to a few percent, the rest of
# the system is not ours to count on.
MACHINE_MARGIN = 1.2
META_ADVICE = "use --meta to see every shape and cost without allocating, or shrink the sizes"


def guard_memory(needed: int, max_memory: int | None, what: str = "this run needs", advice: str = META_ADVICE,
                 machine_advice: str | None = None) -> None:
    """Refuse, with the estimate, a run that would not fit: better one line now than a process killed later.
    `advice` names what the command offers instead (bench has no --meta; a model run has --layer and --text),
    `machine_advice` where it differs when the limit is the machine's."""
    if max_memory is not None:
        if needed > max_memory:
            raise ResourceError(f"{what} about {cost.format_bytes(needed)}, more than --max-memory "
                                f"{cost.format_bytes(max_memory)}; {advice}")
        return
    available = cost.available_memory()
    if available is not None and needed * MACHINE_MARGIN > available:
        raise ResourceError(f"{what} about {cost.format_bytes(needed)} but this machine has "
                            f"{cost.format_bytes(available)} available; {machine_advice or advice}")


def check_addressable(needed: int) -> None:
    """--meta allocates nothing, but PyTorch still counts every tensor's bytes in 64 bits."""
    if needed >= INT64:
        raise UsageError(f"these sizes need about {cost.format_bytes(needed)}, beyond the 2^63 bytes PyTorch can "
                         "count even on the meta device; shrink the sizes")


def guard_files(specs: list[str | None], max_memory: int | None) -> None:
    """Before any data is read, the input files' tensors, sized from their headers, must fit together (in
    --max-memory, or in what the machine has). A file whose header alone cannot be read (a legacy .pt) counts
    by its size on disk, about what loading it takes. A tensor named by several flags counts once, however its
    path is spelled: the run reads each file once (tensors/opened.py) and holds its tensors once."""
    from attnscope.tensors import HeaderUnreadable, load_tensor, split_spec
    from attnscope.tensors.opened import identity

    sizes: dict[tuple[object, ...], int] = {}
    for spec in dict.fromkeys(spec for spec in specs if spec):
        try:
            shape = load_tensor(spec, meta=True)
        except HeaderUnreadable as exc:
            sizes[identity(split_spec(spec)[0]) + (None,)] = exc.size  # read whole, whichever tensor is asked
            continue
        except UsageError:
            continue  # its load names what is wrong
        path, name = split_spec(spec)
        sizes[identity(path) + (name,)] = shape.numel() * shape.element_size()
    guard_memory(sum(sizes.values()), max_memory, what="the input files hold")


def inputs_bytes(*tensors: torch.Tensor | None) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def structural_bytes(spec: AttentionSpec, n_Q: int, n_K: int) -> int:
    """The causal or window mask sdpa builds and holds while it runs: one bool per (query, key)."""
    return n_Q * n_K if spec.structural else 0


def flag_overhead(asked: AttentionOptions, spec: AttentionSpec, traced: int) -> int:
    """What the output flags add to a traced run's peak: --save writes contiguous private copies of the
    steps, and --check runs PyTorch's own attention beside it, which (on CPU, or with attention weights
    returned) materializes as much again, twice as much where its reference is the float64 formula."""
    formula = (spec.rope is not None or spec.alibi or spec.softcap is not None or spec.temperature is not None
               or spec.sinks)
    return traced * (bool(asked.save) + (2 if formula else 1) * bool(asked.check))


def sized_need(asked: AttentionOptions, spec: AttentionSpec, needed: int) -> int | None:
    """What sdpa's and mha's random inputs are guarded for, from their sizes alone: under --meta None, once PyTorch
    can count the bytes; else what the run `needed` plus what its output flags add. The caller asks its own
    guard_memory (the tests read each run's guard)."""
    if asked.meta:
        check_addressable(needed)
        return None
    return needed + flag_overhead(asked, spec, needed)
