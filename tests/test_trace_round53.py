"""Held-out round 53 (SegFormer, LeViT, OpenELM, Jais, GIT, NEZHA, Hiera, Gemma 1): two of its findings, in styles
written afresh.

LeViT's projections are a Linear then BatchNorm1d in eval mode (MLPLayerWithBN): trace split the Linear's output
by width and refused correct code ("4 query heads cannot share 6 key/value heads"). The norm is a scale and a shift
per channel, so the pair is now read as one projection (usertrace/normfold.py), with a note.

GIT's prefix-LM attention with its text tokens' causal part built with `triu(..., diagonal=0)` (a
token no longer sees itself) was named `mask.window_untold` "by experiment", the rerun with a window of 1 giving
back "your x (line 49)": with each query seeing itself alone, the rerun's output is the values, which the code
holds at its head split, before it ever scores. rerun.reproduces now takes the run's output only from a tensor of the
code's made from its scores (or a softmax, an exp, a kernel): the divergence is said at the masked scores, not by
experiment. The style is checked first against F.scaled_dot_product_attention in float64 with the mask written
out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from trace_styles_round53 import BatchNormedAttention, PrefixLMSelfAttention
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_round53.py")
B, N, PREFIX = 2, 7, 3


def _allowed() -> np.ndarray:
    keep = np.zeros((B, N, N), dtype=bool)
    keep[:, :, :PREFIX] = True  # every token sees the prefix
    for i in range(PREFIX, N):
        keep[:, i, PREFIX:i + 1] = True  # the text causally
    return keep


def test_the_style_is_its_formula_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = PrefixLMSelfAttention().double().eval()
    x = torch.randn(B, N, 32, dtype=torch.float64)
    q, k, v = (p(x).view(B, N, 4, 8).transpose(1, 2) for p in (m.query, m.key, m.value))
    keep = torch.from_numpy(_allowed())[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, N, 32)
    got = m(x)
    assert (got - want).abs().max() < 1e-10
    planted = PrefixLMSelfAttention(bug="future_diagonal").double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).nan_to_num(nan=1.0).abs().max() > 1e-3


def test_a_mistake_in_the_codes_own_mask_is_never_evidenced_by_its_values(runner, tmp_path):
    options = ("--mask", saved(tmp_path, "prefix.npy", _allowed()), "--batch", str(B), "--nq", str(N))
    assert_passes(*run_case(runner, STYLES, "PrefixLMSelfAttention", None, options))
    code, out = run_case(runner, STYLES, "PrefixLMSelfAttention", "bug='future_diagonal'", options)
    found = out["first_divergence"]
    assert code == 1 and found["reference"] == "masked_scores", found
    assert found["user"] == "scores" and found["experiment"] != "mask.window_untold", found


def _folded(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """LinearBatchNorm in eval mode as one weight and bias: a = gamma / sqrt(var + eps), c = beta - mean · a."""
    norm = layer.batch_norm
    a = norm.weight / torch.sqrt(norm.running_var + norm.eps)
    return a[:, None] * layer.linear.weight, norm.bias - norm.running_mean * a


def test_the_batch_normed_style_is_its_formula_and_the_plants_change_it():
    torch.manual_seed(0)
    m = BatchNormedAttention().double().eval()
    x = torch.randn(B, N, 32, dtype=torch.float64)
    qkv = F.linear(x, *_folded(m.qkv)).view(B, N, 4, 32).transpose(1, 2)
    q, k, v = qkv.split([8, 8, 16], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, 64)
    want = F.linear(out, *_folded(m.proj))
    got = m(x)
    assert (got - want).abs().max() < 1e-10
    for bug in ("softmax_queries", "merge_no_transpose"):
        planted = BatchNormedAttention(bug=bug).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - got).abs().max() > 1e-3


def test_a_projection_then_its_batch_norm_is_one_projection(runner):
    code, out = run_case(runner, STYLES, "BatchNormedAttention")
    assert_passes(code, out)
    said = " ".join(" ".join(out["notes"]).split())
    assert "qkv.linear then qkv.batch_norm" in said and "proj.linear then proj.batch_norm" in said, said
    assert_named(*run_case(runner, STYLES, "BatchNormedAttention", "bug='softmax_queries'"), "softmax.axis")
    assert_named(*run_case(runner, STYLES, "BatchNormedAttention", "bug='merge_no_transpose'"),
                 "heads.merge_without_transpose")
