"""tensors/size_threads.py: a long text's small operations on one thread, products with a matrix and operations on
BIG numbers on torch's threads; every result the same as on torch's threads (compared with the same calls made
outside it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnscope.tensors import size_threads
from attnscope.tensors.size_threads import BIG, small_ops_on_one_thread


@pytest.fixture(autouse=True)
def _threads_back():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _threads_seen(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    return seen


def test_which_operations_keep_the_threads(monkeypatch):
    torch.manual_seed(0)
    small, W = torch.randn(300, 64), torch.randn(128, 64)
    scores = torch.randn(9, 700, 700)  # >= BIG numbers
    Q, K = torch.randn(9, 700, 64), torch.randn(9, 64, 700)  # a product that makes >= BIG
    assert scores.numel() >= BIG and 9 * 700 * 700 >= BIG
    outside = (small.exp(), F.linear(small, W), scores.softmax(-1), Q @ K, torch.bmm(Q, K))
    torch.set_num_threads(2)
    seen = _threads_seen(monkeypatch)
    with small_ops_on_one_thread():
        assert torch.get_num_threads() == 1
        seen.clear()
        inside = [small.exp()]
        assert seen == []  # a small operation: one thread, nothing set
        for make in (lambda: F.linear(small, W), lambda: scores.softmax(-1), lambda: Q @ K, lambda: torch.bmm(Q, K)):
            seen.clear()
            inside.append(make())
            assert seen == [2, 1], make  # widened for the call, then one thread again
    assert torch.get_num_threads() == 2
    for a, b in zip(outside, inside, strict=True):
        assert torch.equal(a, b)


def test_off_or_on_one_thread_changes_nothing(monkeypatch):
    torch.set_num_threads(1)
    seen = _threads_seen(monkeypatch)
    with small_ops_on_one_thread():
        torch.randn(9, 700, 700).softmax(-1)
    with small_ops_on_one_thread(False):
        assert not isinstance(torch.overrides._get_current_function_mode(), size_threads._BySize)
    assert seen == [] and torch.get_num_threads() == 1
