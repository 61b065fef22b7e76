"""`attnscope trace` on held-out round 35's findings: Qwen-1's `rotary_pos_emb_list=None` (a list of one (cos, sin)
pair, each [1, n, 1, d_head]) was left None, as tables a module makes itself, so its code skipped RoPE and correct
code was "RoPE is never applied"; now the parameter is RoPE's, and a module given None that never rotates is given
trace's tables. Pixtral's (cos, sin) [n_patches, d_head] for every image (unsqueezed at 0) raised beside batched
inputs; the pair without a batch axis is now among the forms tried. Each correct style is checked against float64
SDPA with RoPE written here, each plant shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round35_tables.py")
styles = user_module(STYLES)


def _tables(n, d):
    """Half-split (cos, sin) [n, d] of position · 10000^(-2i / d), float64."""
    angle = torch.outer(torch.arange(n, dtype=torch.float64), 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64)
                                                                          / d))
    emb = torch.cat((angle, angle), dim=-1)
    return emb.cos(), emb.sin()


def _turned(x, cos, sin):
    """x [b, h, n, d] turned half-split, written apart from the styles' own helpers."""
    half = x.shape[-1] // 2
    other = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + other * sin


def _heads(t, h=4):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(5)
    n = 7
    x = torch.randn(2, n, 64, generator=g, dtype=torch.float64)
    cos, sin = _tables(n, 16)
    with torch.no_grad():
        m = styles.QWenAttention().double().eval()
        q, k, v = (_heads(t) for t in m.c_attn(x).split(64, dim=-1))
        out = F.scaled_dot_product_attention(_turned(q, cos, sin), _turned(k, cos, sin), v, is_causal=True)
        want = m.c_proj(out.transpose(1, 2).flatten(2))
        listed = [(cos[None, :, None, :], sin[None, :, None, :])]
        assert torch.allclose(m(x, listed), want, atol=1e-10)
        for bug in ("scale_twice", "rope_q_only"):
            assert (planted(styles.QWenAttention, m, bug, x, listed) - want).abs().max() > 1e-2, bug

        p = styles.PixtralAttention().double().eval()
        q, k, v = (_heads(proj(x)) for proj in (p.q_proj, p.k_proj, p.v_proj))
        out = F.scaled_dot_product_attention(_turned(q, cos, sin), _turned(k, cos, sin), v)
        want = p.o_proj(out.transpose(1, 2).flatten(2))
        assert torch.allclose(p(x, position_embeddings=(cos, sin)), want, atol=1e-10)
        wrong = planted(styles.PixtralAttention, p, "scale_d_model", x, None, (cos, sin))
        assert (wrong - want).abs().max() > 1e-2


ROPE = ("--rope", "--causal", "--batch", "2")


def test_qwen_ones_list_of_tables_is_fed_and_its_plants_named(runner):
    code, out = run_case(runner, STYLES, "QWenAttention", None, ROPE)
    assert_passes(code, out)
    assert not any("makes RoPE's tables itself" in note for note in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "QWenAttention", "bug='scale_twice'", ROPE), "scale.twice")
    found = assert_named(*run_case(runner, STYLES, "QWenAttention", "bug='rope_q_only'", ROPE), "rope.not_applied")
    assert "keys" in found["diagnosis"], found


def test_pixtrals_tables_for_every_image_are_read(runner):
    code, out = run_case(runner, STYLES, "PixtralAttention", None, ("--rope", "--batch", "2"))
    assert_passes(code, out)
    assert any("[n_Q, d_head], one for all sequences" in " ".join(note.split()) for note in out["notes"]), \
        out["notes"]
    code, out = run_case(runner, STYLES, "PixtralAttention", "bug='scale_d_model'", ("--rope", "--batch", "2"))
    assert_named(code, out, "scale.d_model")
