"""Held-out round 59 (Dinat, Seamless M4T conformer, Blenderbot, BEiT, GroupViT, Phi-3, M2M100, Granite-MoE):
findings in styles written afresh.

Neighbourhood attention (NAT, Dinat) scores each query against the keys of its own window, gathered per query
(`[b, h, n, kernel, d]`), and adds its learned table `rpb` per (query, neighbour) cell. trace read the gathered
scores as pieces only where each key row stands once in them, and a bias of the module's own only as a tensor
`[.., n_Q, n_K]`: the reference ran without the bias, and correct code diverged at the scores with "none of your
tensors has scores's shape". Keys gathered per query, a row in several windows, now make pieces of the scores
(gathered._scan), and a bias added to them is scattered to the cells they stand for (piecebias.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trace_styles_round59 import Neighbourhood1d, Neighbourhood2d, allowed, allowed_2d
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).parent / "trace_styles_round59.py")


def _moved(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # off their init values
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return module.double().eval()


def _table_1d(rpb: torch.Tensor, n: int, kernel: int) -> torch.Tensor:
    """The dense bias [h, n, n], written out cell by cell: query i's window starts at clamp(i - kernel // 2, 0,
    n - kernel); key j of it takes rpb[:, j - i + kernel - 1]."""
    out = torch.zeros(rpb.shape[0], n, n, dtype=rpb.dtype)
    for i in range(n):
        start = min(max(i - kernel // 2, 0), n - kernel)
        for j in range(start, start + kernel):
            out[:, i, j] = rpb[:, j - i + kernel - 1]
    return out


def test_the_1d_style_is_masked_attention_with_its_table():
    torch.manual_seed(0)
    m = _moved(Neighbourhood1d())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    q, k, v = (f(x).view(2, 7, 4, 8).transpose(1, 2) for f in (m.q, m.k, m.v))
    bias = _table_1d(m.rpb.detach(), 7, 3).masked_fill(~allowed(7, 3), float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with torch.no_grad():
        assert (m(x) - m.proj(out.transpose(1, 2).reshape(2, 7, 32))).abs().max() < 1e-10
        for plant in ("kv_swapped", "no_scale", "bias_after_softmax"):
            planted = Neighbourhood1d(bug=plant).double().eval()
            planted.load_state_dict(m.state_dict())
            assert (planted(x) - m(x)).abs().max() > 1e-3


def test_the_2d_style_is_masked_attention_with_its_table():
    torch.manual_seed(0)
    m = _moved(Neighbourhood2d())
    x = torch.randn(2, 3, 4, 24, dtype=torch.float64)
    q, k, v = m.qkv(x).reshape(2, 12, 3, 3, 8).permute(2, 0, 3, 1, 4)
    rows, cols = _table_1d(torch.eye(5, dtype=torch.float64), 3, 3), _table_1d(torch.eye(5, dtype=torch.float64), 4, 3)
    # the row and column offsets one-hot, [5, n, n] each: the table looked up by both
    bias = torch.einsum("hab,aik,bjl->hijkl", m.rpb.detach(), rows, cols).reshape(3, 12, 12)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~allowed_2d(3, 4, 3), float("-inf")))
    with torch.no_grad():
        assert (m(x) - m.proj(out.transpose(1, 2).reshape(2, 3, 4, 24))).abs().max() < 1e-10
        planted = Neighbourhood2d(bug="merge_without_transpose").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - m(x)).abs().max() > 1e-3


@pytest.fixture
def windows_1d(tmp_path):
    return ("--nq", "7", "--batch", "2", "--mask", saved(tmp_path, "near.npy", allowed(7, 3).numpy()))


def test_neighbourhood_attention_with_its_own_table_passes(runner, windows_1d, tmp_path):
    code, out = run_case(runner, STYLES, "Neighbourhood1d", None, windows_1d)
    assert_passes(code, out)
    assert any("position bias of its own to its scores in pieces" in note for note in out["notes"]), out["notes"]
    near = saved(tmp_path, "near2d.npy", allowed_2d(3, 4, 3).numpy())
    assert_passes(*run_case(runner, STYLES, "Neighbourhood2d", None, ("--nq", "12", "--mask", near)))


@pytest.mark.parametrize(("bug", "entry"), [("kv_swapped", "kv.swapped"), ("no_scale", "scale.none"),
                                            ("bias_after_softmax", "t5.after_softmax")])
def test_plants_in_neighbourhood_attention_are_named(runner, windows_1d, bug, entry):
    assert_named(*run_case(runner, STYLES, "Neighbourhood1d", f"bug='{bug}'", windows_1d), entry)


def test_a_merge_of_neighbourhood_heads_without_transpose_is_named(runner, tmp_path):
    near = saved(tmp_path, "near2d.npy", allowed_2d(3, 4, 3).numpy())
    assert_named(*run_case(runner, STYLES, "Neighbourhood2d", "bug='merge_without_transpose'", ("--nq", "12",
                                                                                                 "--mask", near)),
                 "heads.merge_without_transpose")
