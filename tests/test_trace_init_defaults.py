"""`attnscope trace` reads what a module declares from the defaults of its __init__'s parameters, and its parents'
where it hands them **kwargs (runs/trace_setup._init_defaults): round 15a's gemma_pytorch wrapper, scaled by its
default query_pre_attn_scalar ** -0.5 and run without --scale, was called `scale.other` on correct code.

Each correct style is checked apart from attnscope against a float64 formula and exits 0; each planted bug changes
the output and is named by experiment. Styles: tests/trace_styles_init_defaults.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_init_defaults.py")
styles = user_module(STYLES)

CORRECT = [("PreScaled", None, ("--causal",)), ("PreScaledWrapper", None, ("--causal",)),
           ("PreScaledWrapper", "dropout=0.1", ("--causal",)), ("CappedRotary", None, ("--causal", "--rope"))]
PLANTED = [
    ("PreScaled", "bug='d_head'", ("--causal",), "scale.none"),
    ("PreScaledWrapper", "bug='d_head'", ("--causal",), "scale.none"),
    ("CappedRotary", "bug='default_base'", ("--causal", "--rope"), "rope.base"),
    ("CappedRotary", "bug='no_softcap'", ("--causal", "--rope"), "softcap.missing"),
]


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass(runner, target, init, options):
    assert_passes(*run_case(runner, STYLES, target, init, options))


@pytest.mark.parametrize(("target", "init", "options", "entry"), PLANTED, ids=case_ids(PLANTED))
def test_planted_bugs_named_by_experiment(runner, target, init, options, entry):
    assert_named(*run_case(runner, STYLES, target, init, options), entry)


def test_the_defaults_read_are_said(runner):
    _, out = run_case(runner, STYLES, "PreScaledWrapper", None, ("--causal",))
    assert any("query_pre_attn_scalar = 12" in n for n in out["notes"]), out["notes"]
    _, out = run_case(runner, STYLES, "CappedRotary", None, ("--causal", "--rope"))
    said = " ".join(out["notes"])
    assert "RoPE base 500000" in said and "softcap 20, read from your module" in said, out["notes"]
    # --init's value wins
    _, out = run_case(runner, STYLES, "PreScaled", "query_pre_attn_scalar=24", ("--causal",))
    assert any("query_pre_attn_scalar = 24" in n for n in out["notes"]), out["notes"]


# --- the styles checked apart from attnscope ----------------------------------------------------------------


def _attend(q, k, v, scale, cap=None):
    s = (q @ k.transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap) if cap else s
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def _rope64(t, base):
    n, d = t.shape[-2], t.shape[-1]
    angle = torch.outer(torch.arange(n, dtype=torch.float64), base ** (-torch.arange(0, d, 2).double() / d))
    t1, t2 = t[..., : d // 2], t[..., d // 2:]
    return torch.cat([t1 * angle.cos() - t2 * angle.sin(), t2 * angle.cos() + t1 * angle.sin()], -1)


def test_styles_are_the_formula_in_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        for cls in (styles.PreScaled, styles.PreScaledWrapper):
            m = cls().double().eval()
            q, k, v = (t.view(2, 5, 4, 8).transpose(1, 2) for t in (x @ m.qkv_proj.weight.T + m.qkv_proj.bias)
                       .split(32, -1))
            want = m.o_proj(_attend(q, k, v, 12 ** -0.5).transpose(1, 2).reshape(2, 5, 32))
            torch.testing.assert_close(m(x), want, atol=1e-6, rtol=1e-5)  # its softmax runs in float32
            assert not torch.allclose(cls(bug="d_head").double().eval()(x), m(x))
        m = styles.CappedRotary().double().eval()
        q, k, v = (f(x).view(2, 5, 2, 16).transpose(1, 2) for f in (m.to_q, m.to_k, m.to_v))
        want = m.to_out(_attend(_rope64(q, 5e5), _rope64(k, 5e5), v, 16 ** -0.5, cap=20.0)
                        .transpose(1, 2).reshape(2, 5, 32))
        torch.testing.assert_close(m(x), want)
        for bug in ("default_base", "no_softcap"):
            planted = styles.CappedRotary(bug=bug).double().eval()
            planted.load_state_dict(m.state_dict())
            assert not torch.allclose(planted(x), want)
