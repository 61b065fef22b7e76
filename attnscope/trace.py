"""The record of a run: `Step`s in order, each with its tensor, symbolic dims, the op that made it and the steps it
was computed from (`inputs`, by name: structure a reader follows, where `op` is text a person reads).

A `Trace` is a read-only mapping from step name to tensor, so `trace["x"]` is the output of a
multi-head attention run, as the tutorials' dict of intermediates was.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Step:
    """One intermediate tensor.

    `dims` names every axis (`n_batch, n_Q, d_K`, ...), `op` is the expression that produced it,
    `flops` the floating-point operations that op cost (`work`: the count or its `Cost`), `allocates` is False for views
    (a `view`/`permute` shares its input's memory, so it adds nothing to the peak), and `inputs` names the steps
    (or the caller's inputs, `Q`, `X`) the tensor was computed from, in the op's order: `scores` from
    `("Q_rot", "K_rot")`, `x_raw` from `("attention", "V_rep")`; empty where the recording site says none.
    """

    name: str
    tensor: torch.Tensor
    dims: tuple[str, ...]
    op: str
    work: int | Cost = 0  # the FLOPs, or a Cost to count them from when asked (`flops`)
    allocates: bool = True
    inputs: tuple[str, ...] = field(default=(), kw_only=True)  # keyword-only: subclasses add positional fields

    @property
    def flops(self) -> int:
        """The floating-point operations of `op`: counted from its `Cost` here, when a table or the JSON asks, so a
        forward records its steps without the arithmetic (cost.py's `counted`)."""
        if isinstance(self.work, int):
            return self.work
        from attnscope.cost import counted

        return counted(*self.work)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def dtype(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")

    def dims_text(self) -> str:
        """`[n_batch, n_Q, d_K] = [3, 30, 128]`, the form the table and docs use."""
        names = ", ".join(self.dims)
        sizes = ", ".join(str(n) for n in self.shape)
        return f"[{names}] = [{sizes}]"

    def reading(self, renamed: Mapping[str, str]) -> Step:
        """The step with inputs renamed (`{"Q": "X"}`: a module's argument Q is the layer's X): in `inputs`, and in
        `op` where it applies a function to that input alone (`W_q(Q)` -> `W_q(X)`); other ops stay as they are."""
        inputs = tuple(renamed.get(name, name) for name in self.inputs)
        op = self.op
        if len(self.inputs) == 1 and self.inputs[0] in renamed and op.endswith(f"({self.inputs[0]})"):
            op = f"{op.removesuffix(f'({self.inputs[0]})')}({inputs[0]})"
        return replace(self, inputs=inputs, op=op)


Cost = tuple[str, tuple[int, ...], int, int]
"""A step's FLOPs said as data, `(kind, shape, k, extra)`: ("linear", out_shape, d_in, bias), ("matmul", out_shape,
k, element-wise extra), ("softmax", shape, 0, 0), ("rms_norm", shape, weighted, extra); counted by cost.py when
asked."""


class Recorder(Protocol):
    """Where a stage records its steps: a `Trace` (called, it adds) or its `add`, or `discard` when nothing is kept
    (`record=False`). Either way the tensor comes back, so a stage reads the same recorded or not."""

    def __call__(self, name: str, tensor: torch.Tensor, dims: tuple[str, ...], op: str, flops: int | Cost = 0,
                 allocates: bool = True, *, inputs: tuple[str, ...] = ()) -> torch.Tensor: ...


def discard(name: str, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The `Recorder` that keeps nothing: the tensor back, unrecorded."""
    return tensor


@dataclass
class Trace(Mapping[str, "torch.Tensor"]):
    """Steps in the order they were computed, looked up by name; `notes` are one-line remarks."""

    _steps: dict[str, Step] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    notebook_view: ClassVar[Callable[[Trace], str] | None] = None  # how Jupyter shows a trace, handed in from above

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        dims: tuple[str, ...],
        op: str,
        flops: int | Cost = 0,
        allocates: bool = True,
        *,
        inputs: tuple[str, ...] = (),
    ) -> torch.Tensor:
        """Record a step and hand its tensor back, so the computation reads as a chain of adds; `flops`: a count, or
        a `Cost` counted when asked; `inputs`: the steps it was computed from, by name."""
        if name in self._steps:
            raise ValueError(f"step {name!r} is already in this trace; a name is never reused")
        if len(dims) != tensor.dim():
            raise ValueError(f"step {name!r} has {tensor.dim()} axes but {len(dims)} dim names {dims}")
        self._steps[name] = Step(name, tensor, tuple(dims), op, flops, allocates, inputs=tuple(inputs))
        return tensor

    __call__ = add  # a Trace is a Recorder: a stage handed one records into it

    def add_step(self, step: Step, name: str | None = None) -> torch.Tensor:
        """Record a step taken from another trace, optionally under a new name."""
        return self.add(name or step.name, step.tensor, step.dims, step.op, step.work, step.allocates,
                        inputs=step.inputs)

    def set_op(self, name: str, op: str) -> None:
        """Say where an input came from (`torch.randn(...)`, `loaded from q.npy`) once the caller knows."""
        self._steps[name] = replace(self._steps[name], op=op)

    def step(self, name: str) -> Step:
        return self._steps[name]

    @property
    def steps(self) -> list[Step]:
        return list(self._steps.values())

    @property
    def total_flops(self) -> int:
        return sum(s.flops for s in self._steps.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._steps[name].tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        rows = ", ".join(f"{s.name}{list(s.shape)}" for s in self._steps.values())
        return f"Trace({rows})"

    def _repr_html_(self) -> str:
        """Jupyter shows a trace through `notebook_view`, which the package hands in (attnscope/__init__.py:
        views/embed.py's explorer page, the static table and heatmap where the frontend runs no script), so that
        the core imports no view; without one, the steps as text."""
        if Trace.notebook_view is None:
            return f"<pre>{html.escape(repr(self))}</pre>"
        return Trace.notebook_view(self)
