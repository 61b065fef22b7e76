"""`attnscope trace` names two deviations at once by experiment (usertrace/pairs.py): round 22's Jais attention, whose
ALiBi bias is symmetric (−m_h · |i − j|, the reference's under its causal mask), exited 1 with no cause where a
mask mistake showed the upper triangle too (the band one key wider, the mask after the softmax, `triu` for `tril`):
no one catalog entry reproduced both. Now two entries' changes join in one rerun; a convention of the code's that
alone leaves the output as it is is kept and the other names the cause, and two mistakes are named both
("scale.none+mask.filled_with_0"). Styles of our own (tests/trace_styles_round25_pairs.py), each checked against
F.scaled_dot_product_attention in float64 with ALiBi's own −m_h · (i − j) and a causal mask."""

from __future__ import annotations

from pathlib import Path

import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_pairs.py")
styles = user_module(STYLES)
ALIBI = ("--causal", "--alibi")


def _alibi_causal(heads: int, n: int) -> torch.Tensor:
    """ALiBi as its paper writes it, −m_h · (i − j) with m_h = 2^(-8 h / heads), and -inf above the diagonal."""
    m = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = -m[:, None, None] * (i - j).double()
    return bias.masked_fill(j > i, float("-inf"))


def test_the_styles_are_causal_alibi_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.XAttend().double()
    torch.testing.assert_close(m(x), m.to_out(sdpa(m.to_q(x), m.to_k(x), m.to_v(x), 4, _alibi_causal(4, x.shape[1]))))
    m = styles.MosaicBlock().double()
    torch.testing.assert_close(m(x), m.out_proj(sdpa(*m.Wqkv(x).chunk(3, -1), 4, _alibi_causal(4, x.shape[1]))))
    m = styles.BaddbmmAlibi().double()
    fused = m.query_key_value(x).view(2, 7, 4, 3, 4)
    q, k, v = (fused[..., i, :].reshape(2, 7, 16) for i in range(3))
    torch.testing.assert_close(m(x), m.dense(sdpa(q, k, v, 4, _alibi_causal(4, x.shape[1]))))


PLANTS = [("XAttend", "bug='causal_wide'", ALIBI, "mask.off_by_one"),
          ("XAttend", "bug='mask_after'", ALIBI, "mask.after_softmax"),
          ("XAttend", "bug='no_scale_fill0'", ALIBI, "scale.none+mask.filled_with_0"),
          ("MosaicBlock", "bug='causal_wide'", ALIBI, "mask.off_by_one"),
          ("MosaicBlock", "bug='causal_narrow'", ALIBI, "mask.off_by_one"),
          ("BaddbmmAlibi", "bug='causal_triu'", ALIBI, "mask.transposed")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


CORRECT = [("XAttend", None, ALIBI), ("MosaicBlock", None, ALIBI), ("BaddbmmAlibi", None, ALIBI)]
test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_a_convention_kept_is_said_and_not_named(runner):
    """The symmetric bias is the code's convention, said beside the mistake; the cause is the mask's alone."""
    code, out = run_case(runner, STYLES, "XAttend", "bug='causal_wide'", ALIBI)
    found = out["first_divergence"]
    said = " ".join(found["diagnosis"].split())
    assert code == 1 and "your code's own convention too: a bias symmetric in i and j" in said, said
    assert "alibi.query_positions kept" in found["evidence"], found["evidence"]


def test_two_mistakes_are_said_both(runner):
    code, out = run_case(runner, STYLES, "XAttend", "bug='no_scale_fill0'", ALIBI)
    found = out["first_divergence"]
    said = " ".join(found["diagnosis"].split())
    assert code == 1 and said.startswith("two mistakes at once:") and "filled with 0" in said, said
    assert "these two mistakes" in found["evidence"], found["evidence"]


def test_no_pair_where_one_entry_does(runner):
    """A mistake one entry reproduces alone is named alone (the band one key narrower hides the upper triangle)."""
    code, out = run_case(runner, STYLES, "MosaicBlock", "bug='causal_narrow'", ALIBI)
    found = out["first_divergence"]
    assert code == 1 and "kept" not in found["evidence"] and "two mistakes" not in found["diagnosis"], found
