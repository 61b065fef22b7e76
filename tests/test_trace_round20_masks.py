"""`attnscope trace` on masks built or fed in the idioms of real libraries (round 20): DistilBERT's key padding
filled with finfo.min, BART's 4-D additive mask added to the scores viewed per head, Llama 4's chunked local
attention built in the module, a decode step whose sliding window is a boolean mask built from cache_position, a
module whose window is optional. A mask applied with its queries' and keys' axes exchanged (`triu` for `tril`,
`mask.transpose(-1, -2)`, `j >= i` for `j <= i`) was 'not by experiment': it is mask.transposed. Styles of our own
(tests/trace_styles_round20_masks.py), each checked against F.scaled_dot_product_attention in float64, each plant
shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from test_trace_round19_ownmask import _band, _changed
from trace_round14_helpers import heads, merged, planted
from tracecases import assert_named, assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round20_masks.py")
styles = user_module(STYLES)


def _chunks(n, chunk):
    """Llama 4's chunked local mask, written apart from the styles': blocks of `chunk` positions, causal in each."""
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return allowed


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    real = torch.ones(2, 7, dtype=torch.long)
    real[0, 5:] = 0  # 1 = a real token
    keys = real.bool()[:, None, None, :]
    with torch.no_grad():
        m = styles.DistilSelfAttention().double().eval()
        q, k, v = (heads(p(x)) for p in (m.q_lin, m.k_lin, m.v_lin))
        want = m.out_lin(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keys)))
        assert torch.allclose(m(x, x, x, real), want, atol=1e-10)
        for bug in ("polarity", "on_queries", "filled_with_0", "after_softmax"):
            assert _changed(planted(styles.DistilSelfAttention, m, bug, x, x, x, real), want), bug

        m = styles.BartAttention().double().eval()
        q, k, v = (heads(p(x)) for p in (m.q_proj, m.k_proj, m.v_proj))
        for allowed in (_band(7, 7), _band(7, 7) & keys):
            additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
            want = m.out_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
            assert torch.allclose(m(x, additive.expand(2, 1, 7, 7)), want, atol=1e-10)
            for bug in ("transposed", "added_after"):
                assert _changed(planted(styles.BartAttention, m, bug, x, additive.expand(2, 1, 7, 7)), want), bug

        m = styles.ChunkedLocalAttention().double().eval()
        assert torch.equal(styles.chunked_mask(7, 3), _chunks(7, 3))
        q, k, v = (heads(p(x), n) for p, n in ((m.q_proj, 4), (m.k_proj, 2), (m.v_proj, 2)))
        want = m.o_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=_chunks(7, 3), enable_gqa=True)))
        assert torch.allclose(m(x), want, atol=1e-10)
        for bug in ("transposed", "after_softmax", "filled_with_0", "off_by_one", "chunk_boundary"):
            assert _changed(planted(styles.ChunkedLocalAttention, m, bug, x), want), bug

        m = styles.WindowDecode().double().eval()
        cache = tuple(torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        q = heads(m.q_proj(x[:, :3]))
        k, v = (torch.cat([c, heads(p(x[:, :3]), 2)], -2) for c, p in zip(cache, (m.k_proj, m.v_proj), strict=True))
        want = m.o_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=_band(3, 7, 3), enable_gqa=True)))
        assert torch.allclose(m(x[:, :3], cache), want, atol=1e-10)
        for bug in ("window_off_by_one", "upper_left", "transposed", "polarity"):
            assert _changed(planted(styles.WindowDecode, m, bug, x[:, :3], cache), want), bug

        m = styles.PaddedEncoderLayer().double().eval()
        q, k, v = (heads(t) for t in m.in_proj(x).split(32, -1))
        additive = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~_band(7, 7), -torch.inf)
        want = m.out_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=_band(7, 7) & keys)))
        assert torch.allclose(m(x, additive, ~real.bool()), want, atol=1e-10)
        assert _changed(planted(styles.PaddedEncoderLayer, m, "polarity", x, additive, ~real.bool()), want)

        m = styles.BufferCausal().double().eval()
        q, k, v = (heads(t) for t in m.c_attn(x).split(32, -1))
        additive = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(~keys, torch.finfo(torch.float64).min)
        want = m.c_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=_band(7, 7) & keys)))
        assert torch.allclose(m(x, additive), want, atol=1e-10)
        assert _changed(planted(styles.BufferCausal, m, "transposed", x, additive), want)

        m = styles.OptionalWindow().double().eval()
        q, k, v = (heads(t) for t in m.qkv(x).split(32, -1))
        for window in (None, 3):
            allowed = _band(7, 7, window) & keys
            want = m.proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
            assert torch.allclose(m(x, real, use_sliding_window=window is not None), want, atol=1e-10)
            for bug in ("window_off_by_one", "transposed") if window else ("transposed",):
                assert _changed(planted(styles.OptionalWindow, m, bug, x, real, window is not None), want), bug


@pytest.fixture()
def files(tmp_path):
    """A key-padding file [n_batch, n_K] (True = a real token) and Llama 4's chunked mask [n_Q, n_K] of 3."""
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 5:] = False
    np.save(tmp_path / "pad.npy", pad)
    np.save(tmp_path / "chunks.npy", _chunks(7, 3).numpy())
    return {"PAD": str(tmp_path / "pad.npy"), "CHUNKS": str(tmp_path / "chunks.npy")}


