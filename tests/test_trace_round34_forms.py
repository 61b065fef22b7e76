"""`attnscope trace` on held-out round 34's findings: gpt-fast's `freqs_cis`, a real table [n_Q, d_head / 2, 2] of
(cos, sin) that trace handed as Meta's complex one (correct code exited 1: its view raised), now tried among RoPE's
table forms; a partial rotary's share turned at the end of each head (`q[..., -rotary_ndims:]`), now
`rope.fraction` by experiment where it read as no RoPE; and a cross-attention whose memory's padding sits in its
`encoder_attention_mask` beside `attention_mask`, given there by its name, so that code applying the queries' mask
to the memory's keys shows `mask.not_applied` (it passed). Each correct style is checked against float64 SDPA with
transformers-independent RoPE, each plant shown to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round34_forms.py")
styles = user_module(STYLES)


def _turned(x, n, pairing, width=None):
    """x [b, h, n, d] turned by position · 10000^(-2i / width) on its first `width` coordinates, float64."""
    d = x.shape[-1]
    r = width or d
    theta = torch.outer(torch.arange(n, dtype=torch.float64), 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64)
                                                                           / r))
    part, rest = x[..., :r], x[..., r:]
    if pairing == "interleaved":
        z = torch.complex(part[..., 0::2], part[..., 1::2]) * torch.polar(torch.ones_like(theta), theta)
        turned = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        z = torch.complex(part[..., : r // 2], part[..., r // 2:]) * torch.polar(torch.ones_like(theta), theta)
        turned = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((turned, rest), dim=-1)


def _heads(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(4)
    n = 7
    with torch.no_grad():
        m = styles.GptFastAttention().double().eval()
        x = torch.randn(2, n, 64, generator=g, dtype=torch.float64)
        q, k, v = m.wqkv(x).split([64, 32, 32], dim=-1)
        q, k, v = _turned(_heads(q, 4), n, "interleaved"), _turned(_heads(k, 2), n, "interleaved"), _heads(v, 2)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        want = m.wo(out.transpose(1, 2).flatten(2))
        angle = torch.outer(torch.arange(n, dtype=torch.float64), 10000.0 ** (-torch.arange(0, 16, 2) / 16))
        table = torch.stack((angle.cos(), angle.sin()), dim=-1)  # gpt-fast's precompute_freqs_cis
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.allclose(m(x, table, causal), want, atol=1e-6)
        assert (planted(styles.GptFastAttention, m, "gqa_repeat", x, table, causal) - want).abs().max() > 1e-2

        p = styles.PartialRotary().double().eval()
        q, k, v = (_heads(t, 4) for t in p.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(_turned(q, n, "half", 8), _turned(k, n, "half", 8), v, is_causal=True)
        want = p.dense(out.transpose(1, 2).flatten(2))
        assert torch.allclose(p(x), want, atol=1e-6)
        assert (planted(styles.PartialRotary, p, "last_share", x) - want).abs().max() > 1e-2

        c = styles.BlipCross().double().eval()
        xq, memory = torch.randn(3, 5, 32, generator=g, dtype=torch.float64), torch.randn(3, 9, 48, generator=g,
                                                                                       dtype=torch.float64)
        keep = torch.ones(3, 9, dtype=torch.bool)
        keep[1, 6:] = False
        out = F.scaled_dot_product_attention(_heads(c.query(xq), 4), _heads(c.key(memory), 4),
                                             _heads(c.value(memory), 4), attn_mask=keep[:, None, None, :])
        want = out.transpose(1, 2).flatten(2)
        bias = torch.zeros(3, 1, 1, 9, dtype=torch.float64).masked_fill(~keep[:, None, None, :], float("-inf"))
        assert torch.allclose(c(xq, encoder_hidden_states=memory, encoder_attention_mask=bias), want, atol=1e-10)
        wrong = planted(styles.BlipCross, c, "encoder_mask_ignored", xq, None, None, memory, bias)
        assert (wrong - want).abs().max() > 1e-2


ROPE = ("--causal", "--rope", "--rope-pairing", "interleaved")


def test_gpt_fasts_real_table_is_read(runner):
    code, out = run_case(runner, STYLES, "GptFastAttention", None, ROPE)
    assert_passes(code, out)
    assert any("gpt-fast's freqs_cis" in note for note in out["notes"]), out["notes"]


def test_gpt_fasts_tiled_heads_are_named(runner):
    assert_named(*run_case(runner, STYLES, "GptFastAttention", "bug='gqa_repeat'", ROPE), "gqa.tiled")


def test_a_partial_rotary_passes_and_its_share_at_the_end_is_named(runner):
    assert_passes(*run_case(runner, STYLES, "PartialRotary", None, ("--causal", "--rope")))
    code, out = run_case(runner, STYLES, "PartialRotary", "bug='last_share'", ("--causal", "--rope"))
    found = assert_named(code, out, "rope.fraction")
    assert "the wrong share of each head" in found["diagnosis"], found


def _pad(tmp_path):
    keep = np.ones((3, 9), dtype=bool)
    keep[1, 6:] = False
    np.save(tmp_path / "pad.npy", keep)
    return str(tmp_path / "pad.npy")


def test_the_memorys_padding_goes_to_its_own_mask_parameter(runner, tmp_path):
    options = ("--nq", "5", "--nk", "9", "--mask", _pad(tmp_path))
    assert_passes(*run_case(runner, STYLES, "BlipCross", None, options))
    code, out = run_case(runner, STYLES, "BlipCross", "bug='encoder_mask_ignored'", options)
    assert_named(code, out, "mask.not_applied")
    assert any(note.startswith("encoder_attention_mask: given the key padding of the memory") for note in
               out["notes"]), out["notes"]
