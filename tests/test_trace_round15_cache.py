"""`attnscope trace` on a cache the forward takes preallocated and writes in place (round 15a's gemma_pytorch
GemmaAttention: `k_cache.index_copy_(1, kv_write_indices, xk)` into [n_batch, max_len, n_kv_head, d_head], read
whole). The new tokens' indices are positions (a parameter named so: `kv_write_indices`, `positions`, `input_pos`);
without --cache the code, which cannot run with its cache None, is handed one of no cached positions (room for the
new ones, a prefill); with --cache N, the cached keys and values followed by room for the new ones; the key/value
heads such a cache holds are read from the keys the code writes into it where nothing said them before a run (a
fused GQA projection). Styles of our own (tests/trace_styles_round15_cache.py), each checked against
F.scaled_dot_product_attention in float64 and each plant shown to change its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads, merged, moved

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round15_cache.py")
styles = user_module(STYLES)


def _planted(cls, ours, bug, *args):
    wrong = cls(bug=bug).double().eval()
    wrong.load_state_dict(ours.state_dict())
    return wrong(*args)


def test_the_styles_are_sdpa_after_their_cache_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    n_cache, n = 3, 4
    x = torch.randn(2, n, 32, generator=g, dtype=torch.float64)
    positions = torch.arange(n_cache, n_cache + n)
    allowed = torch.arange(n_cache + n)[None, :] <= positions[:, None]  # [n, n_cache + n], lower-right causal
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    with torch.no_grad():
        m = moved(styles.GemmaCache(), 3)
        cached = [torch.randn(2, n_cache, 2, 8, generator=g, dtype=torch.float64) for _ in range(2)]

        def room(parts, axis):
            return tuple(torch.cat([p, p.new_zeros(*p.shape[:axis], n, *p.shape[axis + 1:])], axis) for p in parts)

        q, k, v = m.qkv_proj(x).split([32, 16, 16], -1)
        keys, values = (torch.cat([c, t.unflatten(-1, (2, 8))], 1).transpose(1, 2)
                        for c, t in zip(cached, (k, v), strict=True))
        want = m.o_proj(merged(F.scaled_dot_product_attention(heads(q), keys, values, attn_mask=allowed,
                                                              enable_gqa=True)))
        assert torch.allclose(m(x, positions, room(cached, 1), additive), want, atol=1e-5)  # its softmax in float32
        assert (_planted(styles.GemmaCache, m, "tiled", x, positions, room(cached, 1), additive) - want
                ).abs().max() > 1e-2

        m = moved(styles.FastCache(), 3)
        cached = [torch.randn(2, 4, n_cache, 8, generator=g, dtype=torch.float64) for _ in range(2)]
        q, k, v = (heads(t) for t in m.wqkv(x).chunk(3, -1))
        keys, values = torch.cat([cached[0], k], 2), torch.cat([cached[1], v], 2)
        want = m.wo(merged(F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)))
        assert torch.allclose(m(x, positions, *room(cached, 2), allowed), want, atol=1e-10)
        assert (_planted(styles.FastCache, m, "scale_twice", x, positions, *room(cached, 2), allowed) - want
                ).abs().max() > 1e-2

        m = moved(styles.SlotCache(), 3)
        cached = [torch.randn(2, 1, n_cache, 8, generator=g, dtype=torch.float64) for _ in range(2)]
        k, v = (t[:, None] for t in m.kv_proj(x).chunk(2, -1))
        keys, values = (torch.cat([c, t], 2).expand(-1, 4, -1, -1) for c, t in zip(cached, (k, v), strict=True))
        want = m.out_proj(merged(F.scaled_dot_product_attention(heads(m.q_proj(x)), keys, values, attn_mask=allowed)))
        assert torch.allclose(m(x, positions, room(cached, 2), allowed), want, atol=1e-10)
        assert (_planted(styles.SlotCache, m, "scale_d_head", x, positions, room(cached, 2), allowed) - want
                ).abs().max() > 1e-2


NAMES = ["GemmaCache", "FastCache", "SlotCache"]


@pytest.mark.parametrize("name", NAMES)
def test_a_prefill_hands_an_empty_cache_with_room(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if "your code cannot run with its cache None" in n]
    assert said and "it is handed one of no cached positions" in said[0] and "room for the cached and the new " \
        "positions together" in said[0], out["notes"]
    if name == "GemmaCache":  # 2 key/value heads, read from the keys it writes: a fused projection says none
        assert "n_kv_head = 2, read from the new keys your code writes into it (line " in said[0], said


@pytest.mark.parametrize("name", NAMES)
def test_a_decode_step_hands_the_cache_with_room(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", "--causal", "--cache", "3")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if "your code keeps its cache as" in n]
    assert said and "room for the cached and the new positions together (n_K = n_cache + n_Q)" in said[0], \
        out["notes"]
    statuses = {row["reference"]: row["status"] for row in out["alignment"]}
    assert statuses["K_cat"] in ("equal", "permuted") and statuses["x"] == "equal", statuses


@pytest.mark.parametrize(("name", "bug", "cause"), [("GemmaCache", "tiled", "gqa.tiled"),
                                                     ("FastCache", "scale_twice", "scale.twice"),
                                                     ("SlotCache", "scale_d_head", "scale.d_head")])
@pytest.mark.parametrize("cache", [[], ["--cache", "3"]])
def test_plants_are_named_by_experiment(runner, name, bug, cause, cache):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", "--causal", *cache)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def test_a_decode_step_beside_an_input_trace_cannot_make_is_refused_in_words_that_say_what_to_do(runner):
    result, _ = trace(runner, f"{STYLES}:SlotMapped", "--cache", "3")
    assert result.exit_code == 2, result.stdout + result.stderr
    assert "also takes slot_mapping without a default, which trace cannot make: trace the module that calls it " \
        "with them, or give them defaults" in result.stderr, result.stderr
