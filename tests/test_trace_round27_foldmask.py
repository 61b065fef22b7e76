"""`attnscope trace` gives a mask to code that folds its heads into the batch in the shape the code asks for (round 27:
HF ProphetNet's bmm attention, whose own assert asks for an additive `attention_mask` `[n_batch·n_head, 1, src_len]`,
exited 2 with "--mask was given to no argument ... key_value_states is neither", though the argument is named
`attention_mask`). The shape is read from the code (usertrace/maskwant.py): its check (an assert, an `if ..: raise`
comparing the mask's size with a tuple, read in the frame that raised) or the scores the mask met in the op it was fed
to, the heads folded in each sequence's order. Where no shape fits, the error names the mask's argument and the
shapes tried. Styles of our own (tests/trace_styles_round27_foldmask.py), each checked against
F.scaled_dot_product_attention in float64."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _trace_ref import sdpa as _sdpa
from test_trace_command import trace, user_module
from test_trace_round25_maskforms import _keep  # key padding [2, 7]: the first sequence's last two padded
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_foldmask.py")
styles = user_module(STYLES)


@pytest.fixture()
def files(tmp_path):
    """The key padding [2, 7]; a mask per query [2, 1, 7, 7] (causal, and the first sequence's last two keys
    padded), which no key padding carries."""
    keep = _keep().numpy()
    np.save(tmp_path / "pad.npy", keep)
    rule = np.tril(np.ones((7, 7), dtype=bool))[None].repeat(2, 0) & keep[:, None, :]
    np.save(tmp_path / "rule.npy", rule[:, None])
    return {"PAD": str(tmp_path / "pad.npy"), "RULE": str(tmp_path / "rule.npy")}


def _bias(keep: torch.Tensor, heads: int) -> torch.Tensor:
    """Key padding [B, N] as the additive [B·heads, 1, N] a folded code takes: 0 / -inf, each sequence's heads side
    by side (prepare_attention_mask's repeat_interleave)."""
    bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    return bias[:, None, :].repeat_interleave(heads, dim=0)


def test_the_styles_are_masked_attention():
    """Each correct style, given the mask in the shape it asks for, is SDPA in float64 with the padding."""
    torch.manual_seed(0)
    keep = _keep()
    padding = keep[:, None, None, :]
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.BmmAttention().double()
    want = m.out_proj(_sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 4, padding))
    torch.testing.assert_close(m(x, attention_mask=_bias(keep, 4))[0], want)
    for checked in (False, True):
        m = styles.FoldedProcessorAttention(checked=checked).double()
        want = m.to_out[0](_sdpa(m.to_q(x), m.to_k(x), m.to_v(x), 4, padding))
        torch.testing.assert_close(m(x, attention_mask=_bias(keep, 4)), want)
    m = styles.FairseqMultihead().double()
    t = x.transpose(0, 1)  # time-first [T, B, C]
    want = m.out_proj(_sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 4, padding))
    torch.testing.assert_close(m(t, t, t, key_padding_mask=~keep)[0].transpose(0, 1), want)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    rule = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    want = m.out_proj(_sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 4, padding & causal))
    torch.testing.assert_close(m(t, t, t, key_padding_mask=~keep, attn_mask=rule)[0].transpose(0, 1), want)
    m = styles.MaskedSetAttention().double()
    q = m.fc_q(x)
    o = _sdpa(q, m.fc_k(x), m.fc_v(x), 4, padding, scale=1 / math.sqrt(24)) + q  # O = Q_ + A·V_, head by head
    bias = _bias(keep, 4).reshape(2, 4, 1, 7).transpose(0, 1).reshape(8, 1, 7)  # rows head·batch + b
    torch.testing.assert_close(m(x, mask=bias), o + F.relu(m.fc_o(o)))


PADDED = ("--batch", "2", "--nq", "7", "--mask", "PAD")
SET = (*PADDED, "--scale", repr(1 / math.sqrt(24)))  # Set Transformer divides by √dim_V, not √d_head
CORRECT = [("BmmAttention", None, PADDED),
           ("FoldedProcessorAttention", "checked=True", PADDED),
           ("FoldedProcessorAttention", "checked=False", PADDED),
           ("FairseqMultihead", None, PADDED), ("FairseqMultihead", None, (*PADDED, "--causal")),
           ("MaskedSetAttention", None, SET)]
