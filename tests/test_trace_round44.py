"""`attnscope trace` on what held-out round 44 found. transformers' LightGlue takes RoPE's pair as
`position_embeddings=None` and, given None, rotates nothing: trace gave it None first (as for code that makes its
own tables), kept that run, and called the correct module `rope.not_applied`. Where the code given None rotates
nothing and given trace's tables returns another output, the tables are its RoPE
(trace_attempt._own_tables_rotate), and the pair's interleaved layout is then read from its run
(trace_tables.other_layouts), which needed the first run's plan kept after the time-first and column readings
tried theirs and were not kept. Checked against F.scaled_dot_product_attention in float64, on queries and keys
turned by a float64 formula of adjacent pairs.

torchaudio's wav2vec2 takes an additive mask of -10000 [B, 1, L, L] and each row's max out before its softmax. With
such a --mask file the reference's masked scores are finite (-10000 + score): its allowed cells were read as those
that are not -inf, so no experiment could stand for the reference and none ran; the tolerance was the -10000's
(1.0 at float32's 1e-4), so a wrong tensor lined up as the masked scores. A masked score is now any very negative
one, on either side (rerun.build, align.difference), the tolerance that of the cells kept (align.tolerance); the mask
added after the softmax is rerun with its own numbers (masktrials._finite_mask); and a softmax over the queries is
rerun on what the code's softmax took (scaletrials.code_masked: the rows' max taken out). Checked against
F.scaled_dot_product_attention in float64 with the additive mask.

timm's MultiQueryAttentionV2 runs on a feature map read as columns, its weights laid out [b, n, h, m]: a dropout left
on was read only in the columns' layout of the attention, so the rerun never ran (runtrials._dropped now also tries
the row form's there). timm's MultiQueryAttention2d with kv_stride downsamples its keys and values, each by a
strided depthwise Conv2d and a BatchNorm2d of its own: on a feature map those maps were never read as the keys' and
values' input side, so the reference wanted n_K = n_Q and nothing lined up (keyinputs._maps); and its query map
reshaped straight to [b, h, n, k] is heads.split_without_permute in the column form (headtrials.trials_split)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case, saved
from transformers import LightGlueConfig

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round44.py")
styles = user_module(STYLES)
B, N, D, H = 2, 7, 32, 4
DH = D // H
INIT = "config=LightGlueConfig(descriptor_dim=32, num_attention_heads=4), layer_idx=0"


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, N, DH] laid out interleaved, as LightGluePositionalEncoder's repeat_interleave(2)."""
    inv = 10000.0 ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    angle = (torch.arange(N, dtype=torch.float64)[:, None] * inv).repeat_interleave(2, dim=-1)
    return angle.cos().expand(B, N, DH), angle.sin().expand(B, N, DH)


def _turned(t: torch.Tensor) -> torch.Tensor:
    """[B, H, N, DH], adjacent pairs (2i, 2i + 1) turned by position · 10000^(-2i/DH), in float64."""
    inv = 10000.0 ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    turn = torch.polar(torch.ones(N, DH // 2, dtype=torch.float64), torch.arange(N, dtype=torch.float64)[:, None] * inv)
    return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * turn).flatten(-2)


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.view(B, N, H, DH).transpose(1, 2)


@pytest.mark.parametrize("bug", [None, "rope_on_values", "ignored"])
def test_the_style_is_sdpa_and_the_plants_change_it(bug):
    config = LightGlueConfig(descriptor_dim=32, num_attention_heads=4)
    m = styles.LightGlue(config).double()
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(44), dtype=torch.float64)
    q, k, v = _turned(_heads(m.q_proj(x))), _turned(_heads(m.k_proj(x))), _heads(m.v_proj(x))
    want = m.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))
    with torch.no_grad():
        got = styles.LightGlue(config, bug=bug).double()(x, _pair())[0]
        # LightGlue turns q and k in float32 (apply_rotary_pos_emb casts them), so 1e-5
        assert (got - want).abs().max() < 1e-5 if bug is None else (got - want).abs().max() > 1e-3


def test_tables_defaulting_to_none_that_the_code_needs_are_given_and_their_layout_read(runner):
    code, out = run_case(runner, STYLES, "LightGlue", INIT, ("--rope",))
    assert_passes(code, out)
    assert any(n.startswith("RoPE's tables (position_embeddings): given as (cos, sin), interleaved")
               for n in out["notes"]), out["notes"]
    assert not any("makes RoPE's tables itself" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("bug", "entry"), [("rope_on_values", "rope.on_values"), ("ignored", "rope.not_applied")])
def test_the_plants_are_named(runner, bug, entry):
    assert_named(*run_case(runner, STYLES, "LightGlue", f"{INIT}, bug={bug!r}", ("--rope",)), entry)


WAV_PLANTS = [("mask_after_softmax", "mask.after_softmax"), ("softmax_queries", "softmax.axis"),
              ("scale_both", "scale.twice"), ("merge", "heads.merge_without_transpose")]
M = 9


