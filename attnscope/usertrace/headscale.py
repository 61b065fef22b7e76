"""A learned temperature the code scales its scores by, one number per head (or one for all): cosine attention's
`q̂ · k̂ᵀ · exp(clamp(logit_scale, max=log 100))` (Swin V2, OpenCLIP's scaled_cosine), XCiT's and Restormer's
`(q · kᵀ) * self.temperature`, a scale divided by a learned parameter. It is the code's own scale, head by head,
which no one `--scale` describes: read from the data flow and the numbers, never from names.

Read where the line-up diverges: a multiplication (or a division by it) on the way to the softmax, one of whose
operands holds the code's content scores `q · kᵀ` (in some layout, times any number, as the code computes them) and
the other is computed from a learned parameter of the module's own alone (no projection's weight, never from the
inputs); its output, in the reference's scores layout, is the reference's `q · kᵀ` times one number per head. Those
numbers are the code's scale. The reference scales each head's scores so (`scaled` folds them into its run, from
the scores on), and a rerun of a catalog mistake keeps them (rerun.Base.head), so the mistakes around them are still
named by experiment. A scale the user asked for with `--scale` is the reference's, and the code's temperature is then
compared with it as any scale is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import layouts, tolerance
from attnscope.usertrace.record import MULTIPLIES

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record

DIVS = ("div", "__truediv__", "true_divide", "div_", "__itruediv__")
ALIGNED = ("equal", "permuted")
REFOLDED = ("scores", "biased_scores", "masked_scores", "attention", "x_raw")
UNFOLDED = ("capped_scores", "alibi_bias", "sinks", "sink_weight")  # steps the fold does not know: left as they are


@dataclass
class HeadScale:
    factors: torch.Tensor  # [n_head] float64: the code's scores are the reference's q · kᵀ times these, head by head
    record: Record  # the product that applies them
    note: str

    @property
    def same(self) -> bool:
        """One number in every head (a learned scalar scale, or heads still at their initial value)."""
        return bool(torch.allclose(self.factors, self.factors[0].expand_as(self.factors), rtol=1e-6, atol=0.0))


def found(module: Any, records: list[Record], inputs: Inputs, lined: Any) -> HeadScale | None:
    """The code's own scale per head the line-up `lined` (lined.LineUp) suggests, or None: where the line-up holds
    the code's queries and keys, no `--scale` was asked, and the code multiplies its content scores by a tensor of
    its own learned parameters whose product is the reference's q · kᵀ times one number per head."""
    from attnscope.usertrace.ownbias import computed_from
    from attnscope.usertrace.ownterm import CONTENT_K, CONTENT_Q, before_softmax, d_head_of, extra_params

    trace, spec = lined.trace, lined.spec
    if module is None or not isinstance(module, torch.nn.Module) or trace is None or spec is None \
            or "scores" not in trace or spec.head_scale is not None or spec.layout == "col" \
            or (spec.scale is not None and spec.scale_from is None):
        return None
    dims = trace.step("scores").dims
    d_head = d_head_of(trace)
    if "n_head" not in dims or d_head is None:
        return None
    axis = dims.index("n_head")
    scale = spec.scale if spec.scale is not None else d_head ** -0.5
    content = trace["scores"].double() / scale  # q · kᵀ as the reference computes it
    paired = {row.reference: row.record for row in lined.rows if row.record is not None and row.status in ALIGNED}
    q_side = {r.index for n, r in paired.items() if n in CONTENT_Q}
    # the keys' side, or the values' (keys and values swapped: the scores read the tensor lined up with the values)
    k_side = {r.index for n, r in paired.items() if n in CONTENT_K or n in ("V_split", "V")}
    if not q_side or not k_side:
        return None
    own = extra_params(module, records, paired)  # the module's parameters no projection holds
    learned = dict(module.named_parameters())
    fed = computed_from(records, set(inputs.tensors))
    softmaxed = before_softmax(records)
    for record in records:
        if (record.func not in MULTIPLIES and record.func not in DIVS) or record.index not in softmaxed \
                or not record.tensor.is_floating_point() or record.tensor.numel() != content.numel():
            continue
        factor = _factor_operand(record, records, q_side, k_side, fed, own, learned)
        if factor is None:
            continue
        factors = _per_head(record.tensor, content, axis)
        if factors is None:  # the code's scores are not the reference's (keys and values swapped): its own numbers
            factors = _held(record, records, learned, int(content.shape[axis]))
        if factors is not None:  # times a number the code scales its sum by later (after its own term is added)
            later, lines = _scaled_later(record, records, softmaxed)
            if later != 1.0:  # said in the note, so a constant on top of the temperature is seen (Swin V2's /√d)
                said = " = 1/√d_head, on top of the temperature" if math.isclose(later, d_head ** -0.5, rel_tol=1e-4) \
                    else ""
                factor = f"{factor}; then times {later:.4g}{said} at line {', '.join(map(str, lines))}"
            factors = factors * later
            return HeadScale(factors, record, _note(record, factor, factors, d_head, spec))
    return None


