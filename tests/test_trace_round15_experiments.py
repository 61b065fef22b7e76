"""`attnscope trace` names a mistake by experiment wherever the code makes it (round 15's GPT-J upper-left decode
step, Phi-2's keys and values swapped before a partial RoPE, CogVideoX's `sdpa(q, v, k)` and heads split without the
transpose beside its 3-D RoPE, a flax port's dropout written by hand): each entry rerun where the code's order of
steps puts it, not read off the first differing tensor.

- Masked before the scale (GPT-J's `where(causal, q @ kᵀ, min) / scale_attn`, LLMs-from-scratch's `masked_fill_`
  then `softmax(s / √d)`, an additive bias before `* scale`): the code never holds the scaled scores unmasked, so a
  mask's mistake is tried at the masked scores and said there.
- Keys and values swapped before RoPE (separate projections; a partial rotary, interleaved pairs, grouped heads, a
  qk-norm the swap comes before): the values rotated as the keys are, with the reference's own rotation.
- `F.scaled_dot_product_attention(q, v, k)` beside a processor's own 2-D or 3-D RoPE: the angle table read from the
  queries and the keys wherever the code hands them (to the pattern too), and from the code's own tensors before and
  after its rotation where the heads were split wrongly before it.
- A dropout written by hand (haiku's `keep * x / keep_rate`, `torch.rand_like(x) > p`, a flax port's broadcast
  `bernoulli_` keep-mask), its mask read from the code's tensors: dropout.left_on in eval(), and --train applying it.

The styles (tests/trace_styles_round15_experiments.py) are checked against a float64 formula of their own here
(F.scaled_dot_product_attention, RoPE as complex rotations), and each plant shown to change the output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads, merged, moved, planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round15_experiments.py")
styles = user_module(STYLES)


F32 = 1e-5  # RoPE tables made in float32 (transformers', diffusers', Meta's): compared to float32's tolerance


def turned(x, angles, pairing):
    """x `[.., n, d]` with each pair turned by `angles` `[n, d/2]` (a complex product: RoPE's definition)."""
    d = x.shape[-1]
    if pairing == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angles), angles)
    if pairing == "half":
        return torch.cat((z.real, z.imag), dim=-1)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def positions(n, d, base=10000.0, start=0):
    """1-D RoPE's angles `[n, d/2]`: position times base^(-2i/d)."""
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv


def lower_right(n, m):
    return torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)


def additive(allowed):
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


