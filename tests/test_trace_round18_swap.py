"""`attnscope trace` on keys and values swapped, or the values taken from the keys, where the code also rotates and
norms its keys, groups its heads without repeating them, or compresses its keys and values along the sequence
(round 18's swap): the swap after RoPE and a qk-norm, where no name holds the weights and the data flow reads the
scores' right operand as K, is kv.swapped by experiment (the rerun's keys as projected, its values rotated and normed
as the keys are); a Linear over the tokens is no projection of q, k or v, and a sibling of it the code holds and never
calls pools the values in the reference, so the values taken from the compressed keys are kv.values_from_keys.
Styles of its own (tests/trace_styles_round18_swap.py), each checked against F.scaled_dot_product_attention in
float64 and each plant shown to change its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import planted as _planted
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round18_swap.py")
styles = user_module(STYLES)


def _turned(x, sign, pairs):
    """x `[b, h, n, d]` with each pair (the halves, or neighbours) turned by sign · θ, as a complex product."""
    n, d = x.shape[-2], x.shape[-1]
    theta = torch.outer(torch.arange(n, dtype=torch.float64),
                        1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [n, d / 2]
    if pairs == "halves":
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(theta), sign * theta)
        return torch.cat((z.real, z.imag), dim=-1)
    z = torch.view_as_complex(x.unflatten(-1, (d // 2, 2)).contiguous()) * torch.polar(torch.ones_like(theta),
                                                                                         sign * theta)
    return torch.view_as_real(z).flatten(-2)


def _heads(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [b, n, h·d] -> [b, h, n, d]


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def _sdpa(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=causal)
    return out.transpose(1, 2).flatten(2)  # [b, n, h·d]


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        for qk_norm in (True, False):
            m = styles.MinusThetaGqa(qk_norm=qk_norm).double().eval()
            q, k, v = _heads(m.to_q(x), 4), _heads(m.to_k(x), 2), _heads(m.to_v(x), 2)
            if qk_norm:
                q, k = _rms(q), _rms(k)
            want = m.proj(_sdpa(_turned(q, -1, "halves"), _turned(k, -1, "halves"), v, True))
            assert torch.allclose(m(x), want, atol=1e-5)  # the tables are float32 buffers
            for bug in ("kv_swapped", "values_from_keys"):
                assert (_planted(styles.MinusThetaGqa, m, bug, x, qk_norm=qk_norm) - want).abs().max() > 1e-2

        e = styles.GroupedEinsum().double().eval()
        q, k, v = _heads(e.wq(x), 4), _heads(e.wk(x), 2), _heads(e.wv(x), 2)
        q = F.layer_norm(q, (8,), e.q_ln.weight, e.q_ln.bias)
        k = F.layer_norm(k, (8,), e.k_ln.weight, e.k_ln.bias)
        want = e.mix(_sdpa(_turned(q, 1, "neighbours"), _turned(k, 1, "neighbours"), v, True))
        assert torch.allclose(e(x), want, atol=1e-10)
        for bug in ("kv_swapped", "values_from_keys"):
            assert (_planted(styles.GroupedEinsum, e, bug, x) - want).abs().max() > 1e-2

        x = torch.randn(2, 10, 24, generator=g, dtype=torch.float64)
        c = styles.SequenceCompressed().double().eval()

        def squeezed(t, lin):  # [b, n, dim] -> [b, k, dim]: each feature's n tokens mixed into k
            return torch.einsum("bnd,kn->bkd", t, lin.weight) + lin.bias[:, None]

        q, k, v = c.to_q(x), squeezed(c.to_k(x), c.E), squeezed(c.to_v(x), c.F)
        want = c.to_out(_sdpa(_heads(q, 3), _heads(k, 3), _heads(v, 3), False))
        assert torch.allclose(c(x), want, atol=1e-10)
        for bug in ("kv_swapped", "values_from_keys"):
            assert (_planted(styles.SequenceCompressed, c, bug, x) - want).abs().max() > 1e-2


CORRECT = [("MinusThetaGqa", None, ("--rope", "--causal")),
           ("MinusThetaGqa", "qk_norm=False", ("--rope", "--causal")),
           ("GroupedEinsum", None, ("--rope", "--causal")),
           ("SequenceCompressed", None, ("--nq", "10"))]


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass(runner, target, init, options):
    assert_passes(*run_case(runner, STYLES, target, init, options))


PLANTS = [("MinusThetaGqa", "bug='kv_swapped'", ("--rope", "--causal"), "kv.swapped"),
          ("MinusThetaGqa", "qk_norm=False, bug='kv_swapped'", ("--rope", "--causal"), "kv.swapped"),
          ("MinusThetaGqa", "bug='values_from_keys'", ("--rope", "--causal"), "kv.values_from_keys"),
          ("GroupedEinsum", "bug='kv_swapped'", ("--rope", "--causal"), "kv.swapped"),
          ("GroupedEinsum", "bug='values_from_keys'", ("--rope", "--causal"), "kv.values_from_keys"),
          ("SequenceCompressed", "bug='kv_swapped'", ("--nq", "10"), "kv.swapped"),
          ("SequenceCompressed", "bug='values_from_keys'", ("--nq", "10"), "kv.values_from_keys")]


@pytest.mark.parametrize(("target", "init", "options", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, target, init, options, entry):
    assert_named(*run_case(runner, STYLES, target, init, options), entry)


def test_the_values_pooled_by_the_compression_the_code_never_calls(runner):
    code, out = run_case(runner, STYLES, "SequenceCompressed", "bug='values_from_keys'", ("--nq", "10"))
    assert_named(code, out, "kv.values_from_keys")
    assert any("your values by F, which your code holds beside E and never calls" in n for n in out["notes"]), \
        out["notes"]
    assert "v=to_v" in out["reference"], out["reference"]
