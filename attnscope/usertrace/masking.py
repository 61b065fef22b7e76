"""How the user's code reads its mask, and the mask given to it in that convention.

The code is first called with a boolean mask, True = may attend. Its recorded ops then say how it applies
the mask (the first op where the mask, or what the code made of it, meets the scores):

- `scores.masked_fill(mask == 0, -1e9)`, `~mask`, `torch.where(mask, scores, -inf)`,
  `F.scaled_dot_product_attention(attn_mask=mask)`: True = may attend ("attend", the tutorials' and PyTorch's
  F.scaled_dot_product_attention's convention);
- `scores.masked_fill(mask, -1e9)`, `scores[mask] = -inf`, nn.MultiheadAttention's `attn_mask` and
  `key_padding_mask`: True = masked out ("masked");
- `scores + mask`: an additive float mask, 0 = may attend, -inf = masked ("additive", transformers' and
  F.scaled_dot_product_attention's float masks);
- `1 - mask` (which PyTorch refuses on a boolean): 0/1 floats, 1 = may attend ("float01", BERT's
  `(1.0 - mask) * -10000.0`); a code that casts the mask and builds its bias itself reads it as "attend";
- `scores - mask` (a boolean refused there too): a float mask subtracted, 0 = may attend, +inf = masked
  ("subtracted", xformers-like `attn - attn_bias` with the bias positive where a key is blocked).
When the convention is not "attend", the code is called again with the mask written its way. Inverting a
mask that the code reads the other way round is what `torch.nn.MultiheadAttention` asks of a mask written for
F.scaled_dot_product_attention; transformers' `_prepare_4d_attention_mask` turns 0/1 into 0/-inf the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.usertrace.align import ADDS_A_MASK  # diffusers' baddbmm(attention_mask, q, kᵀ, beta=1)

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.record import Failure, Record

INVERTING = ("__invert__", "bitwise_not", "logical_not")
CARRYING = ("unsqueeze", "view", "reshape", "expand", "expand_as", "to", "bool", "__getitem__", "squeeze",
            "contiguous", "type_as", "float", "int", "long", "half", "bfloat16", "double", "repeat", "cuda", "cpu",
            "broadcast_to", "permute", "transpose", "clone", "detach", "type")
COMPARING = ("__eq__", "eq", "__ne__", "ne")
BELOW = ("__lt__", "lt", "__le__", "le")  # `mask < 0.5`: True where the mask is False
ABOVE = ("__gt__", "gt", "__ge__", "ge")  # `mask > 0`: True where it is True
ARITHMETIC = ("__rsub__", "sub", "__sub__", "mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "div",
              "__truediv__", "masked_fill", "where")
ADDS = ("add", "__add__", "__radd__", "sub", "__sub__", "add_", "__iadd__", "sub_", "__isub__")  # fairseq's +=
WORDS = {
    "attend": "boolean, True = may attend (F.scaled_dot_product_attention's convention)",
    "masked": "boolean, True = masked out (nn.MultiheadAttention's convention)",
    "additive": "additive float, 0 = may attend, -inf = masked",
    "float01": "float 0/1, 1 = may attend",
    "float10": "float 0/1, 1 = masked out",
    "subtracted": "float, subtracted from the scores: 0 = may attend, +inf = masked",
    "additive_min": "additive float, 0 = may attend, finfo.min = masked (transformers' 4-D masks)",
}
SUBTRACTS = ("sub", "__sub__", "sub_", "__isub__", "subtract")
# masks merged into one (nn.MultiheadAttention's attn_mask | key_padding_mask): either side's polarity carried
MERGING = ("__or__", "__ror__", "__ior__", "logical_or", "bitwise_or", "__and__", "__rand__", "__iand__",
           "logical_and", "bitwise_and")
SHAPED_ONLY = ("ones_like", "zeros_like", "full_like", "empty_like", "rand_like", "randn_like", "new_ones",
               "new_zeros", "new_full", "new_empty")


@dataclass
class Convention:
    kind: str  # attend | masked | additive | float01 | float10 | subtracted | additive_min
    line: int | None = None
    how: str = ""  # the op that told it
    stated: str = ""  # where the code's own words give the other polarity (statedmask.py): 'line N: "..."'
    compared: bool = False  # read from a comparison with a number only an additive mask's values straddle
    defaulted: str = ""  # where the module's own default mask gives the other polarity (defaultmask.py): 'line N: op'
    unread: bool = False  # no op of the run read the mask: the kind is the default, not the code's

    def note(self, parameter: str) -> str:
        where = f" (line {self.line}: {self.how})" if self.line else ""
        if self.unread:  # BLIP's cross branch that never reads its encoder_attention_mask: no reading to report
            return f"{parameter}: given {WORDS[self.kind]}; no op of your code's run reads it"
        if self.defaulted:
            return (f"{parameter}: given {WORDS[self.kind]}, as your module's own default for it holds "
                    f"({self.defaulted}, made when none is given: read the way your ops read it, it would mask every "
                    "key); your code "
                    f"reads it the other way round: it masks where the mask is {self.kind == 'attend'}{where}")
        if self.stated:
            opposite = f"it masks where the mask is {self.kind == 'attend'}" if self.kind in ("attend", "masked") \
                else f"it masks where the mask is {1 if self.kind == 'float01' else 0}"
            return (f"{parameter}: given {WORDS[self.kind]}, as your code's own words say it is ({self.stated}); "
                    f"your code reads it the other way round: {opposite}{where}")
        if self.kind == "float01" and self.how == "converted":  # agrees(): OpenFold's inf * (mask - 1)
            return (f"{parameter}: {WORDS['float01']}: your code builds its own bias from the mask's numbers"
                    f"{f' (line {self.line})' if self.line else ''}, and a boolean makes it raise in that arithmetic")
        if self.kind == "attend" and self.how == "converted":
            return (f"{parameter}: {WORDS['attend']}; your code builds its own bias from it"
                    f"{f' (line {self.line})' if self.line else ''}")
        reads = {"attend": "it masks where the mask is False", "masked": "it masks where the mask is True",
                 "additive": "it adds the mask to the scores", "float01": "it computes with the mask as numbers",
                 "float10": "it computes with the mask as numbers, 1 where a key is masked",
                 "subtracted": "it subtracts the mask from the scores",
                 "additive_min": "it adds the mask to the scores"}
        if self.compared:
            fill = "finfo.min" if self.kind == "additive_min" else "-inf"
            reads[self.kind] = (f"it compares the mask with a number that tells an additive mask's 0 and {fill} "
                                "apart (and no boolean's True and False)")
        return f"{parameter}: {WORDS[self.kind]}, as your code reads it: {reads[self.kind]}{where}"


def detect(records: list[Record], failure: Failure | None, label: str) -> Convention:
    """The convention the code's ops show (attend when they show none)."""
    derived: dict[int, tuple[bool, bool]] = {}  # record -> (inverted, made by arithmetic)
    compared: Convention | None = None  # a comparison only an additive mask's values answer (`mask < 0`)
    filled: dict[int, int] = {}  # record -> the line where cells of the mask were set to a large negative number
    biased: dict[int, Convention] = {}  # record -> the polarity a `where(mask, number, number)` bias settled
    kept: set[int] = set()  # records that are `1 - mask` of the mask as given (0/1 turned round, nothing more)
    read = False
    for record in records:
        sources = [_source(arg, derived, label) for arg in record.args]
        found = [s for s in sources if s is not None]
        if not found:
            continue
        read = True
        inverted, arithmetic = found[0]
        others = [a for a, s in zip(record.args, sources, strict=True) if s is None and _is_tensor(a)]
        name = record.func
        if name in SHAPED_ONLY:  # ones_like(mask): the mask's shape alone, none of its values
            continue
        reads = [arg[1][1] if arg[0] == "kw" else arg for arg in record.args]
        fill = next((filled[v] for kind, v in reads if kind == "rec" and v in filled), None)
        bias = next((biased[v] for kind, v in reads if kind == "rec" and v in biased), None)
        edited = (name == "where" and len(sources) == 3 and sources[0] is None and any(sources[1:])) or (
            name.startswith("masked_fill") and len(sources) > 1 and sources[0] is not None and sources[1] is None)
        if name in MERGING and all(_boolean(a, records) for a in record.args if _is_tensor(a)):
            derived[record.index] = found[0]  # another boolean mask merged in: no scores met yet
            continue
        if edited:  # the mask as the data, cells of it replaced where the code's own condition says (Gemma 2's
            # window merged into the causal mask it is given: where(window, finfo.min, attention_mask),
            # attention_mask.masked_fill(far, finfo.min)): carried on
            derived[record.index] = found[0]
            put = record.args[2 if name.startswith("masked_fill") else 1] if len(record.args) > 2 else ("", None)
            value = _number(put[1]) if put[0] == "text" else None
            if fill is not None or (value is not None and value <= -1e4):
                filled[record.index] = fill if fill is not None else record.line
            continue
        if fill is not None and name == "scaled_dot_product_attention":
            # cells of the mask set to a large negative number (finfo.min), which on a boolean would read True:
            # the code's mask is numbers, added to the scores
            return Convention("additive", record.line, f"cells of it set to a large negative number (line {fill}), "
                              f"then {record.details.get('op', record.call)}")
        if fill is not None:
            filled[record.index] = fill
        if bias is not None and others:  # a bias the code wrote from the mask by torch.where, now applied
            applying = _short(record.details.get("op", record.call))
            return Convention(bias.kind, record.line, f"{bias.how}, then {applying}")
        written_as = (_where_bias(record, sources, inverted) or _filled_bias(record, sources, inverted)) \
            if bias is None else bias
        if written_as is not None:  # torch.where(mask, -inf, 0.0): a bias whose very negative side says the polarity
            biased[record.index] = written_as
            derived[record.index] = (inverted, True)
            continue
        if others and name in ADDS and _compared_after(record, records):  # a sum compared with a number (HF's
            # `(causal_mask + attention_mask[:, None, None, :]) == 0`): the mask merged into the code's own, not yet
            # applied to the scores
            derived[record.index] = (inverted, True)
            continue
        if others and name in MULTIPLIES and any(kind == "rec" and v in kept for kind, v in reads):
            # `scores * (1 - mask)`: what multiplies the scores keeps where it is 1, so the mask's 1 is masked out
            # (CTRL's `triu(ones, 1)`): the mask as the code's own arithmetic reads it, multiplied in (a mistake the
            # catalog names, mask.multiplied, by experiment)
            return Convention("float10", record.line, f"1 - mask multiplies the scores "
                                                      f"({_short(record.details.get('op', record.call))})")
        if others:  # the mask meets another tensor: this op applies it
            applied = _applied(record, inverted, arithmetic, others, _floated(record, sources, records))
            if compared is not None and applied.kind in ("attend", "masked"):
                # a boolean reading of what a comparison made of an additive mask (Jamba's masked_fill(mask < 0,
                # 0.0)): the mask compared is additive
                return compared
            # an op that says nothing of the mask (`scores * mask`), then arithmetic a boolean raises in: numbers
            raised = _raised(failure, records, derived, label) if applied.line is None else None
            return raised or applied
        compared = compared or _compared_additive(record)
        if name in INVERTING + COMPARING + BELOW + ABOVE:
            derived[record.index] = (inverted ^ _turns(record), arithmetic)
        elif name in ("scaled_dot_product_attention",):
            return Convention("attend", record.line, "F.scaled_dot_product_attention(attn_mask=...)")
        elif name == "multi_head_attention_forward":
            return Convention("masked", record.line, "nn.MultiheadAttention's attn_mask")
        else:
            derived[record.index] = (inverted, arithmetic or name in ARITHMETIC)
            if name == "__rsub__" and not arithmetic and any(_literal(a) == 1 for a in record.args):
                kept.add(record.index)
    return _raised(failure, records, derived, label) or compared or Convention("attend", unread=not read)


