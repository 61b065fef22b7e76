"""What the code does after the merge of its heads, up to what it returns: the Set Transformer's `ln0`,
`O + relu(fc_o(O))` and `ln1`, BitNet's sub-norm before `o_proj`, a gate on the merged heads, a block's residual
`x + attn`. No reference holds those ops, so the line-up ends at the merge (or at the output projection where it
finds one); this module carries the comparison on to the module's return value.

- `replayed`: the code's own ops, run again from the tensor the reference's last step is lined up with (the merge,
  or the output projection's output), that tensor replaced by the reference's own (call.call's `swap`): each op on
  the way to what the code returns is compared with the code's first run to tolerance, the return value too. A
  correct module is so confirmed end to end; an op whose result differs from the code's own is where a difference
  after the merge first appears.
- `unreached`: read off the data flow, an op that changes values, computed from the merged heads, whose result
  reaches nothing the module returns (`h = self.ln0(o)` then `o` used on; `F.relu(h)` whose result is dropped;
  `gated = o * sigmoid(g)` then `o_proj(o)`): code computes it for nothing, so the output is not what it was written
  to be.
- `added_twice`: an input of the forward added on the way from the merge to the return by two adds (`h = x + attn`,
  then `h + x`): the residual taken twice.
- `dropped_on`: a dropout that zeroed part of what it was given on the way from the merge to the return, though the
  code runs for inference (MMCV's `F.dropout(out, self.proj_drop.p)`, whose `training` defaults to True): the
  module's output is drawn at random. The replay would not see it (the code run again draws the same mask from the
  same seed), so it is read off the run, as dropouts.drops reads any dropout, and named `dropout.left_on`.

Each is said as a difference after the merge, at the op and the line where it first appears; no catalog mistake is
named, none having been rerun, but for the dropout, whose mask is read from its own two tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import REARRANGING, ancestors, compare, tolerance
from attnscope.usertrace.firststep import FINAL
from attnscope.usertrace.lined import ALIGNED, Divergence
from attnscope.usertrace.outops import CASTS, RANDOM

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.lined import Aligned, LineUp
    from attnscope.usertrace.record import Record

ADDS = ("add", "__add__", "__radd__", "add_", "__iadd__")
KEEPING = REARRANGING + CASTS + ("dropout", "clone", "detach", "identity")


def start(rows: list[Aligned]) -> Aligned | None:
    """The last step the line-up found in the code, where it is the module's output or its merge (x, x_rsh2)."""
    return next((row for row in reversed(rows) if row.reference in FINAL and row.status in ALIGNED
                 and row.record is not None), None)


def merge(rows: list[Aligned]) -> Record | None:
    """The code's merge of the heads (the tensor x_rsh2 is lined up with), else the start."""
    row = next((r for r in rows if r.reference == "x_rsh2" and r.status in ALIGNED and r.record is not None), None)
    row = row or start(rows)
    return row.record if row is not None else None


def _returned(records: list[Record]) -> list[Record]:
    return [r for r in records if "returned" in r.details and r.tensor.is_floating_point()]


def _below(records: list[Record], top: Record) -> list[Record]:
    """The records computed from `top`, in the order the code ran them."""
    return [r for r in records if r.index > top.index and top.index in ancestors(r, records)]


def _live(records: list[Record]) -> set[int]:
    """The records what the call returns is made from (and those it returns)."""
    live: set[int] = set()
    for r in _returned(records):
        live |= ancestors(r, records) | {r.index}
    return live


def _where(record: Record) -> str:
    return f"line {record.line} ({record.details.get('op', record.call)})"


