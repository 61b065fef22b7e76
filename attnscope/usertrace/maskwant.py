"""The shape a mask parameter wants, read from the code where it raised on the one trace gave it: its own check (HF
ProphetNet's `assert attention_mask is None or attention_mask.size() == (self.num_attn_heads * batch_size, 1,
src_len)`, BART's `if attention_mask.size() != (bsz, 1, tgt_len, src_len): raise ValueError(...)`), its sizes taken
in the frame that raised; or the scores the mask met in the op it was fed to (`attn_weights + attention_mask`,
`baddbmm(attention_mask, q, k)`). A shape whose first axis is n_batch·n_head holds the heads folded into the batch
(`[n_batch·n_head, 1, n_K]`, `[n_batch·n_head, n_Q, n_K]`: bmm-era HF, fairseq, diffusers' prepare_attention_mask),
each sequence's heads side by side, as `view(n_batch, n_head, ..)` folds them. runs/trace_mask.py gives the mask so.
"""

from __future__ import annotations

import ast
import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import torch

    from attnscope.usertrace.call import Called
    from attnscope.usertrace.record import Failure

_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.FloorDiv: operator.floordiv}


def asserted(failure: Failure | None, path: Path, given: torch.Tensor) -> tuple[list[int], int] | None:
    """The shape the code's own check asks of the mask it was given (`given`), with the check's line: an assert,
    or an `if` whose body raises, comparing the mask's `.size()` / `.shape` with a tuple, the tuple's sizes read in
    the frame that raised; None where the code raised elsewhere, or its check names no shape of the mask."""
    if failure is None or failure.op or failure.exception is None:
        return None
    frame, line = _frame(failure.exception, path)
    if frame is None or line is None:
        return None
    test = _check(path, line)
    if test is None:
        return None
    for node in ast.walk(test):
        if not isinstance(node, ast.Compare) or len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            continue
        left, right = node.left, node.comparators[0]
        for side, other in ((left, right), (right, left)):
            name = _sized(side)
            held = frame.f_locals.get(name) if name is not None else None
            if held is None or not (held is given or "mask" in (name or "").lower()
                                    and tuple(getattr(held, "shape", ())) == tuple(given.shape)):
                continue  # the mask given, or one made of it under a mask's name (`mask = mask.to(dtype)`)
            want = _sizes(other, frame)
            if want is not None:
                return want, line
    return None


def laid(allowed: torch.Tensor, failure: Failure | None, met: list[int] | None, path: Path, given: torch.Tensor,
         sizes: dict[str, int], col: bool = False) -> tuple[torch.Tensor, str, None] | None:
    """The mask `allowed` (True = may attend) laid out as the code wants it, where it raised on `given`: the shape
    its own check asks (asserted), else that of the scores it met (`met`, the op's other operand: key padding then
    `[n_batch·n_head, 1, n_K]`, which they broadcast); heads folded into the batch where that shape's first axis is
    n_batch·n_head (folded), else as masking.laid_like lays it. None
    where neither says a shape, or the mask cannot be laid so."""
    from attnscope.usertrace.masking import laid_like

    checked = asserted(failure, path, given)
    want = checked[0] if checked is not None else met
    if want is None:
        return None
    # scores met, not a shape asked: key padding as diffusers' prepare_attention_mask folds it, [n_batch·n_head, 1, n_K]
    narrow = [want[0], 1, want[2]] if checked is None and len(want) == 3 else None
    out = None if col else (narrow and folded(allowed, narrow, sizes)) or folded(allowed, want, sizes)
    if out is None:
        out = laid_like(allowed, want, sizes, col) if checked is None or len(want) > 2 else None
    if out is None or checked is None:
        return out
    form, words, _ = out
    return form, f"{words.split(', as ')[0]}, as your code's check asks (line {checked[1]}: {tuple(want)})", None


