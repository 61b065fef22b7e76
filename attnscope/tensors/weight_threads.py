"""A short text's forward with its small operations on one torch thread and its products with weights on all.

A layer of a short text (a few dozen tokens) is a handful of products with the layer's weights, millions of
numbers each, and some forty small operations around them: norms, RoPE, the scores, the mask, the softmax, the
merge of the heads, the readings and the self-check, a few hundred thousand numbers each. torch's thread count is
process-wide and read by each operation as it starts: on two threads every small operation hands half its work to
the second thread and waits for it, which on a machine running anything else costs it a time slice each time
(the 1.1B LLaMA's 16 layers at 73 tokens, 2 CPUs at a load average of 10: 20.7 s on two threads, 12.2 s so;
docs/performance.md, issue 44 goal 1). `weights_on_all_threads()` runs every operation on one thread except the
products with a matrix (`F.linear`, and `matmul`, `@`, `mm`, `addmm` with a 2-D operand: a weight), which run on
the threads torch had: an `F.linear` with enough work as parts of its weight's rows, side by side on one torch
thread each (rowsplit.py: MKL's own split of a skinny product gains little), any other product whole on torch's
threads. A stretch that sets its own products' threads (attention/stages.py's `wide`, around the
projections of a traced attention) runs `unhooked()`, without the per-op hook.

Every number stays what the same operations give on torch's threads (an `F.linear` in parts: on one thread, the
same bits wherever MKL's two threads split the output, rowsplit.py): a matrix product's thread count changes how
it splits its sums (one thread against two: up to 1.1e-4 on a random [73, 2048] x [2048, 5632], entries about 45),
so those keep theirs, whatever their size; an element-wise operation, a softmax or a norm over a row computes each
output the same way on any number of threads, and so does a batch of products (`bmm`, `@` of two batched operands:
each product whole on one thread; checked on the value norms' Gram matrices and a `[16, 73, 2048] @ [16, 2048,
1024]`). Checked: every layer's pattern and value norms of the 1.1B LLaMA, bit for bit; tests/test_weight_threads.py
on a tiny one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from attnscope.tensors import rowsplit
from attnscope.tensors.threads import one_thread

SHORT = 256  # a pass over at most this many tokens runs its small operations on one thread
PRODUCTS = frozenset({F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                      torch.mm, torch.Tensor.mm, torch.addmm, torch.Tensor.addmm})


class _WeightsWide(TorchFunctionMode):
    """Inside it torch runs on one thread; a product with a matrix (a 2-D operand) on `threads`."""

    def __init__(self, threads: int) -> None:
        super().__init__()
        self.threads = threads

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in PRODUCTS or not any(isinstance(a, torch.Tensor) and a.dim() == 2
                                           for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        if func is F.linear:  # a weight's rows in parts, one thread each (rowsplit.py), where that is worth it
            parts = rowsplit.linear_in_parts(self.threads, *args, **kwargs)
            if parts is not None:
                return parts
        torch.set_num_threads(self.threads)
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_num_threads(1)


HOOKS: list[_WeightsWide] = []  # the hooks in force, innermost last: its `threads` are what products keep


@contextmanager
def weights_on_all_threads(n_tokens: int) -> Iterator[None]:
    """For a pass over `n_tokens` tokens (at most SHORT; longer passes are left as they are): one torch thread
    inside the block but for the products with a matrix, which keep the threads torch had (the hook's `threads`,
    `HOOKS[-1].threads`); restored after."""
    threads = torch.get_num_threads()
    if n_tokens > SHORT or threads == 1:
        yield
        return
    hook = _WeightsWide(threads)
    HOOKS.append(hook)
    try:
        with one_thread(), hook:
            yield
    finally:
        HOOKS.remove(hook)  # this one, whatever order generators holding others end in


@contextmanager
def product_threads() -> Iterator[None]:
    """Inside a short text's forward (the hook in force): torch on the threads its products keep (`HOOKS[-1]`), for
    products with weights the hook does not see or that a stretch makes itself (attention/stages.py's `wide`; the
    value norms' Gram matrices, a batch of products with W_O's heads); back to one thread after. Elsewhere
    nothing changes. A product's sums split as they always did, and a batch's products are each made whole on one
    thread: every number stays the same."""
    if not HOOKS:
        yield
        return
    torch.set_num_threads(HOOKS[-1].threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)


@contextmanager
def unhooked() -> Iterator[None]:
    """A stretch of the forward that sets its products' threads itself (attention/stages.py's `wide`: a layer's
    traced attention): inside `weights_on_all_threads` the per-op hook is lifted there, so its small operations run
    on the one thread without a Python call each; elsewhere nothing changes."""
    from torch.overrides import _get_current_function_mode

    hook = HOOKS[-1] if HOOKS else None
    if hook is None or _get_current_function_mode() is not hook:  # not ours on top: leave the stack as it is
        yield
        return
    hook.__exit__(None, None, None)
    try:
        yield
    finally:
        hook.__enter__()


@contextmanager
def own_products() -> Iterator[None]:
    """A stretch that sets its products' threads itself (attention/stages.py's `wide`), on a text of any length: a
    linear attention layer's call. Its other operations run on one thread (the recurrence and the exact matrix
    are thousands of small steps: docs/performance.md), its products on the threads torch had (the hook's in
    force where a short text's forward set one, else this stretch's), and no per-op hook runs inside."""
    with weights_on_all_threads(0), unhooked():  # 0 tokens: whatever the text's length
        yield
