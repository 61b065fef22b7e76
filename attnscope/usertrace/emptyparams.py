"""Parameters a module's `__init__` leaves as `torch.empty` made them (GPT-OSS's `sinks = nn.Parameter(torch.empty(
n_head))`: transformers fills it in its model's `_init_weights`, which a module built alone never runs). Their values
are whatever memory held, another in each process: 0 one run, 1e+28 or NaN the next, so a trace of the same code
could pass once and fail the next time. trace fills them from --seed, and a note says so.

`Watch` is a TorchFunctionMode held while the module is built: it notes each tensor an uninitialised factory made
(by its storage: `nn.Parameter(t)` is another Python object on the same memory) and forgets it when an in-place op
writes it (`nn.init`'s `uniform_`, `normal_`, a `copy_`, `fill_`, `t[...] = ...`, through a view too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attnscope.usertrace.blank import UNINITIALISED


class Watch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.blank: dict[int, tuple[int, ...]] = {}  # data_ptr -> shape, of tensors made uninitialised, not yet written
        self._alive: list[torch.Tensor] = []  # keep them alive, so that their memory is not another's

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in UNINITIALISED and isinstance(out, torch.Tensor) and out.numel() > 0:
            self.blank[out.data_ptr()] = tuple(out.shape)
            self._alive.append(out)
        elif (name.endswith("_") and not name.endswith("__") or name == "__setitem__") and self.blank:
            # the tensor written: a method's self, or nn.init's `tensor=` (kaiming_uniform_(tensor=w, ...))
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                self._written(first)
        return out

    def _written(self, tensor: torch.Tensor) -> None:
        """Whatever of a noted tensor `tensor` covers counts as written: its storage's start, or any noted tensor
        whose memory it lies in (a view of it)."""
        try:
            start = tensor.untyped_storage().data_ptr()
            end = start + tensor.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, a subclass)
            return
        for ptr in [p for p in self.blank if start <= p < end]:
            del self.blank[ptr]


def fill(module: torch.nn.Module, blank: dict[int, tuple[int, ...]], seed: int) -> list[str]:
    """Fill the module's parameters and buffers that are still as an uninitialised factory made them: normal
    values from `seed` (std 1 for a vector, as a learned sink or gain; 1/√fan_in for a matrix, as a projection's).
    The names filled, in the module's order."""
    filled: list[str] = []
    if not blank:
        return filled
    generator = torch.Generator().manual_seed(seed + 7919)
    named = list(module.named_parameters(remove_duplicate=True)) + list(module.named_buffers(remove_duplicate=True))
    with torch.no_grad():
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or tensor.device.type == "meta" \
                    or not tensor.is_floating_point() or blank.get(tensor.data_ptr()) != tuple(tensor.shape):
                continue
            values = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
            if tensor.dim() >= 2:
                values = values / max(1, tensor.shape[-1]) ** 0.5
            tensor.copy_(values.to(tensor.dtype))
            filled.append(name)
    return filled


def note(names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{shown}: your module's __init__ leaves {'them' if len(names) > 1 else 'it'} as torch.empty made "
            f"{'them' if len(names) > 1 else 'it'} (whatever memory held, another each run; a model's "
            "_init_weights fills such a parameter): trace filled "
            f"{'them' if len(names) > 1 else 'it'} from --seed, normal values")
