"""`attnscope trace` on round 12b's gaps, with styles of its own (tests/trace_styles_r12b.py):

- a memory parameter no name gives away (Mllama's `cross_attention_states=None` beside `use_cache=None`, a
  Perceiver's `kv_input=None` behind `pos=None`, a function's `source=None` behind `scale=None`): each parameter
  defaulting to None is given keys of their own in turn, and the one the key and value projections read is the
  memory (data flow), with --nk, --k, or where the code raised with it None.

Each correct style is checked against a float64 formula, F.scaled_dot_product_attention or transformers' eager
module; each plant is shown to change the output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from test_trace_f12_kv import _heads, _sdpa

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r12b.py")
styles = user_module(STYLES)


# --- a memory parameter read from the data flow ---------------------------------------------------------------

def test_vision_cross_attention_is_transformers_mllama_and_the_plants_change_it():
    from transformers import MllamaTextConfig
    from transformers.models.mllama.modeling_mllama import MllamaTextCrossAttention

    config = MllamaTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                              num_hidden_layers=1, vocab_size=64, cross_attention_layers=[0], rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    hf = MllamaTextCrossAttention(config, layer_idx=0).eval()
    ours = styles.VisionCrossAttention()
    hf.load_state_dict(ours.state_dict())
    x, image = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        want = hf(x, cross_attention_states=image, attention_mask=None)[0]
        assert torch.allclose(ours(x, image)[0], want, atol=1e-5)
        for bug in ("softmax_queries", "v_from_k"):
            wrong = styles.VisionCrossAttention(bug=bug)
            assert (wrong(x, image)[0] - want).abs().max() > 1e-2
        with pytest.raises(TypeError):  # None reads the cache, which is None too
            ours(x)


def test_latent_cross_and_the_function_are_sdpa_and_the_plants_change_them():
    m = styles.LatentCross().double()
    x, ctx = torch.randn(2, 4, 24, dtype=torch.float64), torch.randn(2, 6, 24, dtype=torch.float64)
    with torch.no_grad():
        k, v = m.to_kv(ctx).chunk(2, -1)
        want = m.to_out(_sdpa(m.to_q(x), k, v, 3))
        assert torch.allclose(m(x, kv_input=ctx), want, atol=1e-10)
        wrong = styles.LatentCross(bug="no_scale").double()
        assert (wrong(x, kv_input=ctx) - want).abs().max() > 1e-2
    W = [torch.randn(12, 12, dtype=torch.float64) / 3 for _ in range(4)]
    x, src = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 6, 12, dtype=torch.float64)
    q, k, v = _heads(x @ W[0], 4), _heads(src @ W[1], 4), _heads(src @ W[2], 4)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(3), -1)
    want = (p @ v).transpose(1, 2).reshape(2, 4, 12) @ W[3]
    assert torch.allclose(styles.attend_source(x, *W, 4, source=src), want, atol=1e-10)
    assert (styles.attend_source_d_model(x, *W, 4, source=src) - want).abs().max() > 1e-2


MEMORIES = [("VisionCrossAttention", "vision_states"), ("LatentCross", "kv_input"), ("attend_source", "source")]


@pytest.mark.parametrize(("name", "memory"), MEMORIES)
def test_the_memory_is_the_parameter_the_key_projection_reads(runner, name, memory):
    result, out = trace(runner, f"{STYLES}:{name}", "--nk", "5")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == 5
    assert any(n.startswith(f"{memory}: the memory your code takes its keys and values from (cross-attention, "
                            "n_K = 5), read from its data flow") for n in out["notes"]), out["notes"]


def test_code_that_raises_without_its_memory_is_given_one(runner):
    """Mllama's cross-attention reads its cache when it has no vision states: run with None it raised (exit 1,
    "your code raised"); the memory is then read as above, and the note says why."""
    result, out = trace(runner, f"{STYLES}:VisionCrossAttention")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if n.startswith("vision_states: the memory")]
    assert said and "your code raised with vision_states = None (line" in said[0], out["notes"]


def test_files_for_the_queries_and_the_memory(runner, tmp_path):
    torch.manual_seed(0)
    torch.save(torch.randn(2, 4, 32), tmp_path / "x.pt")
    torch.save(torch.randn(2, 6, 32), tmp_path / "image.pt")
    result, out = trace(runner, f"{STYLES}:VisionCrossAttention", "--q", str(tmp_path / "x.pt"), "--k",
                        str(tmp_path / "image.pt"))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == 6


@pytest.mark.parametrize(("name", "args", "cause"), [
    ("VisionCrossAttention", ("--init", "bug='softmax_queries'", "--nk", "5"), "softmax.axis"),
    ("VisionCrossAttention", ("--init", "bug='v_from_k'"), "kv.values_from_keys"),
    ("LatentCross", ("--init", "bug='no_scale'", "--nk", "5"), "scale.none"),
    ("attend_source_d_model", ("--nk", "5"), "scale.d_model"),
])
def test_mistakes_beside_a_memory_are_named_by_experiment(runner, name, args, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")


def test_a_self_attention_with_other_optional_parameters_still_refuses_nk(runner):
    result, _ = trace(runner, f"{STYLES}:attend_source", "--nk", "5", "--forward", "source=None")
    assert result.exit_code == 2
    assert "takes one tensor (self-attention), so n_K = n_Q: none of scale (defaulting to None)" in result.stderr


# --- nn.Parameter weights reshaped before they project ----------------------------------------------------------

def _rms(t):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + torch.finfo(t.dtype).eps)


def _want_weights(m, x):
    """Each Parameter style's attention in float64 from its weights, written from the shapes they are held in."""
    b, n, d = x.shape
    if isinstance(m, styles.SpeedrunAttention):
        W_q, W_k, W_v = m.qkv_w  # each [H·D, dim]
        q, k = (_rms((x @ W.t()).view(b, n, 4, 8)).transpose(1, 2) for W in (W_q, W_k))
        v = (m.lambdas[0] * (x @ W_v.t())).view(b, n, 4, 8).transpose(1, 2)
        p = torch.softmax((q @ k.transpose(-1, -2) * 0.12).masked_fill(~torch.ones(n, n).tril().bool(), -math.inf),
                          -1)
        return (p @ v).transpose(1, 2).reshape(b, n, 32) @ m.c_proj.weight.t()
    if isinstance(m, styles.KernelAttention):
        q, k, v = (torch.einsum("bnd,dhe->bnhe", x, m.qkv_kernel[:, i]).reshape(b, n, 24) for i in range(3))
        return torch.einsum("bnhe,hed->bnd", _sdpa(q, k, v, 3).view(b, n, 3, 8), m.out_kernel)
    parts = [torch.einsum("bnd,hed->bnhe", x, m.qkv[:, i * 8:(i + 1) * 8]) + m.qkv_bias[:, i * 8:(i + 1) * 8]
             for i in range(3)]
    q, k, v = (t.transpose(1, 2) for t in parts)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, 32)
    return m.dense(y)


