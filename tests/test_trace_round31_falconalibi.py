"""`attnscope trace` on ALiBi added BEFORE the 1/√d_head scale, `(q · kᵀ + alibi) · scale` (transformers'
FalconAttention with alibi=True, and the same order written by hand): the scale multiplies the bias too, the same
as ALiBi's slopes times the scale added after it. A convention read by experiment (the reference rerun with those
slopes reproduces every tensor): a note, exit 0, never `alibi.slopes`. Wrong slopes (another sequence, a factor that
is not the scale), the sign flipped and the scale applied twice are still named by experiment. Each style is first
checked in float64 against a formula of its own: BLOOM's build_alibi_tensor slopes, then
F.scaled_dot_product_attention with the bias, times the scale, in its additive mask."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_trace_command import trace, user_module
from tracecases import assert_named, passing_test, plants_test, run_case
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from typer.testing import CliRunner

from attnscope.cli import app

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round31_falconalibi.py")
FALCON = str(Path(transformers.__file__).parent / "models" / "falcon" / "modeling_falcon.py")
styles = user_module(STYLES)
B, N, D, H = 2, 6, 32, 4  # batch, tokens, width, heads
OPTIONS = ("--alibi", "--causal")


def _biased_mask(scale: float, n_head: int = H) -> torch.Tensor:
    """[B, n_head, N, N] float64: −inf above the diagonal, BLOOM's m_h · j times the scale elsewhere."""
    alibi = build_alibi_tensor(torch.ones(B, N), n_head, torch.float64).view(B, n_head, 1, N)  # m_h · j
    causal = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)
    return causal + alibi * scale


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v [B, heads, N, d]: softmax(q · kᵀ / √d + (m_h · j) / √d, causal) · v, merged to [B, N, heads · d]."""
    d = q.shape[-1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_biased_mask(d ** -0.5, q.shape[1]))
    return out.transpose(1, 2).flatten(-2)


def _want_own(m, x):
    qkv = m.query_key_value(x).view(B, N, H, 3, D // H)  # per head: q, k, v
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    return m.dense(_sdpa(q, k, v))


def _want_handed(m, x):
    d = D // H
    w = m.query_key_value(x)
    q = w[..., :D].view(B, N, H, d).transpose(1, 2)
    k, v = (w[..., D + i * d: D + (i + 1) * d][:, None].expand(B, H, N, d) for i in range(2))  # one kv head
    return m.dense(_sdpa(q, k, v))


def _handed_inputs(x):
    alibi = build_alibi_tensor(torch.ones(B, N), H, torch.float64)  # [B·H, 1, N], m_h · j
    mask = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1).expand(B, 1, N, N)
    return x, alibi, mask


def test_the_styles_are_the_formula_and_the_plants_change_it():
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(311), dtype=torch.float64)
    with torch.no_grad():
        own = styles.FalconOwn().double().eval()
        want = _want_own(own, x)
        assert torch.allclose(own(x), want, atol=1e-10)
        for bug in ("scale_twice", "slopes_from_0", "slopes_doubled", "slopes_scaled_again"):
            planted = styles.FalconOwn(bug=bug).double().eval()
            planted.load_state_dict(own.state_dict())
            assert (planted(x) - want).abs().max() > 1e-3, bug
        handed = styles.FalconHanded().double().eval()
        want = _want_handed(handed, x)
        assert torch.allclose(handed(*_handed_inputs(x)), want, atol=1e-10)
        for bug in ("sign", "slopes_doubled", "scale_twice"):
            planted = styles.FalconHanded(bug=bug).double().eval()
            planted.load_state_dict(handed.state_dict())
            assert (planted(*_handed_inputs(x)) - want).abs().max() > 1e-3, bug


def test_transformers_falcon_adds_alibi_before_the_scale_as_the_formula_says():
    config = transformers.FalconConfig(hidden_size=D, num_attention_heads=H, alibi=True)
    m = transformers.models.falcon.modeling_falcon.FalconAttention(config, layer_idx=0).double().eval()
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(312), dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(313), dtype=torch.float64) * 0.3)
        out = m(*_handed_inputs(x))[0]
        assert torch.allclose(out, _want_handed(m, x), atol=1e-10)


test_correct_styles_pass = passing_test(STYLES, [("FalconOwn", None, OPTIONS), ("FalconHanded", None, OPTIONS)])
test_planted_bugs_are_named_by_experiment = plants_test(STYLES, [
    ("FalconOwn", "bug='scale_twice'", OPTIONS, "scale.twice"),
    ("FalconOwn", "bug='slopes_from_0'", OPTIONS, "alibi.slopes"),
    ("FalconOwn", "bug='slopes_doubled'", OPTIONS, "alibi.slopes"),
    ("FalconOwn", "bug='slopes_scaled_again'", OPTIONS, "alibi.slopes"),
    ("FalconHanded", "bug='sign'", OPTIONS, "alibi.sign"),
    ("FalconHanded", "bug='slopes_doubled'", OPTIONS, "alibi.slopes"),
    ("FalconHanded", "bug='scale_twice'", OPTIONS, "scale.twice"),
])


def test_transformers_falcon_attention_with_alibi_exits_0_with_the_note(runner):
    init = f"config=FalconConfig(hidden_size={D}, num_attention_heads={H}, alibi=True), layer_idx=0"
    code, out = run_case(runner, FALCON, "FalconAttention", init, OPTIONS)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    said = " ".join(out["notes"])
    assert "ALiBi added before the 1/√d scale (Falcon's order" in said and "the same as slopes/√d after it" in said
    assert "a convention, not a mistake" in said, said


def test_falcons_order_with_a_scale_of_its_own_is_said_with_that_scale(runner):
    """--scale 0.3 where the code scales its biased scores by 0.3: the note names that scale, not 1/√d."""
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(312), dtype=torch.float64)
    with torch.no_grad():
        m = styles.FalconOwn(scale=0.3).double().eval()
        qkv = m.query_key_value(x).view(B, N, H, 3, D // H)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_biased_mask(0.3), scale=0.3)
        assert torch.allclose(m(x), m.dense(out.transpose(1, 2).flatten(-2)), atol=1e-10)
    code, out = run_case(runner, STYLES, "FalconOwn", "scale=0.3", (*OPTIONS, "--scale", "0.3"))
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    said = " ".join(out["notes"])
    assert "ALiBi added before the scale 0.3 (Falcon's order" in said and "the same as slopes × 0.3 after it" in said
    assert "1/√d" not in said, said


def test_wrong_slopes_in_falcons_order_are_said_as_the_code_holds_them(runner):
    """The scale is no part of the slopes a mistake is said with: the reading is given up (alibi.slopes undoes it),
    and the first line-up's fitted slopes are those after the scale, 2^(-8 h / n_head) from h = 0 over √d_head."""
    code, out = run_case(runner, STYLES, "FalconOwn", "bug='slopes_from_0'", OPTIONS)
    assert code == 1
    fitted = ", ".join(f"{2 ** (-8 * h / H) / math.sqrt(D // H):.4g}" for h in range(H))
    assert fitted in out["first_divergence"]["diagnosis"], out["first_divergence"]["diagnosis"]
    assert not any("Falcon's order" in n for n in out["notes"]), out["notes"]


