"""`attnscope trace` where ALiBi is added inside the op that makes the scores (tests/trace_styles_round6_d.py):
BLOOM's `baddbmm(bias, q, kᵀ, beta=1, alpha=1/√d)`, one `addmm` per head stacked, `bias + q @ kᵀ * scale`.

The unbiased scores never exist as a tensor there: the scores step is `unseen` (never paired with the op that adds
the bias, nor with a later tensor), the divergence is at the biased (or masked) scores, and the experiments compare
their runs with the tensors that do exist, a constant per query row being a convention (BLOOM's `m_h · j`, MPT's
`m_h · (j − n + 1)`, the paper's `−m_h · (i − j)` all pass). ALiBi's sign and slopes, and the mask's polarity, are
named by experiment, and the slopes printed are the code's (never the fit shifted by ALiBi's own).

Each style is checked apart from attnscope against a float64 formula holding its weights, and each planted bug
changes its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_columns_weights import ALIGNED
from test_trace_command import user_module
from tracecases import run_case

from attnscope.usertrace.align import adds_a_bias
from attnscope.usertrace.record import Record

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round6_d.py")
styles = user_module(STYLES)
NAMES = ("FusedAlibi", "AddmmAlibi", "SummedAlibi")
BUGS = {"alibi_sign": ("alibi.sign", "biased_scores"), "slopes_from_0": ("alibi.slopes", "biased_scores"),
        "mask_polarity": ("mask.polarity", "masked_scores")}


def _run(runner, target: str, bug: str | None) -> tuple[int, dict]:
    return run_case(runner, STYLES, target, "bug=None" if bug is None else f"bug='{bug}'", ("--causal", "--alibi"))


@pytest.mark.parametrize("target", NAMES)
def test_fused_bias_lines_up(runner, target):
    code, out = _run(runner, target, None)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]


@pytest.mark.parametrize("bug", sorted(BUGS))
@pytest.mark.parametrize("target", NAMES)
def test_fused_bias_bugs_named_by_experiment(runner, target, bug):
    entry, step = BUGS[bug]
    code, out = _run(runner, target, bug)
    assert code == 1, out
    found = out["first_divergence"]
    assert found["experiment"] == entry, found
    assert found["reference"] == step, found
    # the scores before the bias are never paired with the op that adds it, nor with a later tensor
    scores = next(row for row in out["alignment"] if row["reference"] == "scores")
    assert scores["status"] in ("unseen", *ALIGNED), scores
    assert "adds no position bias" not in found["diagnosis"]
    if bug == "slopes_from_0":
        assert "slopes 1, 0.25, 0.0625, 0.01562" in found["diagnosis"], found["diagnosis"]
        assert "1.25" not in found["diagnosis"]


def test_slopes_printed_are_the_codes(runner):
    code, out = _run(runner, "FusedAlibi", "slopes_tripled")
    assert code == 1
    found = out["first_divergence"]
    assert found["experiment"] == "alibi.slopes", found
    assert "0.75, 0.1875, 0.04688, 0.01172" in found["diagnosis"], found["diagnosis"]


def _formula(module, x: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    """The paper's ALiBi in float64 from the module's weights: softmax(q kᵀ/√d − m_h (i − j), causal) v."""
    b, n, d = x.shape
    h, dh = module.n_head, module.d_head
    x = x.double()

    def lin(layer: torch.nn.Linear) -> torch.Tensor:
        out = x @ layer.weight.double().T
        return out + layer.bias.double() if layer.bias is not None else out

    if isinstance(module, styles.FusedAlibi):
        qkv = lin(module.fused).view(b, n, h, 3, dh)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        out_layer = module.proj
    elif isinstance(module, styles.AddmmAlibi):
        q, k, v = (lin(p).view(b, n, h, dh).transpose(1, 2) for p in (module.q_proj, module.k_proj, module.v_proj))
        out_layer = module.o_proj
    else:
        q, k, v = (t.reshape(b, n, h, dh).transpose(1, 2) for t in lin(module.to_qkv).chunk(3, -1))
        out_layer = module.to_out
    m = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float64).view(1, h, 1, 1)
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    scores = q @ k.transpose(-1, -2) / dh ** 0.5 - m * (i - j)
    scores = scores.masked_fill(j > i, float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
    return y @ out_layer.weight.double().T + out_layer.bias.double()


@pytest.mark.parametrize("target", NAMES)
def test_styles_against_float64_formula(target):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    cls = getattr(styles, target)
    module = cls()
    with torch.no_grad():
        torch.testing.assert_close(module(x).double(), _formula(module, x), atol=1e-5, rtol=1e-5)
        for bug in (*BUGS, "slopes_tripled"):
            buggy = cls(bug=bug)
            buggy.load_state_dict(module.state_dict())
            assert not torch.allclose(buggy(x), module(x), atol=1e-4), bug


def _record(func: str, *args: tuple[str, object]) -> Record:
    return Record(0, func, func, torch.zeros(1), 1, list(args), "function", True, 0, ())


def test_adds_a_bias():
    assert adds_a_bias(_record("baddbmm", ("rec", 1), ("text", "beta=1"), ("text", "alpha=0.25")))
    assert adds_a_bias(_record("addmm", ("rec", 1), ("rec", 2), ("rec", 3)))
    assert not adds_a_bias(_record("baddbmm", ("rec", 1), ("text", "beta=0"), ("text", "alpha=0.25")))
    assert not adds_a_bias(_record("matmul", ("rec", 1), ("rec", 2)))