def folded(allowed: torch.Tensor, want: list[int], sizes: dict[str, int]) -> tuple[torch.Tensor, str, None] | None:
    """The mask `allowed` (True = may attend, `[.., n_Q or 1, n_K]`) as `want`, a shape of three axes whose first is
    n_batch·n_head (each sequence's heads side by side; n_head read from the shape where trace knows none), its second
    1 (key padding: the same for every query) or n_Q; with its words. None for any other shape, or a mask that
    differs across queries where the shape keeps one row."""
    n_batch, n_Q, n_K = sizes.get("n_batch", 1), sizes.get("n_Q"), sizes.get("n_K")
    if n_Q is None or n_K is None or len(want) != 3 or want[2] != n_K or want[1] not in (1, n_Q) \
            or allowed.dim() < 2 or allowed.shape[-1] != n_K or allowed.shape[-2] not in (1, n_Q):
        return None
    n_head = sizes.get("n_head") or (want[0] // n_batch if want[0] % n_batch == 0 else 0)
    if n_head < 2 or want[0] != n_batch * n_head:
        return None
    grid = allowed.reshape(-1, allowed.shape[-2], n_K)
    if grid.shape[0] not in (1, n_batch):
        return None
    grid = grid.expand(n_batch, grid.shape[1], n_K)
    if want[1] == 1 and want[1] != n_Q:
        if not bool((grid == grid[:, :1, :]).all()):
            return None  # a rule of the queries (causal) kept in one row: not this shape
        grid, words = grid[:, :1, :], "[n_batch·n_head, 1, n_K]"
    else:
        grid, words = grid.expand(n_batch, n_Q, n_K), "[n_batch·n_head, n_Q, n_K]"
    return grid.repeat_interleave(n_head, dim=0), words, None


def _frame(exc: BaseException, path: Path) -> tuple[Any, int | None]:
    """The last frame of the user's file in `exc`'s traceback, and its line."""
    from pathlib import Path as _Path

    tb = exc.__traceback__
    found: tuple[Any, int | None] = (None, None)
    while tb is not None:
        if _Path(tb.tb_frame.f_code.co_filename) == path:
            found = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    return found


def _check(path: Path, line: int) -> ast.expr | None:
    """The test of the check that raised at `line`: the innermost assert holding the line, or the `if` around the
    raise there."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    best: tuple[int, ast.expr] | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and _holds(node, line) or isinstance(node, ast.If) and any(
                isinstance(s, ast.Raise) and _holds(s, line) for s in node.body):
            assert isinstance(node, (ast.Assert, ast.If))
            if best is None or node.lineno > best[0]:
                best = node.lineno, node.test
    return best[1] if best else None


def _holds(node: ast.stmt, line: int) -> bool:
    """Whether the statement `node` spans `line`."""
    return node.lineno <= line <= (node.end_lineno or node.lineno)


def _sized(node: ast.expr) -> str | None:
    """The name whose shape `node` reads: `x.size()`, `x.shape`, `tuple(x.shape)`, `list(x.size())`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("tuple", "list") \
            and len(node.args) == 1:
        node = node.args[0]
    if isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "size":
        node = node.func
    elif not (isinstance(node, ast.Attribute) and node.attr == "shape"):
        return None
    return node.value.id if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else None


def _sizes(node: ast.expr, frame: Any) -> list[int] | None:
    """The sizes a tuple or list of the code's (`(self.num_attn_heads * batch_size, 1, src_len)`, `torch.Size([..])`)
    holds, read in `frame`; None where it is none, or any element is not a plain size."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and getattr(node.func, "attr", getattr(node.func, "id", "")) \
            == "Size":
        node = node.args[0]
    if not isinstance(node, (ast.Tuple, ast.List)) or not node.elts:
        return None
    out = []
    for element in node.elts:
        value = _value(element, frame)
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        out.append(value)
    return out


def _value(node: ast.expr, frame: Any) -> Any:
    """A size expression's value in `frame`: numbers, names, attributes, + - * //, `x.size(i)`, `x.shape[i]`; None
    for anything else (no call of the code's is made)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return frame.f_locals.get(node.id, frame.f_globals.get(node.id))
    if isinstance(node, ast.Attribute):
        held = _value(node.value, frame)
        return getattr(held, node.attr, None) if held is not None and not node.attr.startswith("__") else None
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left, frame), _value(node.right, frame)
        if isinstance(a, int) and isinstance(b, int) and not (b == 0 and isinstance(node.op, ast.FloorDiv)):
            return _OPS[type(node.op)](a, b)
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
            and len(node.args) == 1:
        held, axis = _value(node.func.value, frame), _value(node.args[0], frame)
        return int(held.shape[axis]) if hasattr(held, "shape") and isinstance(axis, int) \
            and -len(held.shape) <= axis < len(held.shape) else None
    if isinstance(node, ast.Subscript):
        held, axis = _value(node.value, frame), _value(node.slice, frame)
        return int(held[axis]) if isinstance(held, tuple) and isinstance(axis, int) \
            and -len(held) <= axis < len(held) else None
    return None


def in_fold_order(chosen: tuple[Any, str, Any, Called, str], run: Callable[[dict[str, Any], Any], Called],
                  tensors: dict[str, torch.Tensor], n_batch: int) -> tuple[Any, str, Any, Called, str]:
    """The mask `chosen` (form, words, padded, the run, its convention) folded with the heads in the code's order:
    each sequence's heads side by side (`view(bsz * num_heads, ..)`, row b·n_head + h) unless, by experiment, the
    code folds them the other way (Set Transformer's `torch.cat(x.split(d_head, 2), 0)`, row h·n_batch + b): with
    every sequence of the inputs made the first (`run(tensors, mask)`, a mask that masks nothing), the rows of its
    first pattern are equal across the sequences in that order alone. The mask is then laid so, and the code run on
    it again."""
    import torch

    from attnscope.usertrace import masking

    form, words, padded, called, kind = chosen
    n_head = form.shape[0] // n_batch if form.dim() == 3 and n_batch > 1 else 0
    if not words.startswith("[n_batch·n_head") or n_head < 2 or form.shape[0] != n_batch * n_head:
        return chosen
    same = {n: t[:1].expand_as(t).clone() for n, t in tensors.items() if t.dim() and t.shape[0] == n_batch}
    dtype = next(iter(tensors.values())).dtype
    tried = run({**tensors, **same}, masking.written(torch.ones_like(form, dtype=torch.bool), kind, dtype))
    pattern = next((r.tensor for r in tried.records if masking.is_pattern(r)), None)
    if tried.failure is not None or pattern is None or pattern.dim() != 3 or pattern.shape[0] != n_batch * n_head:
        return chosen
    p = pattern.detach().double()

    def alike(rows: torch.Tensor) -> bool:  # [n_batch, ..] equal across the sequences
        return bool(torch.allclose(rows, rows[:1].expand_as(rows), rtol=1e-5, atol=1e-6))

    if alike(p.reshape(n_batch, n_head, *p.shape[1:])) or not alike(
            p.reshape(n_head, n_batch, *p.shape[1:]).transpose(0, 1)):
        return chosen
    outer = form.reshape(n_batch, n_head, *form.shape[1:]).transpose(0, 1).reshape(form.shape)
    again = run(tensors, masking.written(outer, kind, dtype))
    if again.failure is not None:
        return chosen
    return outer, f"{words}, the heads outside the batch (row head·n_batch + b, as your code folds them)", padded, \
        again, kind