def _compared_after(record: Record, records: list[Record]) -> bool:
    """Whether a later op compares the tensor `record` made with a number (`== 0`, `!= 0`): a sum the code turns
    into a boolean of its own, as transformers' `padding_mask = causal_mask + attention_mask; padding_mask == 0`."""
    for later in records[records.index(record) + 1:]:
        if later.func in COMPARING and later.args and later.args[0] == ("rec", record.index) \
                and len(later.args) > 1 and _literal(later.args[1]) is not None:
            return True
    return False


def _turns(record: Record) -> bool:
    """Whether an op of the mask alone turns its polarity round: `~mask`, `mask == 0`, `mask != 1`, `mask < 0.5`."""
    name = record.func
    if name in INVERTING:
        return True
    if name in COMPARING:
        value = _literal(record.args[1]) if len(record.args) > 1 else None
        return (value in (0, False)) == (name in ("__eq__", "eq"))
    return name in BELOW


def flow(records: list[Record], label: str) -> tuple[list[tuple[int, bool]], dict[str, bool]]:
    """The mask parameter `label` followed through the ops of it alone (a view, a cast, an inversion, another
    boolean mask merged in) to the ops that use it: each op that reads it, in the order run, with its line and
    whether what it read was turned round (`~mask`, `mask == 0`, `1 - mask`); and each name the code gave what it
    made of the mask, with the same. What the code's words say of a helper's parameter, or of a variable, is said of
    the mask turned so (statedmask.py)."""
    derived: dict[int, tuple[bool, bool]] = {}
    uses: list[tuple[int, bool]] = []
    names: dict[str, bool] = {}
    for record in records:
        sources = [_source(arg, derived, label) for arg in record.args]
        found = [s for s in sources if s is not None]
        if not found or record.func in SHAPED_ONLY:
            continue
        inverted = found[0][0]
        uses.append((record.line, inverted))
        others = [a for a, s in zip(record.args, sources, strict=True) if s is None and _is_tensor(a)]
        if others and not (record.func in MERGING and all(_boolean(a, records) for a in others)):
            continue  # it meets the scores (or another tensor): the mask goes no further
        one = record.func == "__rsub__" and any(_literal(a) == 1 for a in record.args)  # `1 - mask`, of 0/1
        derived[record.index] = (inverted ^ (_turns(record) or one), False)
        names.update(dict.fromkeys(record.names, derived[record.index][0]))
    return uses, names


