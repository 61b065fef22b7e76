"""`attnscope trace` on what held-out rounds 38 and 39 left: MobileBERT's values read the block's full width beside
its bottlenecked queries and keys (trace fed every input the queries' width and the code raised; each input is now
fed at the width its projection reads, and the reference's W_v reads it too); heads split (d_head, n_head) in every
projection and merged back so (SuperGlue's checkpoint layout, BERT's `transpose_for_scores` written (head_size,
heads)): a convention, the queries alone so `heads.split_transposed`; code that raises on every mask trace writes for
--causal (it was run unmasked and read `mask.not_applied`; now refused, exit 2); TorchScript helpers (Sockeye's)
run as their Python; LayoutLMv2's lone fused `qkv_linear` without an output projection, and its `rel_pos`. Each
correct style is checked against a float64 formula, each plant shown to change its output and named by experiment."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import assert_named, assert_passes, run_case, saved

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round38_widths.py")
styles = user_module(STYLES)


@pytest.fixture()
def padding(tmp_path):
    keep = np.ones((2, 9), dtype=bool)
    keep[1, 6:] = False
    return saved(tmp_path, "pad.npy", keep)


def _inputs(g):
    q = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 9, 48, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 9, dtype=torch.float64)
    mask[1, ..., 6:] = -10000.0
    return q, k, v, mask


def test_the_styles_are_their_formulas_and_the_plants_change_them():
    g = torch.Generator().manual_seed(38)
    m = styles.MobileSelf().double().eval()
    q_in, k_in, v_in, mask = _inputs(g)
    with torch.no_grad():
        q, k, v = (p(t).unflatten(-1, (4, 8)).transpose(1, 2) for p, t in ((m.query, q_in), (m.key, k_in),
                                                                            (m.value, v_in)))
        keep = mask == 0
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        want = want.transpose(1, 2).reshape(2, 7, 32)
        assert torch.allclose(m(q_in, k_in, v_in, mask), want, atol=1e-10)
        for bug in ("q_heads_last", "scale_all", "no_permute", "mask_after"):
            got = planted(styles.MobileSelf, m, bug, q_in, k_in, v_in, mask)
            assert (got - want).abs().max() > 1e-3, bug

        # every projection split (head_size, heads) and merged back so: attention over strided heads, which a
        # checkpoint laid so computes (the heads' rows taken h, h + n_head, ...)
        order = torch.arange(32).view(8, 4).t().reshape(-1)  # strided head h: features h, h + 4, ...
        q, k, v = (p(t)[..., order].unflatten(-1, (4, 8)).transpose(1, 2) for p, t in ((m.query, q_in), (m.key, k_in),
                                                                                      (m.value, v_in)))
        strided = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2)
        strided = strided.reshape(2, 7, 32)[..., torch.argsort(order)]
        assert torch.allclose(planted(styles.MobileSelf, m, "heads_last", q_in, k_in, v_in, mask), strided, atol=1e-10)

        s = styles.GlueAttention().double().eval()
        x, src, val = (torch.randn(2, 32, n, generator=g, dtype=torch.float64) for n in (6, 9, 9))
        order = torch.arange(32).view(8, 4).t().reshape(-1)
        q, k, v = (layer(t).transpose(1, 2)[..., order].unflatten(-1, (4, 8)).transpose(1, 2)
                   for layer, t in zip(s.proj, (x, src, val), strict=True))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 6, 32)
        want = s.merge(heads[..., torch.argsort(order)].transpose(1, 2))
        assert torch.allclose(s(x, src, val), want, atol=1e-10)
        for bug in ("merge_head_major", "value_from_source", "scale_model"):
            assert (planted(styles.GlueAttention, s, bug, x, src, val) - want).abs().max() > 1e-3, bug

        o = styles.OwnMaskForm().double().eval()
        x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        heads = [p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (o.q_proj, o.k_proj, o.v_proj)]
        want = o.o_proj(torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
                        .transpose(1, 2).reshape(2, 6, 32))
        assert torch.allclose(o(x, causal.expand(2, 4, 1, 6, 6)), want, atol=1e-10)


def test_values_wider_than_the_queries_are_fed_at_their_projections_width(runner, padding):
    code, out = run_case(runner, STYLES, "MobileSelf", None, ("--batch", "2", "--nk", "9", "--mask", padding))
    assert_passes(code, out)
    assert out["params"]["sizes"]["d_v_in"] == 48 and out["params"]["sizes"]["d_feat"] == 32, out["params"]
    value = next(s for s in out["steps"] if s["name"] == "value_tensor")
    assert value["shape"] == [2, 9, 48] and value["dims"][-1] == "d_v_in", value


def test_every_projection_split_strided_is_a_convention(runner, padding):
    code, out = run_case(runner, STYLES, "MobileSelf", "bug='heads_last'", ("--batch", "2", "--nk", "9", "--mask",
                                                                           padding))
    assert_passes(code, out)
    assert any(n.startswith("heads strided: your code splits its queries, keys and values each as (d_head, n_head)")
               for n in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "GlueAttention", None, ("--nk", "9"))
    assert_passes(code, out)
    assert "heads strided (split and merge)" in out["reference"], out["reference"]


@pytest.mark.parametrize(("bug", "entry"), [("merge_head_major", "heads.merge_wrong_permute"),
                                            ("value_from_source", "kv.values_from_keys"),
                                            ("scale_model", "scale.d_model")])
def test_the_strided_styles_plants_are_named(runner, bug, entry):
    assert_named(*run_case(runner, STYLES, "GlueAttention", f"bug={bug!r}", ("--nk", "9")), entry)


@pytest.mark.parametrize(("bug", "entry"), [("q_heads_last", "heads.split_transposed"), ("scale_all", "scale.d_model"),
                                            ("no_permute", "heads.merge_without_transpose"),
                                            ("mask_after", "mask.after_softmax")])
def test_its_plants_are_named(runner, padding, bug, entry):
    code, out = run_case(runner, STYLES, "MobileSelf", f"bug={bug!r}", ("--batch", "2", "--nk", "9", "--mask",
                                                                          padding))
    assert_named(code, out, entry)


def test_a_mask_the_code_raises_on_in_every_form_is_refused_not_blamed(runner):
    from test_trace_command import trace

    result, out = trace(runner, f"{STYLES}:OwnMaskForm", "--causal")
    assert result.exit_code == 2 and out is None, result.stdout
    line = result.stderr.strip()
    assert line.count("\n") == 0 and "--causal: your code raised on the mask trace handed to mask" in line, line
    assert "pass --mask FILE, or run without --causal" in line and "Traceback" not in line, line


def test_the_reference_reads_values_of_their_own_width():
    from attnscope.attention.multihead import MultiHeadAttention

    g = torch.Generator().manual_seed(5)
    ref = MultiHeadAttention(32, 4, d_v_in=48, dtype=torch.float64)
    q, k, v = (torch.randn(2, n, w, generator=g, dtype=torch.float64) for n, w in ((5, 32), (6, 32), (6, 48)))
    heads = [w(t).unflatten(-1, (4, 8)).transpose(1, 2) for w, t in ((ref.W_q, q), (ref.W_k, k), (ref.W_v, v))]
    scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(8)
    want = ref.W_o((scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(ref(q, k, v)["x"], want, atol=1e-10)


def test_tolerances_and_layouts_kept_across_a_trace_follow_the_tensor():
    """align.tolerance keeps its answer per tensor while the tensor is not written to (a trace asks it of the same
    tensors thousands of times); a tensor written in place, or asked in another dtype, gets its own answer; layouts
    hands each caller a list of its own."""
    from attnscope.usertrace.align import layouts, tolerance

    t = torch.ones(3, dtype=torch.float32)
    assert tolerance(t) == pytest.approx(1e-5 + 1e-4)
    t.mul_(100.0)
    assert tolerance(t) == pytest.approx(1e-5 + 1e-4 * 100)
    assert tolerance(t, torch.float16) == pytest.approx(2e-3 + 2e-3 * 100)
    assert tolerance(torch.tensor([float("-inf"), 2.0], dtype=torch.float64)) == pytest.approx(1e-10 + 1e-7 * 2)
    first = layouts((2, 4, 7, 8), (2, 7, 32))
    first.clear()
    assert layouts((2, 4, 7, 8), (2, 7, 32)), "a caller's change reached the kept layouts"


def test_torchscript_helpers_run_as_python_and_their_plant_is_named(runner):
    g = torch.Generator().manual_seed(7)
    m = styles.ScriptedAttention().double().eval()
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        heads = [p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q, m.k, m.v)]
        want = m.o(torch.nn.functional.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(2, 6, 32))
        assert torch.allclose(m(x), want, atol=1e-10)
        assert (planted(styles.ScriptedAttention, m, "unscaled", x) - want).abs().max() > 1e-3
    code, out = run_case(runner, STYLES, "ScriptedAttention")
    assert_passes(code, out)
    assert any(n.startswith("split_heads, dot_scores: compiled with @torch.jit.script") for n in out["notes"]), \
        out["notes"]
    inside = Path(STYLES).read_text().splitlines().index("    return torch.matmul(q, k.transpose(-1, -2)) * scale") + 1
    scores = next(row for row in out["alignment"] if row["reference"] == "scores")
    assert scores["status"] == "equal" and scores["line"] == inside, scores  # seen inside the compiled helper
    assert_named(*run_case(runner, STYLES, "ScriptedAttention", "bug='unscaled'"), "scale.none")


@pytest.fixture()
def fast_qkv_files(tmp_path):
    g = torch.Generator().manual_seed(9)
    bias = torch.randn(2, 4, 7, 7, generator=g).numpy()
    keep = np.ones((2, 7), dtype=bool)
    keep[1, 5:] = False
    np.save(tmp_path / "rel.npy", bias)
    np.save(tmp_path / "pad.npy", keep)
    return {"REL": str(tmp_path / "rel.npy"), "PAD": str(tmp_path / "pad.npy")}


def test_one_fused_linear_alone_without_an_output_projection_and_rel_pos(runner, fast_qkv_files):
    g = torch.Generator().manual_seed(8)
    m = styles.FastQkv().double().eval()
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    rel = torch.from_numpy(np.load(fast_qkv_files["REL"])).double()
    masked = torch.zeros(2, 1, 1, 7, dtype=torch.bool)
    masked[1, ..., 5:] = True
    with torch.no_grad():
        q, k, v = (m.qkv_linear(x) + torch.cat((m.q_bias, torch.zeros_like(m.q_bias), m.v_bias), -1)).chunk(3, -1)
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (q, k, v))
        bias = rel.masked_fill(masked, float("-inf"))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)
        assert torch.allclose(m(x, masked, rel), want.reshape(2, 7, 32), atol=1e-10)
        assert (planted(styles.FastQkv, m, "bias_transposed", x, masked, rel) - want.reshape(2, 7, 32)).abs().max() \
            > 1e-3
    options = ("--batch", "2", "--nq", "7", "--mask", fast_qkv_files["PAD"], "--position-bias", fast_qkv_files["REL"])
    code, out = run_case(runner, STYLES, "FastQkv", None, options)
    assert_passes(code, out)
    assert "o=(none)" in out["reference"], out["reference"]
    assert_named(*run_case(runner, STYLES, "FastQkv", "bug='bias_transposed'", options), "t5.transposed")


def test_a_learned_gain_per_coordinate_on_the_queries_is_a_convention(runner):
    g = torch.Generator().manual_seed(10)
    m = styles.PerDimScaled().double().eval()
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    causal = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -1e30)
    with torch.no_grad():
        gain = torch.nn.functional.softplus(m.scaling) * 1.442695041 / math.sqrt(8)
        q, k, v = (p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = torch.nn.functional.scaled_dot_product_attention(q * gain, k, v, is_causal=True, scale=1.0)
        want = m.o_proj(want.transpose(1, 2).reshape(2, 6, 32))
        assert torch.allclose(m(x, causal), want, atol=1e-10)
        assert float(gain.max() - gain.min()) > 0.05  # a vector, not one number
        for bug in ("keys_from_values", "extra_scale"):
            assert (planted(styles.PerDimScaled, m, bug, x, causal) - want).abs().max() > 1e-3, bug
    code, out = run_case(runner, STYLES, "PerDimScaled", None, ("--causal",))
    assert_passes(code, out)
    assert any("a learned gain per coordinate of each head" in n for n in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "PerDimScaled", "bug='keys_from_values'", ("--causal",)),
                 "kv.keys_from_values")
    found = assert_named(*run_case(runner, STYLES, "PerDimScaled", "bug='extra_scale'", ("--causal",)), "scale.none")
    assert "the gain on your queries is then your module's whole scale" in found["diagnosis"], found