def _additive() -> torch.Tensor:
    """[B, 1, M, M]: -10000.0 at padded keys (the last 3 of the first sequence, the last of the second)."""
    keep = torch.ones(B, M, dtype=torch.bool)
    keep[0, 6:] = False
    keep[1, 8:] = False
    return ((~keep).double() * -10000.0)[:, None, None, :].expand(B, 1, M, M).contiguous()


@pytest.mark.parametrize("bug", [None, *(p[0] for p in WAV_PLANTS)])
def test_wav2vec2_is_sdpa_and_the_plants_change_it(bug):
    m = styles.Wav2Vec2().double()
    x = torch.randn(B, M, D, generator=torch.Generator().manual_seed(442), dtype=torch.float64)
    q, k, v = (t.view(B, M, H, DH).transpose(1, 2) for t in (m.q_proj(x), m.k_proj(x), m.v_proj(x)))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=_additive())
    want = m.out_proj(o.transpose(1, 2).reshape(B, M, D))
    with torch.no_grad():
        got = styles.Wav2Vec2(bug=bug).double()(x, _additive())[0]
        assert (got - want).abs().max() < 1e-10 if bug is None else (got - want).abs().max() > 1e-3


@pytest.fixture()
def additive(tmp_path):
    return ("--batch", str(B), "--nq", str(M), "--mask", saved(tmp_path, "mask.npy", _additive().float()))


def test_wav2vec2_with_an_additive_mask_of_minus_10000_passes(runner, additive):
    assert_passes(*run_case(runner, STYLES, "Wav2Vec2", "embed_dim=32, num_heads=4", additive))


@pytest.mark.parametrize(("bug", "entry"), WAV_PLANTS)
def test_wav2vec2_plants_are_named(runner, additive, bug, entry):
    assert_named(*run_case(runner, STYLES, "Wav2Vec2", f"embed_dim=32, num_heads=4, bug={bug!r}", additive), entry)


def test_mqav2_is_sdpa_and_its_dropout_left_on_is_named(runner):
    m = styles.MQAv2().double().eval()
    x = torch.randn(B, D, 2, 5, generator=torch.Generator().manual_seed(443), dtype=torch.float64)
    tokens = x.flatten(2).transpose(1, 2)  # [B, 10, D], raster order
    q = torch.einsum("bnd,hkd->bhnk", tokens, m.query_proj)
    k, v = (tokens @ w for w in (m.key_proj, m.value_proj))
    o = F.scaled_dot_product_attention(q, k[:, None].expand_as(q), v[:, None].expand_as(q))
    want = torch.einsum("bhnv,dhv->bdn", o, m.out_proj).reshape(B, D, 2, 5)
    with torch.no_grad():
        assert (m(x) - want).abs().max() < 1e-10
    init = "dim=32, num_heads=4, key_dim=8, value_dim=8, attn_drop=0.1"
    assert_passes(*run_case(runner, STYLES, "MQAv2", init, ()))
    assert_named(*run_case(runner, STYLES, "MQAv2", f"{init}, bug='dropout_on'", ()), "dropout.left_on")


MQA2D_INIT = "dim=32, num_heads=4, key_dim=8, value_dim=8, kv_stride=2"


def test_mqa2d_is_sdpa_and_its_plants_change_it():
    m = styles.MQA2d().double().eval()
    x = torch.randn(B, D, 4, 6, generator=torch.Generator().manual_seed(444), dtype=torch.float64)
    with torch.no_grad():
        q = m.query.proj(x).flatten(2).view(B, H, DH, 24).transpose(-1, -2)  # [B, H, 24, DH]
        k = m.key.proj(m.key.norm(m.key.down_conv(x))).flatten(2).transpose(1, 2)  # [B, 6, DH]: 2 x 3 positions
        v = m.value.proj(m.value.norm(m.value.down_conv(x))).flatten(2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k[:, None].expand(B, H, 6, DH), v[:, None].expand(B, H, 6, DH))
        want = m.output.proj(o.transpose(1, 2).reshape(B, 4, 6, D).permute(0, 3, 1, 2))
        assert (m(x) - want).abs().max() < 1e-10
        for bug in ("query_straight", "scaled_twice"):
            assert (styles.MQA2d(bug=bug).double().eval()(x) - want).abs().max() > 1e-3, bug


def test_mqa2d_keys_and_values_read_from_maps_of_their_own(runner):
    code, out = run_case(runner, STYLES, "MQA2d", MQA2D_INIT, ("--nq", "24"))
    assert_passes(code, out)
    said = [n for n in out["notes"] if n.startswith("your key and value projections (key.proj and value.proj) each "
                                                     "read a tensor your module makes from its input")]
    assert said and "n_K = 6 where the input has 24" in said[0], out["notes"]


@pytest.mark.parametrize(("bug", "entry"), [("query_straight", "heads.split_without_permute"),
                                            ("scaled_twice", "scale.twice")])
def test_mqa2d_plants_are_named(runner, bug, entry):
    assert_named(*run_case(runner, STYLES, "MQA2d", f"{MQA2D_INIT}, bug={bug!r}", ("--nq", "24")), entry)
