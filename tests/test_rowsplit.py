"""tensors/rowsplit.py: a short text's product with a weight as parts of the weight's rows, side by side on one
torch thread each, against F.linear and a float64 product; where it steps aside; and a whole run's numbers."""

from __future__ import annotations

import json
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from test_weight_threads import two_threads  # noqa: F401  (the fixture: torch on two threads)
from tiny_models import SENTENCE, build

from attnscope.attention import stages
from attnscope.tensors import rowsplit
from attnscope.tensors.rowsplit import linear_in_parts, worth_parts
from attnscope.tensors.weight_threads import unhooked, weights_on_all_threads

pytestmark = pytest.mark.usefixtures("two_threads")  # torch on two threads in every test, put back after


def _float64(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _threads_seen(monkeypatch) -> list[int]:
    """Patch rowsplit's F.linear to note the Python thread each part runs on."""
    seen: list[int] = []

    def linear(*args, **kwargs):
        seen.append(threading.get_ident())
        return F.linear(*args, **kwargs)

    monkeypatch.setattr(rowsplit, "F", types.SimpleNamespace(linear=linear))
    return seen


@pytest.mark.parametrize("shape", [(7, 1024), (2, 5, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_parts_side_by_side_match_the_product(monkeypatch, shape, with_bias) -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(*shape), torch.randn(4097, 1024) / 32  # an odd count of rows: unequal parts
    bias = torch.randn(4097) if with_bias else None
    outside = F.linear(x, weight, bias)
    seen = _threads_seen(monkeypatch)
    calls: list[int] = []
    original = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), original(n)))
    with weights_on_all_threads(7):
        inside = F.linear(x, weight, bias)
        assert 2 not in calls  # torch never set to two threads inside: the parts run on one torch thread each
    assert len(seen) == 2 and len(set(seen)) == 2  # two parts, on two Python threads
    assert inside.shape == outside.shape and inside.is_contiguous()
    torch.testing.assert_close(inside, outside, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(inside.double(), _float64(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_stages_wide_splits_a_plain_linear(monkeypatch) -> None:
    torch.manual_seed(1)
    layer = torch.nn.Linear(1024, 2048)
    x = torch.randn(1, 9, 1024)
    with torch.no_grad():
        outside = layer(x)
        seen = _threads_seen(monkeypatch)
        with weights_on_all_threads(9), unhooked():  # as a page's attention calls it
            inside = stages.wide(layer, x)
            functional = stages.wide(F.linear, x, layer.weight, layer.bias)
    assert len(set(seen)) == 2 and len(seen) == 4  # two products of two parts
    torch.testing.assert_close(inside, outside, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(functional, outside, rtol=1e-6, atol=1e-5)


def test_a_linear_with_hooks_or_its_own_forward_runs_whole(monkeypatch) -> None:
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    hooked = torch.nn.Linear(1024, 2048)
    called = []
    hooked.register_forward_hook(lambda *args: called.append(True))
    x = torch.randn(1, 9, 1024)
    seen = _threads_seen(monkeypatch)
    with torch.no_grad(), weights_on_all_threads(9), unhooked():
        stages.wide(hooked, x)
        stages.wide(Scaled(1024, 2048), x)
    assert called == [True] and seen == []


def test_where_it_steps_aside() -> None:
    x, weight = torch.randn(7, 1024), torch.randn(4096, 1024)
    assert worth_parts(2, x, weight, None)
    assert not worth_parts(1, x, weight, None)  # one thread: nothing to split
    assert not worth_parts(2, x[:1, :16], weight[:16, :16], None)  # too little work for a hand-off
    assert not worth_parts(2, x.double(), weight, None)  # mixed dtypes: F.linear's own error, whole
    assert not worth_parts(2, x, weight.to("meta"), None)  # not on the CPU
    assert not worth_parts(2, x, weight[0], None)  # a 1-D weight
    assert not worth_parts(8, x, weight[:4], None)  # fewer rows than threads
    wanting = weight.clone().requires_grad_()
    assert not worth_parts(2, x, wanting, None)  # a gradient asked: autograd sees the one product
    with torch.no_grad():
        assert worth_parts(2, x, wanting, None)
    assert linear_in_parts(1, x, weight) is None


def test_an_error_in_the_parts_is_raised_and_the_pool_still_works() -> None:
    x, weight = torch.randn(7, 1000), torch.randn(4096, 1024)  # widths that do not agree
    with pytest.raises(RuntimeError):
        linear_in_parts(2, x, weight)
    x = torch.randn(7, 1024)
    torch.testing.assert_close(linear_in_parts(2, x, weight), F.linear(x, weight), rtol=1e-6, atol=1e-4)


@fuzz_settings(25)  # ATTNSCOPE_FUZZ_EXAMPLES=N for a long run
@given(rows=st.integers(1, 9), d_in=st.integers(1, 70), d_out=st.integers(1, 90), threads=st.integers(2, 5),
       with_bias=st.booleans(), batch=st.booleans())
def test_any_shape_in_parts_is_the_product(rows, d_in, d_out, threads, with_bias, batch) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + d_in * 10 + d_out)
    x = torch.randn((2, rows, d_in) if batch else (rows, d_in), generator=generator)
    weight = torch.randn(d_out, d_in, generator=generator)
    bias = torch.randn(d_out, generator=generator) if with_bias else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rowsplit, "PARTS_FROM", 0)
        got = linear_in_parts(threads, x, weight, bias)
    if d_out < threads:
        assert got is None
        return
    assert got is not None and got.shape == F.linear(x, weight, bias).shape
    torch.testing.assert_close(got.double(), _float64(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_every_layer_in_parts_keeps_its_numbers(tmp_path, monkeypatch, runner) -> None:
    """A tiny LLaMA's every product in parts (PARTS_FROM 0) against the same run with none split: every layer's
    pattern and readings agree to float32's rounding (bit for bit where the one-thread sums are torch's own)."""
    from attnscope.cli import app

    build("llama", tmp_path)
    runs = {}
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(rowsplit, "PARTS_FROM", threshold)
        result = runner.invoke(app, ["head", "--model", str(tmp_path), "--layer", "1", "--head", "0", "--text",
                                     SENTENCE, "--json", "--all-layers"])
        assert result.exit_code == 0, result.stderr
        assert torch.get_num_threads() == 2
        runs[threshold] = json.loads(result.stdout)
    split, whole = runs[0], runs[1 << 62]
    assert len(split["all_layers"]) == len(whole["all_layers"]) == 3
    for a, b in zip(split["all_layers"], whole["all_layers"], strict=True):
        torch.testing.assert_close(torch.tensor(a["attention"]), torch.tensor(b["attention"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(split["attention"]), torch.tensor(whole["attention"]), rtol=0,
                               atol=1e-6)


def test_a_forked_child_makes_its_own_helpers() -> None:
    """A child forked after the pool was made holds the pool's object but not its threads: it makes its own."""
    import multiprocessing

    x, weight = torch.randn(7, 1024), torch.randn(4096, 1024)
    linear_in_parts(2, x, weight)  # the parent's pool made
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        got = pool.apply_async(_in_child, (x, weight)).get(timeout=60)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-6, atol=1e-4)


def _in_child(x, weight):
    torch.set_num_threads(1)
    return linear_in_parts(2, x, weight)
