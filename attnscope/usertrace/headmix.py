"""Talking-heads attention (Shazeer et al. 2020): the code mixes its heads' scores, each head's logits (or weights)
made a weighted sum of every head's by a learned [n_head, n_head] matrix, before the softmax, after it, or both
(x-transformers' `pre_softmax_talking_heads` and `post_softmax_talking_heads`, 1x1 Conv2d layers over the head axis;
`einsum('b h i j, h k -> b k i j', dots, mix)`; a matmul over the heads moved last). Read from the data flow and the
numbers, never from names.

Found where the line-up diverges: an op on the way to the softmax (or after it, on the weights) that reads one
tensor made from the code's queries and keys, gives a tensor of its shape, is no view and no elementwise op, and
whose output, along one axis of n_head, is to tolerance a matrix M times its input along that axis: out[k] = Σ_h
M[k, h] · in[h], M read from the two tensors by least squares (M no diagonal: a scale per head is headscale.py's).
The reference then mixes its scores so (before its mask) and its weights (after its softmax), `mixed` folding M into
its run, and a rerun of a catalog mistake mixes too (rerun.Base.mix_pre, mix_post), so the mistakes around the
mixing are named by experiment. Where the fold cannot stand, the divergence says the code mixes its heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import ancestors, tolerance

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record

ALIGNED = ("equal", "permuted")
SKIPPED = ("softmax", "log_softmax", "_softmax", "dropout", "masked_fill", "masked_fill_", "where", "clone",
           "detach", "contiguous", "to", "float", "double", "half", "type_as")
# steps the fold does not know: the run is left as it is (sinks: a column of their own in each softmax row)
UNFOLDED = ("sinks", "sink_weight")
AFTER_PRE = ("capped_scores", "biased_scores", "masked_scores", "attention", "x_raw", "x_rsh1", "x_rsh2", "x")


@dataclass
class Mixing:
    record: Record  # the op that mixes
    matrix: torch.Tensor  # [n_head, n_head + 1] float64: out[k] = Σ_h matrix[k, h] · in[h] + matrix[k, -1]
    after: bool  # on the weights, after the softmax


@dataclass
class HeadMix:
    pre: Mixing | None
    post: Mixing | None

    @property
    def matrices(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.pre.matrix if self.pre else None, self.post.matrix if self.post else None)

    @property
    def first(self) -> Mixing:
        found = self.pre or self.post
        assert found is not None
        return found

    def note(self) -> str:
        where = " and ".join(w for w, m in (("its scores before the softmax", self.pre),
                                            ("its weights after it", self.post)) if m is not None)
        lines = ", ".join(f"line {m.record.line}: {_op(m.record)}" for m in (self.pre, self.post) if m is not None)
        biased = any(m is not None and bool(m.matrix[:, -1].abs().max() > 0) for m in (self.pre, self.post))
        n = self.first.matrix.shape[0]
        return (f"your code mixes its heads ({lines}): {where}, each head's a weighted sum of all heads' by a learned "
                f"[{n}, {n}] matrix{', plus a number a head' if biased else ''} (talking-heads attention): the "
                "reference mixes them too, with your run's matrices; a convention, not a mistake")

    def words(self, compared: str | None) -> str:
        """The divergence in words where the reference cannot be made to mix as the code does."""
        m = self.first
        what = "weights" if m.after else "scores"
        up = f"; compared up to {compared}" if compared else ""
        return (f"your code mixes the heads' {what} (line {m.record.line}: {_op(m.record)}): each head's {what} "
                f"become a weighted sum of all heads' (talking-heads attention), which the reference does not hold"
                f"{up}")


def _op(record: Record) -> str:
    return str(record.details.get("op", record.label))


def found(records: list[Record], lined: Any) -> HeadMix | None:
    """The code's mixing of its heads' scores (before the softmax) and weights (after it) where the line-up `lined`
    holds the code's queries, keys and a head axis; None where the code mixes none."""
    trace = lined.trace
    if trace is None or "scores" not in trace:
        return None
    dims = trace.step("scores").dims
    if "n_head" not in dims:
        return None
    n_head = int(trace["scores"].shape[dims.index("n_head")])
    size = int(trace["scores"].numel())
    paired = {row.reference: row.record for row in lined.rows if row.record is not None and row.status in ALIGNED}
    q_side = {paired[n].index for n in ("Q_split", "Q_rot", "Q_normed", "Q", "Q_feat") if n in paired}
    k_side = {paired[n].index for n in ("K_split", "K_rot", "K_normed", "K", "K_feat", "V_split", "V")
              if n in paired}
    if n_head < 2 or not q_side or not k_side:
        return None
    softmaxes = {r.index for r in records if r.func.split(".")[-1] in ("softmax", "log_softmax", "_softmax")}
    pre = post = None
    for record in records:
        if record.func in SKIPPED or record.func.split(".")[-1] in SKIPPED or not record.tensor.is_floating_point() \
                or record.tensor.numel() != size:
            continue
        given = [records[v] for kind, v in record.args if kind == "rec"]
        inputs = [g for g in given if g.tensor.shape == record.tensor.shape and g.tensor.is_floating_point()]
        if len(inputs) != 1 or any(g.tensor.numel() >= size for g in given if g is not inputs[0]):
            continue  # one tensor of the scores' size mixed, the rest small (the matrix)
        up = ancestors(record, records)
        if not (up & q_side and up & k_side):
            continue
        matrix = _matrix(inputs[0].tensor, record.tensor, n_head)
        if matrix is None:
            continue
        after = bool(up & softmaxes)
        if after and post is None:
            post = Mixing(record, matrix, True)
        elif not after and pre is None:
            pre = Mixing(record, matrix, False)
    return HeadMix(pre, post) if pre is not None or post is not None else None


