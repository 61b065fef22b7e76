"""`attnscope trace` names the values projected from the input turned by position (RoPE on the input, read by the
query and key projections as their input side, usertrace/qkinput.py) as rope.on_values: where the value projection
read that tensor too, the three roles' one input side was taken as a convention of the code's (keyinputs.py, a
convolutional or pooled projection) and the mistake passed (exit 0). A tensor that is the input with each token
turned and its norm kept is RoPE's, which the values never take: it stays the queries' and keys' input side, the
reference's values read the input, and ropetrials' rerun with the values projected from it names the mistake. Styles
of our own (tests/trace_styles_round25_turnedinput.py), each checked against F.scaled_dot_product_attention in
float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from _trace_ref import sdpa
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_turnedinput.py")
styles = user_module(STYLES)


def _turned(x: torch.Tensor, heads: int, pairing: str) -> torch.Tensor:
    """x [B, N, D] with each head's features turned by position in float64, base 10000: (i, i + d/2) pairs for
    "half", (2i, 2i + 1) for "adjacent"."""
    B, N, D = x.shape
    d = D // heads
    angle = torch.outer(torch.arange(N, dtype=torch.float64), 10000.0 ** (-torch.arange(0, d, 2).double() / d))
    h = x.view(B, N, heads, d)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    if pairing == "half":
        a, b = h[..., : d // 2], h[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).reshape(B, N, D)
    a, b = h[..., 0::2], h[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(B, N, D)


def test_the_styles_are_attention_over_the_turned_input():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.ConformerRotary().double()
    t = _turned(x, 2, "half")
    torch.testing.assert_close(m(x), m.linear_out(sdpa(m.linear_q(t), m.linear_k(t), m.linear_v(x), 2)))
    m = styles.ComplexTurned().double()
    t = _turned(x, 4, "adjacent")
    out = sdpa(F.linear(t, m.wq), F.linear(t, m.wk), F.linear(x, m.wv, m.bv), 4)
    torch.testing.assert_close(m(x), F.linear(out, m.wo))
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.RoFormerTurned().double()
    t = _turned(x, 3, "adjacent")
    torch.testing.assert_close(m(x), m.dense(sdpa(m.query(t), m.key(t), m.value(x), 3)))


PLANTS = [("ConformerRotary", "bug='values_turned'", (), "rope.on_values"),
          ("ComplexTurned", "bug='values_turned'", (), "rope.on_values"),
          ("RoFormerTurned", "bug='values_turned'", (), "rope.on_values")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        x = torch.randn(2, 7, good.linear_q.in_features if hasattr(good, "linear_q") else
                        good.query.in_features if hasattr(good, "query") else good.wq.shape[1])
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


CORRECT = [("ConformerRotary", None, ()), ("ComplexTurned", None, ()), ("RoFormerTurned", None, ())]
test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_note_says_the_values_read_the_input(runner):
    code, out = run_case(runner, STYLES, "ConformerRotary", "bug='values_turned'")
    said = [" ".join(n.split()) for n in out["notes"] if n.startswith("your query, key and value projections read")]
    assert code == 1 and said and "turned by its position with its norm kept" in said[0], out["notes"]
