"""Two parameters that each raise on what trace first gives them (held-out round 61, Conditional DETR: correct code
reported as raising, exit 1). The mask is unpacked as `[bsz, src_len]` first, so every shape of it the code gets past
then raises on the query sine embedding, a second parameter of the memory's length by trace's first guess; no shape
ran, and the failure kept was the mask's, which the readings of the sine embedding never take up. The first shape the
code gets past its mask with now stands for the run (trace_mask._raised_past), so the sine embedding is read as a
position embedding of the queries, and each of its runs tries the mask's shapes again. The style is checked against
F.scaled_dot_product_attention in float64 first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_two_readings import SineJoinedCrossAttention
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_two_readings.py")


def _padding() -> torch.Tensor:
    allowed = torch.ones(2, 9, dtype=torch.bool)
    allowed[0, 6:] = False
    allowed[1, 4:] = False
    return allowed


def test_the_style_is_sdpa_on_joined_heads_and_each_plant_changes_it():
    torch.manual_seed(0)
    m = SineJoinedCrossAttention().double().eval()
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    sine, pos = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)

    def heads(t):
        return t.view(2, -1, 4, 8)

    with torch.no_grad():
        q = torch.cat([heads(m.q_content_proj(x)), heads(m.q_pos_sine_proj(sine))], -1).transpose(1, 2)
        k = torch.cat([heads(m.k_content_proj(memory)), heads(m.k_pos_proj(pos))], -1).transpose(1, 2)
        v = heads(m.v_proj(memory)).transpose(1, 2)
        mask = _padding()[:, None, None, :]
        want = m.o_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(2, 5, 32))
        got = m(x, memory, sine, pos, _padding().double())[0]
        assert (got - want).abs().max() < 1e-10
        for bug in ("mask_inverted", "softmax_queries"):
            planted = SineJoinedCrossAttention(bug=bug).double().eval()
            planted.load_state_dict(m.state_dict())
            assert (planted(x, memory, sine, pos, _padding().double())[0] - got).abs().max() > 1e-3, bug


@pytest.mark.parametrize(("bug", "entry"), [(None, None), ("mask_inverted", "mask.polarity"),
                                            ("softmax_queries", "softmax.axis")])
def test_both_parameters_are_read_and_plants_named(runner, tmp_path, bug, entry):
    options = ("--batch", "2", "--nq", "5", "--nk", "9", "--mask", saved(tmp_path, "pad.npy", _padding().numpy()))
    found = run_case(runner, STYLES, "SineJoinedCrossAttention", bug and f"bug='{bug}'", options)
    if entry is None:
        assert_passes(*found)
        notes = " ".join(found[1]["notes"])
        assert "query_sine_embed: your code raised on the input trace first gave it" in notes, notes
        assert "runs on one shaped [n_batch, n_K] key padding" in notes, notes
    else:
        assert_named(*found, entry)
