"""Time-first inputs, `[n, n_batch, d]`: fairseq's MultiheadAttention, `nn.MultiheadAttention(batch_first=False)`,
the Transformer-XL and Megatron cores (`[s, b, h]`), read from the run as the column form is (columns.py).

Code written for time-first inputs either fails on batch-first ones (a mask `[n_Q, n_K]` added to scores whose
sequence axis is the batch), or runs and attends across the batch. Neither is a bug of the code: trace runs it
again on the same inputs transposed, `[n, n_batch, d]`, and keeps that reading where the code runs only on it,
lines up whole under it, or diverges where only under it an experiment of the catalog reproduces the code's
tensors. The reference reads the inputs transposed back (`Inputs.qkv`); the code's tensors are lined up in
whatever layout they hold the steps (`[n_Q, n_batch, d_feat]`, fairseq's `[n_batch·n_head, n_Q, d_head]`), as any
layout is (align.py). Masks keep their own convention (`key_padding_mask` `[n_batch, n_K]`, `attn_mask`
`[n_Q, n_K]`): no mask is time-first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import InputOptions, Inputs
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Failure

# the steps up to the scores: a time-first code fed batch-first mixes its batch into its sequence there at the latest
BEFORE_MIXING = ("Q_feat", "K_feat", "V_feat", "Q_split", "K_split", "V_split", "Q_rot", "K_rot", "K_rep", "V_rep",
                 "Q", "K", "V", "scores")


def possible(o: InputOptions, inputs: Inputs) -> bool:
    """Whether the code may be tried on time-first inputs: batched 3-D inputs [n_batch, n, d], random draws or files
    (a file [T, B, C] is read as [n_batch, n, d] first, then time-first), rows asked for, a decode step's too (its
    cache stays [n_batch, n_kv_head, n_cache, d_head], as fairseq's incremental state holds it). A batch of the
    tokens' size (--batch = --nq) is tried too: the same tensor then reads either way, and only the line-up says
    which reading is the code's."""
    if o.layout != "row" or o.batch == 0 or not inputs.tensors or (bool(inputs.own) and inputs.own_from == "module"):
        return False
    sizes = inputs.sizes
    if "n_batch" not in sizes:
        return False
    if "n_head" in sizes and "d_feat" not in sizes:  # a function's heads [n_batch, n_head, n, d]: behind the tokens?
        return sizes["n_head"] not in (sizes.get("n_Q"), sizes.get("n_K")) \
            and all(t.dim() == 4 for t in inputs.tensors.values())
    return all(t.dim() == 3 for t in inputs.tensors.values())


def early(lined: LineUp) -> bool:
    """Whether the batch-first run diverged where time-first code fed batch-first would: at the scores or before
    (after them, the tokens were already the code's tokens), with no experiment of the catalog reproducing the
    code's tensors (one that does names a batch-first mistake)."""
    return lined.divergence is not None and lined.divergence.reference in BEFORE_MIXING \
        and lined.divergence.experiment is None


def better(tried: LineUp, first: LineUp) -> bool:
    """Whether the time-first reading `tried` is the code's: it lines up whole, or only under it does an experiment of
    the catalog reproduce the code's tensors, or it lines up past the scores where the batch-first run did not reach
    them. A later divergence before the scores is no reason: batch-first code whose heads are split without the
    transpose computes, fed time-first, what correct time-first code computes up to its scores."""
    if tried.no_reference is not None:
        return False
    if tried.divergence is None:
        return True
    if first.divergence is None or first.divergence.experiment is not None:
        return False
    # a cause the catalog reproduces only under it; or every step up to the scores lined up under it, where the
    # batch-first run parted before them (ChatGLM's time-first code masking by itself, run without --causal: its
    # scores line up, its softmax is the reference's under a causal mask)
    return tried.divergence.experiment is not None or (
        first.divergence.reference in BEFORE_MIXING and tried.divergence.reference not in BEFORE_MIXING)