def _where_bias(record: Record, sources: list[tuple[bool, bool] | None], inverted: bool) -> Convention | None:
    """The polarity `torch.where(mask, a, b)` settles where the mask (or what the code made of it) is its condition
    and a and b are numbers, one of them very negative (-inf, finfo.min, -1e9): the mask's True is masked out where
    the very negative number is written where the condition holds (`where(mask, -inf, 0.0)`), may attend where it is
    written elsewhere (`where(mask, 0.0, -inf)`); None for any other op."""
    if record.func != "where" or len(record.args) != 3 or sources[0] is None or any(sources[1:]):
        return None
    values = [_number(value) if kind == "text" else None for kind, value in record.args[1:]]
    if any(v is None for v in values):
        return None
    return _bias_read(record, [v is not None and v <= -1e4 for v in values], inverted)


def _bias_read(record: Record, low: list[bool], inverted: bool) -> Convention | None:
    """The polarity of a bias the code wrote from its mask (`record`), where `low` says whether the number written
    where the mask's condition holds, and the one written elsewhere, is very negative: masked where the very negative
    one is written; None where both or neither is."""
    if low[0] == low[1]:
        return None
    masked = low[0] != inverted
    return Convention("masked" if masked else "attend", record.line,
                      f"written into a bias, very negative where it is {masked} "
                      f"(line {record.line}: {record.details.get('op', record.call)})")


def _short(op: str, most: int = 60) -> str:
    """An op's text to quote after another's: its call with the arguments left out where they run long
    (`F.multi_head_attention_forward(...)`, whose sixteen arguments say nothing of the mask)."""
    return op if len(op) <= most or "(" not in op else op.split("(", 1)[0] + "(...)"


def _filled_bias(record: Record, sources: list[tuple[bool, bool] | None], inverted: bool) -> Convention | None:
    """The polarity `bias.masked_fill(mask, value)` settles where the mask is the condition and `bias` a tensor of
    one number the code made (not the scores), the two then the bias's only values, one of them very negative:
    phi-1's MixFormer `torch.full((b, s), -10000.0).masked_fill_(key_padding_mask, 0.0)` writes 0 where the mask is
    True, so True may attend; `torch.zeros(..).masked_fill(mask, -inf)` writes the very negative number there, so
    True is masked out. None for any other op (a fill of the scores themselves is the mask applied)."""
    import torch

    if not record.func.startswith("masked_fill") or len(record.args) < 3 or sources[0] is not None \
            or sources[1] is None or record.args[2][0] != "text":
        return None
    value = _number(record.args[2][1])
    tensor = record.tensor
    if value is None or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return None
    distinct = torch.unique(tensor)
    others = distinct[distinct != value] if not math.isnan(value) else distinct
    if distinct.numel() > 2 or others.numel() != 1:
        return None
    return _bias_read(record, [value <= -1e4, float(others[0]) <= -1e4], inverted)


def _raised(failure: Failure | None, records: list[Record], derived: dict[int, tuple[bool, bool]], label: str
            ) -> Convention | None:
    """The convention the code's failure on a boolean mask says (arithmetic PyTorch refuses on booleans): added
    (baddbmm), subtracted from the scores, else 0/1 numbers (`1 - mask`, OpenFold's `inf * (mask - 1)`, the old
    TensorFlow `scores * mask - 1e9 * (1 - mask)`); None where it failed elsewhere."""
    named = [label, *(records[i].label for i in derived)]
    if failure is None or not any(n in failure.op for n in named) or "bool" not in failure.message.lower():
        return None
    if any(f"{name}(" in failure.op for name in ADDS_A_MASK):  # baddbmm(mask, q, kᵀ): the mask is added
        return Convention("additive", failure.line, failure.op)
    if any(_subtracted(failure.op, n) for n in named):  # scores - mask: subtracted, +inf where blocked
        return Convention("subtracted", failure.line, failure.op)
    return Convention("float01", failure.line, failure.op)


def _compared_additive(record: Record) -> Convention | None:
    """An additive convention where the code compares its mask with a number that splits an additive mask's values
    (0 and -inf, or finfo.min) but not a boolean's or a 0/1 mask's: Jamba's `masked_fill(causal_mask < 0, 0.0)`,
    `mask == float('-inf')`, `mask == torch.finfo(dtype).min`, `mask >= 0`. On a boolean mask such a comparison is
    the same everywhere (`mask < 0` never True), so the code can only mean a float bias. None for any other op."""
    name = record.func
    if name not in COMPARING + BELOW + ABOVE or len(record.args) < 2 or record.args[1][0] != "text":
        return None
    value = _number(record.args[1][1])
    if value is None or _splits(name, value, 0.0, 1.0) or not _splits(name, value, float("-inf"), 0.0):
        return None
    kind = "additive_min" if -math.inf < value < -1e4 else "additive"  # `== finfo.min`: that fill, not -inf
    return Convention(kind, record.line, record.details.get("op", record.call), compared=True)


def _splits(name: str, value: float, low: float, high: float) -> bool:
    """Whether comparing with `value` by the op `name` tells the mask's values `low` and `high` apart (-inf stands
    for any very negative fill, finfo.min included)."""
    import operator

    if low == float("-inf") and value < -1e4:  # `mask == finfo.min`, `mask < -1e9`: a fill, as -inf is
        low = value if name in ("__eq__", "eq", "__ne__", "ne", "__le__", "le", "__gt__", "gt") else value - 1
    test = {"__eq__": operator.eq, "eq": operator.eq, "__ne__": operator.ne, "ne": operator.ne,
            "__lt__": operator.lt, "lt": operator.lt, "__le__": operator.le, "le": operator.le,
            "__gt__": operator.gt, "gt": operator.gt, "__ge__": operator.ge, "ge": operator.ge}[name]
    return bool(test(low, value)) != bool(test(high, value))


