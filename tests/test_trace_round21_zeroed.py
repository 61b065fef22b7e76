"""`attnscope trace` keeps the code's own zeroing of masked weights after its softmax when it reruns a softmax over
another axis (round 21's ESPnet RelPositionMultiHeadedAttention: `torch.softmax(scores, -1).masked_fill(mask, 0.0)`,
a convention). With the softmax planted over the queries, the cause was named in words but 'not by experiment': the
softmax.axis rerun left the padded keys' columns as its softmax made them (uniform over the queries, or NaN), where
the code sets them to 0. Styles of our own (tests/trace_styles_round21_zeroed.py), each checked against
F.scaled_dot_product_attention in float64, each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round21_zeroed.py")
styles = user_module(STYLES)


def _pad() -> torch.Tensor:
    """[n_batch, n_K] True = a real key: the first sequence's last two keys padding."""
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, 4:] = False
    return pad


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.view(2, 6, h, -1).transpose(1, 2)


def _merged(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(2, 6, -1)


def _made(cls, bug: str = "") -> torch.nn.Module:
    return cls(bug=bug).double().eval()


def test_the_styles_are_attention():
    pad, keys = _pad(), _pad()[:, None, None, :]
    x, y = torch.randn(2, 6, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    m = _made(styles.EspStyle)
    q, k, v = _heads(m.linear_q(x), 4), _heads(m.linear_k(y), 4), _heads(m.linear_v(y), 4)
    want = m.linear_out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keys)))
    assert torch.allclose(m(x, y, y, pad[:, None, :]), want, atol=1e-10)
    assert (_made(styles.EspStyle, "softmax_axis")(x, y, y, pad[:, None, :]) - want).abs().max() > 1e-3

    z = torch.randn(2, 6, 24, dtype=torch.float64)
    m = _made(styles.WenetStyle)
    q, k, v = (_heads(t, 3) for t in m.to_qkv(z).chunk(3, -1))
    want = m.out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keys)))
    assert torch.allclose(m(z, pad[:, None, :]), want, atol=1e-10)
    for bug in ("softmax_axis", "no_scale"):
        assert (_made(styles.WenetStyle, bug)(z, pad[:, None, :]) - want).abs().max() > 1e-3, bug

    m = _made(styles.ZeroedPadding)
    q, k, v = (_heads(w(x), 4) for w in (m.wq, m.wk, m.wv))
    want = m.wo(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keys)))
    assert torch.allclose(m(x, pad), want, atol=1e-10)
    assert (_made(styles.ZeroedPadding, "softmax_axis")(x, pad) - want).abs().max() > 1e-3


@pytest.fixture()
def pad_file(tmp_path):
    np.save(tmp_path / "pad.npy", _pad().numpy())
    return str(tmp_path / "pad.npy")


CASES = [("EspStyle", ""), ("WenetStyle", ""), ("ZeroedPadding", "")]


@pytest.mark.parametrize(("name", "bug"), CASES, ids=case_ids(CASES))
def test_weights_zeroed_after_the_softmax_pass(runner, pad_file, name, bug):
    assert_passes(*run_case(runner, STYLES, name, None, ("--mask", pad_file, "--batch", "2", "--nq", "6")))


PLANTS = [("EspStyle", "softmax_axis", "softmax.axis"),
          ("WenetStyle", "softmax_axis", "softmax.axis"),
          ("WenetStyle", "no_scale", "scale.none"),
          ("ZeroedPadding", "softmax_axis", "softmax.axis")]


@pytest.mark.parametrize(("name", "bug", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_plants_before_the_zeroing_are_named_by_experiment(runner, pad_file, name, bug, cause):
    found = assert_named(*run_case(runner, STYLES, name, f"bug={bug!r}",
                                   ("--mask", pad_file, "--batch", "2", "--nq", "6")), cause)
    assert "line" in found["evidence"], found