def note(failed: Failure | None, weighted: bool, layout: str = "time") -> str:
    """The note for code read as time-first (or, `layout` "bthd", with its heads behind the tokens; "tbhd",
    time-first with its heads split)."""
    if layout in ("bthd", "tbhd"):
        where = f" (line {failed.line}: {failed.message})" if failed is not None and failed.line else ""
        shape = ("[n_batch, n, n_head, d], the heads behind the tokens (flash-attn's, JAX's 'bqhd')"
                 if layout == "bthd" else "[n, n_batch, n_head, d], time-first with the heads split (Megatron's "
                 "core attention [sq, b, np, hn])")
        return (f"your code {'failed' if failed is not None else 'does not line up'} on inputs [n_batch, n_head, n, d]"
                f"{where} and runs on {shape}: read as that convention, a convention, not a mistake; the reference "
                "reads your inputs transposed to [n_batch, n_head, n, d]")
    d = "d_feat" if weighted else "d"
    if failed is not None:
        where = f"line {failed.line}: " if failed.line else ""
        why = f"your code failed on batch-first inputs [n_batch, n, {d}] ({where}{failed.message}) and runs"
    else:
        why = (f"your code runs on batch-first inputs [n_batch, n, {d}] but lines up with the reference only")
    return (f"{why} on time-first ones [n, n_batch, {d}] (fairseq's, nn.MultiheadAttention's batch_first=False): "
            "read as that convention, a convention, not a mistake; the reference reads your inputs transposed to "
            "[n_batch, n, ..] and each of your tensors is lined up in the layout it holds the step in")


def asked(o: Any, inputs: Inputs) -> list[Any]:
    """The options with time-first inputs; 4-D ones in the layouts real code takes them in besides [n_batch, n_head,
    n, d]: the heads behind the tokens (flash-attn's and xformers' BMHK), then time-first with the heads split
    (Megatron's [sq, b, np, hn])."""
    import dataclasses

    four = all(t.dim() == 4 for t in inputs.tensors.values())
    return [dataclasses.replace(o, layout=layout) for layout in (("bthd", "tbhd") if four else ("time",))]


def apart(o: Any, inputs: Inputs, avoid: Iterable[int] = ()) -> int | None:
    """A batch size for the time-first try where --batch gave the tokens' size (n_batch = n_Q or n_K: [n, n_batch, d]
    and [n_batch, n, d] are then one shape, and a layout swapping two axes of one size is no layout): the smallest
    size from 2 up that no dim (nor a size in `avoid`) has; None where the sizes already differ, or files gave them."""
    sizes = inputs.sizes
    if o.q or "n_batch" not in sizes or sizes["n_batch"] not in (sizes.get("n_Q"), sizes.get("n_K")):
        return None
    taken = set(sizes.values()) | set(avoid)
    return next(n for n in range(2, 2 + len(taken) + 1) if n not in taken)


def apart_note(asked: int | None, size: int) -> str:
    """The note for a time-first reading found on a batch of another size than --batch's."""
    given = f"--batch {asked}" if asked else "the batch"
    return (f"{given} equals the tokens' count, so [n, n_batch, ..] and [n_batch, n, ..] are one shape and cannot be "
            f"told apart: traced with n_batch = {size}, where they differ")


def viewed_width(failed: Failure | None, sizes: dict[str, int], o: Any) -> tuple[int, str] | None:
    """(d, its note) where the code, fed heads split with widths trace chose (d_K, d_V: no --dk, --dv), raised on a
    view or reshape to a width of its own that n_head heads of d fill (Megatron's `context.view(sq, b, hp)`, hp =
    np · hn from its kv_channels): d_K = d_V = that width / n_head is tried; None otherwise."""
    import re

    n_head = sizes.get("n_head")
    if failed is None or not n_head or o.dk is not None or o.dv is not None or "d_feat" in sizes:
        return None
    found = re.search(r"shape '\[([-\d, ]+)\]' is invalid for input of size", failed.message)
    if found is None:
        return None
    width = int(found.group(1).split(",")[-1])
    if width <= n_head or width % n_head or width // n_head == sizes.get("d_K") == sizes.get("d_V"):
        return None  # (a width of the queries' d_K alone: `reshape(n, b, h * d)` with d read off the queries)
    d = width // n_head
    return d, (f"d_K = d_V = {d}: your code views its heads merged as {width} = n_head · d (line {failed.line}: "
               f"{failed.op}), and raised on d_K = {sizes.get('d_K')}, d_V = {sizes.get('d_V')}; --dk and --dv size "
               "them otherwise")

