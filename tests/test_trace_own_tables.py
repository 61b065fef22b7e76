"""RoPE's tables of one pairing rotated with the other's, where the code builds its own 2-D tables (held-out round
61, EVA-02 with transformers' rotate_half over timm's interleaved tables: 'none of the usual causes fits'). No
rotation of the reference's heads gives the code's turned queries, so no angle is read from them; the angles are
read from the code's own cos and sin tables, in the pairing their layout says (owntables.py), and the rerun with the
other rotation names rope.pairing. Each style is checked against F.scaled_dot_product_attention in float64 on a
rotation written here, transformers-free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_own_tables import GridRopeAttention
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).parent / "trace_styles_own_tables.py")


def _turned(x: torch.Tensor, angles: torch.Tensor, pairing: str) -> torch.Tensor:
    """x [.., n, d] with pair p of token t turned by angles[t, p] (float64)."""
    d = x.shape[-1]
    a, b = (torch.arange(0, d, 2), torch.arange(1, d, 2)) if pairing == "interleaved" else \
        (torch.arange(d // 2), torch.arange(d // 2, d))
    turned = torch.view_as_real(torch.complex(x[..., a], x[..., b]) * torch.polar(torch.ones_like(angles), angles))
    out = x.clone()
    out[..., a], out[..., b] = turned[..., 0], turned[..., 1]
    return out


@pytest.mark.parametrize(("layout", "heads_after"), [("interleaved", False), ("half", False), ("half", True)])
def test_the_style_is_sdpa_with_2d_rope_and_the_plant_changes_it(layout, heads_after):
    torch.manual_seed(0)
    m = GridRopeAttention(layout=layout, heads_after=heads_after).double().eval()
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij")
    grid = torch.cat([rows.reshape(-1, 1) * m.bands, cols.reshape(-1, 1) * m.bands], -1).double()
    angles = torch.cat([torch.zeros(1, 8, dtype=torch.float64), grid])  # the cls token turned by nothing
    q, k, v = m.qkv(x).view(2, 10, 3, 4, 16).permute(2, 0, 3, 1, 4)
    pairing = "interleaved" if layout == "interleaved" else "half"
    with torch.no_grad():
        out = F.scaled_dot_product_attention(_turned(q, angles, pairing), _turned(k, angles, pairing), v)
        want = m.proj(out.transpose(1, 2).reshape(2, 10, 64))
        assert (m(x) - want).abs().max() < 1e-10
        planted = GridRopeAttention(layout=layout, bug="other_rotation", heads_after=heads_after).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - m(x)).abs().max() > 1e-3


@pytest.mark.parametrize(("layout", "heads_after"), [("interleaved", False), ("half", False), ("half", True)])
def test_tables_of_one_pairing_rotated_with_the_other_are_rope_pairing(runner, layout, heads_after):
    init = f"layout='{layout}', heads_after={heads_after}"
    assert_passes(*run_case(runner, STYLES, "GridRopeAttention", init, ("--nq", "10")))
    found = assert_named(*run_case(runner, STYLES, "GridRopeAttention", f"{init}, bug='other_rotation'",
                                   ("--nq", "10")), "rope.pairing")
    assert "RoPE's tables and pairing do not go together" in found["diagnosis"], found
