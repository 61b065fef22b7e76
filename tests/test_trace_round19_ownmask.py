"""`attnscope trace` on code that masks by itself beside a mask parameter of its caller's (round 19: GPT-Neo's
`attn_weights * causal_mask` and its local layer without its window were hidden under the rule trace handed its
`attention_mask`; a sliding window built from `arange(q_len)` in a decode step and nn.MultiheadAttention's causal
mask read the other way round beside key padding were 'not by experiment'). A code whose scores meet a boolean or 0/1
mask of the positions alone is given a mask that masks nothing, whatever it fills them with; one that masks the
causal part itself owns its window too; the polarity, no-window and upper-left trials keep the key padding beside
the rule. Styles of our own (tests/trace_styles_round19_ownmask.py), each checked against
F.scaled_dot_product_attention in float64, each plant shown to change its output and named by experiment.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads, merged, moved, planted
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round19_ownmask.py")
styles = user_module(STYLES)


def _changed(out, want):
    """Whether a plant's output differs from the correct one (NaN where a query lost every key counts)."""
    return bool((out - want).nan_to_num(nan=1.0).abs().max() > 1e-2)


def _band(n_q, n_k, window=None):
    """True = may attend: causal lower-right, keys less than `window` back."""
    rel = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] - (n_k - n_q)  # j - position of query i
    return (rel <= 0) & (rel > -window) if window else rel <= 0


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    padded = torch.zeros(2, 7, dtype=torch.bool)
    padded[0, 5:] = True  # True = padded
    additive = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(padded[:, None, None, :], -1e9)
    with torch.no_grad():
        for window in (None, 3):
            m = moved(styles.CodeGenLike(window=window), 3)
            q, k, v = (heads(t) for t in m.qkv_proj(x).split(32, -1))
            allowed = _band(7, 7, window) & ~padded[:, None, None, :]
            want = m.out_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
            assert torch.allclose(m(x, additive), want, atol=1e-10)
            for bug in ("mask_mult", "fill_zero") if window is None else ("no_window",):
                assert _changed(planted(styles.CodeGenLike, m, bug, x, additive, window=window), want), bug

        m = moved(styles.WindowFromPositions(), 3)
        q, k, v = (heads(p(x)) for p in (m.wq, m.wk, m.wv))
        want = m.wo(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=_band(7, 7, 3) & ~padded[:, None, None])))
        assert torch.allclose(m(x, padded), want, atol=1e-10)
        assert _changed(planted(styles.WindowFromPositions, m, "no_window", x, padded), want)
        cache = (torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64),
                 torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64))
        k_all, v_all = torch.cat([cache[0], k], -2), torch.cat([cache[1], v], -2)
        want = m.wo(merged(F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=_band(7, 10, 3))))
        assert torch.allclose(m(x, None, cache), want, atol=1e-10)
        assert _changed(planted(styles.WindowFromPositions, m, "upper_left", x, None, cache), want)

        for boolean in (False, True):
            m = moved(styles.LibraryMHA(boolean=boolean), 3)
            w, b = m.self_attn.in_proj_weight, m.self_attn.in_proj_bias
            q, k, v = (heads(t) for t in F.linear(x, w, b).split(32, -1))
            allowed = _band(7, 7) & ~padded[:, None, None, :]
            want = m.self_attn.out_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
            assert torch.allclose(m(x, padded), want, atol=1e-10)
            assert _changed(planted(styles.LibraryMHA, m, "inverted", x, padded, boolean=boolean), want)


CORRECT = [("CodeGenLike", None, ("--causal",)),
           ("CodeGenLike", "window=3", ("--window", "3")),
           ("WindowFromPositions", None, ("--window", "3")),
           ("WindowFromPositions", None, ("--window", "3", "--cache", "3")),
           ("LibraryMHA", None, ("--causal",)),
           ("LibraryMHA", "boolean=True", ("--causal",))]


@pytest.mark.parametrize(("name", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_code_that_masks_by_itself_passes(runner, name, init, options):
    assert_passes(*run_case(runner, STYLES, name, init, options))


PLANTS = [("CodeGenLike", "bug='mask_mult'", ("--causal",), "mask.multiplied"),
          ("CodeGenLike", "bug='fill_zero'", ("--causal",), "mask.filled_with_0"),
          ("CodeGenLike", "window=3, bug='no_window'", ("--window", "3"), "mask.no_window"),
          ("WindowFromPositions", "bug='no_window'", ("--window", "3"), "mask.no_window"),
          ("WindowFromPositions", "bug='upper_left'", ("--window", "3", "--cache", "3"), "mask.upper_left"),
          ("LibraryMHA", "bug='inverted'", ("--causal",), "mask.polarity"),
          ("LibraryMHA", "boolean=True, bug='inverted'", ("--causal",), "mask.polarity")]


@pytest.mark.parametrize(("name", "init", "options", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, name, init, options, cause):
    assert_named(*run_case(runner, STYLES, name, init, options), cause)


def test_a_mask_of_its_own_is_never_hidden_under_the_rule(runner):
    """The scores multiplied by the code's causal buffer keep every weight above 0; trace's rule handed to its
    attention_mask would mask the same cells again. The code is given a mask that masks nothing, and says so."""
    code, out = run_case(runner, STYLES, "CodeGenLike", "bug='mask_mult'", ("--causal",))
    assert code == 1
    assert any(n.startswith("your code applies a mask of its own to its scores (line ") for n in out["notes"]), \
        out["notes"]


def test_a_mask_on_a_relative_term_is_not_a_mask_of_its_own(runner):
    """Music Transformer multiplies its relative term q · Eᵀ (the queries and a table: no product of q and k) by a
    0/1 mask of the positions and takes the causal rule from its caller: read as masking by itself (4545c63), it was
    handed a mask that masks nothing, and the correct module was a false alarm (round 16b's music_raw_ok)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        m = moved(styles.RelativeTableMasked(), 3)
        q, k, v = (heads(p(x)) for p in (m.Wq, m.Wk, m.Wv))
        rel = torch.arange(7)[None, :] - torch.arange(7)[:, None]  # j - i
        table = torch.einsum("bhld,md->bhlm", q, m.E[16 - 7:])  # row i, column m: distance m - 6
        term = torch.where(rel <= 0, table.gather(-1, (rel + 6).clamp(0, 6).expand(2, 4, 7, 7)), 0.0)
        want = m.fc(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=term / math.sqrt(8) + torch.where(
            rel <= 0, 0.0, -math.inf))))
        assert torch.allclose(m(x, rel <= 0), want, atol=1e-10)
    assert_passes(*run_case(runner, STYLES, "RelativeTableMasked", options=("--causal",)))
    assert_named(*run_case(runner, STYLES, "RelativeTableMasked", "bug='axis'", ("--causal",)), "softmax.axis")