def _matrix(given: torch.Tensor, made: torch.Tensor, n_head: int) -> torch.Tensor | None:
    """[M | c] with made = M · given + c along one axis of size n_head (to tolerance), M off its diagonal somewhere
    (a Conv2d or Linear over the heads, its bias c, [n_head]); else None."""
    x_all, y_all = given.detach().double(), made.detach().double()
    if not bool(torch.isfinite(x_all).all()) or not bool(torch.isfinite(y_all).all()):
        return None
    for axis in range(x_all.dim()):
        if x_all.shape[axis] != n_head:
            continue
        x = x_all.movedim(axis, 0).reshape(n_head, -1)  # [n_head, rest]
        y = y_all.movedim(axis, 0).reshape(n_head, -1)
        if x.shape[1] < n_head:
            continue
        x1 = torch.cat([x, torch.ones_like(x[:1])])  # [n_head + 1, rest]: the bias's row
        m = torch.linalg.lstsq(x1.T, y.T).solution.T  # y ≈ m @ x1
        if float((m @ x1 - y).abs().max()) > tolerance(made.detach().float()):
            continue
        square = m[:, :-1]
        off = square - torch.diag(torch.diagonal(square))
        if float(off.abs().max()) <= 1e-6 * float(square.abs().max()):
            return None  # a scale per head, no mixing
        bias = m[:, -1:]
        return torch.cat([square, torch.where(bias.abs() > tolerance(made.detach().float()), bias, 0.0)], dim=1)
    return None


def mix(t: torch.Tensor, matrix: torch.Tensor, axis: int) -> torch.Tensor:
    """`t` mixed along its head axis `axis`: out[k] = Σ_h matrix[k, h] · t[h] + matrix[k, -1]."""
    moved = t.movedim(axis, -1)
    m = matrix.to(t.dtype)
    return (moved @ m[:, :-1].T + m[:, -1]).movedim(-1, axis)


def mixed(trace: Trace, matrices: tuple[torch.Tensor | None, torch.Tensor | None], reference: Any) -> Trace:
    """The reference's run with its scores mixed across the heads by the code's matrix before the mask, and its
    weights after the softmax, the steps after them made again (attention/stages.merge); the run as it was where it
    holds a step the fold does not know, or its scores no head axis."""
    from attnscope.attention.stages import merge
    from attnscope.trace import Trace

    pre, post = matrices
    names = [step.name for step in trace.steps]
    if any(n in names for n in UNFOLDED) or any(n not in names for n in ("scores", "attention", "x_raw")):
        return trace
    dims = trace.step("scores").dims
    if "n_head" not in dims:
        return trace
    axis = dims.index("n_head")
    values = next((n for n in ("V_rep", "V_cat", "V_split", "V") if n in names), None)
    out = Trace(notes=list(trace.notes))
    logits = last = trace["scores"]  # the logits before the mixing (capped where the reference caps)
    for step in trace.steps:
        if step.name in ("x_rsh1", "x_rsh2", "x"):
            continue  # made again by the merge
        if step.name in ("scores", "capped_scores"):
            out.add_step(step)
            logits = step.tensor
            last = mix(logits, pre, axis) if pre is not None else logits
        elif step.name == "biased_scores":  # the bias added to the mixed logits, as the code adds it after them
            last = last + torch.where(torch.isfinite(step.tensor), step.tensor - logits, 0.0)
            out.add(step.name, last, step.dims, step.op, step.work, inputs=step.inputs)
        elif step.name == "masked_scores":
            last = last.masked_fill(torch.isneginf(step.tensor), -torch.inf)
            out.add(step.name, last, step.dims, step.op, step.work, inputs=step.inputs)
        elif step.name == "attention":
            weights = torch.softmax(last, dim=-1).masked_fill(torch.isneginf(last).all(-1, keepdim=True), 0.0)
            weights = mix(weights, post, axis) if post is not None else weights
            out.add("attention", weights, step.dims, step.op, step.work, inputs=step.inputs)
        elif step.name == "x_raw" and values is not None:
            x_raw = out.add("x_raw", torch.matmul(out["attention"], out[values].to(out["attention"].dtype)).to(
                step.tensor.dtype), step.dims, step.op, step.work, inputs=step.inputs)
            if all(n in names for n in ("x_rsh1", "x_rsh2", "x")):
                with torch.no_grad():
                    merge(out, x_raw, reference.W_o, reference.width("n_head"))
        else:
            out.add_step(step)
    return out if "x_raw" in out else trace
