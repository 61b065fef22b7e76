"""The meta device, answered from shapes and dtypes: no torch compiler imported, nothing written to $TMPDIR.

`--meta` (and the shadow run that sizes file inputs for the memory guard) runs attnscope's own code on meta
tensors. In torch 2.x most meta kernels are Python (`torch._meta_registrations`, `torch._refs`): the first
one imports sympy (`elementwise_dtypes`), and the first elementwise one imports torch's compiler,
`torch._dynamo`, through `torch._disable_dynamo` (F.linear with a bias goes through the `addmm` decomposition,
whose `torch.mm` is wrapped that way). That is seconds of start-up, more than a whole real run of a small
layer, and `torch._dynamo` makes its cache folder, `$TMPDIR/torchinductor_<user>`, as it is imported.

`shapes_only()` is a dispatch mode that answers those ops itself, by the rules PyTorch documents:
- pointwise ops (aten's `pointwise` tag, and `masked_fill_`): the broadcast shape, and the dtype PyTorch's own
  type promotion gives, read off the same op run on one-element CPU tensors of the same dtypes and ranks; an
  in-place op returns its first argument, whose shape must already be the broadcast shape;
- matrix products (`mm`, `bmm`, `addmm`, `baddbmm`): `[.., n, k] @ [.., k, m] -> [.., n, m]`;
- `_softmax` and `_log_softmax` keep the shape; reductions over dims (`any`, `amax`, `sum`, `mean`, ...) drop
  them, or keep them as 1 with `keepdim`; `cat` adds up the sizes along its dim.
Everything else (views, factories, copies, whose meta kernels are C++) runs as PyTorch runs it; so does any op
whose inputs a rule does not accept (shapes that do not broadcast, mixed dtypes in a product), so that the error
is PyTorch's own. tests/test_metadevice.py holds every rule against PyTorch's meta kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from attnscope.cost import broadcast_shapes

META = torch.device("meta")


class NoRule(Exception):
    """The op's inputs are not what the rule covers: run it as PyTorch does."""


@contextmanager
def shapes_only(on: bool = True) -> Iterator[None]:
    """Within it, ops on meta tensors are answered from shapes and dtypes (this module's rules); `on=False`
    does nothing, for callers that need the mode only sometimes."""
    if not on:
        yield
        return
    with _ShapesOnly():
        yield


class _ShapesOnly(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: TorchDispatchMode would wrap __torch_dispatch__ in `torch._disable_dynamo` (torch 2.6 on), which
        imports torch._dynamo on the first op, the very cost this mode avoids. Nothing here is compiled."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rule = _rule(func)
        factory = rule is _arange and kwargs.get("device") == META
        if rule is not None and "out" not in kwargs and (factory or _on_meta(args, kwargs)):
            try:
                return rule(func, args, kwargs)
            except (NoRule, RuntimeError, TypeError, ValueError, IndexError):
                pass  # PyTorch's own kernel, and its own error
        return func(*args, **kwargs)


def _on_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device == META for t in tensors)


def _small(value: Any) -> Any:
    """A one-element CPU tensor of the same dtype and rank (a 0-dim one stays 0-dim, as promotion tells them apart)."""
    return torch.ones((1,) * value.dim(), dtype=value.dtype) if isinstance(value, torch.Tensor) else value