PARAMETER_STYLES = [("SpeedrunAttention", 32, "scale_twice"), ("KernelAttention", 24, "no_scale"),
                    ("PackedHeads", 32, "off_by_one")]


@pytest.mark.parametrize(("name", "width", "bug"), PARAMETER_STYLES)
def test_the_parameter_styles_are_what_their_weights_say_and_the_plants_change_them(name, width, bug):
    m = getattr(styles, name)().double()
    x = torch.randn(1, 6, width, dtype=torch.float64)
    with torch.no_grad():
        want = _want_weights(m, x)
        assert torch.allclose(m(x), want, atol=1e-10)
        wrong = getattr(styles, name)(bug=bug).double()
        assert (wrong(x) - want).abs().max() > 1e-2
        if name == "SpeedrunAttention":
            merged = styles.SpeedrunAttention(bug="merge_no_transpose").double()
            assert (merged(x) - want).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "args", "weights"), [
    ("SpeedrunAttention", ("--causal", "--scale", "0.12"), "q=qkv_w[0:32], k=qkv_w[32:64], v=qkv_w[64:96]·lambdas[0]"),
    ("KernelAttention", (), "q=qkv_kernel[0:24], k=qkv_kernel[24:48], v=qkv_kernel[48:72], o=out_kernel"),
    ("PackedHeads", ("--causal",), "q=qkv[per head, part 0], k=qkv[per head, part 1], v=qkv[per head, part 2]"),
])
def test_a_parameter_reshaped_for_its_projection_is_read_as_the_code_uses_it(runner, name, args, weights):
    result, out = trace(runner, f"{STYLES}:{name}", "--batch", "1", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert weights in out["reference"], out["reference"]
    if name == "SpeedrunAttention":
        assert any(n.startswith("your values are multiplied by lambdas[0] = 0.7 (line") for n in out["notes"]), \
            out["notes"]


@pytest.mark.parametrize(("name", "args", "cause"), [
    ("SpeedrunAttention", ("--init", "bug='scale_twice'", "--causal", "--scale", "0.12"), "scale.twice"),
    ("SpeedrunAttention", ("--init", "bug='merge_no_transpose'", "--causal", "--scale", "0.12"),
     "heads.merge_without_transpose"),
    ("KernelAttention", ("--init", "bug='no_scale'"), "scale.none"),
    ("PackedHeads", ("--init", "bug='off_by_one'", "--causal"), "mask.off_by_one"),
])
def test_mistakes_beside_parameter_weights_are_named_by_experiment(runner, name, args, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--batch", "1", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")


# --- q, k, v clipped after their projection ---------------------------------------------------------------------

def _want_clipped(m, x, clip):
    """Each clipping style in float64: the projection's output clamped to ±clip, then SDPA (GQA: repeat_interleave)."""
    if isinstance(m, styles.ClippedFused):
        q, k, v = m.Wqkv(x).clamp(-clip, clip).split([32, 16, 16], -1)
        q, k, v = _heads(q, 4), _heads(k, 2).repeat_interleave(2, 1), _heads(v, 2).repeat_interleave(2, 1)
        y = F.scaled_dot_product_attention(q, k, v)
        return m.out_proj(y.transpose(1, 2).reshape(x.shape))
    if isinstance(m, styles.LiteralClamp):
        q, k, v = m.c_attn(x).clamp(-clip, clip).chunk(3, -1)
        y = F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4), is_causal=True)
        return m.c_proj(y.transpose(1, 2).reshape(x.shape))
    q, k, v = m.att_proj(x).clamp(-clip, clip).chunk(3, -1)
    return m.attn_out(_sdpa(q, k, v, 3))