def _number(text: Any) -> float | None:
    """The number an op's argument text writes ("0", "-inf", "-3.40282e+38"), None for anything else."""
    try:
        return float(str(text))
    except ValueError:
        return None


def agreed(read: Convention, kind: str, before: Convention) -> Convention | None:
    """The convention `kind` the mask was written in, where the one read from that run agrees with it: the same
    kind, none read, or 0/1 floats the code computes its own bias from (OpenFold's `inf * (mask - 1)`, BERT's
    `(1.0 - mask) * -10000.0`: read as a boolean cast first would be, "converted", where a boolean makes the code
    raise in that arithmetic, at the line `before` says); None where the run reads it another way."""
    if read.kind == kind or read.line is None:
        return Convention(kind, read.line, read.how)
    if kind == "float01" and read.how == "converted":
        return Convention(kind, before.line if before.kind == kind and before.line else read.line, read.how)
    return None


def _floated(record: Record, sources: list[tuple[bool, bool] | None], records: list[Record]) -> bool:
    """Whether what the code made of the mask reaches the op that applies it as floats, where it was handed a
    boolean: cast first (OLMo's `bias.to(dtype)`, `mask.float()`, `type_as(q)`), then added."""
    for arg, source in zip(record.args, sources, strict=True):
        if source is None:
            continue
        kind, value = arg[1][1] if arg[0] == "kw" else arg
        if kind == "rec" and 0 <= value < len(records) and records[value].index == value:
            return bool(records[value].tensor.is_floating_point())
        return False
    return False


def _applied(record: Record, inverted: bool, arithmetic: bool, others: list[Any], floated: bool = False
             ) -> Convention:
    name, op = record.func, record.details.get("op", record.call)
    if arithmetic:
        return Convention("attend", record.line, "converted")
    if floated and name == "scaled_dot_product_attention":  # a boolean cast to floats and handed to SDPA: added
        return Convention("additive", record.line, f"cast to floats, then {op}")
    if name.startswith("masked_fill") or name == "__setitem__":
        return Convention("attend" if inverted else "masked", record.line, op)
    if name == "where":
        keeps_scores = len(record.args) > 1 and _is_tensor(record.args[1]) and record.args[1] in others
        return Convention("attend" if keeps_scores != inverted else "masked", record.line, op)
    if name in ("mul", "__mul__", "__rmul__", "mul_") and inverted:  # weights * (mask == 0): 0 keeps, as a mask
        return Convention("masked", record.line, op)  # True = masked out (or additive 0) reads
    if name in SUBTRACTS and len(record.args) > 1 and record.args[0] in others:  # scores - mask
        return Convention("subtracted", record.line, op)
    if name in ADDS or name in ADDS_A_MASK:
        return Convention("additive", record.line, op)
    if name == "scaled_dot_product_attention":  # `~mask` handed to SDPA: True = masked out, as the code reads it
        return Convention("masked" if inverted else "attend", record.line,
                          f"inverted, then {op}" if inverted else "F.scaled_dot_product_attention(attn_mask=...)")
    if name == "multi_head_attention_forward":
        return Convention("attend" if inverted else "masked", record.line,
                          f"inverted, then {op}" if inverted else "nn.MultiheadAttention's attn_mask")
    return Convention("attend")


def _subtracted(op: str, name: str) -> bool:
    """Whether the op text subtracts `name` from a tensor (`scores - mask`, `torch.sub(scores, mask)`,
    `scores.sub_(mask)`), not from a number (`1 - mask`, BERT's 0/1 mask turned into a bias)."""
    import re

    term = re.escape(name)
    left = re.search(rf"(\S+) - {term}(?![\w\[.])", op)
    if left is not None and not re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?", left.group(1)):
        return True
    return re.search(rf"(\bsub_?\(|\bsubtract\()[^,()]+, {term}(?![\w\[.])|\.sub_?\({term}(?![\w\[.])",
                     op) is not None


def reads(records: list[Record], label: str) -> bool:
    """Whether an op of the run reads the mask parameter `label`: none does where the code leaves it unread
    (transformers' Perceiver in cross-attention reads its inputs_mask, never its attention_mask)."""
    return any(_source(arg, {}, label) is not None for record in records for arg in record.args)


def _source(arg: Any, derived: dict[int, tuple[bool, bool]], label: str) -> tuple[bool, bool] | None:
    kind, value = arg
    if kind == "text" and value == label:
        return (False, False)
    if kind == "rec" and value in derived:
        return derived[value]
    if kind == "kw":
        return _source(value[1], derived, label)
    return None


def _boolean(arg: Any, records: list[Record]) -> bool:
    """Whether the tensor argument `arg` (a record's) is boolean; True for the mask parameter's own (text)."""
    import torch

    kind, value = arg
    return kind != "rec" or records[value].tensor.dtype == torch.bool


def _is_tensor(arg: Any) -> bool:
    kind, value = arg
    if kind == "kw":
        return _is_tensor(value[1])
    return kind == "rec" or (kind == "text" and isinstance(value, str) and value.isidentifier()
                             and value not in ("True", "False", "None"))


def _literal(arg: Any) -> Any:
    kind, value = arg
    if kind != "text":
        return None
    return {"0": 0, "0.0": 0, "False": False, "1": 1, "1.0": 1, "True": True}.get(str(value))


def written(allowed: torch.Tensor, kind: str, dtype: torch.dtype, line: int | None = None) -> torch.Tensor:
    """`allowed` (boolean, True = may attend; or a float bias from a --mask file) in the convention `kind`."""
    import torch

    from attnscope import masks

    if kind == "additive_min":  # code that finds its masked cells by `== finfo.min`: that fill, not -inf
        bias = allowed.to(dtype) if allowed.is_floating_point() else masks.to_additive(allowed).to(dtype)
        return bias.clamp(min=torch.finfo(dtype).min)
    if allowed.is_floating_point():
        if kind == "additive":
            return allowed.to(dtype)
        if kind == "subtracted":  # a bias from --mask, subtracted: its negative
            return (-allowed).to(dtype)
        values = allowed[torch.isfinite(allowed)]
        if bool((values != 0).any()):
            where = f" (line {line})" if line else ""
            raise UsageError(f"--mask holds a float bias (values other than 0 and -inf), but your code reads its mask "
                             f"as {WORDS[kind]}{where}; give a boolean mask")
        allowed = allowed == 0
    if kind == "masked":
        return ~allowed
    if kind == "additive":
        return masks.to_additive(allowed).to(dtype)
    if kind == "float01":
        return allowed.to(dtype)
    if kind == "float10":  # 0/1 numbers the other way round: `(1 - mask).bool()` handed to SDPA
        return (~allowed).to(dtype)
    if kind == "subtracted":  # 0 where a key may be seen, +inf where not: scores - mask is -inf there
        return -masks.to_additive(allowed).to(dtype)
    return allowed


