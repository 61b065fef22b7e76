"""A --mask file trace hands to no argument of the code (a key padding parameter named without "mask", now read as
the mask from its use: test_trace_round23_maskuse.py) was refused with one line, exit 2, where the code diverged:
before, such code ran unmasked and was named mask.on_queries "by experiment", the experiment's rerun masking whole
query rows and its comparison leaving out the rows it masked while the code's were finite and ordinary. An experiment
now gives a row it masks whole back only where the code masks that row too (rerun.reproduces). Styles of our own
(tests/trace_styles_round22_unfedmask.py), each correct style checked against F.scaled_dot_product_attention in
float64 with the padding as its boolean mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_unfedmask.py")
styles = user_module(STYLES)
KEEP = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]])  # [n_batch, n_K], 1 = a real token


@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "keep.npy", KEEP.bool().numpy())
    np.save(tmp_path / "padded.npy", (KEEP == 0).numpy())
    return {"KEEP": str(tmp_path / "keep.npy"), "PADDED": str(tmp_path / "padded.npy")}


def _sdpa(m, x, q, k, v, out):
    h = m.h
    split = [t.view(2, 7, h, -1).transpose(1, 2) for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*split, attn_mask=KEEP.bool()[:, None, None, :])
    return out(y.transpose(1, 2).reshape(2, 7, -1))


def test_the_styles_are_attention_over_the_real_keys():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.FusedPadded().double()
    q, k, v = m.qkv(x).split(16, -1)
    torch.testing.assert_close(m(x, KEEP.bool()), _sdpa(m, x, q, k, v, m.proj))
    m = styles.HFSelf().double()
    torch.testing.assert_close(m(x, KEEP), _sdpa(m, x, m.query(x), m.key(x), m.value(x), m.dense))
    m = styles.FairseqLike().double()
    torch.testing.assert_close(m(x, KEEP == 0), _sdpa(m, x, m.q_proj(x), m.k_proj(x), m.v_proj(x), m.out_proj))


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    for name, mask in (("HFSelf", KEEP), ("FairseqLike", KEEP == 0)):
        good, bad = getattr(styles, name)(), getattr(styles, name)(plant="rows")
        assert (good(x, mask) - bad(x, mask)).abs().max() > 1e-3
    good, bad = styles.HFSelf(), styles.HFSelf(plant="ignored")
    assert (good(x, KEEP) - bad(x, KEEP)).abs().max() > 1e-3


@pytest.mark.parametrize("target,file", [("HFSelf", "KEEP"), ("FairseqLike", "PADDED")])
def test_a_mask_argument_passes(runner, files, target, file):
    assert_passes(*run_case(runner, STYLES, target, None, ("--nq", "7", "--batch", "2", "--mask", files[file])))


@pytest.mark.parametrize("target,file", [("HFSelf", "KEEP"), ("FairseqLike", "PADDED")])
def test_the_mask_on_the_queries_is_named(runner, files, target, file):
    code, out = run_case(runner, STYLES, target, "plant='rows'", ("--nq", "7", "--batch", "2", "--mask", files[file]))
    assert_named(code, out, "mask.on_queries")


def test_a_mask_never_applied_is_not_read_as_on_the_queries(runner, files):
    code, out = run_case(runner, STYLES, "HFSelf", "plant='ignored'",
                         ("--nq", "7", "--batch", "2", "--mask", files["KEEP"]))
    assert code == 1 and out["first_divergence"]["experiment"] != "mask.on_queries", out["first_divergence"]


def test_a_key_padding_named_without_mask_takes_the_file_by_its_use(runner, files):
    """Refused by bfb7eb6 (exit 2); its masked_fill says it is the mask (usertrace/maskuse.py): the refusal is for an
    argument the code does not apply as a mask (test_trace_round23_maskuse.py)."""
    code, out = run_case(runner, STYLES, "FusedPadded", None, ("--nq", "7", "--batch", "2", "--mask", files["KEEP"]))
    assert_passes(code, out)
    assert any(n.startswith("key_padding: given the --mask file") for n in out["notes"]), out["notes"]


def test_the_module_without_the_file_passes(runner):
    assert_passes(*run_case(runner, STYLES, "FusedPadded", None, ("--nq", "7", "--batch", "2")))
