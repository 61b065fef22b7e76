"""Norms the module holds for q, k or v and never calls: a note, never a diagnosis.

A norm submodule whose name says the values (`v_norm`, `value_layernorm`, `norm_v`), the queries or the keys, that
computes a norm over a head's `d_head` (normforms.read: an RMSNorm or a LayerNorm, with weights or none, Gemma 3n's
`Gemma3nRMSNorm(head_dim, with_scale=False)`), and that the run never entered (no forward hook fired on it) nor read a
parameter or buffer of, is held and idle: the code's tensors on that side are not normed by it.

No experiment can name that a mistake: the reference norms a side only where an option or the code's own run says so
(`--qk-norm`, valuenorm.py's reading of a norm the code applies), so a norm the code never applies is never in the
reference, and its rerun without it gives nothing back that the line-up did not. A module may hold a norm it
legitimately leaves unused (a branch its config turns off), so the run's outcome stands and the note says what was
held and what the reference did: where the reference norms that side itself (the keys' k_norm under --qk-norm, which
qknorm.missing names by experiment), nothing is said.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from attnscope.usertrace import normforms
from attnscope.usertrace.linearweights import role_of
from attnscope.usertrace.record import mentioned

if TYPE_CHECKING:
    from attnscope.usertrace.call import Called
    from attnscope.usertrace.reference import Spec

SIDES = {"q": "queries", "k": "keys", "v": "values"}


def notes(module: Any, called: Called, spec: Spec, d_head: int | None) -> list[str]:
    """A note for each norm of q, k or v that `module` holds and the run `called` never applied, where the reference
    does not norm that side itself."""
    if not isinstance(module, nn.Module) or not d_head or called.failure is not None:
        return []
    said = []
    for name, norm in module.named_modules():
        role = role_of(name.lower().replace("norm", "")) if name else None
        if role not in SIDES or _normed(role, spec) or any(True for _ in norm.children()) \
                or id(norm) in called.entered or _read(name, norm, called):
            continue
        form = _form(norm, d_head)
        if form is None:
            continue
        said.append(f"your {name} ({type(norm).__name__}, {_described(form)} over d_head = {d_head}) is held "
                    f"but never called: no op of the run applies it, so your {SIDES[role]} are not normed by it, "
                    f"and the reference does not norm them either (no option or step of your code says it); where "
                    f"your model norms its {SIDES[role]}, that call is missing")
    return said


def _normed(role: str, spec: Spec) -> bool:
    """Whether the reference norms that side itself (the experiments then speak for a norm left out)."""
    return spec.v_norm is not None if role == "v" else spec.qk_norm is not None


def _read(name: str, norm: nn.Module, called: Called) -> bool:
    """Whether an op of the run read one of the norm's parameters or buffers (a norm applied by hand, its
    `forward` bypassed: `F.rms_norm(x, (d,), self.v_norm.weight)`)."""
    held = [f"{name}.{p}" for p, _ in [*norm.named_parameters(), *norm.named_buffers()]]
    return any(mentioned(p, called.records) for p in held)


def _form(norm: nn.Module, width: int) -> normforms.NormForm | None:
    """What the norm computes over a last axis of `width`; None where it is no norm over it (it raises, or fits no
    form)."""
    try:
        return normforms.read(norm, width)
    except Exception:  # noqa: BLE001 - a module that does not run on a probe of this width is no norm of a head
        return None


def _described(form: normforms.NormForm) -> str:
    """The norm in words: its kind, its epsilon, and its weights (none: a gain of 1 everywhere, no bias)."""
    kind = "a LayerNorm" if form.kind == "layer" else "an RMSNorm"
    bare = form.bias is None and (form.weight is None or bool(((form.weight - 1).abs() <= 1e-5).all()))
    return f"{kind} (eps {form.eps:g}){' without weights' if bare else ' with weights'}"
