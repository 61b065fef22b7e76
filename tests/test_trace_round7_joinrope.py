"""`attnscope trace` in a decode step, whichever comes first in the code, the cache's join or RoPE (issue 41; tests/
trace_styles_round7_joinrope.py): code that joins its cache before it rotates (AI2's original OLMo: the cache holds
keys before RoPE, and the joined keys turn at positions 0 .. n_K - 1) is a convention, and the experiments that
change the keys or the join rerun the reference in the code's order: the cached keys joined, then the join rotated.
So the join in the wrong order (cache.order), keys and values swapped before or after the join (kv.swapped), the
queries' or the keys' positions (rope.positions) and the pairing (rope.pairing) are named by experiment in both
orders. Each correct style is checked apart from attnscope against F.scaled_dot_product_attention on keys rotated
in float64, and each planted bug changes its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED
from test_trace_command import user_module
from tracecases import run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round7_joinrope.py")
styles = user_module(STYLES)
DECODE = ("--rope", "--causal", "--cache", "3")


def _rotated(x: torch.Tensor, first: int, interleaved: bool = False) -> torch.Tensor:
    """x [.., n, d] rotated at positions first .. first + n - 1 in float64, pairs (2i, 2i + 1) or (i, i + d/2)."""
    x = x.double()
    n, d = x.shape[-2:]
    positions = torch.arange(first, first + n, dtype=torch.float64)
    turn = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                       positions[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    if interleaved:
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2)) * turn).flatten(-2)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat((z.real, z.imag), -1)


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.view(*t.shape[:-1], h, -1).transpose(1, 2).double()


def _attend(q, k, v, out_layer) -> torch.Tensor:
    """SDPA in float64 with the lower-right causal mask of a decode step, heads merged, the output projection."""
    n, total = q.shape[-2], k.shape[-2]
    allowed = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return out_layer(y.transpose(1, 2).reshape(q.shape[0], n, -1).float())


def _mutants_differ(cls, state, inputs, bugs) -> None:
    kept = cls().eval()
    kept.load_state_dict(state)
    for bug in bugs:
        mutant = cls(bug=bug).eval()
        mutant.load_state_dict(state)
        assert not torch.allclose(mutant(*inputs), kept(*inputs), atol=1e-3), bug


def test_styles_against_sdpa():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    module = styles.FusedJoinFirst().eval()
    cache = (torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    q, k, v = module.c_attn(x).split(module.widths, dim=-1)
    k = torch.cat((cache[0].double(), _heads(k, 2)), dim=-2)
    v = torch.cat((cache[1].double(), _heads(v, 2)), dim=-2).repeat_interleave(2, dim=1)
    expected = _attend(_rotated(_heads(q, 4), 3), _rotated(k, 0).repeat_interleave(2, dim=1), v, module.c_proj)
    torch.testing.assert_close(module(x, cache), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(styles.FusedJoinFirst, module.state_dict(), (x, cache),
                    ["cache_order", "swap_after_join", "pairing", "query_positions"])

    module = styles.ComplexJoinFirst().eval()
    cache = (torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))
    k = torch.cat((cache[0].double(), _heads(module.wk(x), 4)), dim=-2)
    v = torch.cat((cache[1].double(), _heads(module.wv(x), 4)), dim=-2)
    expected = _attend(_rotated(_heads(module.wq(x), 4), 3, True), _rotated(k, 0, True), v, module.wo)
    torch.testing.assert_close(module(x, cache), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(styles.ComplexJoinFirst, module.state_dict(), (x, cache),
                    ["cache_order", "swap_before_join", "keys_offset"])

    module = styles.RotateThenJoin().eval()  # its cache holds rotated keys: joined as they are
    k = torch.cat((cache[0].double(), _rotated(_heads(module.k_proj(x), 4), 3)), dim=-2)
    v = torch.cat((cache[1].double(), _heads(module.v_proj(x), 4)), dim=-2)
    expected = _attend(_rotated(_heads(module.q_proj(x), 4), 3), k, v, module.o_proj)
    torch.testing.assert_close(module(x, cache), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(styles.RotateThenJoin, module.state_dict(), (x, cache),
                    ["cache_order", "swap_after_join", "query_positions"])


# --- trace ---------------------------------------------------------------------------------------------------------


def _run(runner, target: str, *args: str) -> tuple[int, dict]:
    return run_case(runner, STYLES, target, options=args)


@pytest.mark.parametrize(("target", "extra"), [
    ("FusedJoinFirst", ()), ("ComplexJoinFirst", ("--rope-pairing", "interleaved")), ("RotateThenJoin", ())])
def test_correct_decode_steps_pass(runner, target, extra):
    code, out = _run(runner, target, *DECODE, *extra)
    assert code == 0 and out["first_divergence"] is None, (out["first_divergence"], out.get("error"))
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]
    joined_first = target != "RotateThenJoin"
    assert any("keys before RoPE" in note for note in out["notes"]) == joined_first, out["notes"]


@pytest.mark.parametrize(("target", "bug", "entry", "words", "extra"), [
    # the cache joined before RoPE: the rerun joins, then rotates
    ("FusedJoinFirst", "cache_order", "cache.order", "then rotated together", ()),
    ("FusedJoinFirst", "swap_after_join", "kv.swapped", "after the cache was joined", ()),
    ("FusedJoinFirst", "pairing", "rope.pairing", "tables and pairing", ()),
    ("FusedJoinFirst", "query_positions", "rope.positions", "at positions 0 to 6", ()),
    ("ComplexJoinFirst", "cache_order", "cache.order", "torch.cat([k, k_cache])", ("--rope-pairing", "interleaved")),
    ("ComplexJoinFirst", "swap_before_join", "kv.swapped", "before the cache was joined",
     ("--rope-pairing", "interleaved")),
    ("ComplexJoinFirst", "keys_offset", "rope.positions", "offset twice", ("--rope-pairing", "interleaved")),
    # rotated first, then joined: the cache holds rotated keys
    ("RotateThenJoin", "cache_order", "cache.order", "torch.cat([k, k_cache])", ()),
    ("RotateThenJoin", "swap_after_join", "kv.swapped", "after the cache was joined", ()),
    ("RotateThenJoin", "query_positions", "rope.positions", "at positions 0 to 6", ()),
])
def test_decode_bugs_named_by_experiment(runner, target, bug, entry, words, extra):
    code, out = _run(runner, target, "--init", f"bug='{bug}'", *DECODE, *extra)
    found = out["first_divergence"]
    assert code == 1 and found is not None, out.get("error")
    assert found["experiment"] == entry and words in found["diagnosis"], found
    assert found["evidence"].startswith("by experiment"), found
    assert "never applied" not in found["diagnosis"], found
