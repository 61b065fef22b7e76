"""`attnscope trace` on masks that leave a query no key, on scores that are large without a mask, and on a causal
square the code slices itself (usertrace/maskrows.py, maskforms.masked_cells, masking.sliced_forms):
- a batch with a sequence all padding: what the code makes of its rows (NaN under -inf, a uniform row under
  finfo.min) is its convention, yet fed_well read it as a sign that the mask's form was wrong, and the form retry
  kept a form that drowned every key of the other sequence (T5's `(1 - bias) * finfo.min` handed 0 / -inf: exit 1
  on correct code);
- scores of -1e5 + score (a model's own offset, no mask) read as masked: maskforms.drowned refused the right form;
- HF CTRL's `mask[ns - nd:ns, :ns]` cut out of the causal square: in a decode step (--cache N) it raised on every
  mask trace gave it, as the op it raised in names the scores alone.
Styles of our own (tests/trace_styles_round27_maskrows.py), each checked against F.scaled_dot_product_attention in
float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _trace_ref import sdpa as _sdpa
from test_trace_command import user_module
from test_trace_round25_maskforms import _keep
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_maskrows.py")
styles = user_module(STYLES)


def _empty_first() -> torch.Tensor:
    """Key padding [2, 7] (True = a real token): the first sequence all padding, the second's last key padded."""
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0] = False
    keep[1, 6:] = False
    return keep


@pytest.fixture()
def files(tmp_path):
    """PAD0: key padding whose first sequence is all padding; PAD: the first's last two keys padded, the second's
    last."""
    np.save(tmp_path / "pad0.npy", _empty_first().numpy())
    np.save(tmp_path / "pad.npy", _keep().numpy())
    return {"PAD0": str(tmp_path / "pad0.npy"), "PAD": str(tmp_path / "pad.npy")}


def test_the_styles_are_masked_attention():
    """Each correct style is SDPA in float64 with the padding on every sequence that has a token; on the one that has
    none, its own convention (NaN under -inf, a uniform row under BERT's finfo.min)."""
    torch.manual_seed(0)
    empty = _empty_first()
    allowed = empty[:, None, None, :]
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.FlashPaddedAttention().double()
    q, k, v = m.Wqkv(x).split(32, dim=2)
    got, want = m(x, key_padding_mask=empty), m.out_proj(_sdpa(q, k, v, 4, allowed))
    torch.testing.assert_close(got[1], want[1])
    assert bool(got[0].isnan().all())
    m = styles.T5KeepAttention().double()
    got, want = m(x, mask=empty.double()), m.o(_sdpa(m.q(x), m.k(x), m.v(x), 4, allowed, scale=1.0))
    torch.testing.assert_close(got[1], want[1])  # the first: finfo.min + a score, -inf in float32's softmax
    m = styles.OffsetScoresAttention().double()
    padded = _keep()
    want = m.o_proj(_sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 4, padded[:, None, None, :]))
    torch.testing.assert_close(m(x, attention_mask=padded.double()), want)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.BertPaddedSelfAttention().double()
    got, want = m(x, attention_mask=empty.double()), m.dense(_sdpa(m.query(x), m.key(x), m.value(x), 3, allowed))
    torch.testing.assert_close(got[1], want[1])
    assert bool(got[0].isfinite().all())


def test_ctrl_is_causal_attention_in_a_decode_step():
    """CTRL-like attention, given its model's causal square over past and new positions, is SDPA in float64 with
    the causal rule aligned lower-right over the cached keys and the new ones; without a cache, upper-left."""
    torch.manual_seed(0)
    m = styles.CTRLLikeAttention().double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    past = torch.randn(2, 2, 4, 3, 8, dtype=torch.float64)  # (key, value), [batch, heads, 3, depth] each
    q, k, v = (m.split_into_heads(w(x), 2) for w in (m.Wq, m.Wk, m.Wv))
    keys, values = torch.cat([past[0], k], dim=-2), torch.cat([past[1], v], dim=-2)
    rule = torch.ones(7, 10, dtype=torch.bool).tril(diagonal=3)
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=rule).permute(0, 2, 1, 3).reshape(2, 7, 32)
    square = torch.triu(torch.ones(10, 10, dtype=torch.float64), 1)
    out, present = m(x, square, layer_past=past)
    torch.testing.assert_close(out, m.dense(want))
    assert present.shape == (2, 2, 4, 10, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 2, 1, 3).reshape(2, 7, 32)
    torch.testing.assert_close(m(x, square[:7, :7])[0], m.dense(want))


EMPTY = ("--batch", "2", "--nq", "7", "--mask", "PAD0")
CORRECT = [("FlashPaddedAttention", None, EMPTY), ("BertPaddedSelfAttention", None, EMPTY),
           ("T5KeepAttention", None, ("--scale", "1", *EMPTY)),
           ("OffsetScoresAttention", None, ("--batch", "2", "--nq", "7", "--mask", "PAD")),
           ("CTRLLikeAttention", None, ("--causal", "--cache", "3"))]
PLANTS = [("FlashPaddedAttention", "bug='polarity'", EMPTY, "mask.polarity"),
          ("BertPaddedSelfAttention", "bug='merge_no_transpose'", EMPTY, "heads.merge_without_transpose"),
          ("T5KeepAttention", "bug='scaled'", ("--scale", "1", *EMPTY), "scale.none"),
          ("OffsetScoresAttention", "bug='no_scale'", ("--batch", "2", "--nq", "7", "--mask", "PAD"), "scale.none"),
          ("CTRLLikeAttention", "bug='slice_off_by_one'", ("--causal", "--cache", "3"), "mask.off_by_one")]


def test_the_plants_change_the_output():
    """Each plant changes what its style returns (on the sequences that have a token)."""
    torch.manual_seed(0)
    empty = _empty_first()
    for name, init, _, _ in PLANTS:
        bug = init.split("'")[1]
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=bug)
        x = torch.randn(2, 7, 24 if name.startswith("Bert") else 32)
        if name == "CTRLLikeAttention":
            past = torch.randn(2, 2, 4, 3, 8)
            square = torch.triu(torch.ones(10, 10), 1)
            a, b = good(x, square, layer_past=past)[0], bad(x, square, layer_past=past)[0]
        else:
            mask = _keep() if name.startswith("Offset") else empty
            given = mask if name.startswith("Flash") else mask.float()
            key = {"Flash": "key_padding_mask", "T5Kee": "mask"}.get(name[:5], "attention_mask")
            a, b = good(x, **{key: given})[1], bad(x, **{key: given})[1]
        assert (a - b).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")
