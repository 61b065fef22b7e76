"""A rerun of the reference with a mistake applied is evidence only where the mistake shows in the code's numbers
(usertrace/evidence.py, asked by rerun.reproduces): NaN met by NaN is nobody's. HF Pix2Struct's vision attention
handed its 0/1 keep mask as 0 / -inf returned NaN, `mask.after_softmax`'s rerun was NaN too, and correct code was
told "by experiment: mask.after_softmax". Here correct modules whose output is NaN by their own nature under the
form trace gives (a left-padded causal batch, an image of padding alone: no form leaves every query a key, so none
is retried) name no mistake by experiment; plants are still named, a mistake's own NaN (an additive mask added after
the softmax) among them. Styles: tests/trace_styles_round26_nanonly.py, each checked against
F.scaled_dot_product_attention in float64."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _trace_ref import sdpa
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

from attnscope.usertrace.evidence import evidenced

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round26_nanonly.py")
styles = user_module(STYLES)


def _pads() -> dict[str, torch.Tensor]:
    """Key padding [n_batch, n_K], True = a real token: RIGHT pads the ends, LEFT the first sequence's first two
    tokens (under a causal rule its first two queries see no key), EMPTY leaves the second sequence no real token."""
    right = torch.ones(2, 7, dtype=torch.bool)
    right[0, 5:], right[1, 6:] = False, False
    left = torch.ones(2, 7, dtype=torch.bool)
    left[0, :2], left[1, 6:] = False, False
    empty = torch.ones(2, 7, dtype=torch.bool)
    empty[0, 5:], empty[1] = False, False
    return {"RIGHT": right, "LEFT": left, "EMPTY": empty}


@pytest.fixture()
def files(tmp_path):
    paths = {}
    for name, pad in _pads().items():
        np.save(tmp_path / f"{name}.npy", pad.numpy())
        paths[name] = str(tmp_path / f"{name}.npy")
    return paths


def test_the_styles_are_masked_attention():
    torch.manual_seed(0)
    pads = _pads()
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.VisionBiasAttention().double()
    keep = pads["RIGHT"][:, None, None, :]
    torch.testing.assert_close(m(x, pads["RIGHT"].double()), m.output(sdpa(m.query(x), m.key(x), m.value(x), 4,
                                                                              keep, scale=1.0)))
    m = styles.LeftPaddedDecoder().double()
    q, k, v = m.c_attn(x).split(32, dim=2)
    for name in ("RIGHT", "LEFT"):
        allowed = pads[name][:, None, None, :] & causal
        got, want = m(x, pads[name][:, None, None, :].double()), m.c_proj(sdpa(q, k, v, 4, allowed))
        seen = allowed.any(-1)[:, 0, :]  # [B, N]: the queries that see a key
        torch.testing.assert_close(got[seen], want[seen])
        assert bool(got[~seen].isnan().all())  # a query that sees no key: NaN, the code's own softmax of -inf
    # given 0 / -inf, as its ops read (`causal + pad`), the decoder masks every key: NaN everywhere
    additive = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(~pads["RIGHT"][:, None, None, :], -math.inf)
    assert bool(m(x, additive).isnan().all())
    m = styles.FoldedHeadsAttention().double()
    allowed = pads["RIGHT"][:, None, None, :] & causal
    mask = torch.zeros(2, 1, 7, 7, dtype=torch.float64).masked_fill(~allowed, -math.inf)
    torch.testing.assert_close(m(x, mask), m.out_proj(sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 4, allowed)))


CAUSAL = ("--causal", "--batch", "2", "--nq", "7", "--mask", "RIGHT")
UNSCALED = ("--scale", "1", "--batch", "2", "--nq", "7", "--mask", "RIGHT")
CORRECT = [("VisionBiasAttention", None, UNSCALED), ("LeftPaddedDecoder", None, CAUSAL),
           ("FoldedHeadsAttention", None, CAUSAL)]
PLANTS = [("VisionBiasAttention", "bug='scaled'", UNSCALED, "scale.none"),
          ("VisionBiasAttention", "bug='merge_no_transpose'", UNSCALED, "heads.merge_without_transpose"),
          ("LeftPaddedDecoder", "bug='no_scale'", CAUSAL, "scale.none"),
          ("LeftPaddedDecoder", "bug='merge_no_transpose'", CAUSAL, "heads.merge_without_transpose"),
          ("FoldedHeadsAttention", "bug='added_after'", CAUSAL, "mask.after_softmax"),
          ("FoldedHeadsAttention", "bug='merge_no_transpose'", CAUSAL, "heads.merge_without_transpose")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    keep = _pads()["RIGHT"]
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    masks = {"VisionBiasAttention": keep.float(), "LeftPaddedDecoder": keep[:, None, None, :].float(),
             "FoldedHeadsAttention": torch.zeros(2, 1, 7, 7).masked_fill(~(keep[:, None, None, :] & causal), -1e9)}
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        x = torch.randn(2, 7, 32)
        assert (good(x, masks[name]) - bad(x, masks[name])).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


@pytest.mark.parametrize(("target", "options"), [
    ("LeftPaddedDecoder", ("--causal", "--batch", "2", "--nq", "7", "--mask", "LEFT")),
    ("VisionBiasAttention", ("--scale", "1", "--batch", "2", "--nq", "7", "--mask", "EMPTY"))])
def test_a_nan_output_of_correct_code_names_no_mistake(runner, files, target, options):
    """Given 0 / -inf, the code's output is NaN everywhere, and `mask.after_softmax`'s rerun (NaN wherever a query
    has a masked key) was named by experiment: the two agreed on NaN alone."""
    code, out = run_case(runner, STYLES, target, None, tuple(files.get(o, o) for o in options))
    found = out["first_divergence"]
    assert found is None or (found["experiment"] is None and not found["evidence"].startswith("by experiment")), found


def _steps(overflow: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The reference's steps and a run's: q @ kᵀ past the largest number at two cells of query 0 (overflow), the
    softmax then NaN on that row and the output with it; else a run NaN everywhere from its weights on."""
    torch.manual_seed(1)
    scores = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    ref = {"scores": scores, "attention": scores.softmax(-1), "out": scores.softmax(-1) @ v}
    run = scores.clone()
    if overflow:
        run[..., 0, :2] = math.inf
        attention = run.softmax(-1)
    else:
        attention = torch.full_like(scores, math.nan)
    return ref, {"scores": run, "attention": attention, "out": attention @ v}


def test_agreeing_on_nan_alone_is_no_evidence():
    ref, run = _steps(overflow=True)
    order, tol = ["scores", "attention", "out"], lambda *_: 1e-6
    held = {"scores": object(), "attention": object(), "out": object()}
    assert evidenced(order, "out", ref, run, {}, held, tol)  # the inf starts where the code's does
    assert not evidenced(order, "out", ref, run, {}, {"attention": object(), "out": object()}, tol)  # not held
    spread = {**run, "out": torch.full_like(run["out"], math.nan)}  # NaN on every row past the weights
    assert not evidenced(order, "out", ref, spread, {}, {"scores": object(), "out": object()}, tol)
    assert evidenced(order, "out", ref, spread, {}, held, tol)  # the weights, held, show where it spread from
    ref, run = _steps(overflow=False)
    assert not evidenced(order, "out", ref, run, {}, {"out": object()}, tol)  # NaN met by NaN, nothing else
