"""`attnscope trace` on multi-head latent attention as transformers 5 writes it (issue #41): DeepseekV3Attention traced
in place read its width as q_lora_rank (its q_b_proj read as a fused q|k|v), was handed RoPE's tables a head wide
where it slices them down to its rotary part (`cos[..., :d / 2]` in apply_rotary_pos_emb_interleave), and its
rope_interleave was then called a mistake. Now its width is what the layer its input reaches first reads
(usertrace/inputwidth.py), tables it slices are made as wide as make the slice meet what it turns
(tableforms._sliced), tables laid out half-split leave DeepSeek's gathered pairs a convention (refspec.pairing_read),
a complex freqs_cis as narrow as the rotary part is read from the op it raised on (tableforms.narrower), and the scale
its config declares with a yarn RoPE (d_K^-0.5 · mscale²) is the reference's. Styles of our own
(tests/trace_styles_round30_mla.py), each checked first against a float64 formula with F.scaled_dot_product_attention;
the plants change the output and are named by experiment (scale.n: √d_nope where √d_K belongs), or, where no
catalog entry fits, diverge at the right step."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from test_trace_round22_mlarope import _rms, _rope  # the rotary parts turned, the latent's norm, in float64
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round30_mla.py")
styles = user_module(STYLES)
OPTIONS = ("--rope", "--causal")
N = 7


def _mla(x, q_layers, kv_a, kv_norm, kv_b, o, heads, d_nope, d_rope, d_v, pairing, scale=None):
    """Latent attention by its formula: each head's query and key its no-RoPE part joined with its rotated part (the
    key's shared by every head), scores · scale (1/√d_K), causal."""
    b, n, _ = x.shape
    q = q_layers(x).view(b, n, heads, d_nope + d_rope).transpose(1, 2)
    q = torch.cat([q[..., :d_nope], _rope(q[..., d_nope:], pairing)], -1)
    latent, k_pe = kv_a(x).split([kv_a.out_features - d_rope, d_rope], -1)
    kv = kv_b(_rms(latent, kv_norm)).view(b, n, heads, d_nope + d_v).transpose(1, 2)
    k = torch.cat([kv[..., :d_nope], _rope(k_pe[:, None], pairing).expand(-1, heads, -1, -1)], -1)
    out = F.scaled_dot_product_attention(q, k, kv[..., d_nope:], is_causal=True, scale=scale)
    return o(out.transpose(1, 2).flatten(2))


def _tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return angle, torch.cat((angle, angle), -1)


def run_style(name: str, x: torch.Tensor, bug: str = "") -> torch.Tensor:
    m = getattr(styles, name)(bug=bug).double()
    b, n, _ = x.shape
    if name == "V3Gathered":
        _, emb = _tables(n, m.qk_rope_head_dim)
        causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
        return m(x, (emb.cos()[None].expand(b, -1, -1), emb.sin()[None].expand(b, -1, -1)), causal)
    if name == "LiteDirect":
        angle, _ = _tables(n, m.rope_dim)
        return m(x, torch.polar(torch.ones_like(angle), angle).to(torch.complex64))
    return m(x)


def reference(name: str, x: torch.Tensor) -> torch.Tensor:
    m = getattr(styles, name)().double()
    if name == "V3Gathered":  # DeepSeek's gathered pairs turn the checkpoint's interleaved ones: the same scores
        return _mla(x, lambda t: m.q_b_proj(_rms(m.q_a_proj(t), m.q_a_layernorm)), m.kv_a_proj_with_mqa,
                    m.kv_a_layernorm, m.kv_b_proj, m.o_proj, m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim,
                    m.v_head_dim, "interleaved", scale=m.qk_head_dim ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)
    if name == "LiteDirect":
        return _mla(x, m.wq, m.wkv_a, m.kv_norm, m.wkv_b, m.wo, m.n_heads, m.nope, m.rope_dim, m.v_dim, "interleaved")
    return _mla(x, m.wq, m.wkv_a, m.kv_norm, m.wkv_b, m.wo, m.n_head, m.d_nope, m.d_rope, m.d_v, "half")


NAMES = ("V3Gathered", "LiteDirect", "EinsumMLA")
# scale.n: √d_nope where √d_K = √(d_nope + d_rope) belongs (in V3Gathered, inside its declared mscale² too)
PLANTS = [(name, "bug='nope_scale'", OPTIONS, "scale.n") for name in NAMES]
# no catalog entry fits these: the first divergence is the step the mistake makes
STEPS = [("V3Gathered", "k_pe_unturned", "K_full"), ("EinsumMLA", "rope_on_nope", "Q_pe_rot")]


@pytest.mark.parametrize("name", NAMES)
def test_the_styles_are_latent_attention_and_the_plants_change_it(name):
    torch.manual_seed(0)
    x = torch.randn(2, N, 32 if name == "V3Gathered" else 24, dtype=torch.float64)
    want = reference(name, x)
    assert torch.allclose(run_style(name, x), want, atol=1e-5), name  # the styles' norms and RoPE run in float32
    for bug in ["nope_scale"] + [b for n, b, _ in STEPS if n == name]:
        assert (run_style(name, x, bug) - want).abs().max() > 1e-3, (name, bug)


@pytest.mark.parametrize("name", NAMES)
def test_correct_styles_pass(runner, name):
    code, out = run_case(runner, STYLES, name, None, OPTIONS)
    assert_passes(code, out)
    if name == "V3Gathered":  # the tables it slices, and the scale its config declares, said
        assert any("keeps a share of the tables it is handed" in note for note in out["notes"]), out["notes"]
        assert "mscale_all_dim = 1" in str(out), out


@pytest.mark.parametrize(("target", "init", "options", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_plants_are_named_by_experiment(runner, target, init, options, entry):
    found = assert_named(*run_case(runner, STYLES, target, init, options), entry)
    assert "√d_nope" in str(found), found  # the part of the head the code scaled by


@pytest.mark.parametrize(("name", "bug", "step"), STEPS, ids=case_ids(STEPS))
def test_a_mistake_no_entry_fits_diverges_at_its_step(runner, name, bug, step):
    code, out = run_case(runner, STYLES, name, f"bug='{bug}'", OPTIONS)
    assert code == 1 and out["first_divergence"]["reference"] == step, out["first_divergence"]


@pytest.mark.parametrize(("model", "target", "config"), [
    ("deepseek_v3", "DeepseekV3Attention", "DeepseekV3Config(hidden_size=64, num_attention_heads=4, "
     "num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, "
     "v_head_dim=16)"),
    ("deepseek_v2", "DeepseekV2Attention", "DeepseekV2Config(hidden_size=64, num_attention_heads=4, "
     "num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, "
     "v_head_dim=16)")])
def test_transformers_own_latent_attention_in_its_file(runner, model, target, config):
    """transformers 5's DeepseekV3Attention (q LoRA, rope_interleave's gathered pairs on tables it slices) and
    DeepseekV2Attention as V2-Lite builds it (one q_proj, a complex freqs_cis over its rotary part), traced in
    their modeling files: width 64, exit 0."""
    path = str(importlib.import_module(f"transformers.models.{model}.modeling_{model}").__file__)
    code, out = run_case(runner, path, target, f"config={config}, layer_idx=0", OPTIONS)
    assert_passes(code, out)
    assert out["params"]["sizes"]["d_feat"] == 64, out["params"]["sizes"]
