"""`attnscope trace` keeps an optional position-ids argument (`position_ids=None`, `pos_ids=None`) at its default,
and where the code raises on None, runs it again given the new tokens' positions, [1, n] from arange(n_cache,
n_cache + n), as transformers' model does before calling its attention (`position_ids = cache_position.unsqueeze(0)`).
Round 23's RecurrentGemma attention, whose rotary reads `position_ids.shape[0]`, was given None and raised: 'your code
raised' on correct code; its Qwen2-VL attention makes its own [3, b, n] ids from None and raised on [1, n] ids.
Styles of our own (tests/trace_styles_round23_positions.py), each checked against F.scaled_dot_product_attention in
float64 with
RoPE written as complex products; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

from attnscope.usertrace import load

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round23_positions.py")
styles = user_module(STYLES)


def _rope(x: torch.Tensor, start: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE as complex products: coordinate i pairs with i + d/2, turned by position · base^(-2i/d)."""
    n, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(start, start + n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), -1)


def _made(cls, bug: str | None = None) -> torch.nn.Module:
    return cls(bug=bug).double().eval()


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.view(2, t.shape[1], h, -1).transpose(1, 2)


def test_the_styles_are_attention():
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    ids = torch.arange(5)[None]
    m = _made(styles.GriffinLike)
    q, k, v = _heads(m.q_proj(x), 4), _heads(m.k_proj(x), 1), _heads(m.v_proj(x), 1)
    out = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True, enable_gqa=True)
    want = m.o_proj(out.transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x, position_ids=ids), want, atol=1e-10)
    assert (_made(styles.GriffinLike, "base")(x, position_ids=ids) - want).abs().max() > 1e-3

    m = _made(styles.LlamaLike)
    q, k, v = _heads(m.q_proj(x), 4), _heads(m.k_proj(x), 2), _heads(m.v_proj(x), 2)
    out = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True, enable_gqa=True)
    want = m.o_proj(out.transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x, position_ids=ids), want, atol=1e-10)
    assert (_made(styles.LlamaLike, "base")(x, position_ids=ids) - want).abs().max() > 1e-3

    m = _made(styles.DecodeStep)
    y = torch.randn(2, 3, 32, dtype=torch.float64)
    past = torch.randn(2, 2, 4, 4, 8, dtype=torch.float64).unbind(0)
    q, k, v = (_heads(w(y), 4) for w in (m.wq, m.wk, m.wv))
    keys, values = torch.cat([past[0], _rope(k, 4)], 2), torch.cat([past[1], v], 2)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(4)
    out = F.scaled_dot_product_attention(_rope(q, 4), keys, values, attn_mask=mask)
    want = m.wo(out.transpose(1, 2).reshape(2, 3, 32))
    assert torch.allclose(m(y, past, pos_ids=torch.arange(4, 7)[None]), want, atol=1e-10)
    planted = _made(styles.DecodeStep, "positions")(y, past, pos_ids=torch.arange(4, 7)[None])
    assert (planted - want).abs().max() > 1e-3

    m = _made(styles.OwnIds)
    q, k, v = (_heads(t, 4) for t in m.qkv(x).chunk(3, -1))
    out = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
    assert torch.allclose(m(x), m.o_proj(out.transpose(1, 2).reshape(2, 5, 32)), atol=1e-10)


def test_position_ids_are_read_from_the_name():
    assert all(load.is_position_ids(n) for n in ("position_ids", "pos_ids", "positionIds", "text_position_ids"))
    assert not any(load.is_position_ids(n) for n in ("input_ids", "token_ids", "position_mask", "cache_position"))


CORRECT = [("GriffinLike", None, ("--rope", "--causal")),
           ("GriffinLike", None, ("--rope", "--causal", "--rope-base", "10000")),
           ("LlamaLike", None, ("--rope", "--causal")),
           ("DecodeStep", None, ("--rope", "--causal", "--cache", "4", "--nq", "3")),
           ("OwnIds", None, ("--rope", "--causal"))]


test_optional_position_ids_pass = passing_test(STYLES, CORRECT)


PLANTS = [("GriffinLike", "bug='base'", ("--rope", "--causal", "--rope-base", "10000"), "rope.base"),
          ("LlamaLike", "bug='base'", ("--rope", "--causal", "--rope-base", "10000"), "rope.base"),
          ("DecodeStep", "bug='positions'", ("--rope", "--causal", "--cache", "4", "--nq", "3"), "rope.positions")]


test_plants_beside_optional_position_ids_are_named = plants_test(STYLES, PLANTS)
