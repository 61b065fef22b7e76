"""`attnscope trace` on RoPE whose angles no one position times a frequency gives (round 14b's EVA-02), and on RoPE
scalings (round 14b's MiniCPM with linear rope_scaling), in styles of their own (tests/trace_styles_round14_rope2d.py):

- 2-D / axial RoPE (EVA-02's, DINOv3's, Qwen2-VL's vision rotary), a prefix of cls and register tokens left
  unrotated, positions of another scale (DINOv3's [-1, 1] patch centres): each token's angles read from the rotated
  queries and keys (usertrace/ropefreqs.Angles), a note and exit 0, with or without --rope; the mistakes beside it
  named by experiment; a table the keys do not share, or pairs turned another way on one side, is no convention;
  the cls token kept aside and joined back is no joint attention.
- linear scaling (positions t / f: transformers', GPT-NeoX-like, Meta's precompute_freqs_cis) read as a convention
  naming the factor; a scaling the module declares (Llama 3.1's) read from the rotated tensors and checked against
  it (YaRN's attention factor with it); another base under it, keys turned without the factor, or cos and sin left
  without YaRN's factor, stay mistakes.

Each correct style is checked against a float64 formula written here with SDPA, each plant shown to change the
output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round14_rope2d.py")
styles = user_module(STYLES)


def _turn(x, angles, pairing):
    """x [b, h, n, d] float64 with pair p of token i turned by angles[i, p]: half-split (p, p + d/2) or interleaved."""
    d = x.shape[-1]
    cos, sin = angles.cos(), angles.sin()
    if pairing == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


def _grid_angles(n_prefix, rows, cols, row_freqs, col_freqs):
    """[n_prefix + len(rows), pairs]: the prefix turns by nothing, patch i's first pairs by rows[i] · row_freqs, the
    others by cols[i] · col_freqs."""
    patches = torch.cat((rows[:, None] * row_freqs, cols[:, None] * col_freqs), -1)
    return torch.cat((torch.zeros(n_prefix, patches.shape[-1], dtype=torch.float64), patches))


def _heads(t, h):
    b, n, _ = t.shape
    return t.view(b, n, h, -1).transpose(1, 2)


def _grid(h, w):
    r, c = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    return r.flatten(), c.flatten()


def _llama3(freqs, factor, low, high, old):
    """Llama 3.1's frequency scaling, vectorised in float64."""
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen < old / high, freqs, torch.where(wavelen > old / low, freqs / factor, mid))


