"""A long text's forward with its small operations on one torch thread and its large ones on all.

`weights_on_all_threads` (weight_threads.py) puts a short text's small operations on one thread; a long text's
were left on torch's threads. Past a few hundred tokens most of a layer's operations are still small (an RMSNorm
or RoPE of `[1, 1,230, 576]`, the GGUF weights' expansion, the residual adds: under a million numbers each, some
forty a layer), and on a busy 2-CPU machine each waits for a second thread to get a core: SmolLM2's 30 layers at
1,230 tokens (`head --all-layers`, the terminal's view) took 80 s on torch's two threads at a load of 8, 34 s on
one (docs/performance.md, issue 44 goal 3). `small_ops_on_one_thread()` runs every operation on one thread except:

- a product with a matrix (a 2-D operand: F.linear, matmul, mm, addmm), which keeps the threads torch had, as in
  weight_threads.py: its sums are split by thread count, so its numbers stay what they are elsewhere;
- an operation on at least BIG numbers, or a product that makes at least BIG (the scores, the masked scores, the
  softmax and `attention @ V` of every head at once, `[n_head, n, n]`): there the threads share real work.

Every number stays what torch's threads give: besides the products with a matrix above, an operation's result
does not depend on the thread count for what runs here (elementwise operations, reductions along an axis of
rows, batched products: each product whole on one thread; weight_threads.py's checks). The terminal's output on
the benchmark's text is the same byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attnscope.tensors.threads import one_thread
from attnscope.tensors.weight_threads import PRODUCTS

BIG = 1 << 22  # numbers an operation reads or makes, at least, to run on every thread (4M: [9, 700, 700])
BATCHED = PRODUCTS | {torch.bmm, torch.Tensor.bmm, torch.baddbmm}


class _BySize(TorchFunctionMode):
    """Inside it torch runs on one thread; a product with a matrix, and an operation as large as BIG, on
    `threads`."""

    def __init__(self, threads: int) -> None:
        super().__init__()
        self.threads = threads

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not _wide(func, args, kwargs):
            return func(*args, **kwargs)
        torch.set_num_threads(self.threads)
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_num_threads(1)


def _wide(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(t.numel() >= BIG for t in tensors):
        return True
    if func not in BATCHED or len(tensors) < 2:
        return False
    if any(t.dim() == 2 for t in tensors):  # a product with a matrix: its threads, whatever its size
        return True
    a, b = tensors[-2], tensors[-1]
    return a.dim() >= 2 and b.dim() >= 2 and a.numel() // max(1, a.shape[-1]) * b.shape[-1] >= BIG  # the product


@contextmanager
def small_ops_on_one_thread(when: bool = True) -> Iterator[None]:
    """Where `when` holds (and torch has more than one thread): one thread inside the block but for the products
    with a matrix and the operations on at least BIG numbers, which keep torch's threads; restored after."""
    threads = torch.get_num_threads()
    if not when or threads == 1:
        yield
        return
    with one_thread(), _BySize(threads):
        yield
