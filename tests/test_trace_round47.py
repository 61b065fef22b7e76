"""`attnscope trace` on what held-out round 47 found (38/40 at first; 8 styles: GPTBigCode, Qwen-1, DistilBERT, OPT,
Gemma 2, Cohere, DBRX, OLMo 2):
- GPTBigCode's multi-query `torch.where(attention_mask, attn_weights, finfo.min)` moved below the softmax: the
  reference's rerun (the masked weights -inf) makes NaN where the code's finfo.min times the values, carried through
  its products, makes numbers past 1e30 or inf; such a number now meets the reference's NaN or inf
  (align.OVERFLOWED), and the words say the code fills its weights (masktrials._filled_after), so the plant is
  mask.after_softmax by experiment;
- OLMo 2's `value_states = self.k_proj(hidden_states)` under its qk-norm over the whole projection: V = K as
  projected, before the norm, was tried only for a norm of each head (K_split); the projection's own keys, split as
  V is, now (kvtrials.trials_values_from_keys).
Each style checked first against F.scaled_dot_product_attention in float64 (OLMo 2's rotation from transformers'
apply_rotary_pos_emb, its heads shared through repeat_kv)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

HERE = Path(__file__).resolve().parent
BIGCODE = str(HERE / "trace_styles_round47_gptbigcode.py")
OLMO2 = str(HERE / "trace_styles_round47_olmo2.py")
B, T = 2, 7


def _trained(m: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight off its initial value: norm gains away from 1, biases away from 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * (1.0 if p.dim() > 1 else 0.3))
    return m.double().eval()


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], n, -1).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


def _tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv
    table = torch.cat((angles, angles), -1)
    return table.cos(), table.sin()


def _bigcode_call(m, x):
    keep = torch.ones(T, T, dtype=torch.bool).tril()[None, :, None, :].expand(B, T, 1, T)
    return m(x, attention_mask=keep)[0]


def _bigcode(m, x):
    e, d, h = m.embed_dim, m.head_dim, m.num_heads
    q, k, v = m.c_attn(x).split((e, d, d), -1)
    q, k, v = _heads(q, h), _heads(k, 1).expand(-1, h, -1, -1), _heads(v, 1).expand(-1, h, -1, -1)
    return m.c_proj(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def _olmo2_call(m, x):
    cos, sin = _tables(T, m.head_dim)
    causal = torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1).expand(B, 1, T, T)
    return m(x, (cos[None].expand(B, -1, -1), sin[None].expand(B, -1, -1)), causal)[0]


def _olmo2(m, x):
    c = m.config
    h, kv = c.num_attention_heads, c.num_key_value_heads
    q = _heads(F.rms_norm(m.q_proj(x), (h * m.head_dim,), m.q_norm.weight, c.rms_norm_eps), h)
    k = _heads(F.rms_norm(m.k_proj(x), (kv * m.head_dim,), m.k_norm.weight, c.rms_norm_eps), kv)
    cos, sin = _tables(T, m.head_dim)
    q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    v = _heads(m.v_proj(x), kv)
    o = F.scaled_dot_product_attention(q, repeat_kv(k, h // kv), repeat_kv(v, h // kv), is_causal=True)
    return m.o_proj(_merge(o))


STYLES = {  # file, class, how the module is called, its reference, the plant, the options, the entry
    "gptbigcode": (BIGCODE, "GPTBigCodeAttention", _bigcode_call, _bigcode, "mask_late", ("--causal",),
                   "mask.after_softmax"),
    "olmo2": (OLMO2, "Olmo2Attention", _olmo2_call, _olmo2, "v_from_k", ("--causal", "--rope", "--qk-norm", "proj"),
              "kv.values_from_keys"),
}


@pytest.mark.parametrize("style", STYLES)
def test_the_styles_are_their_formulas_and_the_plants_change_them(style):
    path, name, call, reference, plant, _, _ = STYLES[style]
    cls = getattr(user_module(path), name)
    m = _trained(cls(), 47)
    width = next(p for p in m.parameters() if p.dim() == 2).shape[1]
    x = torch.randn(B, T, width, generator=torch.Generator().manual_seed(47), dtype=torch.float64)
    planted = cls(bug=plant).double().eval()
    planted.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert (call(m, x) - reference(m, x)).abs().max() < 1e-6  # OLMo 2 softmaxes in float32, as its own eager
        assert not torch.allclose(call(planted, x), call(m, x), atol=1e-3, equal_nan=True)


@pytest.mark.parametrize("style", STYLES)
def test_the_correct_styles_pass_and_the_plants_are_named(runner, style):
    path, name, _, _, plant, options, entry = STYLES[style]
    assert_passes(*run_case(runner, path, name, None, options))
    assert_named(*run_case(runner, path, name, f"bug='{plant}'", options), entry)


def test_weights_filled_after_the_softmax_are_said_so(runner):
    found = assert_named(*run_case(runner, BIGCODE, "GPTBigCodeAttention", "bug='mask_late'", ("--causal",)),
                         "mask.after_softmax")
    assert "the masked weights then filled with a very negative number, as your code fills them" in \
        found["diagnosis"], found


def test_values_from_the_key_projection_before_a_norm_over_it(runner):
    found = assert_named(*run_case(runner, OLMO2, "Olmo2Attention", "bug='v_from_k'",
                                   ("--causal", "--rope", "--qk-norm", "proj")), "kv.values_from_keys")
    assert found["user"] == "value_states" and "as projected, before the qk-norm" in found["diagnosis"], found