def unreached(records: list[Record], top: Record) -> Divergence | None:
    """A value-changing op computed from the merged heads `top` whose result reaches nothing the call returns, where
    the call returns something made from `top` (else None)."""
    below, live = _below(records, top), _live(records)
    if not live & {r.index for r in below}:
        return None
    dead = {r.index for r in below if r.index not in live}
    read = {p for r in records for p in r.parents}
    for r in below:  # where the dropped result is made: the last op of a chain that changes values, nothing reads
        if r.index not in dead or r.index in read or not r.tensor.is_floating_point():
            continue
        chain = [records[i] for i in sorted((ancestors(r, records) & dead) | {r.index})]
        if not any(c.func not in KEEPING and not any(w in c.func for w in RANDOM)
                   and c.tensor.numel() == top.tensor.numel() for c in chain):
            continue
        return Divergence(
            "x", r, None,
            f"the difference is after the merge of the heads: your code computes {r.label} at {_where(r)} from "
            f"the merged heads (your {top.label}, line {top.line}), and its result reaches nothing your module "
            "returns, so what it returns is not made from it; the reference's steps up to the merge are equal to "
            "yours, and no mistake of the catalog was rerun for this")
    return None


def added_twice(records: list[Record], top: Record, given: set[str]) -> Divergence | None:
    """An input of the call (by its label in `given`) added twice on the way from `top` to what the call returns."""
    live = _live(records)
    seen: dict[str, Record] = {}
    for r in _below(records, top):
        if r.index not in live or r.func not in ADDS:
            continue
        for kind, value in r.args:
            if kind != "text" or value not in given:
                continue
            if value in seen:
                first = seen[value]
                return Divergence(
                    "x", r, None,
                    f"the difference is after the merge of the heads: your code adds its input {value} to the "
                    f"attention's output at {_where(first)} and again at {_where(r)}, on the way to what your "
                    "module returns (the residual taken twice); the reference's steps up to the merge are equal to "
                    "yours, and no mistake of the catalog was rerun for this")
            seen[value] = r
    return None


def dropped_on(records: list[Record], tops: list[Record], kind: str, steps: Trace) -> Divergence | None:
    """A dropout on the way from one of `tops` (the merge, the last step lined up: a fused kernel's merge is a
    record of its own beside its output) to what the call returns that zeroed entries of its input, though the call
    ran for inference (`kind`: "module", run in eval() mode, or "function"): dropouts.drops' first such, named
    dropout.left_on. By experiment where its input holds a step of the reference's (`steps`: x, the merge, the
    heads' output): that step, laid out as the input, times the mask the dropout drew (read off its input and
    output, as runtrials.trials_dropout reads one before the merge) is its result; otherwise said from the run, no
    entry named. None where there is none."""
    from attnscope.usertrace.dropouts import drops

    live = _live(records)
    for drop in drops(records):
        record = drop.record
        top = next((t for t in tops if t.index in ancestors(record, records)), None)
        if top is None or record.index not in live:
            continue
        before, after = drop.before.tensor.detach(), record.tensor.detach()
        zeroed = float(((after == 0) & (before != 0)).double().mean())
        p = f"p = {drop.p:.3g}, " if math.isfinite(drop.p) else ""
        how = "own dropout (a keep-mask drawn at random)" if drop.own else "dropout"
        runs = "your module runs in eval() mode" if kind == "module" else "trace runs your function for inference"
        fix = ("draw it only when training (`if self.training`), as F.dropout(..., training=self.training) does"
               if drop.own else "F.dropout's training argument defaults to True: " + (
                   "pass training=self.training (or use nn.Dropout)" if kind == "module" else
                   "pass it a training flag (training=False at inference)"))
        said = (f"dropout is active although {runs}: line {record.line}'s {how} ({p}{zeroed:.1%} of your "
                f"{drop.before.label} zeroed, the rest scaled by 1/(1 − p)) is applied after the merge of the heads, "
                f"on the way from your {top.label} (line {top.line}) to what your module returns, so its output is "
                f"drawn at random; the reference's steps up to there are equal to yours; {fix}")
        held = _held_step(drop.before, after, steps)
        if held is None:
            return Divergence("x", record, None, said + "; no mistake of the catalog was rerun for this")
        name, diff = held
        return Divergence("x", record, None, said, "dropout.left_on",
                          f"by experiment: your {record.label} (line {record.line}) is the reference's {name} times "
                          f"the mask line {record.line} drew (read off its input and output; max |diff| {diff:.1e})")
    return None


