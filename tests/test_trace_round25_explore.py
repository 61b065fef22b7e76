"""Round 25's explorer styles (tests/trace_styles_round25_explore.py), each correct one checked against
F.scaled_dot_product_attention in float64 on its own weights, traced as a user would, and 3-4 plants each named by
experiment. What they hold trace to:
- ops of the code's own on its merged heads before the output projection (BitNet's attn_sub_norm, LeViT's Hardswish)
  are a convention, compared up to the merge (usertrace/outops.py); on each head's output before the merge
  (DiffTransformer's subln), the reference multiplies its heads' output by what they multiply the code's by;
- a position bias summed from several parts (LayoutLMv3's 1-D and 2-D biases, each a Linear over a one-hot of the
  distances), scaled and then transposed on its way to the scores, is read as the module's own (ownbias.py);
- RoPE forgotten on one side, also under a qk-norm of the rotated heads (Hunyuan's), is rope.not_applied by experiment.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_explore.py")
styles = user_module(STYLES)


def _heads(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def _merge(t):
    return t.transpose(1, 2).flatten(2)


def _turn(t, base):
    n, d = t.shape[-2], t.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv).repeat(1, 2)
    half = torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1)
    return t * ang.cos() + half * ang.sin()


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    m = styles.LevitAttention().double()
    q, k, v = m.queries_keys_values(x).view(2, 9, 4, -1).split([6, 6, 12], -1)
    bias = m.attention_biases[:, m.attention_bias_idxs]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=bias)
    torch.testing.assert_close(m(x), m.projection(F.hardswish(_merge(out))))
    m = styles.VideoMAEAttention().double()
    q, k, v = x @ m.query.weight.T + m.q_bias, x @ m.key.weight.T, x @ m.value.weight.T + m.v_bias
    out = F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4))
    torch.testing.assert_close(m(x), m.dense(_merge(out)), rtol=1e-6, atol=1e-6)  # its softmax in float32
    m = styles.LayoutLMv3Attention().double()
    pos, box = torch.arange(9), m.boxes[:9]
    bucket = lambda r: r.clamp(-4, 3) + 4  # noqa: E731
    rel = lambda c: torch.div(c[None, :] - c[:, None], 4, rounding_mode="floor")  # noqa: E731
    bias = (m.rel_pos_bias.weight[:, bucket(pos[None, :] - pos[:, None])]
            + m.rel_pos_x_bias.weight[:, bucket(rel(box[:, 0]))] + m.rel_pos_y_bias.weight[:, bucket(rel(box[:, 1]))])
    out = F.scaled_dot_product_attention(_heads(m.query(x), 4), _heads(m.key(x), 4), _heads(m.value(x), 4),
                                         attn_mask=bias / math.sqrt(8))
    torch.testing.assert_close(m(x), m.dense(_merge(out)))
    m = styles.BitNetAttention().double()
    q, k = _turn(_heads(m.q_proj(x), 4), 500000.0), _turn(_heads(m.k_proj(x), 2), 500000.0)
    out = F.scaled_dot_product_attention(q, k, _heads(m.v_proj(x), 2), is_causal=True, enable_gqa=True)
    causal = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    torch.testing.assert_close(m(x, causal), m.o_proj(m.attn_sub_norm(_merge(out))), rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    m = styles.HunyuanAttention().double()
    q = m.query_layernorm(_turn(_heads(m.q_proj(x), 6), 10000.0))
    k = m.key_layernorm(_turn(_heads(m.k_proj(x), 2), 10000.0))
    out = F.scaled_dot_product_attention(q, k, _heads(m.v_proj(x), 2), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(m(x), m.o_proj(_merge(out)))
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    m = styles.HeadSubNormAttention().double()
    out = F.scaled_dot_product_attention(_heads(m.q_proj(x), 4), _heads(m.k_proj(x), 4), _heads(m.v_proj(x), 4))
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * m.subln.weight
    torch.testing.assert_close(m(x), m.out_proj(_merge(normed * 0.8)), rtol=1e-6, atol=1e-6)  # softmax in float32


BUGS = {"LevitAttention": ("no_scale", "softmax_axis", "merge_no_transpose"),
        "VideoMAEAttention": ("values_from_keys", "scale_twice", "dropout_on"),
        "LayoutLMv3Attention": ("values_from_keys", "no_scale", "bias_transposed", "bias_after"),
        "BitNetAttention": ("rope_on_values", "gqa_tiled", "merge_no_transpose", "k_unrotated"),
        "HunyuanAttention": ("split_no_transpose", "k_unnormed", "no_scale", "k_unrotated"),
        "HeadSubNormAttention": ("no_scale", "values_from_keys", "merge_no_transpose")}


@pytest.mark.parametrize("name", list(BUGS))
def test_the_plants_change_the_output(name):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 48 if name == "HunyuanAttention" else 32)
    good = getattr(styles, name)()
    args = (x, torch.full((9, 9), float("-inf")).triu(1)[None, None]) if name == "BitNetAttention" else (x,)
    for bug in BUGS[name]:
        bad = getattr(styles, name)(bug=bug)
        assert (good(*args) - bad(*args)).abs().max() > 1e-3, (name, bug)


LEVIT = ("--nq", "9")
BITNET = ("--causal", "--rope", "--rope-base", "500000")
HUNYUAN = ("--causal", "--rope")
CORRECT = [("LevitAttention", None, LEVIT), ("VideoMAEAttention", None, ()), ("LayoutLMv3Attention", None, ()),
           ("LayoutLMv3Attention", None, ("--nq", "5", "--batch", "2")), ("BitNetAttention", None, BITNET),
           ("HunyuanAttention", None, HUNYUAN), ("HeadSubNormAttention", None, ())]
test_correct_styles_pass = passing_test(STYLES, CORRECT)

PLANTS = [("LevitAttention", "bug='no_scale'", LEVIT, "scale.none"),
          ("LevitAttention", "bug='softmax_axis'", LEVIT, "softmax.axis"),
          ("LevitAttention", "bug='merge_no_transpose'", LEVIT, "heads.merge_without_transpose"),
          ("VideoMAEAttention", "bug='values_from_keys'", (), "kv.values_from_keys"),
          ("VideoMAEAttention", "bug='scale_twice'", (), "scale.twice"),
          ("VideoMAEAttention", "bug='dropout_on'", (), "dropout.left_on"),
          ("LayoutLMv3Attention", "bug='values_from_keys'", (), "kv.values_from_keys"),
          ("LayoutLMv3Attention", "bug='no_scale'", (), "scale.none"),
          ("LayoutLMv3Attention", "bug='bias_transposed'", (), "t5.transposed"),
          ("LayoutLMv3Attention", "bug='bias_after'", (), "t5.after_softmax"),
          ("BitNetAttention", "bug='rope_on_values'", BITNET, "rope.on_values"),
          ("BitNetAttention", "bug='gqa_tiled'", BITNET, "gqa.tiled"),
          ("BitNetAttention", "bug='merge_no_transpose'", BITNET, "heads.merge_without_transpose"),
          ("BitNetAttention", "bug='k_unrotated'", BITNET, "rope.not_applied"),
          ("HunyuanAttention", "bug='split_no_transpose'", HUNYUAN, "heads.split_without_permute"),
          ("HunyuanAttention", "bug='k_unnormed'", HUNYUAN, "qknorm.missing"),
          ("HunyuanAttention", "bug='no_scale'", HUNYUAN, "scale.none"),
          ("HunyuanAttention", "bug='k_unrotated'", HUNYUAN, "rope.not_applied"),
          ("HeadSubNormAttention", "bug='no_scale'", (), "scale.none"),
          ("HeadSubNormAttention", "bug='values_from_keys'", (), "kv.values_from_keys"),
          ("HeadSubNormAttention", "bug='merge_no_transpose'", (), "heads.merge_without_transpose")]
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize(("target", "options"), [("BitNetAttention", BITNET), ("LevitAttention", LEVIT)])
def test_the_note_says_the_ops_on_the_merge(runner, target, options):
    code, out = run_case(runner, STYLES, target, None, options)
    said = [n for n in out["notes"] if "ops of its own to its merged heads" in n]
    assert code == 0 and said, out["notes"]


def test_the_note_says_the_ops_on_each_head(runner):
    code, out = run_case(runner, STYLES, "HeadSubNormAttention")
    said = [n for n in out["notes"] if "ops of its own to each head's output" in n]
    assert code == 0 and said, out["notes"]


def test_a_summed_bias_is_the_modules_own(runner):
    code, out = run_case(runner, STYLES, "LayoutLMv3Attention")
    said = [n for n in out["notes"] if "position bias of its own" in n]
    assert code == 0 and said and "rel_pos_x_bias" in said[0], out["notes"]