def forms(allowed: torch.Tensor, n_batch: int, filed: torch.Tensor | None = None, n_Q: int | None = None,
          n_head: int | None = None, keyed: torch.Tensor | None = None
          ) -> list[tuple[torch.Tensor, str, torch.Tensor | None]]:
    """The same mask (True = may attend) in the other shapes code takes a mask in, each with its words and the
    keys trace pads itself (None: none), tried in turn where the code fails on the shape given first:
    transformers' 4-D `[n_batch, 1, n_Q, n_K]`, then `[n_batch, n_Q, n_K]` (HF XLM's causal mask, read as `(bs,
    qlen, klen)` where `mask.dim() == 3`: a whole mask, its rule in it, before key padding that cannot carry the
    rule; after it where the mask is key padding), then the key-padding shapes, `[n_batch, n_K]` (flash-attn's and
    nn.MultiheadAttention's key_padding_mask, HF BERT's 2-D attention_mask that the code extends itself),
    `[n_batch, 1, n_K]` (diffusers' attention_mask) and `[n_batch, 1, 1, n_K]`, then `[n_Q, n_K]` (a mask the same
    for every sequence: before key padding, as the whole mask, where it holds a rule). A rule that
    depends on the query (causal, a window) cannot be written as key padding: those shapes then pad one key of
    trace's own (`padded`), which the reference's mask must then pad as well, so that a mask applied along the
    wrong axis shows; the code's own causal mask, if any, is what is compared with the reference's rule. Where the
    --mask file (`filed`, the reference's mask) is key padding, its padding is what those shapes carry. Key padding
    given `[.., 1, n_K]` is spread over the `n_Q` queries in the 4-D shape (BART's size check asks for
    `[n_batch, 1, n_Q, n_K]`). Last, a mask that differs across the batch, `[n_batch·n_head, n_Q, n_K]` with the
    heads inner (nn.MultiheadAttention's and F.multi_head_attention_forward's 3-D attn_mask, which take no other
    shape of a mask per sequence), where `n_head` is known; key padding `[n_batch·n_head, 1, n_K]` before it. Then the
    batch after the keys, `[n_Q, n_K, n_batch]` (and `[n_Q, n_K, 1]` for a mask the same for every sequence), as
    time-first code takes it (labml's).

    `keyed` is the mask as rows `[.., n_Q, n_K]` for the key-padding shapes, where `allowed` is laid out otherwise
    (the column form's square `[.., n_K, n_Q]`, handed whole as it stands): the keys are those of its last axis, and
    `filed` is then laid out as `keyed` is."""
    keyed_wide = None if keyed is None else _wide(keyed, n_batch, n_Q)
    single = allowed.reshape(-1, *allowed.shape[-2:]).shape[0] == 1  # one mask for every sequence
    wide = _wide(allowed, n_batch, n_Q)  # [n_batch, n_Q, n_K]
    n_Q, n_K = wide.shape[-2:]
    out: list[tuple[torch.Tensor, str, torch.Tensor | None]] = [(wide.unsqueeze(1), "[n_batch, 1, n_Q, n_K]", None)]
    padding = bool((wide == wide[:, :1, :]).all())
    by_keys = wide if keyed_wide is None else keyed_wide
    padding_keys = padding if keyed_wide is None else bool((by_keys == by_keys[:, :1, :]).all())
    whole = (wide, "[n_batch, n_Q, n_K]", None)
    # a rule no key padding carries: the whole mask first, and where it is one for every sequence, [n_Q, n_K] too
    # (DeepSeek's model hands its layers `torch.full((s, s), -inf).triu_(1)`, added as `scores + mask.unsqueeze(1)`)
    one = [(wide[0], "[n_Q, n_K]", None)] if single else []
    out += [] if padding else [whole, *one]
    filed_keys = file_padding(filed, n_batch, n_K)
    if padding_keys:
        keys, padded, said = by_keys[:, 0, :], None, ""
    elif filed_keys is not None:  # the file's padding; the rule (causal, a window) is the code's own to apply
        keys, padded, said = filed_keys, None, ", the --mask file's (a causal or window rule is no key padding)"
    else:
        keys, padded, said = padded_keys(by_keys)
    out += [(keys, f"[n_batch, n_K] key padding{said}", padded),
            (keys[:, None, :], f"[n_batch, 1, n_K] key padding{said}", padded),
            (keys[:, None, None, :], f"[n_batch, 1, 1, n_K] key padding{said}", padded)]
    out += [whole, *one] if padding else []
    if not single and n_head is not None:
        # [n_batch, n_Q, n_K] -> [n_batch·n_head, n_Q, n_K], each sequence's heads side by side
        if padding:  # key padding as diffusers' prepare_attention_mask folds it, [n_batch·n_head, 1, n_K], first
            out.append((wide[:, :1].repeat_interleave(n_head, dim=0), "[n_batch·n_head, 1, n_K]", None))
        out.append((wide.repeat_interleave(n_head, dim=0), "[n_batch·n_head, n_Q, n_K]", None))
    # last, the batch after the keys, time-first code's (labml's `[seq_len_q, seq_len_k, batch_size]`, its scores
    # einsum'd `ijbh`): the batch's own axis, then one for every sequence
    out.append((wide.permute(1, 2, 0), "[n_Q, n_K, n_batch] (time-first)", None))
    if single:
        out.append((wide[0][..., None], "[n_Q, n_K, 1] (time-first)", None))
    return out


