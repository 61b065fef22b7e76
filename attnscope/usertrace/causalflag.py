"""A forward's own causal switch: a parameter whose truth makes the code mask the future keys itself.

torch's `nn.MultiheadAttention.forward(query, key, value, ..., is_causal=False)`, nanoGPT-like code's
`forward(x, causal: bool = False)` handed on to `F.scaled_dot_product_attention(..., is_causal=causal)`,
`forward(x, mask=None, is_causal=None)`, a flag that builds a `tril` itself: each masks only when its caller says so.
trace's --causal describes the reference, and such code, left at its default, runs unmasked: every causal run of it
was a false alarm at `masked_scores`.

The switch is read from what the code does with it, never from its name: a parameter defaulting to False (or to None,
where it is annotated a bool or not at all) that the forward reads, the code run once with it left at its default and
once with it True, its mask parameters None both times. It is the code's causal switch where the default run masks
nothing by itself and the run with it True masks a pattern of the positions alone, the same in every sequence and
head, on one side of a diagonal: weights of exactly 0 (or rows of no key, NaN) for every key past one diagonal and
none before it, or the other way round (`masks_by_itself`: a softmax's, a kernel's recomputed weights, weights zeroed
after the softmax). So `tril(diagonal=1)`, a mask read the other way round and `is_causal=True`'s upper-left corner
where n_Q != n_K are the switch's too, each a mistake the catalog then names by experiment; a flag that builds a
sliding window (a band), pads keys, or returns the weights is not.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.usertrace.load import Plan
    from attnscope.usertrace.record import Record

    # the code run on a plan: its records, and whether it raised
    Runner = Callable[[Plan], tuple[list[Record], bool]]


def candidates(fn: Any, plan: Plan, source: Any = None) -> list[str]:
    """The forward's parameters that may be a switch: defaulting to False, or to None where annotated a bool (or
    not at all), or a flag without a default (flags.py: given False), given nothing else by trace, and read in the
    forward's own source (`source`'s, a function's that trace
    holds the weights of)."""
    import ast

    from attnscope.usertrace.astreads import source_tree

    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    tree = source_tree(source or fn)
    if tree is None:
        return []
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    fed = {*plan.tensors, *plan.nones, *plan.zeros, *plan.given, *plan.positions, *plan.position_tensors,
           *plan.position_rows, *plan.position_ids, *plan.position_ids_later, *plan.tables, *plan.embeddings,
           *plan.listed, *plan.aliases, *plan.grouped, *plan.other_masks}
    fed |= {n for n in (plan.mask, plan.cache, plan.cache_values, plan.bias, plan.lengths) if n is not None}
    return [name for name, p in parameters.items() if name not in fed and name in read
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and (_boolish(p) or name in plan.flags)]


def _boolish(p: inspect.Parameter) -> bool:
    said = "" if p.annotation is p.empty else str(getattr(p.annotation, "__name__", p.annotation))
    if p.default is False:
        return not said or "bool" in said
    return p.default is None and (not said or ("bool" in said and "Tensor" not in said))


def read(plan: Plan, names: list[str], run: Runner, band: bool = False) -> tuple[str, Record] | None:
    """The first of `names` that is the code's causal switch, and the record of the weights it masks with it True,
    by experiment (the module docstring); None where none is, or the code masks by itself at its defaults. With
    `band` (--window), the switch is one whose truth masks a band along the diagonal instead (the code builds its
    sliding window itself: every key past one diagonal and every key before another), read also where the code is
    causal by itself at its defaults (a window that only the switch adds)."""
    import dataclasses

    from attnscope.usertrace.masking import masks_by_itself

    bare = plan.without_masks()
    records, failed = run(bare)
    mine = masks_by_itself(records) if not failed else None
    if mine is not None and not (band and half_plane(mine.tensor)):
        return None  # it masks at its defaults: the switch, if any, is not what it needs
    # causal at its defaults and a switch for its window (`use_sliding_window=False`): with --window, the switch is
    # still what it needs
    for name in names:
        records, failed = run(dataclasses.replace(bare, switched=name))
        own = masks_by_itself(records) if not failed else None
        if own is not None and half_plane(own.tensor, band):
            return name, own
    return None


def half_plane(weights: Any, band: bool = False) -> bool:
    """Whether the cells of `weights` [.., a, b] at exactly 0 (and the rows of no key: NaN, or every weight alike) are
    one side of a diagonal, the same in every sequence and head: every cell j - i > d masked and none of the others,
    or the other way round; with `band`, instead, both sides of a band along the diagonal (every cell j - i > d and
    every cell j - i < e masked, none between: a sliding window)."""
    import torch

    if weights.dim() < 2 or weights.shape[-1] < 2:
        return False
    # a row of no key: NaN where the code fills with -inf, every weight alike where with a finite number (finfo.min)
    alike = (weights == weights[..., :1]).all(-1, keepdim=True)
    masked = (weights == 0) | weights.isnan() | alike
    grid = masked.reshape(-1, *masked.shape[-2:])
    every, some = grid.all(0), grid.any(0)
    if not torch.equal(every, some):  # a pattern of the positions alone
        return False
    a, b = every.shape
    ahead = torch.arange(b)[None, :] - torch.arange(a)[:, None]  # [a, b]: j - i
    sides = []
    for d in range(-(a - 1), b):
        cells = every[ahead == d]
        if bool(cells.all()) == bool(cells.any()):
            sides.append(bool(cells.all()))
        else:
            return False  # a diagonal half masked: no half-plane
    turns = sum(x != y for x, y in zip(sides, sides[1:], strict=False))
    return turns == 2 and sides[0] and sides[-1] if band else turns == 1


def note(name: str, default: Any, own: Record, masks: list[str], band: bool = False, kept: str | None = None) -> str:
    """What the switch was given, and why: with `band`, the window --window asks for; `kept`, the mask parameter
    given the --mask file alone beside it (the rule the switch's, never given twice)."""
    given = f"; {', '.join(masks)} = None, so that the mask is made once, by your code" if masks else ""
    given = (f"; {kept} was given the --mask file alone, so that the rule is made once, by your code" if kept
             else given)
    where = "outside a band along the diagonal" if band else "on one side of a diagonal"
    asks = "the sliding window --window" if band else "the causal switch --causal"
    rule = "window" if band else "causal"
    return (f"{name} = True: with it your code masks by itself (line {own.line}: weights of exactly 0 {where}, none "
            f"with {name} = {default!r}), {asks} asks for{given}; the reference's {rule} mask is compared with your "
            "code's own")
