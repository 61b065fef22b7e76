"""RoPE at any base: the base a code rotates with is read from its own rotated queries (each pair's angle at each
position, inv_freq_i = base^(−2i/d) solved for the base: roperead.code_base, ropefreqs.base_from), so a base that
differs from the one the module (or --rope-base) says is named rope.base by experiment whatever it is, and a module
whose unusual base is its own passes. Before, rope.base tried a fixed list of bases (10000, 500000, ...): HF Llama's
dynamic-NTK base used unasked (62996), Meta's precompute_freqs_cis given its arguments in the wrong order (base 96)
and GPT-J's base read from the wrong config field (2048) were 'not by experiment' guesses or 'rotated, but not as the
reference rotates it'. Styles of our own (tests/trace_styles_round24_ropebase.py), each checked against
F.scaled_dot_product_attention in float64 with RoPE as complex products at the base its config says."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round24_ropebase.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor, base: float, interleaved: bool) -> torch.Tensor:
    """x [b, h, n, d] turned as complex pairs, pair i by position · base^(−2i/d), float64."""
    x = x.double()
    d, n = x.shape[-1], x.shape[-2]
    pairs = x.unflatten(-1, (-1, 2)) if interleaved else torch.stack((x[..., : d // 2], x[..., d // 2:]), -1)
    turn = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                       torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2) / d))
    out = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
    return out.flatten(-2) if interleaved else torch.cat((out[..., 0], out[..., 1]), -1)


def _attend(x, wq, wk, wv, wo, h, kvh, base, interleaved, bq=None, bk=None, bv=None):
    b, n, _ = x.shape
    q, k, v = (F.linear(x, w, bias).view(b, n, -1, wq.shape[0] // h).transpose(1, 2)
               for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    q, k = _rope(q, base, interleaved), _rope(k, base, interleaved)
    k, v = k.repeat_interleave(h // kvh, 1), v.double().repeat_interleave(h // kvh, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(b, n, -1), wo.double())


def _weights(*linears):
    return [t.detach().double() for m in linears for t in (m.weight,)]


def test_each_style_is_rope_attention_at_its_configs_base():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.HFLlama()
    want = _attend(x, *_weights(m.q_proj, m.k_proj, m.v_proj, m.o_proj), 4, 2, 25000.0, False,
                   *(p.bias.detach().double() for p in (m.q_proj, m.k_proj, m.v_proj)))
    torch.testing.assert_close(m.double()(x), want, atol=2e-5, rtol=1e-4)
    m = styles.MetaLlama()
    want = _attend(x, *_weights(m.wq, m.wk, m.wv, m.wo), 4, 4, 123456.0, True)
    torch.testing.assert_close(m.double()(x), want, atol=2e-5, rtol=1e-4)
    m = styles.GPTJ()
    want = _attend(x, *_weights(m.q_proj, m.k_proj, m.v_proj, m.out_proj), 4, 4, 70000.0, True)
    torch.testing.assert_close(m.double()(x), want, atol=2e-5, rtol=1e-4)
    q, k, v = (torch.randn(2, 4, 7, 8, dtype=torch.float64) for _ in range(3))
    base = 10000.0 * 3.0 ** (8 / 6)
    want = F.scaled_dot_product_attention(_rope(q, base, False), _rope(k, base, False), v)
    torch.testing.assert_close(styles.ntk_attention(q, k, v), want)


PLANTS = [("HFLlama", "ntk", 62996.05), ("HFLlama", "scaled_twice", 50000), ("MetaLlama", "arg_order", 96),
          ("GPTJ", "field", 2048)]


def test_each_plant_changes_the_output():
    torch.manual_seed(1)
    x = torch.randn(2, 7, 32)
    for target, bug, _ in PLANTS:
        cls = getattr(styles, target)
        right, wrong = cls(), cls(bug=bug)
        wrong.load_state_dict(right.state_dict())
        assert not torch.allclose(right(x), wrong(x), atol=1e-4), (target, bug)
    assert math.isclose(62996.05, 25000.0 * 2.0 ** (8 / 6), rel_tol=1e-6)


CORRECT = [("HFLlama", None, ("--rope", "--causal")), ("MetaLlama", None, ("--rope", "--causal")),
           ("GPTJ", None, ("--rope", "--causal")),
           ("ntk_attention", None, ("--rope", "--heads", "4", "--nq", "6", "--nk", "6", "--rope-base", "39482.22"))]


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_a_module_at_its_own_unusual_base_passes(runner, target, init, options):
    assert_passes(*run_case(runner, STYLES, target, init, options))


def test_a_base_no_name_says_is_read_as_the_codes_own(runner):
    code, out = run_case(runner, STYLES, "ntk_attention", None, ("--rope", "--heads", "4", "--nq", "6", "--nk", "6"))
    assert_passes(code, out)
    assert any("it rotates with RoPE base 39482.2 " in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize(("target", "bug", "base"), PLANTS, ids=case_ids(PLANTS))
def test_a_base_other_than_the_modules_is_named_by_experiment(runner, target, bug, base):
    found = assert_named(*run_case(runner, STYLES, target, f"bug='{bug}'", ("--rope", "--causal")), "rope.base")
    said = re.search(r"rotates with RoPE base ([0-9.e+]+) where your module says", found["diagnosis"])
    assert said is not None and math.isclose(float(said.group(1)), base, rel_tol=1e-5), found  # the base as fit


def test_a_base_other_than_rope_base_is_named_with_the_codes_base(runner):
    found = assert_named(*run_case(runner, STYLES, "ntk_attention", None, (
        "--rope", "--heads", "4", "--nq", "6", "--nk", "6", "--rope-base", "10000")), "rope.base")
    assert "rotates with RoPE base 39482.2 where the reference uses 10000" in found["diagnosis"], found
