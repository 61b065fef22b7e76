"""`attnscope trace --cache N` on code whose optional position ids (`position_ids=None`) it raises on: trace runs it
again given arange(N, N + n_Q)[None], as transformers' model passes them, together with the cache layout the code
keeps (a DynamicCache's `update` is met only once the ids are given). Round 24's HF OLMoE attention under --cache 3
raised ('your code raised ... NoneType') on correct code: the ids' retry ran on the cache pair alone. Styles of our
own (tests/trace_styles_round24_cachepos.py), each checked against F.scaled_dot_product_attention in float64 with RoPE
written as complex products at the positions after the cache; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round24_cachepos.py")
styles = user_module(STYLES)
N_PAST, N_NEW = 3, 4


def _rope(x: torch.Tensor, start: int) -> torch.Tensor:
    n, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(start, start + n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), -1)


class _Cache:
    """A DynamicCache of one layer: update joins the new keys and values after the held ones."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def update(self, k, v, layer_idx, kwargs=None):
        self.k, self.v = torch.cat([self.k, k], -2), torch.cat([self.v, v], -2)
        return self.k, self.v


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.view(2, t.shape[1], h, -1).transpose(1, 2)


def _want(q, k, v, past, wo):
    keys, values = torch.cat([past[0], _rope(k, N_PAST)], 2), torch.cat([past[1], v], 2)
    reps = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(reps, 1), values.repeat_interleave(reps, 1)
    seen = torch.ones(N_NEW, N_PAST + N_NEW, dtype=torch.bool).tril(N_PAST)
    out = F.scaled_dot_product_attention(_rope(q, N_PAST), keys, values, attn_mask=seen)
    return wo(out.transpose(1, 2).reshape(2, N_NEW, -1))


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, N_NEW, 32, dtype=torch.float64)
    ids = torch.arange(N_PAST, N_PAST + N_NEW)[None]
    additive = torch.zeros(1, 1, N_NEW, N_PAST + N_NEW, dtype=torch.float64).masked_fill(
        ~torch.ones(N_NEW, N_PAST + N_NEW, dtype=torch.bool).tril(N_PAST), float("-inf"))
    for name, heads, kv_heads in (("HfCacheStep", 4, 2), ("TupleCacheStep", 4, 4), ("FunctionalStep", 4, 4)):
        m, planted = (getattr(styles, name)(bug=bug).double().eval() for bug in (None, "positions"))
        past = torch.randn(2, 2, kv_heads, N_PAST, 8, dtype=torch.float64).unbind(0)
        if name == "HfCacheStep":
            q, k, v = _heads(m.q_proj(x), heads), _heads(m.k_proj(x), kv_heads), _heads(m.v_proj(x), kv_heads)
            want = _want(q, k, v, past, m.o_proj)
            got = m(x, additive, ids, _Cache(*past))[0]
            wrong = planted(x, additive, ids, _Cache(*past))[0]
        elif name == "TupleCacheStep":
            qkv = m.query_key_value(x).view(2, N_NEW, heads, 24).permute(0, 2, 1, 3)
            want = _want(qkv[..., :8], qkv[..., 8:16], qkv[..., 16:], past, m.dense)
            got, wrong = m(x, past, ids)[0], planted(x, past, ids)[0]
        else:
            q, k, v = (_heads(w(x), heads) for w in (m.wq, m.wk, m.wv))
            want = _want(q, k, v, past, m.wo)
            got, wrong = m(x, past, ids), planted(x, past, ids)
        assert torch.allclose(got, want, atol=1e-6), (name, (got - want).abs().max())
        assert (wrong - want).abs().max() > 1e-3, name


STEP = ("--rope", "--causal", "--cache", str(N_PAST), "--nq", str(N_NEW))
CORRECT = [("HfCacheStep", None, STEP), ("HfCacheStep", "layer_idx=1", STEP), ("TupleCacheStep", None, STEP),
           ("FunctionalStep", None, STEP)]

test_decode_steps_given_their_positions_pass = passing_test(STYLES, CORRECT)


PLANTS = [("HfCacheStep", "bug='positions'", STEP, "rope.positions"),
          ("TupleCacheStep", "bug='positions'", STEP, "rope.positions"),
          ("FunctionalStep", "bug='positions'", STEP, "rope.positions")]

test_plants_in_decode_steps_are_named = plants_test(STYLES, PLANTS)


def test_the_note_says_the_positions_after_the_cache(runner):
    from tracecases import run_case

    code, out = run_case(runner, STYLES, "HfCacheStep", None, STEP)
    assert code == 0
    assert any(f"torch.arange({N_PAST}, {N_PAST} + n_Q)[None]" in note for note in out["notes"]), out["notes"]
