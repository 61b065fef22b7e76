"""`attnscope trace` on a forward(query, key, value) that never reads key and value (round 17: fairseq's
MultiheadAttention with self_attention=True was a false alarm, 'K_split at your v', trace's reference reading K and V
from the key and value it handed and the code ignored): where the data flow shows the scores' operands and the
pattern's partner all from the first parameter alone, it is handed one tensor for all three, as --q alone gives it
(runs/trace_layouts._unread_inputs). Styles: tests/trace_styles_unread_inputs.py, each checked against SDPA in
float64; each plant changes the output and is named by experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_unread_inputs.py")
styles = user_module(STYLES)

CORRECT = [("FairseqSelf", None, ("--nq", "6", "--nk", "6")), ("FairseqSelf", None, ()),
           ("BatchFirstSelf", None, ("--causal",)), ("PackedFromQuery", None, ("--causal",)),
           ("PackedFromQuery", "causal=False", ())]
PLANTED = [("FairseqSelf", "bug='no_scale'", (), "scale.none"),
           ("BatchFirstSelf", "bug='softmax_axis'", ("--causal",), "softmax.axis"),
           ("PackedFromQuery", "bug='kv_swapped'", ("--causal",), "kv.swapped")]


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass_as_self_attention(runner, target, init, options):
    code, out = run_case(runner, STYLES, target, init, options)
    assert_passes(code, out)
    assert any("your code never reads them" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("target", "init", "options", "entry"), PLANTED, ids=case_ids(PLANTED))
def test_planted_bugs_named_by_experiment(runner, target, init, options, entry):
    assert_named(*run_case(runner, STYLES, target, init, options), entry)


def test_cross_attention_reads_its_key_and_value(runner):
    """The same class with self_attention=False reads key and value: three tensors, no note."""
    code, out = run_case(runner, STYLES, "BatchFirstSelf", "self_attention=False", ("--nq", "5", "--nk", "7"))
    assert code == 0 and not any("never reads" in n for n in out["notes"]), out


def test_styles_are_sdpa_in_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        m = styles.FairseqSelf().double().eval()
        q, k, v = (p(x).view(2, 5, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = m.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32))
        ignored = torch.randn(5, 2, 32, dtype=torch.float64)
        torch.testing.assert_close(m(x.transpose(0, 1), ignored, ignored).transpose(0, 1), want)
        assert not torch.allclose(styles.FairseqSelf(bug="no_scale").double()(x.transpose(0, 1), x, x)
                                  .transpose(0, 1), want)
        m = styles.BatchFirstSelf().double().eval()
        q, k, v = (p(x).view(2, 5, 4, 8).transpose(1, 2) for p in (m.wq, m.wk, m.wv))
        want = m.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
        torch.testing.assert_close(m(x, None, None, causal), want)
        planted = styles.BatchFirstSelf(bug="softmax_axis").double().eval()
        planted.load_state_dict(m.state_dict())
        assert not torch.allclose(planted(x, x, x, causal), want)
        m = styles.PackedFromQuery().double().eval()
        q, k, v = (t.view(2, 5, 2, 16).transpose(1, 2) for t in
                   (x @ m.in_proj_weight.T + m.in_proj_bias).chunk(3, -1))
        want = m.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 32))
        torch.testing.assert_close(m(x, None, None), want)
        planted = styles.PackedFromQuery(bug="kv_swapped").double().eval()
        planted.load_state_dict(m.state_dict())
        assert not torch.allclose(planted(x, x, x), want)
