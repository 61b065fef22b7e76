"""`kv.values_from_keys` where the values are read from the key projection before the keys are rotated
(`value_states = self.k_proj(x)` in RoPE code with grouped-query heads, as in round 8's Cohere plant): the value
side then equals K_feat from its first step, so the experiment holds V_feat at K_feat, and the cause is named by
experiment, not 'none fits' at V_feat. Checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import moved

STYLES = str(Path(__file__).resolve().parent / "trace_styles_values_before_rope.py")
styles = user_module(STYLES)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_the_style_is_sdpa_with_rope_and_the_plant_changes_it(pairing):
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        ours = moved(styles.RopeGQA(pairing=pairing))
        q = ours.rotate(ours.q_proj(x).view(2, 7, 4, 8).transpose(1, 2))
        k = ours.rotate(ours.k_proj(x).view(2, 7, 2, 8).transpose(1, 2))
        v = ours.v_proj(x).view(2, 7, 2, 8).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        want = ours.o_proj(o.transpose(1, 2).flatten(2))
        assert torch.allclose(ours(x), want, atol=1e-10)
        wrong = styles.RopeGQA(pairing=pairing, bug="v_from_k").double().eval()
        wrong.load_state_dict(ours.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-2


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_values_from_the_unrotated_keys_are_named_by_experiment(runner, pairing):
    flags = ("--rope", "--causal") + (("--rope-pairing", "interleaved") if pairing == "interleaved" else ())
    result, out = trace(runner, f"{STYLES}:RopeGQA", "--init", f"pairing='{pairing}'", *flags)
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:RopeGQA", "--init", f"pairing='{pairing}', bug='v_from_k'", *flags)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "kv.values_from_keys", out["first_divergence"]