def _scaled_later(record: Record, records: list[Record], softmaxed: set[int]) -> tuple[float, list[int]]:
    """The number the code multiplies `record`'s scores by on their way to the softmax, after terms are added to
    them (`((q · kᵀ) * gain + q · rel) * scale`): each later product of them whose output is its input times one
    number, read off the two tensors; 1 where there is none. A view or an add goes on; anything else stops. With
    the lines of those products."""
    from attnscope.usertrace.align import factor_of
    from attnscope.usertrace.ownterm import ADDS, RESHAPES

    total, current, lines = 1.0, record, []
    for later in records[record.index + 1:]:
        given = [v for kind, v in later.args if kind == "rec"]
        if current.index not in given or later.index not in softmaxed:
            continue
        if later.func in MULTIPLIES or later.func in DIVS:
            if later.tensor.shape != current.tensor.shape:
                break
            ratio = factor_of(later.tensor.double(), current.tensor.double())
            if ratio is None:
                break
            total *= ratio
            lines.append(later.line)
        elif later.func not in ADDS and later.func not in RESHAPES:
            break
        current = later
    return total, lines


def _held(record: Record, records: list[Record], learned: dict[str, Any], n_head: int) -> torch.Tensor | None:
    """The numbers a product of the code's queries and keys as they are (a matmul of the two, nothing else) is
    multiplied (divided) by, one a head or one for all, read off the factor itself: where the line-up diverges before
    the scores (keys and values swapped), they say the code's scale all the same. None where the content operand is
    no bare product or the factor not one number a head."""
    from attnscope.usertrace.record import MATMULS

    given = [(kind, v) for kind, v in record.args if kind == "rec" or kind == "text" and v in learned]
    if len(given) != 2:
        return None
    bare = [i for i, (kind, v) in enumerate(given) if kind == "rec" and records[v].func.split(".")[-1]
            in (*MATMULS, "einsum")]
    if len(bare) != 1 or (record.func in DIVS and bare[0] != 0):
        return None
    kind, value = given[1 - bare[0]]
    factor = (records[value].tensor if kind == "rec" else learned[value]).detach().double()
    sizes = [n for n in factor.shape if n != 1]
    if sizes not in ([], [n_head]):
        return None
    values = factor.reshape(-1).expand(n_head) if not sizes else factor.reshape(n_head)
    return 1 / values if record.func in DIVS else values.clone()