def _held_step(before: Record, after: torch.Tensor, steps: Trace) -> tuple[str, float] | None:
    """The reference step (x, the merge, the heads' output) that `before`, a dropout's input, holds, where that step
    laid out as `before` times the dropout's mask (0 where `after` zeroed an entry, after / before elsewhere) is
    `after` to tolerance: its name and that max |diff|; None where no step so gives it."""
    from attnscope.usertrace.dropouts import multiplier

    kept = before.tensor.detach().double()
    mask = multiplier(kept, after.double())
    for name in ("x", "x_rsh2", "x_raw", "out"):
        if name not in steps:
            continue
        step = steps[name]
        for match in compare(before, step):
            if not match.equal:
                continue
            laid = match.layout.apply(step.double(), tuple(kept.shape))
            diff = float((laid * mask - after.double()).abs().max())
            if diff <= tolerance(after):
                return name, diff
    return None


def replayed(records: list[Record], lined: LineUp, rerun: Callable[[int, torch.Tensor], Any]
             ) -> tuple[str | None, Divergence | None]:
    """The code's ops after the reference's last step, run again on the reference's tensor (`rerun(index, tensor)`:
    the code's run with that record's result replaced, as call.Called), each compared with the code's first run:
    a note saying the module's return value was so confirmed, or the divergence at the first op that differs.
    (None, None) where the code returns that step itself, or where the run again is not the same run."""
    row = start(lined.rows)
    if row is None or row.record is None or lined.trace is None or row.reference not in lined.trace:
        return None, None
    top, step = row.record, lined.trace[row.reference]
    path = [r for r in _below(records, top) if r.index in _live(records)]
    back = [r for r in path if "returned" in r.details]
    if not back:
        return None, None
    matches = [m for m in compare(top, step) if m.equal]
    if not matches:
        return None, None
    again = rerun(top.index, matches[0].layout.apply(step.double(), tuple(top.tensor.shape)))
    ran = getattr(again, "records", None)
    if again is None or not getattr(again, "swapped", False) or getattr(again, "failure", None) is not None \
            or ran is None or len(ran) != len(records) \
            or any((a.func, a.line) != (b.func, b.line) for a, b in zip(ran, records, strict=True)) \
            or any(_differs(a, b) for a, b in zip(ran[:top.index], records, strict=False)):
        return None, None  # another run than the first (a module that keeps state between calls): nothing to say
    worst = 0.0
    for r in path:
        diff = _difference(r, ran[r.index])
        if diff is None:
            return None, None
        if diff > (tolerance(r.tensor) if r.tensor.is_floating_point() else 0.0):
            return None, Divergence(
                "x", r, None,
                f"the difference is after the merge of the heads: your ops from your {top.label} (line {top.line}, "
                f"equal to the reference's {row.reference}) to what your module returns, run again on the "
                f"reference's {row.reference}, first differ from your run at {_where(r)} (max |diff| {diff:.1e}); "
                "no mistake of the catalog was rerun for this")
        worst = max(worst, diff)
    merged = _merged_out_of_order(path, back[-1], lined.trace)
    if merged is not None:
        return None, merged
    lines = sorted({r.line for r in path})
    funcs = ", ".join(dict.fromkeys(r.func for r in path if r.func not in REARRANGING))
    span = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}"
    span += f": {funcs}" if funcs else ": views alone"
    return (f"after {row.reference}: your ops from your {top.label} (line {top.line}) to what your module returns "
            f"({span}) were run again on the reference's {row.reference}, and give what your module "
            f"returns (max |diff| {worst:.1e}): your output is compared end to end"), None


JOINING = ("cat", "concat", "concatenate")
# the heads' output x_raw [B, H, n, d] laid out by a permute other than the reference's (0, 2, 1, 3) before its reshape
# to [B, n, H·d]: the mistake the catalog names for it (heads.merge_without_transpose: no permute)
MERGES = {(0, 1, 2, 3): "heads.merge_without_transpose", (0, 2, 3, 1): "heads.merge_wrong_permute",
          (0, 1, 3, 2): "heads.merge_wrong_permute", (0, 3, 1, 2): "heads.merge_wrong_permute",
          (0, 3, 2, 1): "heads.merge_wrong_permute"}


