"""`attnscope trace` on what held-out round 44 found. transformers' LightGlue takes RoPE's pair as
`position_embeddings=None` and, given None, rotates nothing: trace gave it None first (as for code that makes its
own tables), kept that run, and called the correct module `rope.not_applied`. Where the code given None rotates
nothing and given trace's tables returns another output, the tables are its RoPE
(trace_attempt._own_tables_rotate), and the pair's interleaved layout is then read from its run
(trace_tables.other_layouts), which needed the first run's plan kept after the time-first and column readings
tried theirs and were not kept. Checked against F.scaled_dot_product_attention in float64, on queries and keys
turned by a float64 formula of adjacent pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case
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
