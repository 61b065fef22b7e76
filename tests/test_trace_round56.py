"""Held-out round 56 (Qwen3, Llama 3.1, BERT relative_key_query, Swin V2, RecurrentGemma, Grok-1, InternViT,
Qwen2.5-Omni audio): its findings in styles written afresh.

transformers 4.45's LlamaAttention makes RoPE's tables itself from `position_ids`, which default to None and are
read (`position_ids.shape[0]`): handed None for its own tables, it raised, and trace ran it on trace's tables, so
the module's rotary (its base, its llama3 scaling) never ran and two plants in it passed. Its own tables are now
tried given the new tokens' positions first (Plan.with_positions_given). Under a scaling the module declares, a
rotation that reads as no table (a pairing slip) or at another base now keeps the declared frequencies in the
reference (conventions._scaled), and rope.base is tried at the usual bases under the same scaling
(ropetrials._declared_base)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from trace_styles_round56 import Llama45, llama3_inv_freq
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_round56.py")
OPTIONS = ("--causal", "--rope", "--rope-base", "500000")


def test_the_style_is_transformers_llama3_rope_and_each_plant_changes_it():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(llama3_inv_freq(500000.0, 16), inv_freq)
    torch.manual_seed(0)
    m = Llama45().double().eval()
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    angles = torch.arange(7, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    emb = torch.cat([angles, angles], dim=-1)[None]
    q, k, v = (p(x).view(2, 7, -1, 16).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    out = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    causal = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    got = m(x, causal, position_ids=torch.arange(7)[None])
    # (the module's tables are float32, as transformers' rotary embedding makes them)
    assert (got - m.o_proj(out.transpose(1, 2).reshape(2, 7, 64))).abs().max() < 1e-6
    for bug in ("rotate_every_two", "default_base"):
        planted = Llama45(bug=bug).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x, causal, position_ids=torch.arange(7)[None]) - got).abs().max() > 1e-3, bug


def test_a_45_layer_makes_its_own_scaled_tables_from_positions(runner):
    code, out = run_case(runner, STYLES, "Llama45", None, OPTIONS)
    assert_passes(code, out)
    notes = " ".join(out["notes"])
    assert "position_ids: given the new tokens' positions" in notes and "rope_scaling (llama3)" in notes, notes


def test_a_pairing_and_a_base_slipped_under_the_declared_scaling_are_named(runner):
    assert_named(*run_case(runner, STYLES, "Llama45", "bug='rotate_every_two'", OPTIONS), "rope.pairing")
    assert_named(*run_case(runner, STYLES, "Llama45", "bug='default_base'", OPTIONS), "rope.base")