def laid_like(allowed: torch.Tensor, met: list[int], sizes: dict[str, int], col: bool = False
              ) -> tuple[torch.Tensor, str, None] | None:
    """The same mask (True = may attend) laid out as the scores it meets in the code, `met` (the shape its op
    raised on: GPT-BigCode's multi-query scores `[n_batch, n_Q, n_head, n_K]` take `[n_batch, n_Q, 1, n_K]`): the
    batch on their first axis where it has n_batch's size, the keys (the queries, in the column layout) on the last
    axis of their size and the others on the nearest axis of theirs before it, 1 on every other axis (heads); None
    where the scores have no axis of the queries' or the keys' size."""
    n_batch, n_Q, n_K = sizes.get("n_batch", 1), sizes["n_Q"], sizes["n_K"]
    grid = allowed.transpose(-1, -2) if col else allowed  # [.., n_Q, n_K]
    grid = grid.reshape(-1, *grid.shape[-2:])  # [1 or n_batch, n_Q, n_K]
    if tuple(grid.shape[-2:]) != (n_Q, n_K) or grid.shape[0] not in (1, n_batch) or len(met) < 2:
        return None
    places: dict[str, int] = {}
    if "n_batch" in sizes and met[0] == n_batch and len(met) > 2:
        places["b"] = 0
    # the last axis first (the keys', the queries' in the column layout), then the other nearest before it: where the
    # heads have the queries' size too, [n_batch, n_head, n_Q, n_K] (transformers') puts the queries by the keys
    last: int | None = None
    for role, size in (("q", n_Q), ("k", n_K)) if col else (("k", n_K), ("q", n_Q)):
        free = [i for i, m in enumerate(met) if m == size and i not in places.values()]
        nearest = [i for i in free if last is None or i < last] or free
        if not nearest:
            return None
        places[role] = last = nearest[-1]
    if "b" not in places:
        if grid.shape[0] > 1 and not bool((grid == grid[:1]).all()):
            return None  # a mask that differs across the batch, and no batch axis to carry it
        grid = grid[:1]
        places["b"] = -1
    order = sorted(places, key=lambda r: places[r])
    laid = grid.expand(n_batch if places["b"] >= 0 else 1, n_Q, n_K).permute(*("bqk".index(r) for r in order))
    at = {i: r for r, i in places.items()}  # axis of the scores -> what the mask holds there
    shape = [laid.shape[order.index(at[axis])] if axis in at else 1 for axis in range(len(met))]
    form = laid.reshape(shape) if places["b"] >= 0 else laid[0].reshape(shape)
    named = {"b": "n_batch", "q": "n_Q", "k": "n_K"}
    words = [named[at[axis]] if axis in at else "1" for axis in range(len(met))]
    return form, f"[{', '.join(words)}], as the scores it meets ({list(met)}) are laid out", None


def sliced_forms(allowed: torch.Tensor, n_batch: int, n_cache: int | None) -> list[tuple[torch.Tensor, str]]:
    """The mask (True = may attend, [.., n_Q, n_K]) as 4-D masks for code that slices one itself: transformers'
    `[n_batch, 1, n_Q, n_K]`; in a decode step (`n_cache` keys before the n_Q new ones), also `[n_batch, 1, n_K, n_K]`,
    a mask over every position whose last n_Q rows are the new queries' (code that cuts
    `mask[:, :, n_K - n_Q:n_K, :n_K]` out of its model's mask), the rows before them causal (position i sees
    keys 0 to i), as a model's mask over the whole sequence holds them; where every sequence has the same mask, that
    square alone, `[n_K, n_K]` (HF CTRL's `mask[ns - nd:ns, :ns]` of `triu(ones(past + seq, past + seq), 1)`). Each
    with its words."""
    import torch

    n_Q, n_K = allowed.shape[-2:]
    rows = allowed.reshape(-1, n_Q, n_K)
    out = [(rows.reshape(-1, 1, n_Q, n_K).expand(n_batch, 1, n_Q, n_K), "[n_batch, 1, n_Q, n_K]")]
    if n_cache and n_K == n_cache + n_Q and rows.shape[0] in (1, n_batch):
        earlier = torch.ones(n_cache, n_K, dtype=torch.bool).tril().expand(rows.shape[0], n_cache, n_K)
        whole = torch.cat([earlier, rows.bool()], dim=1)
        out.append((whole[:, None].expand(n_batch, 1, n_K, n_K),
                    f"[n_batch, 1, n_K, n_K], a mask over all {n_K} positions whose last {n_Q} rows are the new "
                    "queries'"))
        if bool((whole == whole[:1]).all()):
            out.append((whole[0], f"[n_K, n_K], a mask over all {n_K} positions whose last {n_Q} rows are the new "
                                  "queries'"))
    return out


def _wide(allowed: torch.Tensor, n_batch: int, n_Q: int | None) -> torch.Tensor:
    """The mask [.., n_Q, n_K] as `[n_batch, n_Q, n_K]`."""
    grid = allowed.reshape(-1, *allowed.shape[-2:])
    if n_Q is not None and grid.shape[-2] == 1:
        grid = grid.expand(grid.shape[0], n_Q, grid.shape[-1])
    return grid.expand(n_batch, *grid.shape[-2:]) if grid.shape[0] == 1 else grid


def file_padding(filed: torch.Tensor | None, n_batch: int, n_K: int) -> torch.Tensor | None:
    """A boolean --mask [.., 1, n_K] (1 on every axis but the first and the keys'), as key padding [n_batch, n_K]
    (True = may attend); None for any other mask."""
    import torch

    if filed is None or filed.dtype != torch.bool or filed.dim() < 2 or filed.shape[-1] != n_K:
        return None
    if any(size != 1 for size in filed.shape[1:-1]) or (filed.dim() == 2 and filed.shape[0] != 1):
        return None
    first = filed.shape[0] if filed.dim() > 2 else 1
    if first not in (1, n_batch):
        return None
    return filed.reshape(first, n_K).expand(n_batch, n_K)


