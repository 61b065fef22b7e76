"""`attnscope trace` on OpenAI whisper's attention, which returns its masked scores beside its output: -inf where
its additive mask is, the code's own and no sign of a mask given the wrong way round (runs/trace_mask.fed_well: NaN
or +inf only). Before, the -inf read as an output not finite, the mask was retried as finfo.min and the note of that
form raised KeyError 'additive_min' (usertrace/masking.Convention.note). The style of our own
(tests/trace_styles_round26_whisper.py) is checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

from attnscope.usertrace.masking import Convention

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round26_whisper.py")
styles = user_module(STYLES)


def test_the_style_is_attention():
    torch.manual_seed(0)
    m = styles.WhisperAttention().double()
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    mask = torch.empty(8, 8, dtype=torch.float64).fill_(-torch.inf).triu_(1)
    split = [t.reshape(2, 6, 4, 12).transpose(1, 2) for t in (m.query(x), m.key(x), m.value(x))]
    want = F.scaled_dot_product_attention(*split, is_causal=True).transpose(1, 2).reshape(2, 6, 48)
    out, qk = m(x, mask=mask)
    torch.testing.assert_close(out, m.out(want))
    assert bool(torch.isneginf(qk).any())  # the returned scores hold the mask's -inf


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 48)
    mask = torch.empty(6, 6).fill_(-torch.inf).triu_(1)
    for bug in ("k_unscaled", "softmax_queries"):
        good, bad = styles.WhisperAttention(), styles.WhisperAttention(bug=bug)
        bad.load_state_dict(good.state_dict())
        assert (good(x, mask=mask)[0] - bad(x, mask=mask)[0]).abs().max() > 1e-3, bug


CAUSAL = ("--causal",)
CORRECT = [("WhisperAttention", None, CAUSAL), ("WhisperAttention", None, ("--nk", "9"))]
PLANTS = [("WhisperAttention", "bug='k_unscaled'", CAUSAL, "scale.half"),
          ("WhisperAttention", "bug='softmax_queries'", CAUSAL, "softmax.axis")]

test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_mask_is_read_as_the_code_adds_it(runner):
    code, out = run_case(runner, STYLES, "WhisperAttention", None, CAUSAL)
    notes = " ".join(" ".join(out["notes"]).split())
    assert code == 0 and "it adds the mask to the scores" in notes and "left a query no key" not in notes, notes


def test_a_mask_read_as_finfo_min_by_experiment_says_so():
    note = Convention("additive_min", 12, "its use of the mask, found by experiment").note("mask")
    assert "finfo.min" in note and "it adds the mask to the scores" in note and "line 12" in note