def _sdpa_module(q_proj, k_proj, v_proj, o_proj, x, h, cache=None, mask=None):
    q, k, v = heads(q_proj(x), h), heads(k_proj(x), h), heads(v_proj(x), h)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=-2), torch.cat([cache[1], v], dim=-2)
    return o_proj(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


def test_masked_before_the_scale_styles_are_causal_attention():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
    cache = tuple(torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        for cls, names, kw in ((styles.JStyleAttention, ("q_proj", "k_proj", "v_proj", "out_proj"), "layer_past"),
                               (styles.ScratchCached, ("W_query", "W_key", "W_value", "out_proj"), "past_kv"),
                               (styles.EinsumBiasFirst, ("to_q", "to_k", "to_v", "to_out"), "cache")):
            ours = moved(cls())
            layers = [ours.get_submodule(n) for n in names]
            want = _sdpa_module(*layers, x, 4, mask=lower_right(5, 5))
            assert torch.allclose(ours(x), want, atol=1e-10), cls.__name__
            step = _sdpa_module(*layers, x, 4, cache=cache, mask=lower_right(5, 8))
            assert torch.allclose(ours(x, **{kw: cache}), step, atol=1e-10), cls.__name__
            assert (planted(cls, ours, "upper_left", x, **{}) - want).abs().max() < 1e-10  # no cache: no corner
            assert (_plant(cls, ours, "upper_left", x, **{kw: cache}) - step).abs().max() > 1e-2
            bugs = ("off_by_one", "polarity") + (("fill_zero",) if cls is not styles.EinsumBiasFirst else ()) + (
                ("scale_d_head",) if cls is styles.JStyleAttention else ())
            for bug in bugs:
                out = torch.nan_to_num(planted(cls, ours, bug, x))
                assert (out - want).abs().max() > 1e-2, (cls.__name__, bug)


def _plant(cls, ours, bug, *args, **kwargs):
    wrong = cls(bug=bug).double().eval()
    wrong.load_state_dict(ours.state_dict())
    return wrong(*args, **kwargs)


def test_swapped_before_rope_styles_are_rotary_attention():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with torch.no_grad():
        llama = moved(styles.LlamaGQA())
        q, k, v = heads(llama.q_proj(x), 4), heads(llama.k_proj(x), 2), heads(llama.v_proj(x), 2)
        angles = positions(6, 8)
        q, k = turned(q, angles, "half"), turned(k, angles, "half")
        want = llama.o_proj(merged(F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                  v.repeat_interleave(2, 1), attn_mask=causal)))
        assert torch.allclose(llama(x), want, atol=F32)
        assert (planted(styles.LlamaGQA, llama, "kv_swapped", x) - want).abs().max() > 1e-2

        phi = moved(styles.PhiPartial())
        q, k, v = heads(phi.q_proj(x), 2), heads(phi.k_proj(x), 2), heads(phi.v_proj(x), 2)
        angles = positions(6, 8)  # the first 8 of each head's 16 coordinates turn
        q = torch.cat((turned(q[..., :8], angles, "half"), q[..., 8:]), dim=-1)
        k = torch.cat((turned(k[..., :8], angles, "half"), k[..., 8:]), dim=-1)
        want = phi.dense(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=causal)))
        assert torch.allclose(phi(x, additive(causal)), want, atol=F32)
        assert (planted(styles.PhiPartial, phi, "kv_swapped", x, additive(causal)) - want).abs().max() > 1e-2

        meta = moved(styles.MetaComplex())
        q, k, v = heads(meta.wq(x), 4), heads(meta.wk(x), 4), heads(meta.wv(x), 4)
        angles = positions(6, 8)
        q, k = turned(q, angles, "interleaved"), turned(k, angles, "interleaved")
        want = meta.wo(merged(F.scaled_dot_product_attention(q, k, v, attn_mask=causal)))
        assert torch.allclose(meta(x, additive(causal)), want, atol=F32)  # Meta's rotation runs in float32
        assert (planted(styles.MetaComplex, meta, "kv_swapped", x, additive(causal)) - want).abs().max() > 1e-2

        qwen = moved(styles.QwenNormed())
        q = F.rms_norm(heads(qwen.q_proj(x), 4), (8,), qwen.q_norm.weight, 1e-6)
        k = F.rms_norm(heads(qwen.k_proj(x), 4), (8,), qwen.k_norm.weight, 1e-6)
        q, k = turned(q, angles, "half"), turned(k, angles, "half")
        want = qwen.o_proj(merged(F.scaled_dot_product_attention(q, k, heads(qwen.v_proj(x), 4), attn_mask=causal)))
        assert torch.allclose(qwen(x, additive(causal)), want, atol=F32)
        assert (planted(styles.QwenNormed, qwen, "kv_swapped", x, additive(causal)) - want).abs().max() > 1e-2


