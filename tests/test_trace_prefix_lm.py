"""A prefix LM's own mask with its causal edge off by one after the prefix (GIT's `_generate_future_mask` with
`triu(diagonal=0)`, held-out round 53): the --mask file says the pattern, `j <= i or j < P`, and the code's edge moved
either way is mask.off_by_one by experiment (maskblocks._prefix), where it used to be 'a pattern of its own'. The
style is checked against F.scaled_dot_product_attention in float64 first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_prefix_lm import PrefixSelfAttention
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_prefix_lm.py")


def _prefix(n: int, p: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) | (j < p)


def test_the_style_is_sdpa_with_the_prefix_mask_and_each_plant_changes_it():
    torch.manual_seed(0)
    m = PrefixSelfAttention().double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    q, k, v = (getattr(m, n)(x).view(2, 7, 4, 8).transpose(1, 2) for n in ("query", "key", "value"))
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=_prefix(7, 3)).transpose(1, 2).reshape(2, 7, 32)
        assert (m(x) - want).abs().max() < 1e-12
        for bug in ("future_diagonal", "future_wide"):
            planted = PrefixSelfAttention(bug=bug).double().eval()
            planted.load_state_dict(m.state_dict())
            assert (planted(x) - m(x)).abs().max() > 1e-3, bug


@pytest.mark.parametrize("bug", [None, "future_diagonal", "future_wide"])
def test_the_prefix_lms_causal_edge_off_by_one_is_named(runner, tmp_path, bug):
    mask = saved(tmp_path, "prefix.npy", _prefix(7, 3).expand(2, 7, 7).numpy())
    found = run_case(runner, STYLES, "PrefixSelfAttention", bug and f"bug='{bug}'",
                     ("--mask", mask, "--batch", "2", "--nq", "7"))
    if bug is None:
        assert_passes(*found)
    else:
        said = assert_named(*found, "mask.off_by_one")
        assert "after your mask's prefix of 3 positions" in said["diagnosis"], said