def _options(options, files):
    return tuple(files.get(o, o) for o in options)


PADDED = ("--mask", "PAD", "--nq", "7")
KEYS = ("--mask", "PAD", "--batch", "2", "--nq", "7")  # query, key, value: no self-attention, n_batch told
CORRECT = [("DistilSelfAttention", None, KEYS),
           ("BartAttention", None, ("--causal",)),
           ("BartAttention", None, ("--causal", *PADDED)),
           ("ChunkedLocalAttention", None, ("--mask", "CHUNKS", "--nq", "7")),
           ("WindowDecode", None, ("--causal", "--window", "3", "--cache", "4", "--nq", "3")),
           ("PaddedEncoderLayer", None, ("--causal",)),
           ("PaddedEncoderLayer", None, ("--causal", *PADDED)),
           ("BufferCausal", None, ("--causal",)),
           ("BufferCausal", None, ("--causal", *PADDED)),
           ("OptionalWindow", None, ("--causal",)),
           ("OptionalWindow", None, ("--causal", "--window", "3")),
           ("OptionalWindow", None, ("--causal", "--window", "3", *PADDED))]


test_correct_masks_pass = passing_test(STYLES, CORRECT, files="files")


PLANTS = [("DistilSelfAttention", "bug='polarity'", KEYS, "mask.polarity"),
          ("DistilSelfAttention", "bug='on_queries'", KEYS, "mask.on_queries"),
          ("DistilSelfAttention", "bug='filled_with_0'", KEYS, "mask.filled_with_0"),
          ("DistilSelfAttention", "bug='after_softmax'", KEYS, "mask.after_softmax"),
          ("BartAttention", "bug='transposed'", ("--causal",), "mask.transposed"),
          ("BartAttention", "bug='transposed'", ("--causal", *PADDED), "mask.transposed"),
          ("BartAttention", "bug='added_after'", ("--causal",), "mask.after_softmax"),
          ("ChunkedLocalAttention", "bug='transposed'", ("--mask", "CHUNKS", "--nq", "7"), "mask.transposed"),
          ("ChunkedLocalAttention", "bug='after_softmax'", ("--mask", "CHUNKS", "--nq", "7"), "mask.after_softmax"),
          ("ChunkedLocalAttention", "bug='filled_with_0'", ("--mask", "CHUNKS", "--nq", "7"), "mask.filled_with_0"),
          ("ChunkedLocalAttention", "bug='off_by_one'", ("--mask", "CHUNKS", "--nq", "7"), "mask.off_by_one"),
          ("ChunkedLocalAttention", "bug='chunk_boundary'", ("--mask", "CHUNKS", "--nq", "7"), "mask.off_by_one"),
          ("WindowDecode", "bug='window_off_by_one'", ("--causal", "--window", "3", "--cache", "4", "--nq", "3"),
           "mask.off_by_one"),
          ("WindowDecode", "bug='upper_left'", ("--causal", "--window", "3", "--cache", "4", "--nq", "3"),
           "mask.upper_left"),
          ("WindowDecode", "bug='transposed'", ("--causal", "--window", "3", "--cache", "4", "--nq", "3"),
           "mask.transposed"),
          ("WindowDecode", "bug='polarity'", ("--causal", "--window", "3", "--cache", "4", "--nq", "3"),
           "mask.polarity"),
          ("PaddedEncoderLayer", "bug='polarity'", ("--causal",), "mask.polarity"),
          ("PaddedEncoderLayer", "bug='polarity'", ("--causal", *PADDED), "mask.polarity"),
          ("BufferCausal", "bug='transposed'", ("--causal",), "mask.transposed"),
          ("BufferCausal", "bug='transposed'", ("--causal", *PADDED), "mask.transposed"),
          ("OptionalWindow", "bug='transposed'", ("--causal",), "mask.transposed"),
          ("OptionalWindow", "bug='window_off_by_one'", ("--causal", "--window", "3"), "mask.off_by_one"),
          ("OptionalWindow", "bug='window_off_by_one'", ("--causal", "--window", "3", *PADDED), "mask.off_by_one")]