def test_processor_styles_are_their_rope_attention():
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        grid = moved(styles.GridRopeProcessor())
        x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
        rows, cols = torch.arange(2).repeat_interleave(3), torch.arange(3).repeat(2)
        angles = torch.cat((positions(2, 8)[rows], positions(3, 8)[cols]), dim=-1)  # [6, 8]: rows, then columns
        q = F.layer_norm(heads(grid.to_q(x), 2), (16,), grid.norm_q.weight, grid.norm_q.bias, 1e-6)
        k = F.layer_norm(heads(grid.to_k(x), 2), (16,), grid.norm_k.weight, grid.norm_k.bias, 1e-6)
        o = F.scaled_dot_product_attention(turned(q, angles, "half"), turned(k, angles, "half"), heads(grid.to_v(x), 2))
        want = grid.to_out[0](merged(o))
        assert torch.allclose(grid(x), want, atol=F32)
        for bug in ("kv_swapped", "split_no_permute"):
            assert (planted(styles.GridRopeProcessor, grid, bug, x) - want).abs().max() > 1e-2

        video = moved(styles.TextVideoProcessor())
        hidden, text = (torch.randn(2, n, 32, generator=g, dtype=torch.float64) for n in (8, 2))
        joined = torch.cat([text, hidden], dim=1)
        t, r, c = torch.arange(2).repeat_interleave(4), torch.arange(2).repeat_interleave(2).repeat(2), \
            torch.arange(2).repeat(4)
        angles = torch.cat((positions(2, 4)[t], positions(2, 6)[r], positions(2, 6)[c]), dim=-1)  # [8, 8]
        angles = torch.cat((torch.zeros(2, 8, dtype=torch.float64), angles))  # the text tokens do not turn
        q = F.layer_norm(heads(video.to_q(joined), 2), (16,), video.norm_q.weight, video.norm_q.bias, 1e-6)
        k = F.layer_norm(heads(video.to_k(joined), 2), (16,), video.norm_k.weight, video.norm_k.bias, 1e-6)
        o = F.scaled_dot_product_attention(turned(q, angles, "interleaved"), turned(k, angles, "interleaved"),
                                           heads(video.to_v(joined), 2))
        out = video.to_out(merged(o))
        mine = video(hidden, text)
        assert torch.allclose(mine[0], out[:, 2:], atol=F32) and torch.allclose(mine[1], out[:, :2], atol=F32)
        for bug in ("kv_swapped", "split_no_permute"):
            assert (planted(styles.TextVideoProcessor, video, bug, hidden, text)[0] - out[:, 2:]).abs().max() > 1e-2

        lumina = moved(styles.LuminaLike())
        x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
        angles = positions(6, 8)
        q, k = turned(heads(lumina.to_q(x), 4), angles, "interleaved"), turned(heads(lumina.to_k(x), 4), angles,
                                                                              "interleaved")
        want = lumina.to_out(merged(F.scaled_dot_product_attention(q, k, heads(lumina.to_v(x), 4), is_causal=True)))
        assert torch.allclose(lumina(x), want, atol=F32)
        assert (planted(styles.LuminaLike, lumina, "kv_swapped", x) - want).abs().max() > 1e-2


def test_hand_written_dropouts_are_attention_and_the_plants_drop():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        hk = moved(styles.HaikuPort())
        want = _sdpa_module(hk.query, hk.key, hk.value, hk.linear, x, 4)
        assert torch.allclose(hk(x), want, atol=1e-10)
        assert (planted(styles.HaikuPort, hk, "dropout_on", x) - want).abs().max() > 1e-2

        rd = moved(styles.RandDropout())
        q, k, v = (heads(t, 4) for t in rd.qkv(x).chunk(3, dim=-1))
        want = rd.proj(merged(F.scaled_dot_product_attention(q, k, v)))
        assert torch.allclose(rd(x), want, atol=1e-10)
        assert (planted(styles.RandDropout, rd, "dropout_on", x) - want).abs().max() > 1e-2

        fx = moved(styles.FlaxOutputDropout())
        q, k, v = (torch.einsum("bnf,fhd->bhnd", x, w) for w in (fx.query_kernel, fx.key_kernel, fx.value_kernel))
        want = torch.einsum("bhqd,hdf->bqf", F.scaled_dot_product_attention(q, k, v), fx.out_kernel)
        assert torch.allclose(fx(x), want, atol=1e-10)
        assert (planted(styles.FlaxOutputDropout, fx, "dropout_on", x) - want).abs().max() > 1e-2


CORRECT = [
    ("JStyleAttention", ("--causal", "--cache", "3")),
    ("ScratchCached", ("--causal", "--cache", "3")),
    ("EinsumBiasFirst", ("--causal", "--cache", "3")),
    ("PhiPartial", ("--rope", "--causal")),
    ("QwenNormed", ("--rope", "--causal")),
    ("GridRopeProcessor", ("--nq", "6")),
    ("TextVideoProcessor", ("--nq", "8", "--nk", "2", "--rope")),
    ("HaikuPort", ("--causal",)),
    ("FlaxOutputDropout", ()),
]


