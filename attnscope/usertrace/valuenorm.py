"""The values RMS-normed per head without weights, read from the code (Gemma 3n's `v_norm = Gemma3nRMSNorm(head_dim,
with_scale=False)` on `[B, T, H, D]`, Gemma 4's): a convention, as a qk-norm is (ownnorm.py), which no option says.

Read from the rows, then by experiment: where the line-up diverges at the keys' repeat, the values or after them,
and the code's output was computed from a tensor whose rows over the values' d_head all have an RMS of 1 (and which
the queries' and keys' steps are not made from), the reference is run again with its values so normed (`V_normed`, after
`V_split`), each usual eps in turn; a run that lines up further, or names the mistake, is kept with a note. Where it
diverges before the values (the keys' norm left out, the norms after RoPE), the same, from such a tensor made from the
code's own lined-up values alone: every experiment rerun there needs the values normed as the code norms them to give
its output back. A norm with weights (the keys' `k_norm` applied to the values, a copy-paste) gives rows of another
RMS, and stays the code's to answer for (`qknorm.on_values` by experiment); so do values normed where the keys' own
norm is weightless too (Llama 4's L2Norm on q, k and, by mistake, v): the two compute the same numbers, and the keys'
norm is the code's, so no values' norm is read there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lineup import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

# a divergence the values' norm may stand behind: at the values, or at a later step whose experiment's rerun gives
# the code's output back only with the values normed as the code norms them (keys repeated in the wrong order)
AT_VALUES = ("V_split", "V_cat", "K_rep", "V_rep", "scores", "masked_scores", "attention", "x_raw", "x_rsh1",
             "x_rsh2", "x")
QK_STEPS = ("Q_split", "K_split", "Q_normed", "K_normed", "Q_rot", "K_rot", "K_cat", "K_rep", "scores")
EPS = (1e-6, 1e-5, 1e-8, 1e-12, 0.0)  # transformers' rms_norm_eps values, the usual first
SPREAD = 1e-3  # the rows' RMS agree with 1 to this: an eps of 1e-6 on rows of RMS 0.03 moves them 5e-4


def read(module: Any, shapes: Any, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
         lined: LineUp) -> tuple[Spec, LineUp] | None:
    """(the spec with the values' norm, its line-up) where the code norms its values per head without weights and
    the reference so run lines up further or names the mistake; None elsewhere."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.relined import line_up_again

    diverged = lined.divergence
    # a weightless norm on the keys too (Llama 4's L2Norm): the values through it compute what a norm of their own
    # would, and the code's keys' norm on its values is qknorm.on_values, the mistake, never read away as this
    if diverged is None or spec.v_norm is not None or spec.qk_norm_gain is not None or diverged.record is None \
            or lined.trace is None or "V_split" not in lined.trace:
        return None
    # a divergence before the values (a side's qk-norm left out, the norms after RoPE): the values' norm stands
    # behind none of it, yet every experiment rerun there must norm the values as the code does to give its output
    # back; read there only from a tensor made from the code's own lined-up values
    values = None if diverged.reference in AT_VALUES else _lined_values(lined)
    if diverged.reference not in AT_VALUES and values is None:
        return None
    d_v = int(lined.trace["V_split"].shape[-1])
    qk = set()
    for row in lined.rows:
        if row.reference in QK_STEPS and row.record is not None and row.status in ("equal", "permuted"):
            qk |= ancestors(row.record, records) | {row.record.index}
    qk |= _weighs(records)  # the keys normed (a value projection's rows used as keys: kv.keys_from_values)
    out = records[-1]  # the values' way ends in the output, whatever step the line-up diverged at
    up = ancestors(diverged.record, records) | ancestors(out, records) | {diverged.record.index, out.index}
    normed = next((records[i] for i in sorted(up) if i not in qk and _unit_rows(records[i], d_v)
                   and (values is None or values in ancestors(records[i], records))), None)
    if normed is None or _keys_gain(normed, records, qk):
        return None
    names = [row.reference for row in lined.rows]
    first = names.index(diverged.reference) if diverged.reference in names else -1
    for eps in EPS:
        asked = dataclasses.replace(spec, v_norm=eps)
        again = line_up_again(module, shapes, inputs, records, train, asked)
        if again is None:
            continue
        found = again.divergence
        later = found is None or (found.reference in names and names.index(found.reference) > first)
        if later or (found is not None and found.experiment is not None and diverged.experiment is None):
            again.notes.append(
                f"your code normalizes its values (line {normed.line}: {normed.label}), each head's row of d_head = "
                f"{d_v} to an RMS of 1 without weights (an RMSNorm without scale, Gemma 3n's v_norm; eps {eps:g}): "
                "read as its own convention, and the reference norms its values so too (V_normed)")
            return asked, again
    return None


def _keys_gain(normed: Record, records: list[Record], qk: set[int]) -> bool:
    """Whether the gain the code multiplies the normed rows by (the op reading them, and what it reads beside them:
    Qwen3-Next's `x * (1 + self.weight)`) is a parameter the queries' or keys' side reads as well: their own norm,
    called on the values (qknorm.on_values), whose weights of 1 (or 1 + 0) only make it look weightless. What the
    queries' and keys' side made (the pattern the values meet) is no gain of the values'."""
    def texts(record: Record) -> set[str]:
        return {value for kind, value in record.args if kind == "text" and "." in value}

    from attnscope.usertrace.align import ancestors

    before = ancestors(normed, records) | {normed.index}
    mine: set[str] = set()
    for child in (r for r in records if normed.index in r.parents):
        beside = set().union(*({p} | ancestors(records[p], records) for p in child.parents)) - before - qk
        beside |= {p for i in beside for p in records[i].parents}  # the parameter as read (a cast the keys' made)
        mine |= texts(child).union(*(texts(records[i]) for i in beside))
    theirs = set().union(*(texts(records[i]) for i in qk)) if qk else set()
    return bool(mine & theirs)


def _weighs(records: list[Record]) -> set[int]:
    """What the code's first pattern is computed from, the queries' and keys' side: a softmax's ancestors, a
    kernel's recomputed pattern's first two operands' (F.scaled_dot_product_attention's query and key) and theirs.
    The values meet the weights after it, so none of theirs is here."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.masking import is_pattern

    pattern = next((r for r in records if is_pattern(r)), None)
    if pattern is None:
        return set()
    if pattern.label != "(attention)":
        return ancestors(pattern, records) | {pattern.index}
    sides = pattern.parents[:2]  # (query, key): the kernel's tensors in the order it was handed them
    return set(sides).union(*(ancestors(records[i], records) for i in sides))


def _lined_values(lined: LineUp) -> int | None:
    """The index of the code's tensor that lines up with the reference's values (`V_split`, else `V_feat`); None
    where neither does."""
    rows = {row.reference: row for row in lined.rows}
    for step in ("V_split", "V_feat"):
        row = rows.get(step)
        if row is not None and row.record is not None and row.status in ("equal", "permuted"):
            return int(row.record.index)
    return None


def _unit_rows(record: Record, width: int) -> bool:
    """Whether the record's rows over its last axis, `width` wide, all have an RMS of 1 (a weightless RMSNorm's)."""
    tensor = record.tensor
    if not tensor.is_floating_point() or tensor.dim() < 2 or tensor.shape[-1] != width or width < 2:
        return False
    rows = tensor.detach().double().reshape(-1, width)
    rms = rows.pow(2).mean(-1).sqrt()
    if rows.shape[0] < 2 or not bool(rms.isfinite().all()):
        return False
    return bool((rms - 1).abs().max() <= SPREAD) and not math.isclose(float(rows.abs().max()), 1.0)
