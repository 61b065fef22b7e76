"""`attnscope trace` on what held-out round 5 found (tests/trace_styles_round6_c.py):

- a rotary fraction read from the rotated tensors after a per-head qk-norm is kept whatever diverges later (RoPE on
  the values, no scale, the softmax's axis), not lost to "RoPE is never applied";
- the rotary share a config says (GPT-J's rotary_dim, transformers' partial_rotary_factor), even one the module
  does not keep, is the reference's: code rotating the whole head is `rope.fraction` by experiment;
- dropout left on in a function returning (out, weights) is `dropout.left_on` by experiment.

Each style is checked apart from attnscope against a float64 formula or F.scaled_dot_product_attention holding its
weights, and each planted bug changes its output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round6_c.py")
styles = user_module(STYLES)


def _turn(x: torch.Tensor, width: int, base: float, interleaved: bool) -> torch.Tensor:
    """RoPE on the first `width` coordinates of each head, in float64, written apart from the styles' code."""
    n = x.shape[-2]
    inv = base ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv  # [n, width / 2]
    part, rest = x[..., :width], x[..., width:]
    if interleaved:
        z = torch.view_as_complex(part.reshape(*part.shape[:-1], -1, 2).contiguous())
        turned = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
    else:
        a, b = part.chunk(2, dim=-1)
        c, s = ang.cos(), ang.sin()
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned, rest), dim=-1)


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, n, d = x.shape
    return x.view(b, n, h, d // h).transpose(1, 2)


def _normed_partial_f64(m, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    lin = lambda layer, t: F.linear(t, layer.weight.double(), layer.bias.double())  # noqa: E731
    norm = lambda layer, t: F.layer_norm(t, (m.hd,), layer.weight.double(), layer.bias.double(), layer.eps)  # noqa: E731
    q = norm(m.qn, _heads(lin(m.wq, x), m.nh).transpose(1, 2)).transpose(1, 2)
    k = norm(m.kn, _heads(lin(m.wk, x), m.nh).transpose(1, 2)).transpose(1, 2)
    v = _heads(lin(m.wv, x), m.nh)
    q, k = (_turn(t, m.turned, m.cfg.rope_theta, False) for t in (q, k))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return lin(m.proj, y.transpose(1, 2).flatten(-2))


def _config_width_f64(m, x: torch.Tensor, width: int) -> torch.Tensor:
    x = x.double()
    q, k, v = (_heads(t, m.h) for t in F.linear(x, m.to_qkv.weight.double()).chunk(3, dim=-1))
    q, k = (_turn(t, width, 10000.0, True) for t in (q, k))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(y.transpose(1, 2).flatten(-2), m.to_out.weight.double())


def _first(out: dict) -> tuple | None:
    found = out["first_divergence"]
    return None if found is None else (found["reference"], found["experiment"])


# --- a rotary fraction read after a per-head qk-norm, kept through a later bug -----------------------------------

NORMED = ("--rope", "--qk-norm", "head", "--causal")


def test_normed_partial_rotary_is_the_formula():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 48)
    m = styles.NormedPartialRotary(styles.NormedPartialConfig()).eval()
    with torch.no_grad():
        assert torch.allclose(m(x).double(), _normed_partial_f64(m, x), atol=1e-5)
        assert not torch.allclose(m.qn.weight, torch.ones_like(m.qn.weight))  # off init
        for bug in ("rope_on_v", "scale_none", "axis"):
            torch.manual_seed(0)
            planted = styles.NormedPartialRotary(styles.NormedPartialConfig(), bug=bug).eval()
            assert not torch.allclose(planted(x), m(x), atol=1e-4), bug


def _fraction_note(out: dict) -> str:
    return next(n for n in out["notes"] if "rotary fraction of 0.25" in n)


def test_normed_partial_rotary_lines_up(runner):
    result, out = trace(runner, f"{STYLES}:NormedPartialRotary", "--init", "cfg=NormedPartialConfig()", *NORMED)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None
    assert {row["status"] for row in out["alignment"]} <= ALIGNED
    assert "every step lines up" in _fraction_note(out)


@pytest.mark.parametrize(("bug", "step", "entry"), [
    ("rope_on_v", "V_split", "rope.on_values"),  # said at the rotated v (lined.shown_earlier)
    ("scale_none", "scores", "scale.none"),
    ("axis", "attention", "softmax.axis"),
])
def test_a_later_bug_keeps_the_fraction_read_before_it(runner, bug, step, entry):
    result, out = trace(runner, f"{STYLES}:NormedPartialRotary", "--init", f"cfg=NormedPartialConfig(), bug='{bug}'",
                        *NORMED)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert _first(out) == (step, entry)
    assert "the divergence below is another matter" in _fraction_note(out)
    assert "never applied" not in out["first_divergence"]["diagnosis"]


# --- the rotary share a config says ----------------------------------------------------------------------------

CONFIGS = [("config=WidthConfig()", 4), ("config={'d_model': 48, 'n_heads': 3, 'partial_rotary_factor': 0.5}", 8)]


@pytest.mark.parametrize(("init", "width"), CONFIGS)
def test_config_width_rotary_is_the_formula(init, width):
    config = styles.WidthConfig() if "WidthConfig" in init else {"d_model": 48, "n_heads": 3,
                                                                  "partial_rotary_factor": 0.5}
    torch.manual_seed(0)
    x = torch.randn(2, 6, 48)
    m = styles.ConfigWidthRotary(config).eval()
    all_turned = styles.ConfigWidthRotary(config, bug="rotate_all").eval()
    with torch.no_grad():
        assert torch.allclose(m(x).double(), _config_width_f64(m, x, width), atol=1e-5)
        assert torch.allclose(all_turned(x).double(), _config_width_f64(all_turned, x, 16), atol=1e-5)
        assert not torch.allclose(all_turned(x).double(), _config_width_f64(all_turned, x, width), atol=1e-4)


@pytest.mark.parametrize(("init", "width"), CONFIGS)
def test_the_configs_rotary_share_lines_up(runner, init, width):
    result, out = trace(runner, f"{STYLES}:ConfigWidthRotary", "--init", init, "--rope", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None
    assert f"{width / 16:g} of each head" in out["reference"]


@pytest.mark.parametrize(("init", "width"), CONFIGS)
def test_rotating_more_than_the_config_says_is_named_by_experiment(runner, init, width):
    result, out = trace(runner, f"{STYLES}:ConfigWidthRotary", "--init", f"{init}, bug='rotate_all'", "--rope",
                        "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert _first(out) == ("Q_rot", "rope.fraction")
    assert f"only the first {width} turn" in out["first_divergence"]["diagnosis"]


def test_the_share_a_config_says_is_read_by_name():
    from attnscope.usertrace.conventions import own_fraction

    m = styles.ConfigWidthRotary(styles.WidthConfig(), bug="rotate_all")
    assert own_fraction(m, 16) is None  # the module keeps no config
    assert own_fraction(m, 16, {"config": styles.WidthConfig()}) == 0.25
    assert own_fraction(m, 16, {"config": {"rotary_pct": 1.0}}) is None  # the whole head: no fraction
    assert own_fraction(m, 16, {"a": {"rotary_dim": 4}, "b": {"partial_rotary_factor": 0.5}}) is None  # disagree


# --- dropout left on in a function returning (out, weights) ------------------------------------------------------

FN = ("--heads", "4", "--dk", "8", "--dv", "8", "--causal")


def test_attend_pair_is_sdpa():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out, weights = styles.attend_pair(q, k, v, mask)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 5))
    torch.manual_seed(2)
    dropped, _ = styles.attend_pair_dropout(q, k, v, mask)
    assert not torch.allclose(dropped, out, atol=1e-4)
    assert math.isclose(float(q.shape[-1]) ** -0.5, 1 / math.sqrt(8))


def test_attend_pair_lines_up(runner):
    result, out = trace(runner, f"{STYLES}:attend_pair", *FN)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None


def test_dropout_in_a_function_is_named_by_experiment(runner):
    result, out = trace(runner, f"{STYLES}:attend_pair_dropout", *FN)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert _first(out) == ("attention", "dropout.left_on")  # at the dropped weights (line 131), not the output
    assert out["first_divergence"]["evidence"].startswith("by experiment")
    text = json.dumps(out)  # a function has no eval(): the message says trace runs it for inference
    assert "runs your function for inference" in text and "eval() mode" not in text
