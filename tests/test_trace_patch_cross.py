"""A `[n_batch, n_Q, n_K]` mask the code adds to scores `[n_batch, n_head, n_Q, n_K]` where n_head = n_Q (held-out
round 62, BLT's patch cross-attention with 4 heads over 4 patches: correct code reported as masking other cells).
The code raises on the mask as given, and trace lays it out as the scores it meets; the queries went on the first
axis of their size, the heads', where transformers' layout puts them beside the keys (masking.laid_like). The
style is checked against F.scaled_dot_product_attention in float64 first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_patch_cross import PatchCrossAttention
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_patch_cross.py")


def _patches() -> torch.Tensor:
    """Each of 4 patches sees the bytes of its own patch: [2, 4, 9], True = may attend."""
    ends = torch.tensor([[2, 4, 7, 9], [3, 5, 6, 9]])
    starts = torch.cat([torch.zeros(2, 1, dtype=torch.long), ends[:, :-1]], dim=1)
    j = torch.arange(9)
    return (j >= starts[..., None]) & (j < ends[..., None])


def test_the_style_is_sdpa_under_the_patch_mask_and_the_plant_changes_it():
    torch.manual_seed(0)
    m = PatchCrossAttention().double().eval()
    x, memory = torch.randn(2, 4, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    bias = torch.zeros(2, 4, 9, dtype=torch.float64).masked_fill(~_patches(), float("-inf"))
    q = m.q_proj(x).view(2, 4, 4, 8).transpose(1, 2)
    k, v = (p(memory).view(2, 9, 4, 8).transpose(1, 2) for p in (m.k_proj, m.v_proj))
    with torch.no_grad():
        want = m.o_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=_patches()[:, None])
                        .transpose(1, 2).reshape(2, 4, 32))
        assert (m(x, memory, bias[:, None]) - want).abs().max() < 1e-10
        planted = PatchCrossAttention(bug="kv_swapped").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x, memory, bias[:, None]) - want).abs().max() > 1e-3


@pytest.mark.parametrize(("bug", "entry"), [(None, None), ("kv_swapped", "kv.swapped")])
def test_the_mask_goes_beside_the_keys_where_the_heads_have_the_queries_size(runner, tmp_path, bug, entry):
    options = ("--batch", "2", "--nq", "4", "--nk", "9", "--mask", saved(tmp_path, "patches.npy", _patches().numpy()))
    found = run_case(runner, STYLES, "PatchCrossAttention", bug and f"bug='{bug}'", options)
    if entry is None:
        assert_passes(*found)
        assert any("[n_batch, 1, n_Q, n_K], as the scores it meets" in note for note in found[1]["notes"]), found
    else:
        assert_named(*found, entry)
