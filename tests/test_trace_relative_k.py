"""A projection of the positions named with a key's word (held-out round 63, Parakeet's `relative_k_proj` beside
`k_proj`: refused, exit 2, 'no reference'). Its name read as a second key projection, and naming could not choose
between two called at full rank; a name that says positions (relative, rel, pos, position, r) gives no role
(linearweights.POSITION_WORDS), so q_proj, k_proj, v_proj and o_proj hold the reference, and the code's position term
is its own. Checked against a float64 formula first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trace_styles_relative_k import RelativeKeyAttention
from tracecases import assert_named, assert_passes, run_case

from attnscope.usertrace.linearweights import role_of

STYLES = str(Path(__file__).parent / "trace_styles_relative_k.py")


def test_names_of_position_projections_give_no_role():
    assert [role_of(n) for n in ("relative_k_proj", "linear_pos", "pos_key_proj", "r_net")] == [None] * 4
    assert [role_of(n) for n in ("k_proj", "key", "to_q", "out_proj")] == ["k", "k", "q", "o"]


def test_the_style_is_transformer_xl_attention_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = RelativeKeyAttention().double().eval()
    x, pos = torch.randn(2, 6, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)

    def heads(t):
        return t.view(2, 6, 4, 8).transpose(1, 2)

    with torch.no_grad():
        q, k, v, r = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x)), heads(m.relative_k_proj(pos))
        u, w = m.bias_u[None, :, None], m.bias_v[None, :, None]
        scores = (torch.einsum("bhid,bhjd->bhij", q + u, k) + torch.einsum("bhid,bhjd->bhij", q + w, r)) / 8 ** 0.5
        want = m.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32))
        assert (m(x, pos) - want).abs().max() < 1e-10
        planted = RelativeKeyAttention(bug="kv_swapped").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x, pos) - want).abs().max() > 1e-3


@pytest.mark.parametrize(("bug", "entry"), [(None, None), ("kv_swapped", "kv.swapped")])
def test_a_relative_key_projection_beside_k_proj_is_traced(runner, bug, entry):
    found = run_case(runner, STYLES, "RelativeKeyAttention", bug and f"bug='{bug}'", ("--nq", "6"))
    if entry is None:
        assert_passes(*found)
    else:
        assert_named(*found, entry)
