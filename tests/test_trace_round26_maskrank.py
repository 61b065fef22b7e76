"""`attnscope trace` gives a mask the code takes in several forms in each of them once the first lines up
(runs/trace_maskranks.py, usertrace/maskranks.py): code that branches on its mask's rank runs other ops for a form
trace does not hand first, and a mistake there was missed (exit 0). HF Pix2Struct's vision attention, handed a 4-D
mask, never ran its 2-D branch; BERT's get_extended_attention_mask, handed key padding [n_batch, n_K], never its 3-D
one. Styles of our own (tests/trace_styles_round26_maskrank.py), each checked against F.scaled_dot_product_attention
in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from test_trace_round25_maskforms import _keep, files  # noqa: F401  (files: the key padding [2, 7] fixture)
from tracecases import assert_named, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round26_maskrank.py")
styles = user_module(STYLES)


def test_the_styles_are_masked_attention_in_every_form():
    """Each correct style, in each form of the mask it takes, is SDPA in float64 with the padding."""
    torch.manual_seed(0)
    keep = _keep()
    allowed = keep[:, None, None, :]  # [B, 1, 1, N]
    per_query = allowed.expand(2, 1, 7, 7)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.Pix2StructVisionLike().double()
    want = m.output(sdpa(m.query(x), m.key(x), m.value(x), 4, allowed, scale=1.0))
    for mask in (keep.double(), allowed.double(), per_query.double()):
        torch.testing.assert_close(m(x, attention_mask=mask)[0], want)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.BertExtendingSelfAttention().double()
    want = m.dense(sdpa(m.query(x), m.key(x), m.value(x), 3, allowed))
    for mask in (keep.double(), keep[:, None, :].double(), per_query[:, 0].double()):
        torch.testing.assert_close(m(x, attention_mask=mask), want)
    m = styles.DiffusersLikeAttention().double()
    want = m.to_out[0](sdpa(m.to_q(x), m.to_k(x), m.to_v(x), 3, allowed))
    bias = torch.zeros(2, 1, 7, dtype=torch.float64).masked_fill(~keep[:, None, :], float("-inf"))
    for mask in (keep.double(), bias, bias.expand(2, 7, 7)):
        torch.testing.assert_close(m(x, attention_mask=mask), want)


UNSCALED = ("--scale", "1", "--batch", "2", "--nq", "7", "--mask", "PAD")
PADDED = ("--batch", "2", "--nq", "7", "--mask", "PAD")
CORRECT = [("Pix2StructVisionLike", None, UNSCALED), ("BertExtendingSelfAttention", None, PADDED),
           ("DiffusersLikeAttention", None, PADDED)]
PLANTS = [("Pix2StructVisionLike", "bug='mask_on_queries'", UNSCALED, "mask.on_queries"),
          ("Pix2StructVisionLike", "bug='scaled'", UNSCALED, "scale.none"),
          ("Pix2StructVisionLike", "bug='merge_no_transpose'", UNSCALED, "heads.merge_without_transpose"),
          ("BertExtendingSelfAttention", "bug='mask3d_transposed'", PADDED, "mask.on_queries"),
          ("BertExtendingSelfAttention", "bug='no_scale'", PADDED, "scale.none"),
          ("DiffusersLikeAttention", "bug='mask2d_on_queries'", PADDED, "mask.on_queries"),
          ("DiffusersLikeAttention", "bug='no_scale'", PADDED, "scale.none"),
          ("DiffusersLikeAttention", "bug='merge_no_transpose'", PADDED, "heads.merge_without_transpose")]


def test_the_plants_change_the_output():
    """Each plant changes what its style returns for a mask in the form whose branch it sits in."""
    torch.manual_seed(0)
    keep = _keep().float()
    forms = {"mask_on_queries": keep, "mask3d_transposed": keep[:, None, :], "mask2d_on_queries": keep}
    for name, init, _, _ in PLANTS:
        bug = init.split("'")[1]
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=bug)
        x = torch.randn(2, 7, 32 if name.startswith("Pix") else 24)
        mask = forms.get(bug, keep)

        def out(m, x=x, mask=mask):
            got = m(x, attention_mask=mask)
            return got[0] if isinstance(got, tuple) else got

        assert (out(good) - out(bad)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


@pytest.mark.parametrize(("target", "init", "options", "shape"), [
    ("Pix2StructVisionLike", "bug='mask_on_queries'", UNSCALED, "[n_batch, n_K]"),
    ("BertExtendingSelfAttention", "bug='mask3d_transposed'", PADDED, "[n_batch, 1, n_K]")])
def test_the_divergence_says_the_form_given(request, runner, target, init, options, shape):
    """The plant in a branch trace's first form never reaches: named in the run given the other form, which the
    divergence and a note say."""
    paths = request.getfixturevalue("files")
    code, out = run_case(runner, STYLES, target, init, tuple(paths.get(o, o) for o in options))
    found = assert_named(code, out, "mask.on_queries")
    assert found["diagnosis"].startswith(f"with the mask given as {shape}, "), found
    said = [" ".join(n.split()) for n in out["notes"] if "more than one form" in n]
    assert said and f"given {shape}, " in said[0] and "it does not" in said[0], out["notes"]
