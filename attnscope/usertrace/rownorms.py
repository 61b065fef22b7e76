"""A qk-norm without weights, read from what the code computes on q and k: a tensor of the queries' (or the keys')
size whose every row, over d_head or over the whole projection, has one and the same length. Llama 4's
`Llama4TextL2Norm` (`x · rsqrt(mean(x²) + eps)`, no parameters, after RoPE), nanochat's `F.rms_norm(q,
(q.size(-1),))` and a cosine attention's `F.normalize(q, dim=-1)` (rows of unit length) write no weight that
normforms.py could fit, yet their rows show it.

The reading says where the rows were normalized (the record, its line, before or after RoPE), over which width
("head" or "proj", as the reference's qk-norm runs), and the rows' RMS: 1 for an RMSNorm, 1/√width for rows of unit
length (an RMSNorm scaled by that gain, which the reference's norm weights then hold). The epsilon is the
parameter-free norm module's own where the module holds one (its `eps`, read by normforms.read on a probe), else
the form's usual one: 1e-6 for an RMSNorm (F.rms_norm's default is float32's machine epsilon, as small), none for
unit rows (F.normalize's 1e-12 only guards a zero row). A weightless norm over d_head gives the same numbers
before and after RoPE (a rotation keeps each row's length), so the reference's qk-norm before RoPE describes
either; the note says where the code puts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnscope.usertrace import normforms
from attnscope.usertrace.record import Record

SPREAD = 2e-3  # the rows' lengths agree to this (relative): an epsilon of 1e-5 on rows of RMS 0.1 moves them 1e-3


@dataclass(frozen=True)
class RowNorm:
    """Where and how the code normalizes its q and k rows."""

    over: str  # "head": each head's d_head coordinates; "proj": the whole projection
    gain: float  # the RMS of each normalized row: 1 (RMSNorm), 1/√width (unit length)
    eps: float
    record: Record  # the first normalized tensor, the queries' or the keys'
    kind: str  # "RMS" or "unit"
    eps_from: str  # where the epsilon was read

    def words(self, after_rope: bool | None) -> str:
        what = "to RMS 1, x · rsqrt(mean(x²) + eps)" if self.kind == "RMS" else \
            "to unit length, x / ‖x‖ (an RMSNorm scaled by 1/√width)"
        over = "over each head's d_head" if self.over == "head" else "over the whole projection"
        where = "" if after_rope is None else (", after RoPE" if after_rope else ", before RoPE")
        label = "" if self.record.label.startswith("#") else f"your {self.record.label}, "
        return (f"your code normalizes q and k {what}, {over}, without weights ({label}line {self.record.line}"
                f"{where}; eps {self.eps:g}, {self.eps_from})")


def read(module: Any, records: list[Record], trace: Any) -> RowNorm | None:
    """The weightless qk-norm the records show, or None. `trace` is the reference's run (its Q_feat and K_feat
    give the sizes and widths)."""
    if trace is None or "Q_feat" not in trace or "K_feat" not in trace or "Q_split" not in trace:
        return None
    q_feat, k_feat, d_head = trace["Q_feat"], trace["K_feat"], int(trace["Q_split"].shape[-1])
    widths = {d_head: "head", int(q_feat.shape[-1]): "proj", int(k_feat.shape[-1]): "proj"}
    sizes = {k_feat.numel(): "k", q_feat.numel(): "q"}  # as many: the first is the queries', the next the keys'
    found: dict[str, tuple[Record, str, float]] = {}
    for record in records:
        tensor = record.tensor
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() < 2 \
                or tensor.numel() not in sizes or tensor.shape[-1] not in widths or tensor.shape[-1] < 2:
            continue
        role = sizes[tensor.numel()]
        if role in found and len(sizes) > 1:
            continue
        rms = _rows_rms(tensor)
        if rms is not None:
            found.setdefault(role if role not in found else "k", (record, widths[tensor.shape[-1]], rms))
    if len(found) < 2 or found["q"][1] != found["k"][1]:
        return None
    (record, over, rms), width = found["q"], int(found["q"][0].tensor.shape[-1])
    unit = abs(rms * math.sqrt(width) - 1.0) < 1e-2
    if not unit and abs(rms - 1.0) >= 1e-2:
        return None
    eps, eps_from = _eps(module, width, unit)
    return RowNorm(over, 1.0 / math.sqrt(width) if unit else 1.0, eps, record, "unit" if unit else "RMS", eps_from)


def after_rope(norm: Record, records: list[Record], trace: Any) -> bool | None:
    """Whether the code normalizes after it rotates: some tensor of its before the norm already holds the rotated
    queries, its head rows (each scaled to unit length, which a rotation and a weightless norm both keep) those of
    the reference's Q_rot, in any layout; `trace` is the reference's run with the norm and the code's RoPE. None
    without RoPE."""
    from attnscope.usertrace.align import layouts

    if trace is None or "Q_rot" not in trace:
        return None
    want = _unit_rows(trace["Q_rot"].double())
    shape = tuple(want.shape)
    for record in records:
        tensor = record.tensor
        if record.index >= norm.index or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() \
                or tensor.numel() != want.numel():
            continue
        for layout in layouts(shape, tuple(tensor.shape)):
            try:
                mine = _unit_rows(layout.undo(tensor, shape).double())
            except RuntimeError:
                continue
            if torch.allclose(mine, want, atol=1e-4):
                return True
    return False


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _rows_rms(tensor: torch.Tensor) -> float | None:
    """The rows' one RMS over the last axis, None where the rows' lengths differ (or any is zero)."""
    rows = tensor.detach().double().reshape(-1, tensor.shape[-1])
    if rows.shape[0] < 2:
        return None
    rms = rows.pow(2).mean(-1).sqrt()
    low, high = float(rms.min()), float(rms.max())
    if not math.isfinite(high) or low <= 0 or high - low > SPREAD * high:
        return None
    if float(rows.mean(-1).abs().max()) <= 1e-4 * high:  # the mean taken out too: a LayerNorm's (normforms.py's)
        return None
    return float(rms.median())


def _eps(module: Any, width: int, unit: bool) -> tuple[float, str]:
    """The epsilon of the module's parameter-free norm (normforms.read on a probe: a submodule holding no weights
    that computes an RMSNorm), else the form's usual one."""
    if isinstance(module, torch.nn.Module):
        for sub in module.modules():
            if sub is module or next(sub.parameters(), None) is not None or normforms.own_eps(sub) is None:
                continue
            form = normforms.read(sub, width)
            if form is not None and form.kind == "rms" and form.bias is None:
                name = next((n for n, m in module.named_modules() if m is sub), "")
                return form.eps, f"your {name}'s"
    return (0.0, "F.normalize's, which only guards a zero row") if unit else (1e-6, "not read: the usual one")