CLIP_STYLES = [("ClippedFused", 32, 0.8, "half_clip"), ("LiteralClamp", 32, 1.5, "off_by_one"),
               ("InPlaceClip", 24, 1.0, "no_scale")]


@pytest.mark.parametrize(("name", "width", "clip", "bug"), CLIP_STYLES)
def test_the_clipping_styles_clip_and_the_plants_change_them(name, width, clip, bug):
    m = getattr(styles, name)().double()
    x = torch.randn(2, 6, width, dtype=torch.float64)
    with torch.no_grad():
        want = _want_clipped(m, x, clip)
        assert torch.allclose(m(x), want, atol=1e-10)
        assert not torch.allclose(_want_clipped(m, x, 1e9), want, atol=1e-3)  # the clamp is active on these inputs
        wrong = getattr(styles, name)(bug=bug).double()
        assert (wrong(x) - want).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "args", "said"), [
    ("ClippedFused", (), "q, k and v clipped to ±0.8 after their projection, read from your module (its clip_qkv"),
    ("LiteralClamp", ("--causal",), "your code clips its projection's output to ±1.5 (line"),
    ("InPlaceClip", (), "q, k and v clipped to ±1 after their projection, read from your module (its clip_qkv = 1"),
])
def test_a_clip_of_q_k_v_is_read_as_the_modules_own(runner, name, args, said):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(said in n for n in out["notes"]), out["notes"]
    assert "q, k, v clipped to ±" in out["reference"], out["reference"]


def test_a_clamp_other_than_the_config_says_diverges_at_the_projection(runner):
    result, out = trace(runner, f"{STYLES}:ClippedFused", "--init", "bug='half_clip'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["reference"] == "Q_feat", out["first_divergence"]


@pytest.mark.parametrize(("name", "args", "cause"), [
    ("ClippedFused", ("--init", "bug='d_model'"), "scale.d_model"),
    ("LiteralClamp", ("--init", "bug='off_by_one'", "--causal"), "mask.off_by_one"),
    ("InPlaceClip", ("--init", "bug='no_scale'"), "scale.none"),
])
def test_mistakes_beside_a_clip_are_named_by_experiment(runner, name, args, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")