def _dtype_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """The dtype PyTorch gives: the op itself on one-element CPU tensors."""
    result = func(*tree_map(_small, args), **tree_map(_small, kwargs))
    if not isinstance(result, torch.Tensor):
        raise NoRule
    return result.dtype


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by name, defaults filled in."""
    bound = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _pointwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    leaves, _ = tree_flatten((args, kwargs))
    shape = broadcast_shapes(*(t.shape for t in leaves if isinstance(t, torch.Tensor)))
    dtype = _dtype_of(func, args, kwargs)
    if func._schema.name.endswith("_"):  # in place: the first argument, unchanged in shape
        target = args[0]
        if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
            raise NoRule
        return target  # type: ignore[no-any-return]
    return torch.empty(shape, dtype=dtype, device=META)


def _product(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """mm, bmm, and addmm / baddbmm (a bias broadcast to the product)."""
    bound = _bound(func, args, kwargs)
    a, b = (bound["mat1"], bound["mat2"]) if "mat1" in bound else (bound.get("batch1", bound["self"]),
                                                                      bound.get("batch2", bound.get("mat2")))
    if not isinstance(b, torch.Tensor) or a.dim() != b.dim() or a.dim() not in (2, 3) or a.dtype != b.dtype:
        raise NoRule
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise NoRule
    shape = (*a.shape[:-1], b.shape[-1])
    bias = bound["self"] if "mat1" in bound or "batch1" in bound else None
    if bias is not None and (bias.dtype != a.dtype or broadcast_shapes(bias.shape, shape) != shape):
        raise NoRule
    return torch.empty(shape, dtype=a.dtype, device=META)


def _softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    bound = _bound(func, args, kwargs)
    x = bound["self"]
    dtype = torch.float32 if bound.get("half_to_float") else x.dtype
    return torch.empty(x.shape, dtype=dtype, device=META)


def _reduction(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    bound = _bound(func, args, kwargs)
    x, dims, keep = bound["self"], bound.get("dim"), bool(bound.get("keepdim", False))
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise NoRule
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(x.dim()))
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) and -x.dim() <= d < x.dim() for d in dims):
        raise NoRule
    reduced = {d % x.dim() for d in dims}
    shape = [1 if i in reduced else n for i, n in enumerate(x.shape) if keep or i not in reduced]
    return torch.empty(shape, dtype=_dtype_of(func, args, kwargs), device=META)


def _cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    bound = _bound(func, args, kwargs)
    tensors, dim = list(bound["tensors"]), bound.get("dim", 0)
    if not tensors or any(t.dim() != tensors[0].dim() for t in tensors) or tensors[0].dim() == 0:
        raise NoRule  # (1-D empty tensors, which cat skips, go to PyTorch too)
    d = dim % tensors[0].dim()
    others = {tuple(n for i, n in enumerate(t.shape) if i != d) for t in tensors}
    if len(others) != 1:
        raise NoRule
    shape = list(tensors[0].shape)
    shape[d] = sum(t.shape[d] for t in tensors)
    return torch.empty(shape, dtype=_dtype_of(func, args, kwargs), device=META)


def _arange(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """`torch.arange`'s length, ceil((end - start) / step) as its kernel computes it in double, and its dtype:
    the one asked for, else int64 for whole numbers and the default float dtype otherwise."""
    bound = _bound(func, args, kwargs)
    start, end, step = bound.get("start", 0), bound["end"], bound.get("step", 1)
    numbers = (start, end, step)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers) or step == 0:
        raise NoRule
    length = math.ceil((end - start) / step) if any(isinstance(x, float) for x in numbers) else -((start - end) // step)
    if length < 0:
        raise NoRule
    dtype = bound.get("dtype") or (torch.get_default_dtype() if any(isinstance(x, float) for x in numbers)
                                   else torch.int64)
    return torch.empty(length, dtype=dtype, device=META)


RULES: dict[str, Callable[[Any, tuple[Any, ...], dict[str, Any]], torch.Tensor]] = {
    "aten::mm": _product, "aten::bmm": _product, "aten::addmm": _product, "aten::baddbmm": _product,
    "aten::_softmax": _softmax, "aten::_log_softmax": _softmax, "aten::cat": _cat,
    "aten::masked_fill_": _pointwise,  # in place, and not tagged pointwise
    "aten::arange": _arange,  # a factory: device="meta" says where it goes
}
REDUCTIONS = ("aten::any", "aten::all", "aten::amax", "aten::amin", "aten::sum", "aten::mean")
VIEWS_AND_COPIES = ("aten::clone", "aten::_to_copy", "aten::copy_")  # C++ meta kernels already; keep their strides


def _rule(func: Any) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], torch.Tensor] | None:
    name = func._schema.name
    if name in RULES:
        return RULES[name]
    if name in VIEWS_AND_COPIES:
        return None
    if name in REDUCTIONS:
        return _reduction
    if torch.Tag.pointwise in func.tags:
        return _pointwise
    return None