def test_wrong_slopes_in_transformers_falcon_are_said_at_the_biased_scores(runner):
    """transformers' FalconAttention handed twice the bias: its one value head is broadcast by the matmul, so no
    V_rep exists and x_raw is lost with the attention before it; the divergence is the biased scores (it was said at
    V_rep), named alibi.slopes."""
    code, out = run_case(runner, STYLES, "FalconDoubled", None, OPTIONS)
    found = assert_named(code, out, "alibi.slopes")
    assert found["reference"] == "biased_scores", found
    assert [row["status"] for row in out["alignment"] if row["reference"] == "V_rep"] == ["unseen"], out["alignment"]


@pytest.mark.parametrize("scale", ["0", "-1"])
def test_a_scale_that_is_not_positive_is_refused_in_one_line(runner, scale):
    """--scale 0 or below: one line and exit 2 (the experiments divide by the scale and take its root: it was an
    internal error, ZeroDivisionError or a math domain error)."""
    result = runner.invoke(app, ["trace", f"{STYLES}:FalconOwn", *OPTIONS, "--scale", scale])
    assert result.exit_code == 2, result.output
    assert "must be positive" in result.output and "Traceback" not in result.output and "--debug" not in result.output


@pytest.mark.parametrize("scale", ["1e-300", "1e300"])
def test_a_scale_past_float32s_range_is_refused_in_one_line(runner, scale):
    """--scale 1e300 or 1e-300: one line and exit 2 (the experiments square it: inf or 0 in float64, an overflow or
    a division by zero inside them, an internal error before)."""
    result = runner.invoke(app, ["trace", f"{STYLES}:FalconOwn", *OPTIONS, "--scale", scale])
    assert result.exit_code == 2, result.output
    assert "float32's range" in result.output and "Traceback" not in result.output \
        and "--debug" not in result.output


def test_a_scale_at_the_edge_of_float32s_range_is_traced() -> None:
    """--scale 3e38 is float32's: the scores' ratio is said as a number (its square, 9e76, names no root)."""
    result, out = trace(CliRunner(), f"{STYLES}:FalconOwn", *OPTIONS, "--scale", "3e38")
    assert result.exit_code == 1 and out["first_divergence"]["reference"] == "scores", result.output
