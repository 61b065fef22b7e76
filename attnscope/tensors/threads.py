"""One torch thread for a stretch of small operations, then the count put back.

torch's intra-op thread count is process-wide. For operations too small to share (a decode step's
matrix-vector products, a linear layer's recurrence of thousands of small steps, the readings' and trace's
reruns of some thirty ops on a few hundred thousand numbers) a second thread only adds its hand-offs, and on a
busy 2-CPU machine it waits for a core: docs/performance.md measures each use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_thread(when: bool = True) -> Iterator[None]:
    """torch set to one intra-op thread inside the block where `when` holds (and it had more), restored after."""
    import torch

    threads = torch.get_num_threads()
    single = when and threads > 1
    if single:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if single:
            torch.set_num_threads(threads)