def _want(name, m, x):
    """The style's output from a float64 formula: its weights, its angle table written out here, SDPA."""
    n = x.shape[1]
    if name == "EvaRope":
        bias = torch.cat((m.q_bias, torch.zeros_like(m.v_bias), m.v_bias))
        q, k, v = (_heads(t, 2) for t in F.linear(x, m.qkv.weight, bias).chunk(3, -1))
        freqs = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        rows, cols = _grid(3, 3)
        angles = _grid_angles(1, rows, cols, freqs, freqs)
        y = F.scaled_dot_product_attention(_turn(q, angles, "interleaved"), _turn(k, angles, "interleaved"), v)
        return m.proj(y.transpose(1, 2).reshape(x.shape))
    if name == "DinoRope":
        q, k, v = (_heads(p(x), 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        periods = 100.0 ** (2 * torch.arange(4, dtype=torch.float64) / 8)
        rows, cols = _grid(3, 4)
        rows, cols = (rows + 0.5) / 3 * 2 - 1, (cols + 0.5) / 4 * 2 - 1
        angles = _grid_angles(3, rows, cols, 2 * math.pi / periods, 2 * math.pi / periods)
        y = F.scaled_dot_product_attention(_turn(q, angles, "half"), _turn(k, angles, "half"), v)
        return m.out_proj(y.transpose(1, 2).reshape(x.shape))
    if name == "QwenVisionRope":
        q, k, v = (_heads(t, 2) for t in m.qkv(x).view(*x.shape[:2], 3, -1).unbind(2))
        inv = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        rows, cols = _grid(3, 3)
        angles = _grid_angles(0, rows, cols, inv, inv)
        y = F.scaled_dot_product_attention(_turn(q, angles, "half"), _turn(k, angles, "half"), v)
        return m.proj(y.transpose(1, 2).reshape(x.shape))
    positions = torch.arange(n, dtype=torch.float64)
    inv = 10000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    if name == "NeoxLinear":
        q, k, v = (t.transpose(1, 2) for t in m.query_key_value(x).view(*x.shape[:2], 2, 48).split(16, -1))
        angles = torch.outer(positions / 4, inv)
        y = F.scaled_dot_product_attention(_turn(q, angles, "half"), _turn(k, angles, "half"), v, is_causal=True)
        return m.dense(y.transpose(1, 2).reshape(x.shape))
    if name == "MetaLinear":
        q, k, v = (_heads(w(x), 2) for w in (m.wq, m.wk, m.wv))
        angles = torch.outer(positions / 8, inv)
        y = F.scaled_dot_product_attention(_turn(q, angles, "interleaved"), _turn(k, angles, "interleaved"), v,
                                           is_causal=True)
        return m.wo(y.transpose(1, 2).reshape(x.shape))
    q, k, v = (_heads(p(x), 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    if name == "YarnScaled":  # transformers' own YaRN frequencies and attention factor
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=16384, rope_parameters={**styles.YARN, "rope_theta": 10000.0})
        yarn, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        q, k = (factor * _turn(t, torch.outer(positions, yarn.double()), "half") for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return m.o_proj(y.transpose(1, 2).reshape(x.shape))
    angles = torch.outer(positions / 2, inv) if name == "LinearLlama" else \
        torch.outer(positions, _llama3(inv, 8.0, 1.0, 4.0, 64))
    y = F.scaled_dot_product_attention(_turn(q, angles, "half"), _turn(k, angles, "half"), v, is_causal=True)
    return m.o_proj(y.transpose(1, 2).reshape(x.shape))


STYLED = [("EvaRope", 10, ("rope_on_v", "scale_dmodel", "softmax_axis", "merge_no_transpose", "k_grid_transposed")),
          ("DinoRope", 15, ("rope_on_v", "scale_dmodel", "merge_no_transpose", "k_pairing")),
          ("QwenVisionRope", 9, ("rope_on_v", "scale_dmodel", "softmax_axis")),
          ("LinearLlama", 7, ("k_unscaled",)), ("NeoxLinear", 7, ("rope_on_v",)),
          ("MetaLinear", 7, ("mask_after_softmax",)), ("Llama3Scaled", 7, ("base_wrong",)),
          ("YarnScaled", 7, ("no_mscale",))]


@pytest.mark.parametrize(("name", "n", "bugs"), STYLED)
def test_the_styles_are_their_formula_and_the_plants_change_them(name, n, bugs):
    x = torch.randn(2, n, 32, dtype=torch.float64)
    m = getattr(styles, name)().double().eval()
    with torch.no_grad():
        want = _want(name, m, x)
        assert (m(x) - want).abs().max() < 1e-5  # the styles make their tables in float32
        for bug in bugs:
            wrong = getattr(styles, name)(bug=bug).double().eval()
            wrong.load_state_dict(m.state_dict(), strict=False)
            assert (wrong(x) - want).abs().max() > 1e-2, bug


GRIDS = [("EvaRope", ("--nq", "10"), "tokens 0, 1 turn by no angle", "pairs interleaved"),
         ("DinoRope", ("--nq", "15"), "tokens 0 to 2 turn by no angle", "pairs half-split"),
         ("QwenVisionRope", ("--nq", "9"), "token 0 turns by no angle", "pairs half-split"),
         ("EvaRope", ("--nq", "10", "--rope"), "tokens 0, 1 turn by no angle", "pairs interleaved")]


@pytest.mark.parametrize(("name", "options", "kept", "pairs"), GRIDS)
def test_two_d_rope_and_a_prefix_kept_aside_are_read_from_the_rotated_tensors(runner, name, options, kept, pairs):
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if n.startswith("RoPE as your code computes it")]
    assert said and "angles of its own, the same for q and k" in said[0] and kept in said[0] and pairs in said[0]
    assert "A convention, not a mistake" in said[0]
    assert not any("joint attention" in n for n in out["notes"]), out["notes"]


PLANTS = [("EvaRope", "10", "rope_on_v", "rope.on_values"), ("EvaRope", "10", "scale_dmodel", "scale.d_model"),
          ("EvaRope", "10", "softmax_axis", "softmax.axis"),
          ("EvaRope", "10", "merge_no_transpose", "heads.merge_without_transpose"),
          ("DinoRope", "15", "rope_on_v", "rope.on_values"), ("DinoRope", "15", "scale_dmodel", "scale.d_model"),
          ("DinoRope", "15", "merge_no_transpose", "heads.merge_without_transpose"),
          ("QwenVisionRope", "9", "rope_on_v", "rope.on_values"),
          ("QwenVisionRope", "9", "softmax_axis", "softmax.axis")]


@pytest.mark.parametrize(("name", "n", "bug", "cause"), PLANTS)
def test_mistakes_beside_a_two_d_rope_are_named_by_experiment(runner, name, n, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", n, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
    assert any("angles of its own" in n for n in out["notes"]), out["notes"]
    assert not any("joint attention" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "n", "bug"), [("EvaRope", "10", "k_grid_transposed"),
                                                ("DinoRope", "15", "k_pairing")])
def test_a_table_the_keys_do_not_share_is_no_convention(runner, name, n, bug):
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", n, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert not any(n.startswith("RoPE as your code computes it") for n in out["notes"]), out["notes"]


SCALED = [("LinearLlama", "positions are scaled by 1/2 (linear RoPE scaling"),
          ("NeoxLinear", "positions are scaled by 1/4 (linear RoPE scaling"),
          ("MetaLinear", "positions are scaled by 1/8 (linear RoPE scaling"),
          ("Llama3Scaled", "the frequencies its rope_scaling (llama3) gives base 10000"),
          ("YarnScaled", "the frequencies its rope_scaling (yarn) gives base 10000")]


@pytest.mark.parametrize(("name", "words"), SCALED)
def test_a_rope_scaling_is_read_as_a_convention(runner, name, words):
    result, out = trace(runner, f"{STYLES}:{name}", "--rope", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if n.startswith("RoPE as your code computes it")]
    assert said and words in said[0] and "A convention, not a mistake" in said[0], out["notes"]


SCALED_PLANTS = [("NeoxLinear", "rope_on_v", "rope.on_values"), ("MetaLinear", "mask_after_softmax",
                                                                  "mask.after_softmax")]


@pytest.mark.parametrize(("name", "bug", "cause"), SCALED_PLANTS)
def test_mistakes_beside_a_scaling_are_named_by_experiment(runner, name, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--rope", "--causal", "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


@pytest.mark.parametrize(("name", "bug"), [("LinearLlama", "k_unscaled"), ("Llama3Scaled", "base_wrong"),
                                          ("YarnScaled", "no_mscale")])
def test_a_scaling_on_one_side_or_over_another_base_stays_a_mistake(runner, name, bug):
    result, out = trace(runner, f"{STYLES}:{name}", "--rope", "--causal", "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["reference"] in ("Q_rot", "K_rot"), out["first_divergence"]
    assert "never applied" not in out["first_divergence"]["diagnosis"]


def test_another_base_under_linear_scaling_is_named_by_experiment(runner):
    config = "ScalingConfig(rope_theta=500000.0, rope_scaling={'type': 'linear', 'factor': 2.0})"
    result, out = trace(runner, f"{STYLES}:LinearLlama", "--rope", "--causal", "--init",
                        f"bug='base_default', config={config}")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "rope.base", out["first_divergence"]
    assert "base 10000, positions scaled by 1/2" in out["first_divergence"]["diagnosis"]
