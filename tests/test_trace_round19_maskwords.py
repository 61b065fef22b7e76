"""`attnscope trace` where the code's words, its own switches and its data flow each say something of its mask.
Words are read of what they speak of: a helper's parameter that the forward hands the mask turned round
(`masked_softmax(scores, attention_mask == 0)` into `def masked_softmax(scores, pad): "True = masked out"`), a
variable a comment names (`# pad: True = masked out` over `pad = ~mask`), said of the mask turned back; words of a
helper that keeps its own word say nothing of the traced forward's contract. A reading of the ops that leaves the
weights on the keys the mask forbids and none on some it allows (the TensorFlow tutorial's `mask * -1e9`, 1 =
masked, read as a bias built from 1 = may attend) is given the other way round. A forward's own causal switch is
handed True beside a --mask file (the file alone to its mask parameter) and under --window where its truth builds
the sliding window itself; one that raises when True is a refusal in one line. Styles of our own
(tests/trace_styles_round19_maskwords.py), each checked against F.scaled_dot_product_attention in float64, each plant
shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from test_trace_round18_invmask import _changed, _keep
from trace_round14_helpers import heads, merged, moved, padding_file, planted
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round19_maskwords.py")
styles = user_module(STYLES)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    keys = _keep()[:, None, None, :]  # [b, 1, 1, n_K]
    allowed = (keys & causal).expand(2, 1, 7, 7)  # [b, 1, n_Q, n_K], True = may attend
    with torch.no_grad():
        m = moved(styles.HfEncoderHelper(), 3)
        want = m.dense(merged(F.scaled_dot_product_attention(heads(m.query(x)), heads(m.key(x)), heads(m.value(x)),
                                                             attn_mask=allowed)))
        assert torch.allclose(m(x, allowed), want, atol=1e-10)
        for bug in ("polarity", "on_queries", "after_softmax", "scale_twice"):
            assert _changed(planted(styles.HfEncoderHelper, m, bug, x, allowed), want), bug

        m = moved(styles.TfTutorialPort(), 3)
        want = m.dense(merged(F.scaled_dot_product_attention(heads(m.wq(x)), heads(m.wk(x)), heads(m.wv(x)),
                                                             attn_mask=allowed)))
        assert torch.allclose(m(x, x, x, ~allowed), want, atol=1e-10)  # 1 = masked, added as mask * -1e9
        for bug in ("kv_swapped", "scale_d_head", "polarity"):
            assert _changed(planted(styles.TfTutorialPort, m, bug, x, x, x, (~allowed).double()), want), bug

        m = moved(styles.FairseqPadCausal(), 3)
        want = m.out_proj(merged(F.scaled_dot_product_attention(heads(m.q_proj(x)), heads(m.k_proj(x)),
                                                                heads(m.v_proj(x)), attn_mask=allowed)))
        t = x.transpose(0, 1)  # [n, b, d]
        assert torch.allclose(m(t, ~_keep(), is_causal=True).transpose(0, 1), want, atol=1e-10)
        for bug in ("polarity", "on_queries", "causal_off_by_one"):
            assert _changed(planted(styles.FairseqPadCausal, m, bug, t, ~_keep(), True).transpose(0, 1),
                            want), bug

        m = moved(styles.MistralOwnWindow(), 3)
        i = torch.arange(7)
        window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)  # j <= i, i - j < 4
        k, v = (heads(p(x), 2).repeat_interleave(2, dim=1) for p in (m.wk, m.wv))
        want = m.wo(merged(F.scaled_dot_product_attention(heads(m.wq(x)), k, v, attn_mask=window)))
        assert torch.allclose(m(x, causal=True), want, atol=1e-10)
        assert not torch.allclose(m(x), want, atol=1e-3)  # its default masks nothing
        for bug in ("window_off_by_one", "softmax_axis"):
            assert _changed(planted(styles.MistralOwnWindow, m, bug, x, True), want), bug

        q, k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
        assert torch.allclose(styles.kept_attention(q, k, v, allowed), F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed), atol=1e-10)

        m = moved(styles.CommentedKeep(), 3)
        q, k, v = (heads(t) for t in m.to_qkv(x).chunk(3, -1))
        want = m.to_out(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
        assert torch.allclose(m(x, allowed), want, atol=1e-10)
        for bug in ("fill_zero", "scale_none"):
            assert _changed(planted(styles.CommentedKeep, m, bug, x, allowed), want), bug


@pytest.fixture(scope="module")
def padding(tmp_path_factory):
    return str(padding_file(tmp_path_factory.mktemp("pad"), 5))  # as _keep(): keys 5, 6 of the first padded


def _args(rule, padding):
    return {"causal": ["--causal"], "padding": ["--mask", padding, "--batch", "2"],
            "both": ["--causal", "--mask", padding, "--batch", "2"], "window": ["--window", "4"]}[rule]


CORRECT = [("HfEncoderHelper", "causal"), ("HfEncoderHelper", "padding"), ("TfTutorialPort", "causal"),
           ("TfTutorialPort", "padding"), ("TfTutorialStated", "causal"), ("FairseqPadCausal", "both"),
           ("FairseqPadCausal", "causal"),
           ("MistralOwnWindow", "window"), ("CommentedKeep", "causal"), ("CommentedKeep", "padding")]


@pytest.mark.parametrize(("name", "rule"), CORRECT, ids=case_ids(CORRECT))
def test_correct_code_passes_whatever_its_words_and_switches_say(runner, padding, name, rule):
    code, out = run_case(runner, STYLES, name, options=_args(rule, padding))
    assert_passes(code, out)
    notes = out["notes"]
    assert not any("own words say" in n for n in notes), notes
    if name.startswith("TfTutorial"):  # `mask * -1e9`: read by what its weights show, not as a bias from 1 = may attend
        assert any(n.startswith("mask: boolean, True = masked out") for n in notes), notes
        assert any("kept weight on keys the mask forbids and gave none to keys it allows" in n for n in notes), notes
    if rule == "both":  # the switch True, the file alone to the mask parameter
        assert any(n.startswith("is_causal = True: with it your code masks by itself") and "key_padding_mask was "
                   "given the --mask file alone" in n for n in notes), notes
    if rule == "window":
        assert any(n.startswith("causal = True: with it your code masks by itself") and "outside a band along the "
                   "diagonal" in n for n in notes), notes


PLANTS = [("HfEncoderHelper", "causal", "polarity", "mask.polarity"),
          ("HfEncoderHelper", "padding", "polarity", "mask.polarity"),
          ("HfEncoderHelper", "padding", "on_queries", "mask.on_queries"),
          ("HfEncoderHelper", "causal", "after_softmax", "mask.after_softmax"),
          ("HfEncoderHelper", "padding", "scale_twice", "scale.twice"),
          ("TfTutorialPort", "causal", "kv_swapped", "kv.swapped"),
          ("TfTutorialPort", "padding", "scale_d_head", "scale.d_head"),
          ("TfTutorialStated", "causal", "polarity", "mask.polarity"),
          ("TfTutorialStated", "padding", "polarity", "mask.polarity"),
          ("FairseqPadCausal", "both", "polarity", "mask.polarity"),
          ("FairseqPadCausal", "both", "on_queries", "mask.on_queries"),
          ("FairseqPadCausal", "both", "causal_off_by_one", "mask.off_by_one"),
          ("FairseqPadCausal", "causal", "causal_off_by_one", "mask.off_by_one"),
          ("MistralOwnWindow", "window", "window_off_by_one", "mask.off_by_one"),
          ("MistralOwnWindow", "window", "softmax_axis", "softmax.axis"),
          ("CommentedKeep", "causal", "fill_zero", "mask.filled_with_0"),
          ("CommentedKeep", "padding", "scale_none", "scale.none")]


def test_a_helper_handed_the_mask_turned_round_speaks_of_its_own_parameter(runner):
    """No words of its own: the helper's "True = masked out", said of `~mask`, is said of `mask` as True = may attend,
    which is how the function reads it."""
    code, out = run_case(runner, STYLES, "kept_attention", options=["--heads", "2", "--causal"])
    assert_passes(code, out)
    assert any(n.startswith("mask: boolean, True = may attend") for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "rule", "bug", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, padding, name, rule, bug, cause):
    code, out = run_case(runner, STYLES, name, f"bug='{bug}'", _args(rule, padding))
    assert_named(code, out, cause)


def test_a_switch_that_raises_when_true_is_a_refusal_in_one_line(runner):
    result, out = trace(runner, f"{STYLES}:RefusesCausal", "--causal")
    assert result.exit_code == 2 and out is None, result.stdout
    said = " ".join(result.stderr.split())
    assert "takes no mask and masks nothing by itself, and with is_causal = True it raised NotImplementedError: " \
           "this encoder is bidirectional" in said, said
    assert "Traceback" not in result.stderr
    code, out = run_case(runner, STYLES, "RefusesCausal")
    assert_passes(code, out)
