"""A product with a weight over a short text, its output split by the weight's rows across threads.

A short text's products are skinny: `F.linear(x, W)` with `x` a few dozen rows and `W` millions of numbers. MKL's
own two-thread split of such a product gains little over one thread (on the 2-core machine of docs/performance.md,
`[73, 2048] x [2048, 8192]`: 41 GFLOPS on one thread, 52 on two), and under load its second thread waits for a
core while the first spins at the barrier. `linear_in_parts` hands each of `threads` Python threads its own slice
of W's rows (an equal share of the output's features), each product on one torch thread, and joins the slices:
torch releases the GIL inside the product, so the parts run side by side (every layer of the 1.1B LLaMA at 73
tokens: issue 44 goal 1, docs/performance.md). The forward's other operations already run on one thread
(weight_threads.py), so the parts never share a core with torch's own pool.

Each output number is one row of `x` against one row of `W`, summed by a one-thread product: what `F.linear`
gives on one thread, whatever the machine's core count (MKL's two-thread product gives the same bits where it
splits the output, as it does from a few dozen rows on; for a handful of rows it may split the sum and differ in
the last bits, about 5e-7 relative). Only where nothing asks for a gradient, on the CPU, and where a part is
worth a hand-off (`PARTS_FROM` multiply-adds in all); elsewhere it returns None and the caller runs the product as
it was.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import Tensor

PARTS_FROM = 1 << 23  # multiply-adds (rows of x times W's numbers): about 0.2 ms on one core, 50 µs a hand-off
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # by process and helper count; one torch thread each


def _pool(helpers: int) -> ThreadPoolExecutor:
    """The helper threads, made on first use in this process (a forked child holds its parent's pool without
    its threads: it makes its own)."""
    key = (os.getpid(), helpers)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(helpers, thread_name_prefix="attnscope-rows",
                                         initializer=torch.set_num_threads, initargs=(1,))
    return _POOLS[key]


def worth_parts(threads: int, input: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `F.linear(input, weight, bias)` goes in parts: more than one thread, a 2-D CPU weight of at least
    `threads` rows, one dtype, no gradient wanted, and enough work."""
    tensors = (input, weight) if bias is None else (input, weight, bias)
    if threads < 2 or weight.dim() != 2 or weight.shape[0] < threads or input.dim() == 0:
        return False
    if any(t.device.type != "cpu" or t.dtype != weight.dtype or t.is_sparse for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    rows = input.numel() // max(input.shape[-1], 1)
    return rows * weight.numel() >= PARTS_FROM


def linear_in_parts(threads: int, input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """`F.linear(input, weight, bias)` as `threads` products of a share of W's rows each, side by side on one
    torch thread apiece, joined along the last axis; None where `worth_parts` says no. Run where torch is set to
    one thread (weight_threads' hook): the caller's share runs on it."""
    if not worth_parts(threads, input, weight, bias):
        return None
    rows = weight.shape[0]
    bounds = [rows * i // threads for i in range(threads + 1)]

    def part(i: int) -> Tensor:
        a, b = bounds[i], bounds[i + 1]
        with torch.no_grad():  # a helper thread starts with gradients on; nothing here wants one
            return F.linear(input, weight[a:b], None if bias is None else bias[a:b])

    pool = _pool(threads - 1)
    futures = [pool.submit(part, i) for i in range(1, threads)]
    try:
        with torch._C.DisableTorchFunction():  # the caller's share as it is: no hook above it splits it again
            first = part(0)
    finally:
        parts = [future.result() for future in futures]  # every helper done before this returns or raises
    return torch.cat([first, *parts], dim=-1)
