"""What a parameter of the forward is, read from how the code used it in a run that raised on what trace gave it
(runs/trace_otherwise.py tries the readings in the order these say):

- `culprits`: the parameters the op it raised in reads (or a tensor made from them), else those its line names
  (`b, t, m = media.shape[:3]` raises on no op);
- `listed`: a parameter taken apart as a list, `inputs[0]`, `inputs[1]`, `inputs[2]` (Music Transformer's
  `[Q, K, V]`) or unpacked (`q, k, v = qkv`): how many it holds;
- `integers`: a parameter the code computes with as integers, its positions (mistral-src's `positions % W`,
  `positions[-1].item()`; an index into a table, `table[pos]`);
- `apart_from_keys`: a parameter read so that none of the keys or values the pattern meets come from it (a position
  embedding or positions beside the attention's own inputs, never an input whose length differs by a mistake);
- `keys_from`: the keys the pattern meets come from the input (positions turn them, RoPE's, but never make them);
- `four_axes`: a parameter read as four axes where it had three (Flamingo's media `[b, t, m, d]`: `media.shape[3]`,
  `b, t, m, d = media.shape`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.usertrace.record import Failure, Record

# ops that compute with integers: a remainder, a floor division, a Python number out of a tensor, a cast to an
# integer type (what code does with positions, never with features)
INTEGER_OPS = ("__mod__", "__rmod__", "remainder", "fmod", "__floordiv__", "floor_divide", "item", "long", "int",
               "tolist", "bucketize")
UNPACKED = re.compile(r"(?:too many|not enough) values to unpack \(expected (\d+)")


def derived(records: list[Record], name: str) -> set[int]:
    """The records computed from the parameter `name`, directly or not."""
    found: set[int] = set()
    for record in records:
        if any(_reads(arg, name, found) for arg in record.args) or found & set(record.parents):
            found.add(record.index)
    return found


def _reads(arg: tuple[str, Any], name: str, found: set[int]) -> bool:
    kind, value = arg
    if kind == "text":
        return value == name
    if kind == "rec":
        return value in found
    if kind == "kw":
        return _reads(value[1], name, found)
    if kind == "list":
        return any(_reads(v, name, found) for v in value)
    return False


def culprits(records: list[Record], failure: Failure, names: list[str], path: Path | None = None) -> list[str]:
    """Of the parameters `names`, those the op the code raised in reads (or a tensor made from them); else those the
    line it raised on names as a word (an error of its own, a shape unpacked); in the order of `names`."""
    read = [n for n in names if any(_reads(arg, n, derived(records, n)) for arg in failure.args)]
    if read or path is None or failure.line is None:
        return read
    import linecache

    text = linecache.getline(str(path), failure.line)
    return [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]


def listed(records: list[Record], failure: Failure, name: str, source: str = "") -> int | None:
    """How many tensors the code takes out of the parameter `name` as from a list: one more than the highest whole
    number it indexes it with (`inputs[2]`; in its run, else in its forward's `source`, where the run stopped
    before the second), or as many as it unpacks it into (`q, k, v = qkv`: the count the error expected, else the
    parts it used); None where it does neither, or indexes one alone (`x[0]`: a batch's first)."""
    indexed = [int(r.args[1][1]) for r in records if r.func == "__getitem__" and len(r.args) == 2
               and r.args[0] == ("text", name) and str(r.args[1][1]).isdigit()]
    if indexed and source:
        indexed += [int(i) for i in re.findall(rf"\b{re.escape(name)}\[(\d+)\]", source)]
    if len(set(indexed)) > 1:
        return max(indexed) + 1
    expected = UNPACKED.search(failure.message)
    unpacked = any(r.func == "unbind" and r.args and r.args[0] == ("text", name) for r in records)
    if expected and (unpacked or failure.line is not None):
        count = int(expected.group(1))
        return count if count > 1 else None
    if unpacked:
        parts = {r.details.get("part") for r in records if r.func == "unbind" and r.args[0] == ("text", name)}
        return len(parts) if len(parts) > 1 else None
    return None


def integers(records: list[Record], failure: Failure, name: str) -> bool:
    """Whether the code computes with the parameter `name` as with positions: a remainder or floor division of it, a
    number out of it, a cast to an integer type, or it (or a tensor made from it) used as the index of another
    tensor; or the op it raised in says indices were wanted."""
    made = derived(records, name)
    if any(r.index in made and r.func in INTEGER_OPS for r in records):
        return True
    for r in records:  # table[pos]: an index made from it
        if r.func == "__getitem__" and len(r.args) > 1 and r.args[0] != ("text", name) \
                and any(_reads(arg, name, made) for arg in r.args[1:]):
            return True
    return "indices" in failure.message or "index" in failure.message.split(":")[0].lower() and bool(
        failure.args and any(_reads(arg, name, made) for arg in failure.args))


def four_axes(failure: Failure, name: str, path: Path | None) -> bool:
    """Whether the code raised reading the parameter `name` as four axes (`media.shape[3]`, `b, t, m, d =
    media.shape`): an index past its shape, or four sizes unpacked from three, on a line that names it."""
    message = failure.message
    if "tuple index out of range" not in message and "expected 4, got 3" not in message:
        return False
    if path is None or failure.line is None:
        return False
    import linecache

    return bool(re.search(rf"\b{re.escape(name)}\b", linecache.getline(str(path), failure.line)))


def apart_from_keys(records: list[Record], name: str) -> bool:
    """Whether neither the scores' right operand (the keys) nor the pattern's partner (the values) comes from the
    parameter `name` in a run (Transformer-XL's `r` meets the queries in a term of its own; the keys and values
    are the input's). True where the run shows no scores matmul."""
    from attnscope.usertrace.flow import operands

    found = operands(records)
    if found is None:
        return True
    made = derived(records, name)
    return not any(i in made for i in found[1:3])


def keys_from(records: list[Record], name: str) -> bool:
    """Whether the scores' right operand (the keys) comes from the parameter `name` in a run (True where the run
    shows no scores matmul)."""
    from attnscope.usertrace.flow import operands

    found = operands(records)
    return found is None or found[1] in derived(records, name)


# ops that move or pick a tensor's values without computing new ones: what code does to a table before it turns by it
MOVES = ("__getitem__", "view", "reshape", "unsqueeze", "squeeze", "float", "to", "type_as", "double", "half",
         "expand", "expand_as", "permute", "transpose", "contiguous", "flatten", "unflatten", "clone", "select",
         "narrow", "unbind", "chunk", "split", "movedim", "swapaxes", "detach", "broadcast_to", "view_as", "real",
         "imag", "view_as_real", "view_as_complex", "bfloat16")
# ops that multiply two operands: where a table of values meets the features it turns
PRODUCTS = ("mul", "__mul__", "__rmul__", "mul_", "matmul", "__matmul__", "einsum", "bmm", "addcmul")


def as_read(records: list[Record], name: str) -> set[int]:
    """The records that hold the parameter `name`'s values as given, only moved or picked (a view, an index, a
    cast): `pe[..., 0]`, never `pe * inv_freq` or `pe.cos()`."""
    found: set[int] = set()
    for record in records:
        if record.func in MOVES and record.args and _reads(record.args[0], name, found):
            found.add(record.index)
    return found


def turns(records: list[Record], failure: Failure | None, name: str, first: str) -> bool:
    """Whether the code multiplies the parameter `name`'s values, as given, into a tensor made from its input `first`
    (Flux's `freqs_cis[..., 0] * xq_[..., 0]`, a rotation matrix `pe @ pairs`): a table of RoPE's values, never
    positions (positions are turned into angles, compared or used as indices before they meet the features) nor an
    embedding (projected first). In the run's records, or the op it raised in."""
    held = as_read(records, name)
    made = derived(records, first)
    ops = [(r.func, r.args) for r in records] + ([(failure.func, failure.args)] if failure is not None else [])
    for func, args in ops:
        if func.rsplit(".", 1)[-1] not in PRODUCTS:  # a failure's op may be written in full (`torch.einsum`)
            continue
        if any(_reads(a, name, held) for a in args) and any(_reads(a, first, made - held) for a in args
                                                            if not _reads(a, name, held)):
            return True
    return False