def _merged_out_of_order(path: list[Record], returned: Record, steps: Trace) -> Divergence | None:
    """Where the code only moves and joins values from x on (views, permutes, torch.cat with other features:
    ConvBERT's attention heads beside its convolution's, merged by one view after the cat), the merge of the heads
    is among those ops, and the replay runs the code's own merge: what the module returns must then hold x, its
    features in the reference's order, as a block of its last axis. Where it holds x_raw merged in another order
    instead (permuted (0, 2, 3, 1) before the reshape), that is the mistake, named by this experiment: each merge
    the catalog knows, compared with every block of the return. None where the return holds x, or the ops change
    values, or no merge of x_raw is found."""
    if any(r.func not in KEEPING + JOINING for r in path) or "x" not in steps or "x_raw" not in steps:
        return None
    x, raw, out = steps["x"].double(), steps["x_raw"].double(), returned.tensor.detach().double()
    if x.dim() != 3 or raw.dim() != 4 or out.dim() < 3 or tuple(out.shape[:2]) != tuple(x.shape[:2]) \
            or (raw.shape[0], raw.shape[2]) != tuple(x.shape[:2]) or raw.shape[1] * raw.shape[3] != x.shape[-1]:
        return None
    rows = out.reshape(*x.shape[:2], -1)
    width = x.shape[-1]

    def block(tensor: torch.Tensor) -> int | None:  # the offset of the block of `rows` that is `tensor`
        limit = tolerance(tensor)
        for at in range(rows.shape[-1] - width + 1):
            if float((rows[..., at:at + width] - tensor).abs().max()) <= limit:
                return at
        return None

    if block(x) is not None:
        return None
    for order, entry in MERGES.items():
        at = block(raw.permute(*order).reshape(x.shape))
        if at is None:
            continue
        how = "with no permute" if order == (0, 1, 2, 3) else f"permuted {order}"
        return Divergence(
            "x", returned, None,
            f"your code merges its heads after the attention, in the ops that lead to what it returns (line "
            f"{returned.line}), and merges them in another order than the reference's: features {at} to "
            f"{at + width - 1} of what your module returns are x_raw [n_batch, n_head, n_Q, d_head] {how} before its "
            "reshape to [n_batch, n_Q, n_head·d_head], where the reference permutes (0, 2, 1, 3): "
            ".permute(0, 2, 1, 3) before the reshape",
            entry, f"by experiment: the reference's x_raw merged {how} is features {at} to {at + width - 1} of what "
            "your module returns, to tolerance, and the reference's x is no block of it")
    return None


def _difference(mine: Record, again: Record) -> float | None:
    """The max |diff| of a record and the same op's in the run again (inf where their infinities differ); None
    where their shapes differ."""
    a, b = mine.tensor, again.tensor
    if a.shape != b.shape:
        return None
    if not a.is_floating_point() or not b.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    a, b = a.double(), b.double()
    if any(not torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf, torch.isneginf)):
        return math.inf
    finite = torch.isfinite(a)
    return float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0


def _differs(again: Record, mine: Record) -> bool:
    diff = _difference(mine, again)
    return diff is None or (mine.tensor.is_floating_point() and diff > tolerance(mine.tensor)) or diff == math.inf


def after_merge(records: list[Record], lined: LineUp, given: set[str],
                rerun: Callable[[int, torch.Tensor], Any] | None, inference: str | None = None
                ) -> tuple[str | None, Divergence | None]:
    """Where every step lined up: a note that the module's output was confirmed after the merge, or the difference
    after the merge (unreached, added_twice, dropped_on where the call ran for inference, `inference` its kind,
    replayed, in that order). (None, None) where nothing follows."""
    if lined.divergence is not None or lined.trace is None or not lined.rows:
        return None, None
    top = merge(lined.rows)
    if top is None:
        return None, None
    row = start(lined.rows)
    tops = [top] + ([row.record] if row is not None and row.record is not None else [])
    found = unreached(records, top) or added_twice(records, top, given) \
        or (dropped_on(records, tops, inference, lined.trace) if inference is not None else None)
    note, differs = (None, found) if found is not None else \
        replayed(records, lined, rerun) if rerun is not None else (None, None)
    if differs is not None and row is not None:
        differs.reference = row.reference
    return note, differs