def padded_keys(wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Key padding [n_batch, n_K] for a rule that is none (causal, a window): keys of the first sequence padded, a
    third of them (at least one), those nearest the middle (seen by the most queries under a causal rule) that leave
    every query a key it may see (else nothing padded), so that code applying the padding along the queries, or
    across the batch, or to one key only, differs from the reference, whose mask pads the same keys."""
    import torch

    n_batch, _, n_K = wide.shape
    keys = torch.ones(n_batch, n_K, dtype=torch.bool)
    rows = wide[0].clone()
    padded: list[int] = []
    for key in sorted(range(n_K), key=lambda j: (abs(j - n_K // 2), -j)):
        if len(padded) >= max(1, n_K // 3):
            break
        trial = rows.clone()
        trial[:, key] = False
        if bool(trial.any(-1).all()):
            rows, keys[0, key] = trial, False
            padded.append(key)
    if not padded:
        return keys, None, ", nothing padded (a causal or window rule is no key padding)"
    first = " of the first sequence" if n_batch > 1 else ""
    which = f"key {padded[0]}" if len(padded) == 1 else f"keys {', '.join(map(str, sorted(padded)))}"
    return keys, keys, (f", {which}{first} padded by trace (a causal or window rule is no key padding; the "
                        "reference's mask pads the same keys, so that the mask's axis shows)")


MULTIPLIES = ("mul", "__mul__", "__rmul__", "mul_", "__imul__", "einsum")
SOFTMAX_NAMES = ("softmax", "_softmax", "log_softmax")


def weighs(records: list[Record], label: str, failure: Failure | None = None) -> int | None:
    """The line of the op where the parameter `label` (or what the code made of it alone: a transpose, a view) first
    meets another tensor, where that op multiplies what the softmax made (transformers' `head_mask`,
    `layer_head_mask`: `attn_weights * head_mask`, a weight per head after the softmax, no mask), the op the code
    raised on (`failure`) included; None where it first meets anything else (the scores, before the softmax: a
    mask)."""
    derived: set[int] = set()
    weighted: set[int] = set()  # the softmax's output and what was computed from it
    ops = [(r.index, r.func, r.args, r.line) for r in records]
    if failure is not None and failure.func:
        ops.append((-1, failure.func, failure.args, failure.line or 0))
    for index, func, args, line in ops:
        reads = [value[1] if kind == "kw" else (kind, value) for kind, value in args]
        mine = any(k == "text" and v == label or k == "rec" and v in derived for k, v in reads)
        others = [v for k, v in reads if k == "rec" and v not in derived]
        if mine and others:
            return line if func in MULTIPLIES and any(v in weighted for v in others) else None
        if mine:
            derived.add(index)
        elif func.split(".")[-1] in SOFTMAX_NAMES or any(v in weighted for v in others):
            weighted.add(index)
    return None


TESTS = COMPARING + ("__lt__", "lt", "__le__", "le", "__gt__", "gt", "__ge__", "ge", "logical_not", "__invert__",
                     "bitwise_not", "bool")


def tested(records: list[Record], label: str) -> bool:
    """Whether the code compares the parameter `label` (or what it made of it alone) before it meets another tensor
    (`causal_attention_mask == 0`, `~mask`, `mask.bool()`): a mask's cells read as may-attend or not, where a
    head_mask is a weight it multiplies by as it is."""
    derived: set[int] = set()
    for r in records:
        reads = [value[1] if kind == "kw" else (kind, value) for kind, value in r.args]
        if not any(k == "text" and v == label or k == "rec" and v in derived for k, v in reads):
            continue
        if any(k == "rec" and v not in derived for k, v in reads):
            return False
        if r.func.split(".")[-1] in TESTS:
            return True
        derived.add(r.index)
    return False


def masks_itself(records: list[Record]) -> Record | None:
    """The code's own masking of its scores where it was given no mask: weights of exactly 0 (masks_by_itself), or
    a `where` / `masked_fill` before the first softmax (a mask filled with a value other than -inf included)."""
    found = masks_by_itself(records)
    if found is not None:
        return found
    for r in records:
        name = r.func.split(".")[-1]
        if name in SOFTMAX_NAMES:
            return None
        if name in ("where", "masked_fill", "masked_fill_"):
            return r
    return None


# the ops that apply a mask to the scores: a condition's where / masked_fill, a 0/1 product
PRODUCTS = ("matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "mm", "einsum", "tensordot")  # q · kᵀ
APPLIES = ("where", "masked_fill", "masked_fill_", "mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply")


def own_mask_op(records: list[Record], inputs: set[str], label: str, pattern: tuple[int, int]) -> Record | None:
    """The first op before the first softmax where the scores (a product of two tensors computed from the forward's
    inputs, q · kᵀ, or what is made from one; its last two axes `pattern`'s, [n_Q, n_K], or turned) meet a mask of
    the code's own, whatever it fills them with: a
    boolean or 0/1 tensor of the positions alone, over those two axes (a causal buffer's slice, a tril of ones;
    computed from no input, not from the mask parameter `label`, no random draw), holding both values, through a
    where, a masked_fill or a product that changes the scores (GPT-Neo's buffer multiplied in, `scores *
    causal_mask`, where its weights keep no 0). A term made from the queries alone is no scores: Music Transformer's
    q · Eᵀ of its relative table, multiplied by a mask of the positions before it is skewed, leaves the causal rule
    to the mask its caller gives. None where there is none."""
    import torch

    from attnscope.usertrace.dropouts import RANDOM

    data: set[int] = set()  # computed from the inputs
    other: set[int] = set()  # from the mask parameter, or a random draw
    content: set[int] = set()  # from a product of two tensors computed from the inputs (q · kᵀ), or after one
    for r in records:
        if is_pattern(r):
            return None
        texts = [v for k, v in r.args if k == "text"] + [v[1][1] for k, v in r.args if k == "kw" and v[1][0] == "text"]
        parents = set(r.parents)
        name = r.func.split(".")[-1]
        if label in texts or other & parents or name in RANDOM:
            other.add(r.index)
            continue
        if any(t in inputs for t in texts) or data & parents:
            data.add(r.index)
        if content & parents or (name in PRODUCTS and len(data & parents) >= 2):
            content.add(r.index)
        axes = tuple(r.tensor.shape[-2:])
        if name not in APPLIES or not r.tensor.is_floating_point() or axes not in (pattern, pattern[::-1]):
            continue
        scores = [records[i] for i in r.parents if i in content and records[i].tensor.is_floating_point()
                  and records[i].tensor.shape == r.tensor.shape]
        own = [records[i] for i in r.parents if i not in data and i not in other
               and tuple(records[i].tensor.shape[-2:]) == axes and two_valued(records[i].tensor)]
        if scores and own and not bool(torch.equal(scores[0].tensor, r.tensor)):
            return r
    return None


def unapplied_own_mask(records: list[Record], buffers: set[str], pattern: tuple[int, int]) -> Record | None:
    """A mask the code reads from a buffer of its own module and then never uses: the first op reading the buffer
    by its name (CodeGen's `self.causal_mask[:, :, k - q:k, :k]`, GPT-2's `self.bias[...]`) whose result is a
    boolean or 0/1 tensor holding both values over the scores' two last axes `pattern` ([n_Q, n_K], or turned), and
    which no later op reads: the code meant to mask by itself and left the step out. None where there is none."""
    read = {p for r in records for p in r.parents}
    for r in records:
        names = {v for k, v in r.args if k == "text"}
        if not names & buffers or r.index in read:
            continue
        if tuple(r.tensor.shape[-2:]) in (pattern, pattern[::-1]) and two_valued(r.tensor):
            return r
    return None


def two_valued(tensor: torch.Tensor) -> bool:
    """A boolean, or a tensor of 0s and 1s, holding both values over at least two axes: a mask."""
    import torch

    if tensor.dim() < 2 or tensor.is_complex():
        return False
    values = tensor.detach()
    ones = values if values.dtype == torch.bool else values == 1
    return bool(((values == 0) | ones).all()) and bool(ones.any()) and not bool(ones.all())


def masks_by_itself(records: list[Record]) -> Record | None:
    """The code's pattern where it masks by itself (given a mask that masks nothing): the first softmax (or a
    kernel's recomputed attention) with weights of exactly 0, which only a mask makes (a causal buffer, a tril,
    `is_causal=True`); else the weights after the first softmax where the code zeroes some itself (GPT-2's causal
    buffer applied to them, `torch.where(causal_mask, weights, 0)`: `after_softmax`); None where every weight is
    positive."""
    from attnscope.usertrace.sinkcols import joined_at

    # online softmax (chunked, flash-style) never calls one: each block's exp(scores − max) stands for the pattern
    online = not any(is_pattern(r) for r in records)
    for r in records:
        name = r.func.split(".")[-1]
        if (is_pattern(r) or (online and name in ("exp", "exp_"))) \
                and r.tensor.is_floating_point() and bool((r.tensor == 0).any()):
            sink = joined_at(r, records) if name != "(attention)" else None  # a sink's column weighs no key
            weights = r.tensor if sink is None else r.tensor[..., 1:] if sink == 0 else r.tensor[..., :-1]
            if bool((weights == 0).any()):
                return r
    return after_softmax(records)


def starved(records: list[Record], rows: torch.Tensor | None = None) -> Record | None:
    """The first pattern (a softmax, a kernel's recomputed attention) with a query whose weights are all 0 or NaN: a
    query that saw no key, which a mask leaving every query a key never makes (PyTorch's SDPA gives such a row zeros,
    a plain softmax NaN); None where every row holds weight. `rows` [n_batch, n_Q]: queries the mask leaves no key
    (maskrows.keyless), whose rows are the code's convention and not read."""
    import torch

    from attnscope.usertrace.maskrows import rows_kept

    for r in records:
        if is_pattern(r) and r.tensor.is_floating_point() and r.tensor.dim() >= 1 and r.tensor.shape[-1] > 0:
            w = r.tensor.detach()
            if rows is None and no_key(w):
                return r
            if rows is not None and bool(rows_kept(torch.isnan(w).any(-1) | (w == 0).all(-1), rows).any()):
                return r
    return None


def holds(records: list[Record], allowed: torch.Tensor | None, sizes: dict[str, int]) -> bool | None:
    """Whether the code's first pattern (a softmax, a kernel's recomputed attention) [.., n_Q, n_K] gives no weight
    to any key the mask `allowed` (True = may attend, [.., n_Q or 1, n_K]) forbids: True where it does not, False
    where it keeps weight on such a key while some key the mask allows gets none (the mask applied the other way
    round), None where that cannot be read (no pattern of those axes, a mask that forbids nothing, a batch it cannot
    be laid on)."""
    n_Q, n_K = sizes.get("n_Q"), sizes.get("n_K")
    pattern = next((r.tensor for r in records if is_pattern(r) and r.tensor.is_floating_point()), None)
    if allowed is not None and n_Q is not None and n_K is not None and allowed.dim() >= 2 \
            and allowed.shape[-2] == n_K > n_Q:  # a mask over every position (sliced_forms): the new queries' rows
        allowed = allowed[..., n_K - n_Q:, :]
    if pattern is None or allowed is None or n_Q is None or n_K is None or pattern.dim() < 2 or allowed.dim() < 2 \
            or tuple(pattern.shape[-2:]) != (n_Q, n_K) or allowed.shape[-1] != n_K \
            or allowed.shape[-2] not in (1, n_Q) or bool(allowed.all()):
        return None
    grid = allowed.reshape(-1, allowed.shape[-2], n_K).expand(-1, n_Q, n_K)  # [1 or n_batch, n_Q, n_K]
    if pattern.numel() % (grid.shape[0] * n_Q * n_K) or (grid.shape[0] > 1 and pattern.shape[0] % grid.shape[0]):
        return None
    weights = pattern.detach().reshape(grid.shape[0], -1, n_Q, n_K)  # batch-major: [n_batch, .., n_Q, n_K]
    forbidden = ~grid[:, None].expand_as(weights)
    # a query the mask leaves no key is read nowhere: its row is the code's convention (NaN, uniform, zeros)
    read = grid.any(-1)[:, None, :, None].expand_as(weights)
    none = (weights == 0) | weights.isnan()
    if not bool((forbidden & read).any()):
        return None
    if bool(none[forbidden & read].all()):
        return True
    return False if bool(none[~forbidden & read].any()) else None


def no_key(weights: torch.Tensor) -> bool:
    """Whether some query of `weights` [.., n_Q, n_K] saw no key: a NaN in them, or a row all 0."""
    import torch

    return bool(torch.isnan(weights).any()) or bool((weights == 0).all(-1).any())


def _softmax(record: Record) -> bool:
    return record.func.split(".")[-1] in ("softmax", "_softmax")


def is_pattern(record: Record) -> bool:
    """A pattern the code holds: a softmax's, or a kernel's recomputed attention."""
    return _softmax(record) or record.label == "(attention)"


def after_softmax(records: list[Record]) -> Record | None:
    """The first op after the first softmax that zeroes some of its weights, where the softmax has none at 0: a
    mask of the code's own applied to the weights (`torch.where(causal_mask, weights, 0)`, `weights * tril`,
    `masked_fill(~mask, 0)`), on the weights' own shape, before they meet the values. Zeros with a random draw in
    their history (`F.dropout` in training mode, a keep-mask drawn by hand: dropouts.RANDOM) are a dropout's, never
    a mask; `zeros_like(weights)` holds none of their values. None where there is no such op."""
    import torch

    from attnscope.usertrace.dropouts import RANDOM

    softmax = next((r for r in records if _softmax(r)), None)
    if softmax is None or not softmax.tensor.is_floating_point() or bool((softmax.tensor == 0).any()):
        return None
    drawn: set[int] = set()  # records with a random op in their history (a dropout in eval() mode draws nothing)
    for r in records:
        name = r.func.split(".")[-1]
        idle = "dropout" in name and bool(r.parents) and torch.equal(records[r.parents[0]].tensor, r.tensor)
        if (name in RANDOM and not idle) or drawn & set(r.parents):
            drawn.add(r.index)
    derived = {softmax.index}
    for r in records[softmax.index + 1:]:
        if not derived & set(r.parents) or r.func.split(".")[-1] in SHAPED_ONLY:  # zeros_like(weights): no values
            continue
        if tuple(r.tensor.shape) != tuple(softmax.tensor.shape) or not r.tensor.is_floating_point():
            continue  # the weighted sum (another shape), a comparison: the weights go no further here
        derived.add(r.index)
        if r.index not in drawn and bool((r.tensor == 0).any()):
            return r
    return None
