"""`attnscope trace` on transformers 5's own MLA classes beyond DeepSeek, traced in place (issue #41):
Mistral4Attention diverged at the scores (its queries scaled by `get_llama_4_attn_scale`, 1 + β · log(1 + floor(p /
original_max_position_embeddings)), which Llama 4's reading, floor((p + 1) / floor_scale) under other names, did not
take); KimiLinearAttention (MLA without RoPE) was called "RoPE is never applied" (the latent reference always
turned); LongcatFlashMLA's gains on its LoRA outputs (`mla_scale_q_lora`, `mla_scale_kv_lora`) left Q_pe_rot
unexplained; and DeepSeek's inference code, handed its model's [s, t] mask (`scores + mask.unsqueeze(1)`), was given
key padding and called "the mask is not applied". Now the temperature's names and shift are read (tuning.py), the
latent reference turns nothing without --rope (Latent.rotary), gains on the latents' outputs are read from the run
and folded into the reference's weights (latentgains.py), and a mask the same for every sequence is tried as [n_Q,
n_K] before key padding (masking.forms). Each transformers class, with every weight moved off its init, is checked
first against a float64 formula here, then traced in place: exit 0. Styles of our own
(tests/trace_styles_round31_mlaplace.py), each checked against the formula, pass; their plants are named."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _trace_ref import trained
from test_trace_command import user_module
from test_trace_round22_mlarope import _rms, _rope
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round31_mlaplace.py")
styles = user_module(STYLES)
N = 7
SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.2}
# (model, class, config class, its arguments, options, what a note says)
CLASSES = [
    ("mistral4", "Mistral4Attention", "Mistral4Config", {**SIZES, "q_lora_rank": 32, "rope_parameters": YARN},
     ("--rope", "--causal"), "llama_4_scaling_beta"),
    ("kimi_linear", "KimiLinearAttention", "KimiLinearConfig", {**SIZES, "q_lora_rank": None}, ("--causal",),
     "unturned (no --rope: NoPE)"),
    ("longcat_flash", "LongcatFlashMLA", "LongcatFlashConfig", {**SIZES, "q_lora_rank": 32}, ("--rope", "--causal"),
     "gains on its latents' outputs"),
]


def _formula(x, m, d_nope, d_rope, d_v, heads, *, pairing=None, scale=None, q_gain=1.0, kv_gain=1.0, tune=None,
             base=10000.0):
    """Latent attention by its formula, float64: each head's query (times q_gain) its no-RoPE part joined with its
    rotary part, turned at positions 0 .. n − 1 (pairing None: not at all), times `tune[p]` at its position; the key
    its part expanded from the normed latent (times kv_gain) joined with the rotary part every head shares; causal."""
    b, n, _ = x.shape
    q = m.q_proj(x) if getattr(m, "q_proj", None) is not None else m.q_b_proj(_rms(m.q_a_proj(x), m.q_a_layernorm))
    q = q.view(b, n, heads, d_nope + d_rope).transpose(1, 2) * q_gain
    turn = (lambda t: t) if pairing is None else (lambda t: _rope(t, pairing, base))
    q = torch.cat([q[..., :d_nope], turn(q[..., d_nope:])], -1)
    if tune is not None:
        q = q * tune[:, None]
    latent, k_pe = m.kv_a_proj_with_mqa(x).split([m.kv_a_proj_with_mqa.out_features - d_rope, d_rope], -1)
    kv = m.kv_b_proj(_rms(latent, m.kv_a_layernorm) * kv_gain).view(b, n, heads, d_nope + d_v).transpose(1, 2)
    k = torch.cat([kv[..., :d_nope], turn(k_pe[:, None]).expand(-1, heads, -1, -1)], -1)
    out = F.scaled_dot_product_attention(q, k, kv[..., d_nope:], is_causal=True, scale=scale)
    return m.o_proj(out.transpose(1, 2).flatten(2))


def _tune(n, beta, step, shift=0):
    p = torch.arange(n, dtype=torch.float64)
    return 1 + beta * torch.log(1 + torch.floor((p + shift) / step))


def _tables(n, d, base=10000.0):
    angle = torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat((angle, angle), -1)
    return emb.cos()[None], emb.sin()[None]


def _transformers(model, target, config, args):
    """The class built as --init builds it, every weight moved off its init, in float64."""
    import transformers

    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    made = getattr(transformers, config)(**args)
    return trained(getattr(modeling, target)(made, layer_idx=0), 31).double().eval()


@pytest.mark.parametrize(("model", "target", "config", "args", "options", "said"), CLASSES, ids=case_ids(CLASSES))
def test_transformers_classes_compute_the_formula(model, target, config, args, options, said):
    """What each class computes, by the formula with its convention: Mistral 4's tuned queries (shift 0) and yarn's
    mscale², Kimi's unturned shared part, LongCat's gains √(hidden / rank); transformers' own output."""
    torch.manual_seed(0)
    m = _transformers(model, target, config, args)
    x = torch.randn(2, N, 64, dtype=torch.float64)
    causal = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    cos, sin = _tables(N, 8, m.config.rope_parameters.get("rope_theta", 10000.0) if model != "kimi_linear" else 1e4)
    with torch.no_grad():
        if model == "mistral4":
            got = m(x, (cos, sin), causal, torch.arange(N)[None])[0]
            mscale = 0.1 * math.log(4.0) + 1
            want = _formula(x, m, 16, 8, 16, 4, pairing="interleaved", scale=24 ** -0.5 * mscale ** 2,
                            tune=_tune(N, 0.2, 4))
        elif model == "kimi_linear":
            got = m(x, causal)[0]
            want = _formula(x, m, 16, 8, 16, 4)
        else:
            got = m(x, (cos, sin), causal)[0]
            want = _formula(x, m, 16, 8, 16, 4, pairing="interleaved", q_gain=2 ** 0.5, kv_gain=2.0,
                            base=m.config.rope_parameters["rope_theta"])
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()  # eager softmax runs in float32


