"""`attnscope trace` and a module's own masks (round 15a/b: GPT-2's causal buffer applied after the softmax, ESM's
additive mask added to the probabilities, gemma_pytorch's band on both sides merged into the causal mask it is
given, AudioCraft's `assert attn_mask is None` and `assert query is key`). The rules, each in styles of our own
(tests/trace_styles_round15_masks.py), each style checked against F.scaled_dot_product_attention in float64 and
each plant shown to change its output:
- a mask of the module's own applied after the softmax (a buffer, a tril made at run time) is its own: trace's mask
  never hides it, and the plant is `mask.after_softmax`, by experiment;
- an additive mask added to the weights after the softmax is `mask.after_softmax` too, where the module has no
  output projection (the reference's identity turns the code's inf into NaN);
- a band the module builds on both sides and merges into the mask it is given takes the causal mask alone from
  trace (a window off by one is then `mask.off_by_one`); a mask edited with finfo.min and handed to SDPA is additive;
- a module that raises on trace's mask gets none, and one that raises on three tensors gets one, the same object.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads, merged, moved, planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round15_masks.py")
styles = user_module(STYLES)


def _causal(n, window=None):
    i = torch.arange(n)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window) if window else d >= 0


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    additive = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(~keep[:, None, None, :], -torch.inf)
    causal, band = _causal(7), _causal(7, 4)
    with torch.no_grad():
        m = moved(styles.Gpt2Causal(), 3)
        q, k, v = (heads(t) for t in m.c_attn(x).chunk(3, -1))
        want = m.c_proj(merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(m(x), want, atol=1e-10)
        assert (planted(styles.Gpt2Causal, m, "after_softmax", x) - want).abs().max() > 1e-2

        m = moved(styles.MinGptBuffer(), 3)
        want = m.proj(merged(F.scaled_dot_product_attention(heads(m.query(x)), heads(m.key(x)), heads(m.value(x)),
                                                            is_causal=True)))
        assert torch.allclose(m(x), want, atol=1e-10)
        assert (planted(styles.MinGptBuffer, m, "after_softmax", x) - want).abs().max() > 1e-2

        m = moved(styles.TrilEinsum(), 3)
        q, k, v = (heads(t) for t in m.to_qkv(x).chunk(3, -1))
        want = m.to_out(merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(m(x), want, atol=1e-10)
        assert (planted(styles.TrilEinsum, m, "after_softmax", x) - want).abs().max() > 1e-2

        for name, projections in (("BertLikeSelf", ("query", "key", "value")), ("BiasAdded", ("wq", "wk", "wv")),
                                  ("BaddbmmAdded", ("to_q", "to_k", "to_v"))):
            cls = getattr(styles, name)
            m = moved(cls(), 3)
            q, k, v = (heads(getattr(m, p)(x)) for p in projections)
            want = merged(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]))
            given = additive[:, 0] if name == "BaddbmmAdded" else additive
            out = m(x, given)
            assert torch.allclose(out[0] if isinstance(out, tuple) else out, want, atol=1e-10), name
            wrong = planted(cls, m, "added_after", x, given)
            assert not torch.isfinite(wrong[0] if isinstance(wrong, tuple) else wrong).all(), name

        causal_add = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~causal, -torch.inf)
        m = moved(styles.GemmaBand(), 3)
        q, k, v = (heads(t) for t in m.qkv_proj(x).chunk(3, -1))
        want = m.o_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=band)))
        assert torch.allclose(m(x, causal_add), want, atol=1e-5)  # its softmax in float32
        assert (planted(styles.GemmaBand, m, "window", x, causal_add) - want).abs().max() > 1e-2

        m = moved(styles.BoolBand(), 3)
        want = m.o(merged(F.scaled_dot_product_attention(heads(m.q(x)), heads(m.k(x)), heads(m.v(x)), attn_mask=band)))
        assert torch.allclose(m(x, causal), want, atol=1e-10)
        assert (planted(styles.BoolBand, m, "window", x, causal) - want).abs().max() > 1e-2

        m = moved(styles.HfBand(), 3)
        q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
        want = m.o_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=band)))
        assert torch.allclose(m(x, causal_add), want, atol=1e-10)
        assert (planted(styles.HfBand, m, "window", x, causal_add) - want).abs().max() > 1e-2

        m = moved(styles.StreamingLike(), 3)
        q, k, v = (heads(t) for t in F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, -1))
        want = m.out_proj(merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(m(x, x, x)[0], want, atol=1e-10)
        assert (planted(styles.StreamingLike, m, "off_by_one", x, x, x)[0] - want).abs().max() > 1e-2

        m = moved(styles.RefusesMask(), 3)
        q, k, v = (heads(t) for t in m.wqkv(x).chunk(3, -1))
        want = m.wo(merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(m(x), want, atol=1e-10)
        assert (planted(styles.RefusesMask, m, "scale_d_head", x) - want).abs().max() > 1e-2

        m = moved(styles.SelfOnly(), 3)
        q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
        want = m.out_proj(merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(m(x, x, x), want, atol=1e-10)
        assert (planted(styles.SelfOnly, m, "kv_swapped", x, x, x) - want).abs().max() > 1e-2


@pytest.fixture(scope="module")
def padding(tmp_path_factory):
    keep = np.ones((2, 7), dtype=bool)
    keep[0, 5:] = False
    path = tmp_path_factory.mktemp("pad") / "pad.npy"
    np.save(path, keep)
    return str(path)


def _args(rule, padding):
    return {"own": ["--causal"], "added": ["--mask", padding, "--batch", "2"], "band": ["--window", "4"],
            "refused": ["--causal"]}[rule]


CORRECT = [("Gpt2Causal", "own"), ("MinGptBuffer", "own"), ("TrilEinsum", "own"),
           ("BertLikeSelf", "added"), ("BiasAdded", "added"), ("BaddbmmAdded", "added"),
           ("GemmaBand", "band"), ("BoolBand", "band"), ("HfBand", "band"),
           ("StreamingLike", "refused"), ("RefusesMask", "refused"), ("SelfOnly", "refused")]


@pytest.mark.parametrize(("name", "rule"), CORRECT)
def test_correct_code_passes(runner, padding, name, rule):
    result, out = trace(runner, f"{STYLES}:{name}", *_args(rule, padding))
    assert result.exit_code == 0, result.stdout + result.stderr
    notes = out["notes"]
    if rule == "own":  # its own mask, trace's masking nothing beside it
        assert any(n.startswith("your code masks by itself (line ") for n in notes), notes
    if rule == "band":
        band = "your code masks a band on both sides (the window's far keys, 4 or more back, and the keys 4 or more"
        assert any(n.startswith(band) and "given the causal mask alone" in n for n in notes), notes
    if name == "HfBand":  # finfo.min written into the mask it hands SDPA: numbers, added
        assert any(n.startswith("attention_mask: additive float, 0 = may attend") and "cells of it set to a large "
                   "negative number (line " in n for n in notes), notes
    if name in ("StreamingLike", "RefusesMask"):
        mask = "attn_mask" if name == "StreamingLike" else "mask"
        assert any(n.startswith(f"{mask} = None: your code raised on the mask trace gave it (line ") for n in notes), \
            notes
    if name in ("StreamingLike", "SelfOnly"):
        assert any(n.startswith("query, key, value: your code raised on three tensors (line ") and "runs on one, "
                   "handed to all three (the same tensor" in n for n in notes), notes


PLANTS = [("Gpt2Causal", "own", "after_softmax", "mask.after_softmax"),
          ("MinGptBuffer", "own", "after_softmax", "mask.after_softmax"),
          ("TrilEinsum", "own", "after_softmax", "mask.after_softmax"),
          ("BertLikeSelf", "added", "added_after", "mask.after_softmax"),
          ("BiasAdded", "added", "added_after", "mask.after_softmax"),
          ("BaddbmmAdded", "added", "added_after", "mask.after_softmax"),
          ("GemmaBand", "band", "window", "mask.off_by_one"),
          ("BoolBand", "band", "window", "mask.off_by_one"),
          ("HfBand", "band", "window", "mask.off_by_one"),
          ("StreamingLike", "refused", "off_by_one", "mask.off_by_one"),
          ("RefusesMask", "refused", "scale_d_head", "scale.d_head"),
          ("SelfOnly", "refused", "kv_swapped", "kv.swapped")]


@pytest.mark.parametrize(("name", "rule", "bug", "cause"), PLANTS)
def test_plants_are_named_by_experiment(runner, padding, name, rule, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *_args(rule, padding))
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
