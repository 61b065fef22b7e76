"""Which size flags would make a --mask file that does not fit the scores fit them: read from the file's own shape
(its last axis the keys', its rows the batch's where it is key padding), so a refusal says the one flag to pass
(`--nk 9`, `--batch 2`) instead of a shape to work out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.load import Plan


def axes(shape: tuple[int, ...], sizes: dict[str, int]) -> tuple[str, ...] | None:
    """The dims a file's axes stand for: a 2-D file is [n_Q, n_K] where its rows are the queries' count, else key
    padding [n_batch, n_K] (as inputs._key_padding reads it); [n_batch, n_Q, n_K]; [n_batch, n_head, n_Q, n_K]."""
    if len(shape) == 2:
        return ("n_Q", "n_K") if shape[0] == sizes.get("n_Q") else ("n_batch", "n_K")
    return {3: ("n_batch", "n_Q", "n_K"), 4: ("n_batch", "n_head", "n_Q", "n_K")}.get(len(shape))


def unbatched(mask: torch.Tensor, sizes: dict[str, int], o: Any) -> str | None:
    """The refusal where --batch 0 (2-D inputs, one sequence: no batch axis) meets a file that does not fit the
    scores because it holds several sequences (key padding [n_batch, n_K], [n_batch, n_Q, n_K], ...): it names
    --batch, the one flag to change, and the count the file holds; None otherwise."""
    names = axes(tuple(int(s) for s in mask.shape), sizes)
    if o.batch != 0 or "n_batch" in sizes or names is None or names[0] != "n_batch" or int(mask.shape[0]) == 1:
        return None
    return _unbatched_words(o, tuple(int(s) for s in mask.shape), names)


def unbatched_file(o: Any) -> str | None:
    """unbatched's refusal read from the options alone, before anything is run: --batch 0 with a --mask file whose
    first axis can only be the batch's, several sequences (a 2-D file of rows other than --nq's count, not square:
    key padding [n_batch, n_K]; a 4-D one [n_batch, n_head, n_Q, n_K]). None where it is not so, or where only the
    run's sizes tell (a 3-D file may be per head; a 2-D one without --nq may be [n_Q, n_K])."""
    if o.batch != 0 or not o.mask or o.q or o.k or o.v:
        return None
    from attnscope import masks
    from attnscope.tensors import load_tensor

    shape = tuple(int(s) for s in masks.normalize(load_tensor(o.mask)).shape)
    padding = len(shape) == 2 and o.nq is not None and shape[0] not in (1, o.nq, shape[1])
    if not padding and not (len(shape) == 4 and shape[0] > 1):
        return None
    return _unbatched_words(o, shape, ("n_batch", "n_K") if padding else ("n_batch", "n_head", "n_Q", "n_K"))


def _unbatched_words(o: Any, shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    from pathlib import Path

    reading = ("key padding " if len(names) == 2 else "") + f"[{', '.join(names)}]"
    return (f"--batch 0 asks for 2-D inputs, one sequence with no batch axis, but --mask {Path(o.mask).name} of "
            f"shape {list(shape)} is {reading} for {shape[0]} sequences: pass --batch {shape[0]}, or a mask of one "
            "sequence ([n_Q, n_K], or [1, n_K] as key padding)")


def flags(mask: torch.Tensor, sizes: dict[str, int], o: Any, plan: Plan, is_module: bool
          ) -> tuple[str, str] | None:
    """(the file's reading, e.g. "key padding [n_batch, n_K]"; the flags that make it fit and the sizes they
    replace, e.g. "--nk 9 (n_K is 6)"), or None where no size flag alone does (a heads' axis, sizes set by --q, --k
    or --v files, the column layout, keys tied to the queries' count by a cache). `o` is inputs.InputOptions, not
    imported here: inputs imports this module."""
    names = axes(tuple(int(s) for s in mask.shape), sizes)
    if names is None or o.q or o.k or o.v or o.layout == "col":
        return None
    shaped = [(n, int(s)) for n, s in zip(names, mask.shape, strict=True) if s != 1]
    if any(n not in sizes for n, _ in shaped):  # an axis the scores lack (2-D inputs: no batch)
        return None
    wanted = {n: s for n, s in shaped if s != sizes[n]}
    # n_K has a flag of its own where the code takes its keys apart from its queries (another input, a memory)
    keys_apart = not plan.self_attention or (is_module and bool(plan.memories()) and not o.cache)
    if not wanted or "n_head" in wanted or ("n_K" in wanted and o.cache and not keys_apart):
        return None
    if "n_K" in wanted and not keys_apart:  # n_K = n_Q: the queries' count sets both
        if wanted.get("n_Q", wanted["n_K"]) != wanted["n_K"]:
            return None
        wanted["n_Q"] = wanted.pop("n_K")
    flag = {"n_batch": "--batch", "n_Q": "--nq", "n_K": "--nk"}
    order = [n for n in ("n_Q", "n_K", "n_batch") if n in wanted]
    reading = ("key padding " if names[0] == "n_batch" and len(names) == 2 else "") + f"[{', '.join(names)}]"
    return reading, (" ".join(f"{flag[n]} {wanted[n]}" for n in order) + " ("
                     + ", ".join(f"{n} is {sizes[n]}" for n in order) + ")")
