"""`attnscope trace` on round 12's Llama 4 and ModernBERT forms, in styles of its own (tests/trace_styles_r12_norms.py):
q/k norms without weights read from what the code computes (Llama 4's L2Norm after RoPE, F.rms_norm, F.normalize,
an RMS over the projection by hand), Llama 4's NoPE temperature tuning read from the module, and a local window
handed to a mask parameter named for it (ModernBERT's sliding_window_mask). Each correct style is checked against
transformers' eager modules, SDPA or a float64 formula; each plant is shown to change the output and is named by
experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r12_norms.py")
styles = user_module(STYLES)


def _double(m):
    return m.double().eval()


def _rotated_half(x, base):  # [b, h, n, d], pairs (i, i + d/2), float64
    d, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _rms(x, eps=0.0):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_the_llama4_style_is_transformers_eager_llama4():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    config = Llama4TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              rope_theta=500000.0, use_qk_norm=True, rms_norm_eps=1e-5, no_rope_layers=[1],
                              num_hidden_layers=1, attn_implementation="eager")
    mine = styles.L2NormLlama()
    theirs = Llama4TextAttention(config, 0)
    theirs.load_state_dict(mine.state_dict(), strict=False)
    x = torch.randn(2, 6, 32)
    freqs_cis = Llama4TextRotaryEmbedding(config)(x, torch.arange(6)[None])
    mask = torch.full((6, 6), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        want = theirs(x, freqs_cis, mask)[0]
        assert (mine(x) - want).abs().max() < 1e-5
        wrong = styles.L2NormLlama(bug="gqa_tiled")
        wrong.load_state_dict(mine.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-2


def _want_norms(m, x):
    """The weightless-norm styles in float64: projections, RoPE, norm, SDPA (GQA by repeat_interleave)."""
    b, n, _ = x.shape
    if isinstance(m, styles.RmsNormChat):
        q, k, v = (lin(x).view(b, n, -1, 8).transpose(1, 2) for lin in (m.c_q, m.c_k, m.c_v))
        q, k = _rms(_rotated_half(q, 10000.0), 1.2e-7), _rms(_rotated_half(k, 10000.0), 1.2e-7)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return m.c_proj(y.transpose(1, 2).reshape(b, n, -1))
    if isinstance(m, styles.CosineAttn):
        q, k, v = m.to_qkv(x).chunk(3, -1)
        q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in (q, k, v))
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        return m.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
    q, k, v = _rms(m.wq(x), 1e-6), _rms(m.wk(x), 1e-6), m.wv(x)
    q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in (q, k, v))
    return m.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1))


NORMS = [("RmsNormChat", "scale_twice"), ("CosineAttn", "softmax_axis"), ("ProjRms", "scale_d_model")]


@pytest.mark.parametrize(("name", "bug"), NORMS)
def test_the_norm_styles_are_sdpa_and_the_plants_change_them(name, bug):
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    m = _double(getattr(styles, name)())
    with torch.no_grad():
        want = _want_norms(m, x)
        assert (m(x) - want).abs().max() < 1e-6  # the styles make their RoPE tables in float32
        wrong = _double(getattr(styles, name)(bug=bug))
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-2


NORM_RUNS = [("L2NormLlama", ("--rope", "--causal"), "gqa_tiled", "gqa.tiled", "to RMS 1", "after RoPE; eps 1e-05"),
             ("RmsNormChat", ("--rope", "--causal"), "scale_twice", "scale.twice", "to RMS 1", "after RoPE"),
             ("CosineAttn", (), "softmax_axis", "softmax.axis", "to unit length", "over each head's d_head"),
             ("ProjRms", ("--causal",), "scale_d_model", "scale.d_model", "to RMS 1", "over the whole projection")]


@pytest.mark.parametrize(("name", "options", "bug", "cause", "form", "where"), NORM_RUNS)
def test_a_norm_without_weights_is_read_and_the_plant_named(runner, name, options, bug, cause, form, where):
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if n.startswith("your code normalizes q and k " + form)]
    assert said and where in said[0] and "without weights" in said[0], out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def _tau(n, floor_scale, attn_scale):
    return torch.log1p(torch.floor((torch.arange(n, dtype=torch.float64) + 1) / floor_scale)) * attn_scale + 1


def test_the_tuned_styles_are_llama4s_temperature_over_sdpa():
    """Each query scaled by Llama 4's factor, then SDPA (GQA by repeat_interleave); the plants change the output."""
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    for name, bug, causal in (("NopeTuned", "gqa_tiled", True), ("TunedSdpa", "kv_swapped", True),
                              ("TunedDictConfig", "softmax_axis", False)):
        m = _double(getattr(styles, name)())
        b, n, _ = x.shape
        if name == "TunedSdpa":
            q, k, v = m.qkv(x).chunk(3, -1)
            out, floor, scale, rep = m.proj, 2, 0.5, 1
        else:
            lin = (m.q_proj, m.k_proj, m.v_proj, m.o_proj) if name == "NopeTuned" else (m.wq, m.wk, m.wv, m.wo)
            q, k, v = (f(x) for f in lin[:3])
            out = lin[3]
            floor, scale = (4, 0.1) if name == "NopeTuned" else (3, 0.2)
            rep = 2 if name == "NopeTuned" else 1
        q, k, v = (t.view(b, n, -1, 8).transpose(1, 2) for t in (q, k, v))
        q = q * _tau(n, floor, scale)[:, None]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        want = out(F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(b, n, -1))
        with torch.no_grad():
            assert (m(x) - want).abs().max() < 1e-6, name
            wrong = _double(getattr(styles, name)(bug=bug))
            wrong.load_state_dict(m.state_dict())
            assert (wrong(x) - want).abs().max() > 1e-2, name


