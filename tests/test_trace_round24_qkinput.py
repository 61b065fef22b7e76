"""`attnscope trace` reads a tensor the module makes from its input for its queries' and keys' projections alone,
the values' projection reading the input as it is (round 24's Wav2Vec2-Conformer: rotary position on the hidden
states before linear_q and linear_k, linear_v on the hidden states). It was exit 1 with 'none of your tensors has
scores's shape' where the code's scores had it: usertrace/qkinput.py reads that tensor, from the data flow, as the
queries' and keys' input side, and diagnose.py no longer denies a tensor of the step's shape. Styles of our own
(tests/trace_styles_round24_qkinput.py), each checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round24_qkinput.py")
styles = user_module(STYLES)


def _sdpa(qk_in, x, q, k, v, out, heads):
    b, n, _ = x.shape
    split = [p(t).view(b, n, heads, -1).transpose(1, 2) for p, t in ((q, qk_in), (k, qk_in), (v, x))]
    return out(F.scaled_dot_product_attention(*split).transpose(1, 2).reshape(b, n, -1))


def _rotated(x, heads):
    """Rotary position on each head's features of x, rotate-half pairs, base 10000, in float64."""
    b, n, dim = x.shape
    d = dim // heads
    ang = torch.outer(torch.arange(n, dtype=torch.float64), 10000.0 ** (-torch.arange(0, d, 2).double() / d))
    ang = torch.cat([ang, ang], -1)[:, None, :]
    h = x.view(b, n, heads, d)
    return (h * ang.cos() + torch.cat([-h[..., d // 2:], h[..., :d // 2]], -1) * ang.sin()).reshape(b, n, dim)


def test_the_styles_are_attention_on_their_query_and_key_input():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.RotatedStates().double()
    torch.testing.assert_close(m(x), _sdpa(_rotated(x, 2), x, m.q_lin, m.k_lin, m.v_lin, m.out_lin, 2))
    m = styles.ComplexRotated().double()
    pairs = x.view(2, 7, 2, 4, 2)  # adjacent pairs turned: the same rotation with the halves interleaved
    halves = torch.cat([pairs[..., 0], pairs[..., 1]], -1).reshape(2, 7, 16)
    turned = _rotated(halves, 2).view(2, 7, 2, 2, 4)
    qk_in = torch.stack([turned[..., 0, :], turned[..., 1, :]], -1).reshape(2, 7, 16)
    lin = {n: (lambda t, w=getattr(m, "w" + n), c=getattr(m, "b" + n): F.linear(t, w, c)) for n in "qkvo"}
    torch.testing.assert_close(m(x), _sdpa(qk_in, x, lin["q"], lin["k"], lin["v"], lin["o"], 2))
    m = styles.PositionAffine().double()
    torch.testing.assert_close(m(x), _sdpa(x * m.pos_gain[:7] + m.pos_shift[:7], x, m.to_q, m.to_k, m.to_v, m.proj,
                                           2))
    m = styles.DetrEncoderLayer().double()
    torch.testing.assert_close(m(x), _sdpa(x + m.query_pos[:7], x, m.q_proj, m.k_proj, m.v_proj, m.out_proj, 2))


PLANTS = [("RotatedStates", "bug='scale_d_head'", (), "scale.d_head"),
          ("RotatedStates", "bug='softmax_axis'", (), "softmax.axis"),
          ("RotatedStates", "bug='dropout_on'", (), "dropout.left_on"),
          ("RotatedStates", "bug='merge_no_transpose'", (), "heads.merge_without_transpose"),
          ("ComplexRotated", "bug='no_scale'", (), "scale.none"),
          ("ComplexRotated", "bug='softmax_axis'", (), "softmax.axis"),
          ("PositionAffine", "bug='scale_d_head'", (), "scale.d_head"),
          ("PositionAffine", "bug='merge_no_transpose'", (), "heads.merge_without_transpose"),
          ("DetrEncoderLayer", "bug='dropout_on'", (), "dropout.left_on")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


CORRECT = [("RotatedStates", None, ()), ("ComplexRotated", None, ()), ("PositionAffine", None, ()),
           ("DetrEncoderLayer", None, ())]
test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_note_says_what_the_queries_and_keys_read(runner):
    code, out = run_case(runner, STYLES, "RotatedStates")
    said = [" ".join(n.split()) for n in out["notes"] if n.startswith("your queries' and keys' projections read")]
    assert code == 0 and said, out["notes"]
    assert "your values' projection the input as it is" in said[0], said



def test_a_step_whose_shape_your_code_holds_is_never_said_to_have_none(runner, monkeypatch):
    """With the reading off (as before it), the scores the code holds stand past the tensor its output was paired
    with: the divergence names the nearest of them and how far it is, never 'none of your tensors has'."""
    from attnscope.usertrace import qkinput

    monkeypatch.setattr(qkinput, "read", lambda *args: None)
    code, out = run_case(runner, STYLES, "RotatedStates")
    found = out["first_divergence"]
    said = " ".join(found["diagnosis"].split())
    assert code == 1 and found["reference"] == "scores", found
    assert "none of your tensors has" not in said and "has scores's shape" in said and "max |diff|" in said, said
