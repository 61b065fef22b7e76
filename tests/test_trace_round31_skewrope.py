"""`attnscope trace --rope` on code that changes its queries before the scores, but not by a rotation (a pair's two
coordinates turned by different angles, as V-JEPA 2's rotate_queries_or_keys lays its tables): trace must not say
"RoPE is never applied", which is false; it says the queries are changed in a way it reads as no RoPE. Code that
really never rotates keeps "never applied". Each module is first checked in float64 against a formula of its own."""

from __future__ import annotations

from pathlib import Path

import torch
from test_trace_command import user_module
from tracecases import run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round31_skewrope.py")
styles = user_module(STYLES)


def _want(m, x, skew: bool) -> torch.Tensor:
    b, n, _ = x.shape
    q, k, v = (lin(x).view(b, n, 4, 14).transpose(1, 2) for lin in (m.to_q, m.to_k, m.to_v))
    if skew:  # coordinate j of chunk a turns by pos_a · 10000^(-(j mod 2)/2), with its interleaved partner
        ids = torch.arange(n)
        pos = torch.stack([ids // 4] * 4 + [(ids % 4) // 2] * 4 + [ids % 2] * 4 + [ids * 0] * 2, -1)  # [n, 14]
        f = torch.tensor([1.0 / 10000 ** ((j % 4 % 2) / 2) for j in range(12)] + [0.0, 0.0], dtype=torch.float64)
        angle = pos.double() * f  # [n, 14]
        q, k = (t * angle.cos() + torch.stack((-t[..., 1::2], t[..., 0::2]), -1).flatten(-2) * angle.sin()
                for t in (q, k))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return m.out(out.transpose(1, 2).reshape(b, n, -1))


def test_the_styles_are_what_they_say():
    x = torch.randn(2, 8, 56, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    with torch.no_grad():
        for cls, skew in ((styles.SkewedRotary, True), (styles.NotTurned, False)):
            m = cls().double().eval()
            assert torch.allclose(m(x), _want(m, x, skew), atol=1e-10), cls.__name__


def test_a_skewed_turn_is_not_called_rope_never_applied(runner):
    code, out = run_case(runner, STYLES, "SkewedRotary", None, ("--rope",))
    found = out["first_divergence"]
    assert code == 1 and found is not None and found["reference"] == "Q_rot", out
    assert "never applied" not in found["diagnosis"], found
    assert "changes the queries" in found["diagnosis"] and "no RoPE" in found["diagnosis"], found


def test_no_rotation_at_all_is_still_never_applied(runner):
    code, out = run_case(runner, STYLES, "NotTurned", None, ("--rope",))
    found = out["first_divergence"]
    assert code == 1 and found is not None, out
    assert "RoPE is never applied to the queries" in found["diagnosis"] or found["experiment"], found


def test_v_jepa_2s_own_rotary_in_place_is_not_called_never_applied(runner):
    """transformers' VJEPA2RopeAttention, in place: its 3-D rotary is the style above; the words are the same."""
    import transformers.models.vjepa2.modeling_vjepa2 as vjepa2

    init = ("config=VJEPA2Config(crop_size=32, patch_size=16, frames_per_clip=2, tubelet_size=2), hidden_size=96, "
            "num_attention_heads=4")
    code, out = run_case(runner, vjepa2.__file__, "VJEPA2RopeAttention", init, ("--rope", "--nq", "8"))
    found = out["first_divergence"]
    assert code == 1 and found is not None and found["reference"] == "Q_rot", out
    assert "never applied" not in found["diagnosis"] and "changes the queries" in found["diagnosis"], found