@pytest.fixture
def moved(monkeypatch):
    """trace's modules built as --init says, then every weight moved off its init (as a trained checkpoint's)."""
    from attnscope.usertrace import load

    construct = load.construct

    def built(*args, **kwargs):
        module, given, blank = construct(*args, **kwargs)
        return trained(module, 31), given, blank

    monkeypatch.setattr(load, "construct", built)


@pytest.mark.parametrize(("model", "target", "config", "args", "options", "said"), CLASSES, ids=case_ids(CLASSES))
def test_transformers_classes_pass_in_place(runner, moved, model, target, config, args, options, said):
    path = str(importlib.import_module(f"transformers.models.{model}.modeling_{model}").__file__)
    given = ", ".join(f"{key}={value!r}" for key, value in args.items())
    code, out = run_case(runner, path, target, f"config={config}({given}), layer_idx=0", options)
    assert_passes(code, out)
    assert said in str(out), out["notes"]
    assert out["params"]["sizes"]["d_feat"] == 64, out["params"]["sizes"]


# (style, options)
STYLED = [("GainedMLA", ("--rope", "--causal")), ("GainedInPlaceMLA", ("--rope", "--causal")),
          ("NopeMLA", ("--causal",)), ("TunedMLA", ("--rope", "--causal")),
          ("MaskArg", ("--rope", "--rope-pairing", "interleaved", "--causal"))]


def _style_reference(name, m, x):
    if name == "MaskArg":
        return _formula(x, _Renamed(m), m.nope, m.rope_dim, m.v_dim, m.n_heads, pairing="interleaved")
    if name in ("GainedMLA", "GainedInPlaceMLA"):
        return _formula(x, m, m.nope, m.rope, m.v_dim, m.heads, pairing="half", q_gain=m.mla_scale_q_lora,
                        kv_gain=m.mla_scale_kv_lora)
    if name == "TunedMLA":
        return _formula(x, m, m.nope, m.rope, m.v_dim, m.heads, pairing="half", tune=_tune(x.shape[1], 0.3, 2))
    return _formula(x, m, m.nope, m.rope, m.v_dim, m.heads)


class _Renamed:
    """DeepSeek's inference names (wq, wkv_a, kv_norm, wkv_b, wo) as transformers', for the formula."""

    def __init__(self, m):
        self.q_proj, self.kv_a_proj_with_mqa, self.kv_a_layernorm = m.wq, m.wkv_a, m.kv_norm
        self.kv_b_proj, self.o_proj = m.wkv_b, m.wo


def _run_style(name, m, x):
    if name != "MaskArg":
        return m(x)
    n = x.shape[1]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    return m(x, 0, torch.polar(torch.ones_like(angle), angle).to(torch.complex64), mask)


@pytest.mark.parametrize(("name", "options"), STYLED, ids=case_ids(STYLED))
def test_styles_compute_the_formula_and_the_plant_changes_it(name, options):
    torch.manual_seed(0)
    x = torch.randn(2, N, 24 if name in ("NopeMLA", "MaskArg") else 32, dtype=torch.float64)
    m = getattr(styles, name)().double()
    planted = getattr(styles, name)(bug="nope_scale").double()
    planted.load_state_dict(m.state_dict())  # the same weights
    want = _style_reference(name, m, x)
    assert torch.allclose(_run_style(name, m, x), want, atol=1e-5), name  # norms and RoPE in float32
    assert (_run_style(name, planted, x) - want).abs().max() > 1e-3, name


@pytest.mark.parametrize(("name", "options"), STYLED, ids=case_ids(STYLED))
def test_correct_styles_pass(runner, name, options):
    code, out = run_case(runner, STYLES, name, None, options)
    assert_passes(code, out)
    if name == "MaskArg":  # the model's [s, t] mask, not key padding
        assert any("runs on one shaped [n_Q, n_K]" in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "options"), STYLED, ids=case_ids(STYLED))
def test_the_scale_over_the_no_rope_part_is_named(runner, name, options):
    found = assert_named(*run_case(runner, STYLES, name, "bug='nope_scale'", options), "scale.n")
    assert "√d_nope" in str(found), found
