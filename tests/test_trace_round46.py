"""`attnscope trace` on what held-out round 46 found: all 40 cases right (8 styles: CodeGen, GPT-J, Persimmon,
StableLM, MPT, Whisper, Swin, BLIP-2's Q-Former), three with words that said the wrong thing:
- MPT's slopes written for a power of 2 heads (6 heads): alibi.slopes, its words giving ALiBi's rule for 6 heads as
  2^(-8 h / n_head), the very slopes the code wrongly computed; now BLOOM's rule for a head count that is no power
  of 2 (biastrials._rule), and the code's slopes named as that mistake;
- Whisper's `_shape` viewing the heads straight, where the keys are split before the queries: the divergence at
  K_split, the words saying "is Q_feat ... viewed straight"; now the diverged step's role is named first
  (Trial.lead);
- StableLM's `value_states = self.k_proj(x)` beside `key_states = self.k_proj(x)`: the divergence shown at
  key_states (line 132), which holds the same numbers; now at the tensor the code goes on from
  (diagnose._shown_at_likeliest).
Each style checked first against F.scaled_dot_product_attention in float64 (MPT's slopes from transformers' own
build_alibi_tensor, StableLM's rotation from its apply_rotary_pos_emb)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

HERE = Path(__file__).resolve().parent
WHISPER = str(HERE / "trace_styles_round46_whisper.py")
STABLELM = str(HERE / "trace_styles_round46_stablelm.py")
MPT = str(HERE / "trace_styles_round46_mpt.py")
B, T = 2, 7


def _trained(m: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight off its initial value: norm gains away from 1, biases away from 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * (1.0 if p.dim() > 1 else 0.3))
    return m.double().eval()


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], n, -1).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


def _whisper(m, x):
    q, k, v = (_heads(p(x), m.num_heads) for p in (m.q_proj, m.k_proj, m.v_proj))
    return m.out_proj(_merge(F.scaled_dot_product_attention(q, k, v)))


def _stablelm(m, x):
    h, kv, d = m.num_heads, m.num_key_value_heads, m.head_dim
    q, k, v = _heads(m.q_proj(x), h), _heads(m.k_proj(x), kv), _heads(m.v_proj(x), kv)
    q = torch.stack([F.layer_norm(q[:, i], (d,), m.q_layernorm.norms[i].weight, None, 1e-5) for i in range(h)], 1)
    k = torch.stack([F.layer_norm(k[:, i], (d,), m.k_layernorm.norms[i].weight, None, 1e-5) for i in range(kv)], 1)
    rot = int(d * m.partial_rotary_factor)
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv
    table = torch.cat((angles, angles), -1)[None]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], table.cos(), table.sin())
    q, k = torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)
    k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    return m.o_proj(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def _mpt(m, x):
    h, n = m.n_heads, x.shape[1]
    q, k, v = (_heads(t, h) for t in m.Wqkv(x).chunk(3, -1))
    # BLOOM's slopes times key position j: the same softmax as -m_h (i - j), a constant per query row apart
    slopes = build_alibi_tensor(torch.ones(1, 2), h, torch.float64)[:, 0, 1].view(h, 1, 1)
    i = torch.arange(n, dtype=torch.float64)
    bias = (-slopes * (i[:, None] - i[None, :])).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return m.out_proj(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])))


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1).expand(B, 1, n, n)


STYLES = {  # file, class, how the module is called, its reference, the plant, the options
    "whisper": (WHISPER, "WhisperAttention", lambda m, x: m(x)[0], _whisper, "view_heads", ()),
    "stablelm": (STABLELM, "StableLmSdpaAttention", lambda m, x: m(x, attention_mask=_causal(x.shape[1]))[0],
                 _stablelm, "v_from_k", ("--causal", "--rope", "--qk-norm", "head")),
    "mpt": (MPT, "MultiheadAttention", lambda m, x: m(x)[0], _mpt, "pow2_slopes", ("--causal", "--alibi")),
}


@pytest.mark.parametrize("style", STYLES)
def test_the_styles_are_their_formulas_and_the_plants_change_them(style):
    path, name, call, reference, plant, _ = STYLES[style]
    cls = getattr(user_module(path), name)
    x = torch.randn(B, T, cls().state_dict()[next(iter(cls().state_dict()))].shape[-1],
                    generator=torch.Generator().manual_seed(46), dtype=torch.float64)
    m = _trained(cls(), 4)
    planted = cls(bug=plant).double().eval()
    planted.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert (call(m, x) - reference(m, x)).abs().max() < 1e-6  # StableLM's RoPE tables are float32, as its own
        assert (call(planted, x) - call(m, x)).abs().max() > 1e-3


@pytest.mark.parametrize("style", STYLES)
def test_the_correct_styles_pass(runner, style):
    path, name, _, _, _, options = STYLES[style]
    assert_passes(*run_case(runner, path, name, None, options))


def test_a_head_count_no_power_of_2_has_its_slopes_said_by_blooms_rule(runner):
    found = assert_named(*run_case(runner, MPT, "MultiheadAttention", "bug='pow2_slopes'", ("--causal", "--alibi")),
                         "alibi.slopes")
    said = " ".join(found["diagnosis"].split())
    assert "2^(-8 h / n_head), h = 1 to 6: the rule for a power of 2 heads" in said, said
    assert "2^(-8 h / 4), h = 1 to 4, 4 the power of 2 below n_head, then 2^(-4 h / 4) for odd h = 1 to 3" in said, said


def test_the_keys_split_first_are_named_first(runner):
    found = assert_named(*run_case(runner, WHISPER, "WhisperAttention", "bug='view_heads'"),
                         "heads.split_without_permute")
    assert found["reference"] == "K_split", found
    assert "is K_feat [n_batch, n_K, d_feat] viewed straight" in found["diagnosis"], found
    assert "(Q_feat and V_feat split the same way)" in found["diagnosis"], found


def test_values_made_as_the_keys_are_shown_where_the_code_goes_on_from_them(runner):
    found = assert_named(*run_case(runner, STABLELM, "StableLmSdpaAttention", "bug='v_from_k'",
                                   ("--causal", "--rope", "--qk-norm", "head")), "kv.values_from_keys")
    assert found["reference"] == "V_feat" and found["user"] == "value_states", found
    assert "your value_states (line" in found["diagnosis"], found