test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_a_key_padding_mask_of_one_sequence_never_widens_the_scores(runner):
    """A code causal by itself that indexes its attention_mask as key padding (`mask[:, None, None, :]`) ran on
    trace's [1, n_Q, n_K] mask that masks nothing, an axis of 1 put before its scores (no more cells, one more axis):
    its heads merged from a batch of batches, 'x_rsh2 ... none of the usual causes fits'. It now gets key padding."""
    code, out = run_case(runner, STYLES, "OptionalWindow", None, ("--causal",))
    assert_passes(code, out)
    assert any("the mask widened" in n and "[n_batch, n_K] key padding" in n for n in out["notes"]), out["notes"]


def test_a_switch_that_adds_a_window_to_a_causal_code_is_set(runner):
    """`use_sliding_window=False` on a code causal by itself: with --window its switch is what it needs (it was left
    at its default, and the window missing was a false alarm)."""
    code, out = run_case(runner, STYLES, "OptionalWindow", None, ("--causal", "--window", "3"))
    assert_passes(code, out)
    assert any(n.startswith("use_sliding_window = True: with it your code masks by itself") for n in out["notes"])


def test_chunks_of_the_codes_own_under_causal_alone_say_how_to_describe_them(runner):
    """Llama 4's chunked local attention traced with --causal alone masks more than the rule, the same cells in every
    sequence and head: no mistake, a pattern no flag says; the message says to describe it with --mask FILE."""
    code, out = run_case(runner, STYLES, "ChunkedLocalAttention", None, ("--causal", "--nq", "7"))
    assert code == 1
    said = out["first_divergence"]["diagnosis"]
    assert "your code masks these by itself" in said and "describe them with --mask FILE" in said, said


@pytest.mark.parametrize("options", [("--causal",), PADDED], ids=["trace's padding", "a padding file"])
def test_the_padding_beside_the_rule_is_held_to_its_words(runner, files, options):
    """fairseq-like `key_padding_mask` ("True marks a padding key") read as True = may attend beside an attn_mask
    that takes the rule: its words were never read where another mask parameter took the rule (exit 0), under
    --causal alone (trace's padded keys) or beside a padding file. The padding is given as the words say, and the
    code's reading of it is mask.polarity."""
    options = ("--causal", *_options(options, files)) if options != ("--causal",) else options
    found = assert_named(*run_case(runner, STYLES, "PaddedEncoderLayer", "bug='polarity'", options), "mask.polarity")
    assert found["diagnosis"].startswith("the key padding is read the other way round"), found


def test_a_padding_file_stays_beside_a_causal_mask_of_the_codes_own(runner, files):
    """GPT-2-like code masks by itself (its `bias` buffer) and adds its caller's attention_mask: handed a mask that
    masks nothing, it lost the file's padding, and the correct layer was 'mask.on_queries'. It gets the padding
    alone."""
    code, out = run_case(runner, STYLES, "BufferCausal", None, ("--causal", *_options(PADDED, files)))
    assert_passes(code, out)
    assert any("was given the key padding alone" in n for n in out["notes"]), out["notes"]


def test_a_transposed_mask_says_so(runner):
    """BART's 4-D mask transposed before it is added: the causal rule turned anticausal, named by experiment in its
    own words (it was 'not by experiment', read off the numbers as an anticausal mask)."""
    found = assert_named(*run_case(runner, STYLES, "BartAttention", "bug='transposed'", ("--causal",)),
                         "mask.transposed")
    assert "the mask is transposed" in found["diagnosis"] and "an anticausal mask" in found["diagnosis"], found
