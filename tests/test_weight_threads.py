"""tensors/weight_threads.py: a short text's forward on one torch thread but for its products with wide weights,
which keep torch's threads; the thread count put back after, and every number what it was."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SENTENCE, build
from torch.overrides import TorchFunctionMode

from attnscope.tensors import weight_threads
from attnscope.tensors.weight_threads import SHORT, weights_on_all_threads


@pytest.fixture()
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_and_put_back(two_threads) -> None:
    with weights_on_all_threads(SHORT):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with weights_on_all_threads(SHORT + 1):  # a longer pass is left as it is
        assert torch.get_num_threads() == 2
    with pytest.raises(ValueError), weights_on_all_threads(3):
        raise ValueError
    assert torch.get_num_threads() == 2


def test_matrix_products_keep_the_threads(two_threads, monkeypatch) -> None:
    seen: list[int] = []
    original = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), original(n)))
    x, weight = torch.randn(7, 256), torch.randn(1024, 256)  # below rowsplit's PARTS_FROM: one product
    outside = F.linear(x, weight), x @ weight.T, torch.mm(x, weight.T)
    with weights_on_all_threads(7):
        for product in (lambda: F.linear(x, weight), lambda: x @ weight.T, lambda: torch.mm(x, weight.T),
                        lambda: torch.nn.Linear(256, 64)(x), lambda: x[None] @ weight.T):
            seen.clear()
            product()
            assert seen == [2, 1]  # the product on torch's two threads, then back to one
        seen.clear()
        (x * 2).softmax(-1)
        torch.bmm(x[None], weight.T[None])  # a batch of products: the same numbers on any count
        x[None, None] @ weight.T[None, None]
        assert seen == []  # the rest stays on the one thread
        inside = F.linear(x, weight), x @ weight.T, torch.mm(x, weight.T)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))


def test_every_layer_numbers_unchanged(two_threads, tmp_path, monkeypatch, runner) -> None:
    from attnscope.cli import app

    build("llama", tmp_path)
    runs = {}
    for short in (SHORT, 0):  # 0: as before, every operation on torch's threads
        monkeypatch.setattr(weight_threads, "SHORT", short)
        for extra in ([], ["--all-layers"]):
            result = runner.invoke(app, ["head", "--model", str(tmp_path), "--layer", "1", "--head", "0", "--text",
                                         SENTENCE, "--json", *extra])
            assert result.exit_code == 0, result.stderr
            assert torch.get_num_threads() == 2
            runs[short, bool(extra)] = json.loads(result.stdout)
    for every in (False, True):
        assert runs[SHORT, every] == runs[0, every]  # the same numbers, every weight and reading
    assert len(runs[SHORT, True]["all_layers"]) == 3  # the tiny LLaMA's three layers


class _Products(TorchFunctionMode):
    """Below weights_on_all_threads' hook: the thread count each product with a matrix (a 2-D operand) runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in weight_threads.PRODUCTS and any(isinstance(a, torch.Tensor) and a.dim() == 2
                                                   for a in (*args, *kwargs.values())):
            self.threads.append(torch.get_num_threads())
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "deepseek_v32"])
def test_a_pages_attention_sets_its_products_threads_itself(two_threads, tmp_path, runner, family) -> None:
    """The traced attention runs without the per-op hook (weight_threads.unhooked: stages.wide sets the threads
    around its projections); every product with a matrix in the run still runs on torch's two threads."""
    from tiny_indexer import build as build_indexer
    from tiny_linear import build as build_linear

    from attnscope.cli import app

    if family == "llama":
        build("llama", tmp_path)
    elif family == "deepseek_v32":
        build_indexer(tmp_path, "v32")
    else:
        build_linear("qwen3_next", tmp_path)
    lifted = []
    original = weight_threads.unhooked

    def watched():
        lifted.append(torch.overrides._get_current_function_mode())
        return original()

    products = _Products()
    with pytest.MonkeyPatch.context() as patch:
        import attnscope.attention.indexer as indexer
        import attnscope.attention.latent as latent
        import attnscope.attention.multihead as multihead

        for module in (multihead, latent, indexer):
            patch.setattr(module, "unhooked", watched)
        with products:
            layer = "2" if family == "qwen3_next" else "1"  # Qwen3-Next's full layer
            result = runner.invoke(app, ["head", "--model", str(tmp_path), "--layer", layer, "--head", "0", "--text",
                                         SENTENCE])
    assert result.exit_code == 0, result.stderr
    assert any(isinstance(mode, weight_threads._WeightsWide) for mode in lifted)  # the hook was on top, lifted
    assert products.threads and set(products.threads) == {2}


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "minimax"])
@pytest.mark.parametrize("words", [4, 3 * SHORT])  # a short text under the forward's hook; a long one, no hook
def test_a_linear_layer_sets_its_threads_itself(two_threads, tmp_path, runner, monkeypatch, family, words) -> None:
    """A hybrid's linear layer runs its page's attend_linear under weight_threads.own_products: every product with
    a matrix (its projections through stages.wide, out_proj, and the rest of the run) on torch's two threads, its
    recurrence on one, whatever the text's length; the count put back after."""
    from tiny_linear import build as build_linear

    import attnscope.attention.linear_attention as linear_attention
    from attnscope.cli import app

    build_linear(family, tmp_path)
    recurrence_threads: list[int] = []
    original = linear_attention.recurrence

    def watched(*args, **kwargs):
        recurrence_threads.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_attention, "recurrence", watched)
    products = _Products()
    with products:
        result = runner.invoke(app, ["head", "--model", str(tmp_path), "--layer", "0", "--head", "0", "--text",
                                     " ".join(["the cat sat on the mat"] * (words // 6 + 1))])
    assert result.exit_code == 0, result.stderr
    assert torch.get_num_threads() == 2
    assert recurrence_threads and set(recurrence_threads) == {1}
    assert products.threads and set(products.threads) == {2}
