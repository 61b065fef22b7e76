"""`attnscope trace` with RoPE's table handed in under a name other code gives it (load.table_kind): Meta lingua's
`freq_cis` (2x2 rotation matrices, checked by an assert before use, so its use could not say what it is) and
minimind's `pos_cis` (Meta's complex table). Before, neither name was read as a table: trace gave a random position
embedding and the code raised. Each style is checked against F.scaled_dot_product_attention in float64 on keys and
queries turned by a float64 formula of adjacent pairs (complex multiplication by e^(i·position·θ^(-2j/d)))."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_tablenames.py")
styles = user_module(STYLES)
B, N, D, H, KV, DH = 2, 7, 32, 4, 2, 8


def _angles() -> torch.Tensor:
    inv = 10000.0 ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    return torch.arange(N, dtype=torch.float64)[:, None] * inv  # [N, DH / 2]


def _turned(t: torch.Tensor) -> torch.Tensor:
    """[B, N, h, DH], adjacent pairs turned by the positions' angles, in float64."""
    pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(_angles()), _angles())[None, :, None]).flatten(3)


def _table(name: str) -> torch.Tensor:
    a = _angles()
    if name == "Lingua":
        return torch.stack((a.cos(), -a.sin(), a.sin(), a.cos()), dim=-1).view(N, DH // 2, 2, 2)
    return torch.polar(torch.ones_like(a), a)


def _reference(m, x: torch.Tensor) -> torch.Tensor:
    q = _turned(m.wq(x).view(B, N, H, DH)).transpose(1, 2)
    k = _turned(m.wk(x).view(B, N, KV, DH)).repeat_interleave(H // KV, dim=2).transpose(1, 2)
    v = m.wv(x).view(B, N, KV, DH).repeat_interleave(H // KV, dim=2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return m.wo(o.transpose(1, 2).reshape(B, N, H * DH))


def _run(name: str, bug: str | None, x: torch.Tensor) -> torch.Tensor:
    m = getattr(styles, name)(bug=bug).double()
    if name == "Lingua":
        return m(x, _table(name).double(), mask="causal")
    return m(x, _table(name))[0]


PLANTS = [("Lingua", "q_only", "rope.not_applied"), ("MiniMind", "scale_model", "scale.d_model")]
INIT = {"Lingua": "dim=32, head_dim=8, n_heads=4, n_kv_heads=2", "MiniMind": "hidden_size=32"}


@pytest.mark.parametrize("name", ["Lingua", "MiniMind"])
def test_the_styles_are_sdpa_and_the_plants_change_them(name):
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(76), dtype=torch.float64)
    with torch.no_grad():
        want = _reference(getattr(styles, name)().double(), x)
        assert torch.allclose(_run(name, None, x), want, atol=1e-6)  # minimind's float32 softmax and rotation
        for _, bug, _ in (p for p in PLANTS if p[0] == name):
            assert (_run(name, bug, x) - want).abs().max() > 1e-3, bug


@pytest.mark.parametrize("name", ["Lingua", "MiniMind"])
def test_a_table_under_another_name_is_made_in_the_form_the_code_runs_on(runner, name):
    code, out = run_case(runner, STYLES, name, INIT[name], ("--rope", "--rope-pairing", "interleaved", "--causal"))
    assert_passes(code, out)
    param = "freq_cis" if name == "Lingua" else "pos_cis"
    step = next(s for s in out["steps"] if s["name"] == param)
    assert step["op"].startswith("input: ") and "position·inv_freq" in step["op"], step
    if name == "Lingua":  # raised on Meta's complex table first, then made as lingua's 2x2 rotation matrices
        assert step["dims"] == ["n_Q", "d_head/2", "2", "2"], step
        assert any(n.startswith("RoPE's table (freq_cis): your code runs on 2x2 rotation matrices")
                   for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "bug", "entry"), PLANTS)
def test_the_plants_are_named(runner, name, bug, entry):
    options = ("--rope", "--rope-pairing", "interleaved", "--causal")
    assert_named(*run_case(runner, STYLES, name, f"{INIT[name]}, bug={bug!r}", options), entry)