@pytest.mark.parametrize(("name", "options"), CORRECT)
def test_the_correct_styles_pass(runner, name, options):
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("name", "bug", "options", "cause", "step"), [
    ("JStyleAttention", "upper_left", ("--causal", "--cache", "3"), "mask.upper_left", "masked_scores"),
    ("JStyleAttention", "off_by_one", ("--causal",), "mask.off_by_one", "masked_scores"),
    ("ScratchCached", "upper_left", ("--causal", "--cache", "3"), "mask.upper_left", "masked_scores"),
    ("ScratchCached", "polarity", ("--causal",), "mask.polarity", "masked_scores"),
    ("ScratchCached", "fill_zero", ("--causal",), "mask.filled_with_0", "masked_scores"),
    ("EinsumBiasFirst", "upper_left", ("--causal", "--cache", "3"), "mask.upper_left", "masked_scores"),
    ("EinsumBiasFirst", "off_by_one", ("--causal",), "mask.off_by_one", "masked_scores"),
])
def test_a_mask_before_the_scale_is_named_at_the_masked_scores(runner, name, bug, options, cause, step):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *options)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == cause and first["reference"] == step, first
    statuses = {row["reference"]: row["status"] for row in out["alignment"]}
    assert statuses["scores"] == "unseen", statuses  # the code never holds the scaled scores unmasked


def test_a_scale_mistake_after_the_mask_is_still_named_at_the_scores(runner):
    result, out = trace(runner, f"{STYLES}:JStyleAttention", "--init", "bug='scale_d_head'", "--causal", "--cache", "3")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "scale.d_head" and first["reference"] == "scores", first


@pytest.mark.parametrize(("name", "options", "said"), [
    ("PhiPartial", ("--rope", "--causal"), "each projected by the other's weights and then rotated as the keys are"),
    ("QwenNormed", ("--rope", "--causal"), "before the keys' norm (the values then normed and rotated as the keys"),
    ("LlamaGQA", ("--rope", "--causal"), "keys and values swapped"),
    ("MetaComplex", ("--rope", "--causal"), "keys and values swapped"),
    ("GridRopeProcessor", ("--nq", "6"), "keys and values swapped"),
    ("TextVideoProcessor", ("--nq", "8", "--nk", "2", "--rope"), "keys and values swapped"),
    ("LuminaLike", ("--rope", "--causal"), "keys and values swapped"),
])
def test_keys_and_values_swapped_before_rope_or_in_the_kernel_are_named(runner, name, options, said):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='kv_swapped'", *options)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "kv.swapped" and said in first["diagnosis"], first


@pytest.mark.parametrize(("name", "options"), [("GridRopeProcessor", ("--nq", "6")),
                                               ("TextVideoProcessor", ("--nq", "8", "--nk", "2", "--rope"))])
def test_heads_split_wrongly_before_a_2d_rope_are_named_by_experiment(runner, name, options):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='split_no_permute'", *options)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "heads.split_without_permute", out["first_divergence"]
    assert any("angles of its own" in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "options", "dropped"), [
    ("HaikuPort", ("--causal",), "the attention"),
    ("RandDropout", (), "the attention"),
    ("FlaxOutputDropout", (), "the heads' output"),
])
def test_a_dropout_written_by_hand_is_named_by_experiment(runner, name, options, dropped):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='dropout_on'", *options)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "dropout.left_on", first
    assert "own dropout (a keep-mask drawn at random" in first["diagnosis"] and f"of {dropped} zeroed" in \
        first["diagnosis"], first


def test_train_applies_a_dropout_written_by_hand(runner):
    result, out = trace(runner, f"{STYLES}:RandDropout", "--train")
    assert result.exit_code == 0, result.stdout + result.stderr
    note = next(n for n in out["notes"] if n.startswith("dropout in training mode: line "))
    assert "of the attention (p = 0.25)" in note, note
