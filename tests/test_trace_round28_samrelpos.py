"""`attnscope trace` on decomposed 2-D relative positions whose term is laid out as the scores by an op that reads the
scores' shape alone (round 28's transformers SamVisionAttention: `decomposed_rel_pos.reshape_as(attn_weights)`), in
styles of its own (tests/trace_styles_round28_samrelpos.py): `.reshape_as`, `.view_as` and `.expand_as` lend a shape,
not values, so the term is the code's own, made from its queries and tables, and the correct code passes; the
mistakes beside it (the scale, the softmax's axis, the merge of the heads) are named by experiment.

Each correct style is first checked against a float64 formula of the decomposed relative-position attention:
softmax(q · kᵀ / √d + q · R_h[r_i − r_j] + q · R_w[c_i − c_j]) · v, per head, from the module's own weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_command import trace, user_module
from trace_round14_helpers import planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round28_samrelpos.py")
styles = user_module(STYLES)
GRID = 3


def _weights(m):
    """q, k, v, output layers' (weight, bias) and the row and column tables, whatever the style calls them."""
    if hasattr(m, "qkv"):
        w, b = m.qkv.weight.chunk(3, 0), m.qkv.bias.chunk(3, 0)
        qkv = list(zip(w, b, strict=True))
    else:
        qkv = [(f.weight, f.bias) for f in (m.to_q, m.to_k, m.to_v)]
    out = next(getattr(m, n) for n in ("proj", "out", "o") if hasattr(m, n))
    tables = next((getattr(m, a), getattr(m, b)) for a, b in (("rel_pos_h", "rel_pos_w"), ("table_y", "table_x"),
                                                             ("pos_rows", "pos_cols")) if hasattr(m, a))
    return qkv, (out.weight, out.bias), tables


def _formula(m, x):
    """The decomposed relative-position attention in float64, written out index by index."""
    B, N, C = x.shape
    h, d = m.heads, C // m.heads
    qkv, (wo, bo), (table_r, table_c) = _weights(m)
    q, k, v = ((x @ w.T + b).reshape(B, N, h, d).permute(0, 2, 1, 3) for w, b in qkv)
    pos = torch.arange(N)
    r, c = pos // GRID, pos % GRID
    rel_r = table_r[r[:, None] - r[None, :] + GRID - 1]  # [N, N, d]: the query's row minus the key's
    rel_c = table_c[c[:, None] - c[None, :] + GRID - 1]
    scores = q @ k.transpose(-1, -2) / d ** 0.5 + torch.einsum("bhid,ijd->bhij", q, rel_r + rel_c)
    out = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, N, C)
    return out @ wo.T + bo


CORRECT = ["FoldedReshapeAs", "HeadsViewAs", "ExpandedParts", "ViewedHelper"]
PLANTS = [("FoldedReshapeAs", "no_scale", "scale.none"), ("FoldedReshapeAs", "softmax_axis", "softmax.axis"),
          ("FoldedReshapeAs", "merge_no_transpose", "heads.merge_without_transpose"),
          ("FoldedReshapeAs", "split_no_permute", "heads.split_without_permute"),
          ("HeadsViewAs", "scale_d_head", "scale.d_head"), ("HeadsViewAs", "softmax_axis", "softmax.axis"),
          ("ExpandedParts", "softmax_axis", "softmax.axis"),
          ("ExpandedParts", "merge_no_transpose", "heads.merge_without_transpose"),
          ("ExpandedParts", "split_no_permute", "heads.split_without_permute"),
          ("ViewedHelper", "split_no_permute", "heads.split_without_permute"),
          ("ViewedHelper", "no_scale", "scale.none")]


def test_the_styles_are_the_formula_and_the_plants_change_them():
    x = torch.randn(2, GRID * GRID, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        for name in CORRECT:
            cls = getattr(styles, name)
            m = cls().double().eval()
            want = _formula(m, x)
            assert torch.allclose(m(x), want, atol=1e-9), name
            for style, bug, _ in PLANTS:
                if style == name:
                    assert (planted(cls, m, bug, x) - want).abs().max() > 1e-3, (name, bug)


@pytest.mark.parametrize("name", CORRECT)
def test_a_term_laid_out_by_the_scores_shape_is_the_codes_own(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", str(GRID * GRID))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["error"] is None
    assert any(n.startswith("your code adds a term of its own to its scores") for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "bug", "cause"), PLANTS, ids=[f"{p[0]}-{p[1]}" for p in PLANTS])
def test_mistakes_beside_it_are_named_by_experiment(runner, name, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", "--nq", str(GRID * GRID))
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == cause, first
    assert first["evidence"].startswith("by experiment"), first
