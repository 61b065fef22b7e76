"""Held-out round 51 (ViT, BART, EXAONE, Cohere2, Falcon-H1, Gemma 3n, Longformer, Mllama): 8/8 correct styles
passed and 30/32 plants were named at first. The two misses, and a false alarm the round's helper found beside them:

- A qk-norm put after RoPE passed (exit 0) where the norms' gains were all 1, as `__init__` leaves them: a rotation
  keeps a row's length, so the two orders gave the same numbers. trace now moves such q/k norm gains before the run
  (usertrace/unitgains.py), as training would, and names qknorm.place.
- Falcon-H1's key multiplier (k = k_proj(x) · m, the reference's --scale holding m) hid kv.swapped: the swap's rerun
  kept m on the scores. The swap is now also tried with the keys' own factor going with them into the values.
- A class whose forward is written in another file (tests/test_trace_elsewhere.py).

Each style is checked first against F.scaled_dot_product_attention in float64 (RoPE from transformers'
apply_rotary_pos_emb, the key/value heads from its repeat_kv), its norm gains moved off 1 as trained ones are."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import trace_styles_round51 as styles
from tracecases import assert_named, assert_passes, run_case
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

HERE = Path(__file__).parent
STYLES = str(HERE / "trace_styles_round51.py")
B, T = 2, 7
SCALE = 0.25 / math.sqrt(8)  # KeyMultiplierAttention's key multiplier over √d_head


def _tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos()[None], angles.sin()[None]


def _trained(m: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m.double().eval()


def _normed_reference(m: styles.NormedRopeAttention, x: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.view(B, T, h, m.d).transpose(1, 2)
               for t, h in ((m.wq(x), m.n_heads), (m.wk(x), m.n_kv), (m.wv(x), m.n_kv)))
    cos, sin = _tables(T, m.d)
    q, k = apply_rotary_pos_emb(m.q_norm(q), m.k_norm(k), cos, sin)
    group = m.n_heads // m.n_kv
    out = F.scaled_dot_product_attention(q, repeat_kv(k, group), repeat_kv(v, group), is_causal=True)
    return m.wo(out.transpose(1, 2).reshape(B, T, -1))


def _multiplier_reference(m: styles.KeyMultiplierAttention, x: torch.Tensor) -> torch.Tensor:
    q, k, v = (p(x).view(B, T, m.n_heads, m.d).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    cos, sin = _tables(T, m.d)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
    return m.o_proj(out.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize(("cls", "reference", "bug"), [
    (styles.NormedRopeAttention, _normed_reference, "norm_after_rope"),
    (styles.KeyMultiplierAttention, _multiplier_reference, "kv_swapped"),
])
def test_the_styles_are_their_formulas_and_the_plants_change_them(cls, reference, bug):
    torch.manual_seed(0)
    m = _trained(cls(), 1)
    x = torch.randn(B, T, m.o_proj.out_features if hasattr(m, "o_proj") else 48, dtype=torch.float64)
    got = m(x)
    assert (got - reference(m, x)).abs().max() < 1e-6  # the styles' RoPE tables in float32, as models make them
    planted = cls(bug=bug).double().eval()
    planted.load_state_dict(m.state_dict())
    assert (planted(x) - got).abs().max() > 1e-3
    if cls is styles.NormedRopeAttention:  # the plant is blind as built: gains of 1
        built, planted = cls().double().eval(), cls(bug=bug).double().eval()
        planted.load_state_dict(built.state_dict())
        assert (planted(x) - built(x)).abs().max() < 1e-10


def test_a_qk_norm_after_rope_is_named_though_built_with_gains_of_1(runner):
    options = ("--causal", "--rope", "--qk-norm", "head")
    code, out = run_case(runner, STYLES, "NormedRopeAttention", None, options)
    assert_passes(code, out)
    said = " ".join(" ".join(out["notes"]).split())
    assert "q_norm.weight, k_norm.weight: a q/k norm's gain and bias as your module's __init__ sets them" in said, said
    assert_named(*run_case(runner, STYLES, "NormedRopeAttention", "bug='norm_after_rope'", options), "qknorm.place")


def test_keys_swapped_with_their_own_factor_are_named(runner):
    options = ("--causal", "--rope", "--scale", repr(SCALE))
    assert_passes(*run_case(runner, STYLES, "KeyMultiplierAttention", None, options))
    found = assert_named(*run_case(runner, STYLES, "KeyMultiplierAttention", "bug='kv_swapped'", options),
                         "kv.swapped")
    assert "the factor your code gives its keys (0.25" in " ".join(found["diagnosis"].split())
