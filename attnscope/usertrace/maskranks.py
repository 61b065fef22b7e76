"""A mask the code takes in more than one form: the shapes a mask is handed in (key padding `[n_batch, n_K]`, diffusers'
`[n_batch, 1, n_K]`, HF's 4-D `[n_batch, 1, 1, n_K]`, a mask per query `[n_batch, n_Q, n_K]`, `[n_batch, 1, n_Q,
n_K]`), the path the mask takes through the code's ops in a run (a branch on its rank: HF Pix2Struct's
`if attention_mask.dim() == 2: ... attention_mask[:, None, None, :]`, BERT's get_extended_attention_mask), and
whether two runs' outputs agree. runs/trace_maskranks.py gives the code each other form it takes once the first
lines up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.call import Called
    from attnscope.usertrace.record import Record


def forms(allowed: torch.Tensor, sizes: dict[str, int]) -> list[tuple[torch.Tensor, str]]:
    """The mask `allowed` (boolean, True = may attend, as the code was first given it) in the other shapes a mask is
    handed in, each with its words; key padding's shapes only where the mask is key padding (the same for every
    query of a sequence). None of the shape given, nor any where the sizes leave a shape ambiguous (n_batch equal
    to n_Q or n_K: `[n_batch, n_K]` then reads as `[n_Q, n_K]`), nor a mask that differs across heads."""
    from attnscope.usertrace.maskrows import laid

    grid = laid(allowed, sizes)
    if grid is None:
        return []
    out: list[tuple[torch.Tensor, str]] = []
    if bool((grid == grid[:, :1, :]).all()):  # key padding: no rule of the queries
        keys = grid[:, 0, :]  # [n_batch, n_K]
        out += [(keys, "[n_batch, n_K]"), (keys[:, None, :], "[n_batch, 1, n_K]"),
                (keys[:, None, None, :], "[n_batch, 1, 1, n_K]")]
    out += [(grid, "[n_batch, n_Q, n_K]"), (grid[:, None], "[n_batch, 1, n_Q, n_K]")]
    return [(form, words) for form, words in out if tuple(form.shape) != tuple(allowed.shape)]


def words(shape: tuple[int, ...], sizes: dict[str, int]) -> str:
    """A mask's shape in dims: its first axis n_batch, its last n_K, the one before n_Q where it has that size."""
    dims = ["1" if n == 1 else str(n) for n in shape]
    if len(shape) >= 2 and shape[0] == sizes.get("n_batch") and shape[0] != 1:
        dims[0] = "n_batch"
    if shape and shape[-1] == sizes.get("n_K"):
        dims[-1] = "n_K"
    if len(shape) >= 3 and shape[-2] == sizes.get("n_Q") and shape[-2] != 1:
        dims[-2] = "n_Q"
    return f"[{', '.join(dims)}]"


def path(records: list[Record], label: str) -> tuple[tuple[int, str, Any], ...]:
    """The ops the mask parameter `label` (and what the code made of it) passes through before the code's first
    pattern (a softmax, a kernel's attention), as (line, op, where in a helper file beside the traced one it ran:
    userfolder.py) in the order run: two forms of the mask that take different paths meet a branch of the code's on
    the mask's shape, in the traced file or in a helper of the user's folder it calls."""
    from attnscope.usertrace.masking import is_pattern

    derived: set[int] = set()
    ops: list[tuple[int, str, Any]] = []
    for record in records:
        if is_pattern(record):
            break
        texts = [value for kind, value in record.args if kind == "text"] + [
            value[1][1] for kind, value in record.args if kind == "kw" and value[1][0] == "text"]
        if label in texts or derived & set(record.parents):
            derived.add(record.index)
            ops.append((record.line, record.func, record.details.get("helper")))
    return tuple(ops)


def shaped_alike(first: Called, other: Called) -> bool:
    """Whether a run's output and first pattern have the first run's shapes: a form the code broadcasts into axes
    of its own (a 4-D mask indexed `[:, None]` as a 3-D one would be) is none it takes."""
    from attnscope.usertrace.masking import is_pattern

    def shapes(called: Called) -> tuple[Any, Any]:
        out = _output(called.result)
        pattern = next((r.tensor for r in called.records if is_pattern(r)), None)
        return (None if out is None else tuple(out.shape)), (None if pattern is None else tuple(pattern.shape))

    return shapes(first) == shapes(other)


def returned(result: Any) -> list[torch.Tensor]:
    """The floating tensors a run returned, in order (out, then any weights: `(out, weights)`)."""
    import torch

    found = result if isinstance(result, (tuple, list)) else [result]
    return [t for t in found if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _output(result: Any) -> torch.Tensor | None:
    """The first floating tensor a run returned (out, before any weights)."""
    return next(iter(returned(result)), None)


def agree(first: Any, other: Any) -> bool:
    """Whether two runs returned the same output: the first floating tensor of each (out, before any weights),
    of one shape and equal up to float rounding."""
    import torch

    a, b = _output(first), _output(other)
    if a is None or b is None or a.shape != b.shape:
        return a is None and b is None
    a, b = a.detach().double(), b.detach().double()
    finite = a[torch.isfinite(a)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, scale), equal_nan=True))


def keeps_own(first: Called, other: Called, allowed: torch.Tensor, sizes: dict[str, int]) -> bool:
    """Whether a run on another form of the mask still hides the keys the code hid by itself in the first run:
    the cells of the first pattern of weight 0 in every head that the mask `allowed` lets a query see (a causal
    rule the code builds from a 2-D mask, as transformers' Mistral does, and takes as it is in a 4-D one), of
    weight 0 in the other run's pattern too. A form that loses them is one the code takes from a caller who hands it
    the rule as well: no form of this mask."""
    from attnscope.usertrace.maskrows import laid

    grid = laid(allowed, sizes)
    n_Q, n_K = sizes.get("n_Q"), sizes.get("n_K")
    if grid is None or n_Q is None or n_K is None:
        return True
    weights = [_weights(run, grid.shape[0], n_Q, n_K) for run in (first, other)]
    if weights[0] is None or weights[1] is None:
        return True
    own = (weights[0] == 0).all(1) & grid  # [n_batch, n_Q, n_K]: zero in every head where the mask allows
    return bool((weights[1] == 0).all(1)[own].all())


def _weights(called: Called, n_batch: int, n_Q: int, n_K: int) -> torch.Tensor | None:
    """The run's first pattern as `[n_batch, .., n_Q, n_K]`, batch-major; None where it has no such pattern."""
    from attnscope.usertrace.masking import is_pattern

    pattern = next((r.tensor for r in called.records if is_pattern(r) and r.tensor.is_floating_point()), None)
    if pattern is None or pattern.dim() < 2 or tuple(pattern.shape[-2:]) != (n_Q, n_K) \
            or pattern.numel() % (n_batch * n_Q * n_K):
        return None
    return pattern.detach().reshape(n_batch, -1, n_Q, n_K)
