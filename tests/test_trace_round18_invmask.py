"""`attnscope trace` on code that turns its mask round before it applies it (round 18's ChatGLM2: `~attention_mask`
handed to F.scaled_dot_product_attention was a false alarm, trace handing True = may attend, the code's `~` making
SDPA mask every allowed key, and a cause read off the NaN that made). The polarity is read through the data flow
from the mask parameter to the op that applies it, an inversion on the way flipping it; a bias written by
`torch.where(mask, -inf, 0)` is masked where its very negative side says; a mask that leaves every query a key but
makes the code leave one none is trace's feed read the wrong way round, given the other way round; no cause is read
off the numbers of queries that saw no key. Styles of our own (tests/trace_styles_round18_invmask.py), each checked
against F.scaled_dot_product_attention in float64, each plant shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged, moved, planted
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round18_invmask.py")
styles = user_module(STYLES)


def _keep():
    """Key padding [2, 7], True = may attend, the first sequence's last two keys padded."""
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    return keep


def _changed(out, want):
    """Whether a plant's output differs from the correct one (NaN where a query lost every key counts)."""
    return bool((out - want).nan_to_num(nan=1.0).abs().max() > 1e-2)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    allowed = (_keep()[:, None, None, :] & causal).expand(2, 1, 7, 7)  # [b, 1, n_Q, n_K], True = may attend
    with torch.no_grad():
        m = moved(styles.InvertedSdpa(), 3)
        q, k, v = (heads(t) for t in m.qkv(x).view(2, 7, 3, 32).unbind(2))
        want = m.out(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
        assert torch.allclose(m(x, ~allowed), want, atol=1e-10)
        for bug in ("polarity", "on_queries", "scale_none", "kv_swapped"):
            assert _changed(planted(styles.InvertedSdpa, m, bug, x, ~allowed), want), bug

        m = moved(styles.KeepFill(), 3)
        want = m.out_proj(merged(F.scaled_dot_product_attention(heads(m.q_proj(x)), heads(m.k_proj(x)),
                                                                heads(m.v_proj(x)), attn_mask=allowed)))
        assert torch.allclose(m(x, ~allowed), want, atol=1e-10)
        for bug in ("scale_d_head", "on_queries", "merge_no_transpose"):
            assert _changed(planted(styles.KeepFill, m, bug, x, ~allowed), want), bug

        m = moved(styles.OneMinusBias(), 3)
        want = m.dense(merged(F.scaled_dot_product_attention(heads(m.query(x)), heads(m.key(x)), heads(m.value(x)),
                                                             attn_mask=allowed)))
        assert torch.allclose(m(x, allowed.double()), want, atol=1e-10)
        for bug in ("kv_swapped", "scale_none"):
            assert _changed(planted(styles.OneMinusBias, m, bug, x, allowed.double()), want), bug

        m = moved(styles.TimeFirstInverted(), 3)
        t = x.transpose(0, 1)  # [n, b, d]
        k, v = (heads(p(x), 2).repeat_interleave(2, dim=1) for p in (m.wk, m.wv))
        want = m.wo(merged(F.scaled_dot_product_attention(heads(m.wq(x)), k, v, attn_mask=allowed))).transpose(0, 1)
        assert torch.allclose(m(t, ~allowed), want, atol=1e-10)
        for bug in ("tiled", "kv_swapped", "merge_no_transpose"):
            assert _changed(planted(styles.TimeFirstInverted, m, bug, t, ~allowed), want), bug

        m = moved(styles.WhereBias(), 3)
        q, k, v = (heads(t) for t in m.to_qkv(x).chunk(3, -1))
        want = m.to_out(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
        assert torch.allclose(m(x, ~allowed), want, atol=1e-10)
        for bug in ("scale_twice", "on_queries"):
            assert _changed(planted(styles.WhereBias, m, bug, x, ~allowed), want), bug

        m = moved(styles.PaddingOnes(), 3)
        q, k, v = (heads(t) for t in m.c_attn(x).chunk(3, -1))
        want = m.c_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
        assert torch.allclose(m(x, (~allowed).double()), want, atol=1e-10)
        assert _changed(planted(styles.PaddingOnes, m, "kv_swapped", x, (~allowed).double()), want)


@pytest.fixture(scope="module")
def padding(tmp_path_factory):
    path = tmp_path_factory.mktemp("pad") / "pad.npy"
    np.save(path, _keep().numpy())
    return str(path)


def _args(rule, padding):
    return ["--causal"] if rule == "causal" else ["--mask", padding, "--batch", "2"]


NAMES = ["InvertedSdpa", "KeepFill", "OneMinusBias", "TimeFirstInverted", "WhereBias", "PaddingOnes"]
CORRECT = [(name, rule) for name in NAMES for rule in ("causal", "padding")]


@pytest.mark.parametrize(("name", "rule"), CORRECT, ids=case_ids(CORRECT))
def test_correct_code_passes_whichever_way_it_turns_its_mask(runner, padding, name, rule):
    code, out = run_case(runner, STYLES, name, options=_args(rule, padding))
    assert_passes(code, out)
    notes = out["notes"]
    assert not any("masks by itself" in n for n in notes), notes  # no mask that masks everything read as its own
    read = {"InvertedSdpa": "attention_mask: boolean, True = masked out", "KeepFill": "padding_mask: boolean, True = "
            "masked out", "OneMinusBias": "attention_mask: float 0/1, 1 = may attend", "TimeFirstInverted":
            "attention_mask: boolean, True = masked out", "WhereBias": "mask: boolean, True = masked out",
            "PaddingOnes": "attention_mask: float 0/1, 1 = masked out"}[name]
    assert any(n.startswith(read) for n in notes), notes
    if name in ("InvertedSdpa", "TimeFirstInverted"):  # read through the inversion, not the other way round after
        assert any("inverted, then F.scaled_dot_product_attention(" in n for n in notes), notes
    if name == "PaddingOnes":  # `1 - mask` raises on a boolean: 0/1 numbers, read the other way round by the run
        assert any(n.startswith("attention_mask: given float 0/1, 1 = may attend as your code's ops were read, your "
                                "code left a query no key") for n in notes), notes


PLANTS = [("InvertedSdpa", "causal", "polarity", "mask.polarity"),
          ("InvertedSdpa", "padding", "on_queries", "mask.on_queries"),
          ("InvertedSdpa", "causal", "scale_none", "scale.none"),
          ("InvertedSdpa", "padding", "kv_swapped", "kv.swapped"),
          ("KeepFill", "causal", "scale_d_head", "scale.d_head"),
          ("KeepFill", "padding", "on_queries", "mask.on_queries"),
          ("KeepFill", "causal", "merge_no_transpose", "heads.merge_without_transpose"),
          ("OneMinusBias", "causal", "kv_swapped", "kv.swapped"),
          ("OneMinusBias", "padding", "scale_none", "scale.none"),
          ("TimeFirstInverted", "causal", "tiled", "gqa.tiled"),
          ("TimeFirstInverted", "padding", "kv_swapped", "kv.swapped"),
          ("TimeFirstInverted", "causal", "merge_no_transpose", "heads.merge_without_transpose"),
          ("WhereBias", "causal", "scale_twice", "scale.twice"),
          ("WhereBias", "padding", "on_queries", "mask.on_queries"),
          ("PaddingOnes", "causal", "kv_swapped", "kv.swapped")]


@pytest.mark.parametrize(("name", "rule", "bug", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, padding, name, rule, bug, cause):
    code, out = run_case(runner, STYLES, name, f"bug='{bug}'", _args(rule, padding))
    assert_named(code, out, cause)


def test_a_feed_that_leaves_queries_no_key_is_never_read_for_a_cause(runner, monkeypatch):
    """Where trace's reading of the mask fails (here switched off: the inversion unread, the run never given the other
    way round, the mask that masks nothing taken whatever it makes), the code's `~` turns trace's mask into one that
    masks every key of some queries; the divergence then says so, and no cause (a qk-norm, a mask not applied) is read
    off the zeros and NaN of those queries."""
    from attnscope.runs import trace_mask
    from attnscope.usertrace import masking

    applied = masking._applied
    monkeypatch.setattr(masking, "_applied", lambda record, inverted, *rest: applied(record, False, *rest))
    monkeypatch.setattr(trace_mask, "_finite_reading", lambda o, run, called, convention, dtype: (called, convention))
    monkeypatch.setattr(trace_mask, "fed_well", lambda called: True)
    code, out = run_case(runner, STYLES, "InvertedSdpa", options=["--causal"])
    found = out["first_divergence"]
    assert code == 1 and found is not None and found["experiment"] is None, found
    assert "leaves queries no key (their weights all 0, or NaN) where the reference's mask leaves every query a key" \
        in found["diagnosis"], found
    assert "qk-norm" not in found["diagnosis"] and "not applied" not in found["diagnosis"], found
    assert found["evidence"].startswith("not by experiment"), found