TUNED = [("NopeTuned", ("--causal",), "gqa_tiled", "gqa.tiled", "/ 4)) · 0.1 + 1"),
         ("TunedSdpa", ("--causal",), "kv_swapped", "kv.swapped", "/ 2)) · 0.5 + 1"),
         ("TunedDictConfig", (), "softmax_axis", "softmax.axis", "/ 3)) · 0.2 + 1")]


@pytest.mark.parametrize(("name", "options", "bug", "cause", "form"), TUNED)
def test_the_temperature_a_module_declares_is_its_convention(runner, name, options, bug, cause, form):
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("your code scales each query by log1p(floor((i + 1)") and form in n
               for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def test_a_layer_that_declares_the_temperature_and_does_not_tune_is_left_as_it_is(runner):
    """Llama 4's RoPE layers declare floor_scale and attn_scale too and do not tune: no reading where none fits."""
    result, out = trace(runner, f"{STYLES}:NopeTuned", "--causal", "--init", "use_rope=True")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not any("temperature" in n for n in out["notes"]), out["notes"]


W = ("--window", "4", "--window-side", "both")


def _window(n):
    i = torch.arange(n)
    return (i[:, None] - i[None, :]).abs() <= 2


def test_the_window_styles_are_a_local_sdpa_and_the_plants_change_them():
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    near = _window(7)
    additive = torch.zeros(7, 7, dtype=torch.float64).masked_fill(~near, float("-inf"))
    for name, bug, mask in (("WindowMaskBert", "mask_after_softmax", {"sliding_window_mask": additive}),
                            ("LocalBoolMask", "mask_after_softmax", {"window_mask": near}),
                            ("LocalSdpa", "global_mask", {"local_attention_mask": near})):
        m = _double(getattr(styles, name)())
        b, n, _ = x.shape
        if name == "WindowMaskBert":
            q, k, v = m.Wqkv(x).chunk(3, -1)
            out = m.Wo
        elif name == "LocalBoolMask":
            q, k, v, out = m.to_q(x), m.to_k(x), m.to_v(x), m.to_out
        else:
            (q, k, v), out = m.qkv(x).chunk(3, -1), m.proj
        q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in (q, k, v))
        if name == "WindowMaskBert":
            q, k = _rotated_half(q, 80000.0), _rotated_half(k, 80000.0)
        want = out(F.scaled_dot_product_attention(q, k, v, attn_mask=near).transpose(1, 2).reshape(b, n, -1))
        with torch.no_grad():
            assert (m(x, **mask) - want).abs().max() < 1e-6, name
            wrong = _double(getattr(styles, name)(bug=bug))
            wrong.load_state_dict(m.state_dict())
            assert not torch.allclose(wrong(x, **mask), want, atol=1e-2), name


WINDOWED = [("WindowMaskBert", ("--rope",), "sliding_window_mask", "attention_mask", "mask_after_softmax",
             "mask.after_softmax"),
            ("LocalBoolMask", (), "window_mask", "mask", "mask_after_softmax", "mask.after_softmax"),
            ("LocalSdpa", (), "local_attention_mask", "attention_mask", "global_mask", "mask.no_window")]


@pytest.mark.parametrize(("name", "options", "given", "other", "bug", "cause"), WINDOWED)
def test_a_mask_parameter_named_for_the_window_gets_the_window(runner, name, options, given, other, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *options, *W)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert f"{other} = None" in out["notes"], out["notes"]
    assert any(n.startswith(f"{given}: ") and "as your code reads it" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *options, *W, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def test_a_base_only_inv_freq_says_is_read_so_a_split_without_permute_is_named(runner):
    """ModernBERT's rotary embedding keeps its base in inv_freq alone: read from it (80000), so the heads split
    without the transpose is rerun with the code's own RoPE and named by experiment."""
    result, out = trace(runner, f"{STYLES}:WindowMaskBert", "--rope", "--init", "local=False")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "RoPE base 80000" in out["reference"], out["reference"]
    result, out = trace(runner, f"{STYLES}:WindowMaskBert", "--rope", "--init",
                        "local=False, bug='split_without_permute'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "heads.split_without_permute", out["first_divergence"]


def test_a_two_sided_window_off_by_one_beside_padding_is_named_and_counted_by_distance(runner):
    """The window built on the padding (`distance < w // 2` for `<=`): mask.off_by_one by experiment; a window two
    keys wider, which no experiment reproduces, is counted by |i − j|, not by the diagonal."""
    result, out = trace(runner, f"{STYLES}:WindowFromPadding", "--rope", *W)
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:WindowFromPadding", "--rope", *W, "--init", "bug='window_off_by_one'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "mask.off_by_one", out["first_divergence"]
    assert "on both sides" in out["first_divergence"]["diagnosis"]
    result, out = trace(runner, f"{STYLES}:WindowFromPadding", "--rope", *W, "--init", "bug='window_two_wider'")
    assert result.exit_code == 1, result.stdout + result.stderr
    said = out["first_divergence"]["diagnosis"]
    assert "at |i − j| = 3" in said and "at |i − j| = 4" in said and "diagonal" not in said, said
