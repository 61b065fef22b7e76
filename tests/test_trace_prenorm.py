"""`attnscope trace` on modules that normalize their input before their projections read it (usertrace/prenorm.py):
the normed tensor is the reference's input, a note says so, and mistakes after it are named by experiment
(tests/trace_styles_prenorm.py; each style checked against F.scaled_dot_product_attention in float64, each bug
shown to change the output)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_prenorm.py")
styles = user_module(STYLES)


def _moved(module):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4 + (1.0 if p.dim() == 1 else 0.0))
    return module.double()


def _heads(t, h=3):
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)


def test_the_styles_are_sdpa_on_the_normed_input_and_the_bugs_change_them():
    g = torch.Generator().manual_seed(0)
    x, context = torch.randn(2, 5, 24, generator=g, dtype=torch.float64), torch.randn(
        2, 7, 16, generator=g, dtype=torch.float64)
    m = _moved(styles.FusedPreNorm())
    q, k, v = (_heads(t) for t in m.to_qkv(F.layer_norm(x, (24,), m.norm.weight, m.norm.bias)).chunk(3, dim=-1))
    want = m.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("no_scale", "softmax_dim"):
        wrong = styles.FusedPreNorm(bug=bug).double()
        wrong.load_state_dict(m.state_dict())
        assert not torch.allclose(wrong(x), want, atol=1e-3), bug

    s = _moved(styles.SeparateRMS())
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * s.pre.weight
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    want = s.wo(F.scaled_dot_product_attention(_heads(s.wq(h)), _heads(s.wk(h)), _heads(s.wv(h)), attn_mask=causal)
                .transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(s(x, causal), want, atol=1e-10)
    wrong = styles.SeparateRMS(bug="values_from_keys").double()
    wrong.load_state_dict(s.state_dict())
    assert not torch.allclose(wrong(x, causal), want, atol=1e-3)

    c = _moved(styles.NormedCross())
    q = _heads(c.to_q(F.layer_norm(x, (24,), c.norm.weight, c.norm.bias)))
    k, v = (_heads(t) for t in c.to_kv(F.layer_norm(context, (16,), c.norm_context.weight, c.norm_context.bias))
            .chunk(2, dim=-1))
    want = c.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(c(x, context), want, atol=1e-10)
    wrong = styles.NormedCross(bug="twice").double()
    wrong.load_state_dict(c.state_dict())
    assert not torch.allclose(wrong(x, context), want, atol=1e-3)


RIGHT = [("FusedPreNorm", ()), ("SeparateRMS", ("--causal",)), ("NormedCross", ("--nk", "7"))]
WRONG = [("FusedPreNorm", "no_scale", (), "scale.none"), ("FusedPreNorm", "softmax_dim", (), "softmax.axis"),
         ("SeparateRMS", "values_from_keys", ("--causal",), "kv.values_from_keys"),
         ("NormedCross", "twice", ("--nk", "7"), "scale.d_head")]


@pytest.mark.parametrize(("name", "args"), RIGHT, ids=[r[0] for r in RIGHT])
def test_a_norm_before_the_projections_is_the_input_side(runner, name, args):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("your module normalizes its input before its projections read it") for n in out["notes"])


@pytest.mark.parametrize(("name", "bug", "args", "experiment"), WRONG, ids=[f"{w[0]}-{w[1]}" for w in WRONG])
def test_mistakes_after_the_norm_are_named(runner, name, bug, args, experiment):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == experiment, out["first_divergence"]
