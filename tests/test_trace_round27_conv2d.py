"""`attnscope trace` reads a pointwise Conv2d (kernel 1x1, stride 1, no padding, one group) over a feature map
[B, C, H, W] as the projection it is, the map's positions the tokens in raster order (usertrace/pointwise.py): the
CompVis latent-diffusion / taming-transformers `AttnBlock` raised on rows ("Expected more than 1 value per channel",
its width misread), a VQGAN-like block with heads over the channels raised unpacking four sizes from three. A module
whose q, k, v are pointwise Conv1d layers and whose output projection is an nn.Linear over the rows it lays out
was refused `--layout col`, and its SDPA kernel's scores read transposed. The column form's note said `Kᵀ Q` for
code that computes `Qᵀ K`: it now says what the traced product computes. Styles of our own
(tests/trace_styles_round27_conv2d.py), each checked against a float64 formula."""

from __future__ import annotations

from pathlib import Path

import torch
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_conv2d.py")
styles = user_module(STYLES)


def _attention(q, k, v, heads):
    """[B, C, n] each, channels head-major: softmax(qᵀk / √d_head) over the keys per head, by the formula, float64,
    handed back [B, C, n]."""
    B, C, n = q.shape
    q, k, v = (t.reshape(B, heads, C // heads, n) for t in (q, k, v))  # [B, H, d, n]
    scores = torch.einsum("bhdi,bhdj->bhij", q, k) / (C // heads) ** 0.5  # [B, H, n_Q, n_K]
    return torch.einsum("bhij,bhdj->bhdi", scores.softmax(dim=-1), v).reshape(B, C, n)


def _pointwise(layer, x):
    """A 1x1 convolution's (or a Linear's over the channels) W @ x + b on [B, C, n]."""
    weight = layer.weight.reshape(layer.weight.shape[0], -1)
    return torch.einsum("oc,bcn->bon", weight, x) + layer.bias[:, None]


def _group_norm(norm, x):
    """GroupNorm by its formula on [B, C, n]."""
    B, C, n = x.shape
    g = x.reshape(B, norm.num_groups, -1)
    g = (g - g.mean(-1, keepdim=True)) / (g.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    return g.reshape(B, C, n) * norm.weight[:, None] + norm.bias[:, None]


MAPS = [("AttnBlock", "norm", ("q", "k", "v", "proj_out"), 1),
        ("SpatialSelfAttention", "norm", ("q", "k", "v", "proj_out"), 1),
        ("MultiHeadAttnBlock", "norm", ("q", "k", "v", "proj_out"), 2),
        ("DiffusersAttentionBlock", "group_norm", ("query", "key", "value", "proj_attn"), 2),
        ("MixedProjections", "norm", ("to_q", "to_k", "to_v", "to_out"), 2)]


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    flat = x.reshape(2, 16, 12)
    for name, norm, names, heads in MAPS:
        m = getattr(styles, name)().double()
        q, k, v, o = (getattr(m, n) for n in names)
        h = _group_norm(getattr(m, norm), flat)
        want = flat + _pointwise(o, _attention(_pointwise(q, h), _pointwise(k, h), _pointwise(v, h), heads))
        torch.testing.assert_close(m(x), want.reshape(x.shape), msg=name)


CORRECT = [("AttnBlock", None, ()), ("AttnBlock", None, ("--layout", "col")), ("SpatialSelfAttention", None, ()),
           ("MultiHeadAttnBlock", None, ()), ("DiffusersAttentionBlock", None, ()), ("MixedProjections", None, ()),
           ("MixedProjections", None, ("--layout", "col"))]
PLANTS = [("AttnBlock", "bug='no_scale'", (), "scale.none"),
          ("AttnBlock", "bug='softmax_queries'", (), "softmax.axis"),
          ("AttnBlock", "bug='kv_swapped'", ("--layout", "col"), "kv.swapped"),
          ("SpatialSelfAttention", "bug='softmax_queries'", (), "softmax.axis"),
          ("MultiHeadAttnBlock", "bug='no_scale'", (), "scale.none"),
          ("MultiHeadAttnBlock", "bug='softmax_queries'", (), "softmax.axis"),
          ("DiffusersAttentionBlock", "bug='k_share'", (), "scale.half"),
          ("MixedProjections", "bug='no_scale'", ("--layout", "col"), "scale.none")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 4)
    for name, init, _, _ in PLANTS + [("AttnBlock", "bug='no_transpose'", (), "")]:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows' own literals
        good = getattr(styles, name)(**{k: v for k, v in kwargs.items() if k != "bug"})
        assert (good(x) - getattr(styles, name)(**kwargs)(x)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def _notes(out):
    return [" ".join(n.split()) for n in out["notes"]]


def test_a_feature_map_is_read_from_the_run(runner):
    code, out = run_case(runner, STYLES, "AttnBlock")
    notes = _notes(out)
    assert code == 0 and out["params"]["layout"] == "col" and out["params"]["sizes"]["d_feat"] == 16, notes
    assert any("takes its input as a feature map, [n_batch, d_feat, n_h, n_w]" in n for n in notes), notes
    assert any("normalizes its input before its projections" in n for n in notes), notes
    n_h, n_w = out["params"]["grid"]
    assert out["params"]["sizes"]["n_Q"] == n_h * n_w
    ops = [step["op"] for step in out["steps"]]
    assert any(op.startswith("line ") and "q @ " in op for op in ops), ops


def test_the_column_note_says_what_the_code_computes(runner):
    """bmm(q, k) with q laid [b, hw, c] is Qᵀ K [.., n_Q, n_K]; einsum("bhdk,bhdq->bhkq", k, q) is Kᵀ Q; an SDPA
    kernel's is Qᵀ K."""
    said = {}
    for name in ("AttnBlock", "MultiHeadAttnBlock", "MixedProjections"):
        code, out = run_case(runner, STYLES, name)
        said[name] = next(n for n in _notes(out) if "read as the column convention" in n)
    assert "scores Qᵀ K [.., n_Q, n_K], softmax over the keys, dim -1" in said["AttnBlock"], said
    assert "scores Kᵀ Q [.., n_K, n_Q], softmax over the keys, dim -2" in said["MultiHeadAttnBlock"], said
    assert "scores Qᵀ K [.., n_Q, n_K]" in said["MixedProjections"], said
    assert "W @ x" in said["AttnBlock"]


def test_the_missing_transpose_of_the_pattern_diverges(runner):
    """`bmm(v, w_)` without `w_.permute(0, 2, 1)`: the values contracted over the queries' axis, named
    pattern.transposed by experiment (tests/test_trace_round27_pattrans.py has it in more styles)."""
    code, out = run_case(runner, STYLES, "AttnBlock", "bug='no_transpose'")
    assert code == 1 and out["first_divergence"]["experiment"] == "pattern.transposed", out["first_divergence"]


def test_only_a_pointwise_conv2d_is_a_projection():
    from attnscope.usertrace import pointwise

    x, w = torch.randn(2, 8, 3, 4), torch.randn(4, 8, 1, 1)
    assert pointwise.conv_args([x, w, None, 1, 0, 1, 1], {}, 2) is not None
    assert pointwise.conv_args([x, w], {"padding": (0, 0), "stride": (1, 1)}, 2) is not None
    assert pointwise.conv_args([x, w, None, (2, 2)], {}, 2) is None  # a stride skips positions
    assert pointwise.conv_args([x, w, None, 1, 1], {}, 2) is None  # padding adds positions
    assert pointwise.conv_args([x, torch.randn(4, 8, 3, 3)], {}, 2) is None  # a wider kernel mixes neighbours
    assert pointwise.conv_args([x, w], {}, 1) is None  # a 4-D kernel is no Conv1d's
    assert pointwise.is_pointwise(torch.nn.Conv2d(8, 4, 1)) and not pointwise.is_pointwise(torch.nn.Conv2d(8, 4, 3))
    assert not pointwise.is_pointwise(torch.nn.Conv2d(8, 4, 1, stride=2))
    assert pointwise.as_matrix(w).shape == (4, 8)


def test_layout_col_refuses_linear_layers_alone(runner):
    from test_trace_command import trace

    result, _ = trace(runner, f"{STYLES}:DiffusersAttentionBlock", "--layout", "col")
    assert result.exit_code == 2 and "nn.Linear layers" in result.stderr, result.stderr