PLANTS = [("BmmAttention", "bug='mask_on_queries'", PADDED, "mask.on_queries"),
          ("BmmAttention", "bug='mask_after_softmax'", PADDED, "mask.after_softmax"),
          ("FoldedProcessorAttention", "checked=True, bug='mask_on_queries'", PADDED, "mask.on_queries"),
          ("FoldedProcessorAttention", "checked=False, bug='mask_after_softmax'", PADDED, "mask.after_softmax"),
          ("FairseqMultihead", "bug='polarity'", PADDED, "mask.polarity"),
          ("FairseqMultihead", "bug='polarity'", (*PADDED, "--causal"), "mask.polarity"),
          ("FairseqMultihead", "bug='probs_masked'", PADDED, "mask.after_softmax"),
          ("MaskedSetAttention", "bug='mask_after_softmax'", SET, "mask.after_softmax")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    keep = _keep()
    x = torch.randn(2, 7, 24)
    bias = _bias(keep, 4).float()
    for name, init, _, _ in PLANTS:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows above
        good, bad = getattr(styles, name)(**{k: v for k, v in kwargs.items() if k != "bug"}), \
            getattr(styles, name)(**kwargs)
        if name == "FairseqMultihead":
            t = x.transpose(0, 1)
            a, b = good(t, t, t, key_padding_mask=~keep)[0], bad(t, t, t, key_padding_mask=~keep)[0]
        elif name == "MaskedSetAttention":
            a, b = good(x, mask=bias), bad(x, mask=bias)
        else:
            a, b = (m(x, attention_mask=bias) for m in (good, bad))
            a, b = (o[0] if isinstance(o, tuple) else o for o in (a, b))
        diff = (a - b).abs()
        assert not torch.isfinite(b).all() or diff.max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_the_mask_goes_where_the_check_asks(runner, files):
    """ProphetNet's case: the mask given [n_batch·n_head, 1, n_K], additive, as its own assert asks, with the note
    that says so and the mask's dims in those words."""
    code, out = run_case(runner, STYLES, "BmmAttention", None, ("--batch", "2", "--nq", "7", "--mask", files["PAD"]))
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert any("shaped [n_batch·n_head, 1, n_K], as your code's check asks (line " in n and "(8, 1, 7)" in n
               for n in notes), notes
    assert any(n.startswith("attention_mask: additive float") for n in notes), notes
    mask = next(s for s in out["steps"] if s["name"] == "mask")
    assert mask["shape"] == [8, 1, 7] and mask["dims"][0] == "n_batch·n_head", mask


def test_a_mask_no_shape_holds_names_its_argument(runner, files):
    """A mask per query, where the code's assert asks for key padding [n_batch·n_head, 1, n_K]: one line that names
    attention_mask and the shapes trace gave it, never another argument; no traceback."""
    result, out = trace(runner, f"{STYLES}:BmmAttention", "--batch", "2", "--nq", "7", "--mask", files["RULE"])
    assert result.exit_code == 2 and out is None, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "trace gave attention_mask the mask as " in said and "[8, 7, 7]" in said and "(8, 1, 7)" in said, said
    assert "key_value_states" not in said and "Traceback" not in result.stderr, said
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_heads_are_folded_sequence_by_sequence():
    """maskwant.folded: [n_batch, n_K] key padding as [n_batch·n_head, 1, n_K], each sequence's heads side by side;
    a mask that differs across queries only as [n_batch·n_head, n_Q, n_K]; n_head read off the shape where unknown."""
    from attnscope.usertrace.maskwant import folded

    keep = _keep()
    sizes = {"n_batch": 2, "n_Q": 7, "n_K": 7, "n_head": 4}
    form, words, _ = folded(keep[:, None, None, :], [8, 1, 7], sizes)
    assert words == "[n_batch·n_head, 1, n_K]" and torch.equal(form, keep[:, None, :].repeat_interleave(4, dim=0))
    rule = keep[:, None, :] & torch.ones(7, 7, dtype=torch.bool).tril()
    assert folded(rule, [8, 1, 7], sizes) is None
    form, words, _ = folded(rule, [8, 7, 7], {k: v for k, v in sizes.items() if k != "n_head"})
    assert words == "[n_batch·n_head, n_Q, n_K]" and torch.equal(form, rule.repeat_interleave(4, dim=0))
    assert folded(keep, [6, 1, 7], sizes) is None  # not n_batch·n_head


def test_heads_folded_outside_the_batch_get_the_mask_so(runner, files):
    """Set Transformer's `torch.cat(Q.split(d, 2), 0)` folds head-major (row head·n_batch + b): by experiment (every
    sequence made the first, the rows of its pattern equal across sequences in that order alone), the mask is laid
    so, and a note says it."""
    options = tuple(files.get(o, o) for o in SET)
    code, out = run_case(runner, STYLES, "MaskedSetAttention", None, options)
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert any("[n_batch·n_head, 1, n_K], the heads outside the batch (row head·n_batch + b" in n for n in notes), notes