def _factor_operand(record: Record, records: list[Record], q_side: set[int], k_side: set[int], fed: set[int],
                    own: set[str], learned: dict[str, Any]) -> str | None:
    """The words for the operand of `record` that scales the content scores by a tensor of the module's own learned
    parameters (their names); None where `record` is no such product: one operand made from the code's queries and
    keys, the other (the divisor, for a division) from learned parameters of no projection alone."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.ownbias import arg_names

    given = [(kind, value) for kind, value in record.args if kind in ("rec", "text")]
    if len(given) != 2:
        return None
    sides = []
    for kind, value in given:
        if kind == "rec":
            up = ancestors(records[value], records) | {value}
            sides.append((bool(up & q_side and up & k_side), up))
        else:
            sides.append((False, set()))
    for content, other in ((0, 1), (1, 0)):
        if not sides[content][0] or (record.func in DIVS and other != 1):
            continue
        kind, value = given[other]
        if kind == "text":
            return str(value) if value in own and value in learned else None
        up = sides[other][1]
        if up & fed or up & q_side or up & k_side or records[value].tensor.numel() >= record.tensor.numel():
            return None  # computed from the inputs, or as large as the scores: no temperature
        names = sorted({n for i in up for n in arg_names(records[i].args) if n in own and n in learned})
        if names:
            return ", ".join(names[:3])
    return None


def _per_head(user: torch.Tensor, content: torch.Tensor, axis: int) -> torch.Tensor | None:
    """The numbers, one per head, that `user` (in some layout of the reference's scores) is `content` times, each
    head's to tolerance; None where it is no such product."""
    shape = tuple(content.shape)
    n_head = shape[axis]
    per_head = content.movedim(axis, 0).reshape(n_head, -1)
    energy = per_head.pow(2).sum(1)
    if not bool((energy > 0).all()):
        return None
    for layout in layouts(shape, tuple(user.shape)):
        mine = layout.undo(user.detach(), shape).double().movedim(axis, 0).reshape(n_head, -1)
        factors = (mine * per_head).sum(1) / energy
        if not bool(torch.isfinite(factors).all()) or bool((factors.abs() < 1e-6).any()):
            continue
        if float((mine - factors[:, None] * per_head).abs().max()) <= tolerance(mine.float()):
            return factors
    return None


def _note(record: Record, factor: str, factors: torch.Tensor, d_head: int, spec: Any) -> str:
    made = record.details.get("op", record.label)
    values = ", ".join(f"{float(f):.4g}" for f in factors[:8]) + (", ..." if factors.numel() > 8 else "")
    same = bool(torch.allclose(factors, factors[0].expand_as(factors), rtol=1e-6, atol=0.0))
    instead = f"--scale {spec.scale:g}" if spec.scale is not None else f"1/√d_head = {d_head ** -0.5:.4g}"
    which = (f"{float(factors[0]):.4g} in every head (--scale {float(factors[0]):.4g} says the same)" if same else
             f"one a head: {values}, which no one --scale describes")
    return (f"your code scales its scores by a learned temperature of its own (line {record.line}: {made}; from "
            f"{factor}), {which}: the reference scales each head's q · kᵀ so, in place of {instead}; a convention, "
            "not a mistake")


def scaled(trace: Trace, factors: torch.Tensor, reference: Any, scale: float) -> Trace:
    """The reference's run with each head's scores times `factors` / `scale` (the code's scale per head in place of
    the reference's), the steps after them made again from there: the bias and the mask added as before, the softmax,
    `attention @ V`, the heads merged and projected (attention/stages.merge). The run as it was where it holds a step
    the fold does not know (a softcap, ALiBi, sinks) or its scores no head axis."""
    from attnscope.attention.stages import merge
    from attnscope.trace import Trace

    names = [step.name for step in trace.steps]
    if any(n in names for n in UNFOLDED) or any(n not in names for n in ("scores", "attention", "x_raw")):
        return trace
    dims = trace.step("scores").dims
    if "n_head" not in dims or trace["scores"].shape[dims.index("n_head")] != factors.numel():
        return trace
    shape = [1] * len(dims)
    shape[dims.index("n_head")] = -1
    old = trace["scores"]
    relative = (factors.double() / scale).reshape(shape)
    delta = (old.double() * relative - old.double()).to(old.dtype)  # what the code's scale adds to each score
    said = ", ".join(f"{float(f):.4g}" for f in factors[:4]) + (", ..." if factors.numel() > 4 else "")
    out = Trace(notes=list(trace.notes))
    values = next((n for n in ("V_rep", "V_cat", "V_split", "V") if n in names), None)
    last = old
    for step in trace.steps:
        if step.name not in REFOLDED:
            if step.name in ("x_rsh1", "x_rsh2", "x"):
                continue  # made again by the merge
            out.add_step(step)
            continue
        if step.name in ("scores", "biased_scores", "masked_scores"):
            last = step.tensor + delta  # -inf where masked stays -inf
            op = f"{step.op}, each head's scores scaled by your own [{said}]" if step.name == "scores" else step.op
            out.add(step.name, last, step.dims, op, step.work, inputs=step.inputs)
        elif step.name == "attention":
            attention = torch.softmax(last, dim=-1).masked_fill(torch.isneginf(last).all(-1, keepdim=True), 0.0)
            out.add("attention", attention, step.dims, step.op, step.work, inputs=step.inputs)
        elif values is not None:  # x_raw
            x_raw = out.add("x_raw", torch.matmul(out["attention"], out[values].to(out["attention"].dtype)).to(
                step.tensor.dtype), step.dims, step.op, step.work, inputs=step.inputs)
            if all(n in names for n in ("x_rsh1", "x_rsh2", "x")):
                with torch.no_grad():
                    merge(out, x_raw, reference.W_o, reference.width("n_head"))
    return out if "x_raw" in out else trace


def replay_factor(factors: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """The factor rerun.replay multiplies each head's scaled scores by, `[n_head, 1, 1]`, float64; None without."""
    if factors is None or not math.isfinite(scale) or scale == 0:
        return None
    return (factors.double() / scale).reshape(-1, 1, 1)
