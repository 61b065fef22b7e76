"""`attnscope trace` on heads split without the permute in frames other than the plain batch-first one (round 17's
fairseq q viewed [bsz·heads, tgt_len, d] straight from the time-first projection, round 16b's PatchTST keys viewed
[bs, heads, d_k, q_len] straight, Flamingo's three views beside a norm of the text): each named
heads.split_without_permute by experiment, q, k or v alone or all three. Styles of its own
(tests/trace_styles_round18_split.py): Megatron-LM's time-first baddbmm, attention-is-all-you-need-pytorch's heads
before the batch, keys laid ready for the product, a lucidrains cross-attention with einops written out; each checked
against F.scaled_dot_product_attention in float64, each plant shown to change it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import planted as _planted
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round18_split.py")
styles = user_module(STYLES)
BUGS = ("q", "k", "v", "all")


def _sdpa(q, k, v):
    """[n_batch, n, n_head·d] each -> the heads' attention merged back, [n_batch, n_Q, n_head·d]."""
    return _merged(F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v)))


def _check(cls, ours, want, *args):
    assert torch.allclose(ours(*args), want, atol=1e-10)
    for bug in BUGS:
        assert (_planted(cls, ours, bug, *args) - want).abs().max() > 1e-2, bug


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x, m = (torch.randn(3, n, 32, generator=g, dtype=torch.float64) for n in (5, 6))
    with torch.no_grad():
        tf = styles.TimeFirstBaddbmm().double().eval()  # time-first in and out
        xt, mt = x.transpose(0, 1), m.transpose(0, 1)
        want = tf.dense(_sdpa(tf.query(x), tf.key(m), tf.value(m))).transpose(0, 1)
        _check(styles.TimeFirstBaddbmm, tf, want, xt, mt, mt)

        hf = styles.HeadsFirstBatched().double().eval()
        _check(styles.HeadsFirstBatched, hf, hf.fc(_sdpa(hf.w_qs(x), hf.w_ks(m), hf.w_vs(m))), x, m, m)

        kr = styles.KeysReady().double().eval()
        _check(styles.KeysReady, kr, kr.proj(_sdpa(kr.query(x), kr.key(x), kr.value(x))), x)

        rw = styles.RearrangeWrittenOut().double().eval()
        k, v = rw.to_kv(m).chunk(2, dim=-1)
        _check(styles.RearrangeWrittenOut, rw, rw.to_out(_sdpa(rw.to_q(rw.norm(x)), k, v)), x, m)


@pytest.mark.parametrize("name", ["TimeFirstBaddbmm", "HeadsFirstBatched", "KeysReady", "RearrangeWrittenOut"])
def test_the_correct_styles_pass(runner, name):
    assert_passes(*run_case(runner, STYLES, name))


@pytest.mark.parametrize(("name", "bug", "words"), [
    ("TimeFirstBaddbmm", "q", "Q_feat as your code holds it, time-first [n_Q, n_batch, d_feat], viewed straight as "
                              "[n_batch, n_head, n_Q, d_head] or [n_batch·n_head, n_Q, d_head]"),
    ("TimeFirstBaddbmm", "k", "time-first [n_K, n_batch, d_feat]"),
    ("TimeFirstBaddbmm", "v", "V_feat as your code holds it, time-first [n_K, n_batch, d_feat]"),
    ("TimeFirstBaddbmm", "all", "(K_feat and V_feat split the same way)"),
    ("HeadsFirstBatched", "k", "viewed straight as [n_head, n_batch, n_K, d_head] or [n_head·n_batch, n_K, d_head]"),
    ("HeadsFirstBatched", "all", "[n_head, n_batch, n_Q, d_head]"),
    ("KeysReady", "k", "viewed straight as [n_batch, n_head, d_head, n_K]"),
    ("KeysReady", "all", "K_feat viewed straight as [n_batch, n_head, d_head, n_K]; V_feat split the same way"),
    ("RearrangeWrittenOut", "v", "V_feat [n_batch, n_K, d_feat] viewed straight as [n_batch, n_head, n_K, d_head]"),
    ("RearrangeWrittenOut", "all", "(K_feat and V_feat split the same way)"),
])
def test_a_split_without_its_permute_is_named_by_experiment(runner, name, bug, words):
    code, out = run_case(runner, STYLES, name, f"bug='{bug}'")
    first = assert_named(code, out, "heads.split_without_permute")
    assert words in first["diagnosis"], first["diagnosis"]
    # a norm of the input before the projections is no qk-norm, whatever a reading of one lines up to
    assert out["params"].get("qk_norm_read") is None, out["params"]
