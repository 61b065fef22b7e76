"""`attnscope trace` on modules that run on one sequence [n, d] (round 16a's picoGPT port: trace fed [n_batch, n, d]
and reported 'your code raised' on correct code; `--batch 0` was refused for a module), and on modules that keep
state between calls (round 16b's torchtune attention with its KVCache: a prefill's third run raised its own
AssertionError, its positions past max_len; a decode step without --heads crashed with KeyError 'n_head'). Each run
of such a module starts from the state it was built in; a module that fails at trace's batch size runs at a size of
the tensors it holds. Styles of our own (tests/trace_styles_round16_state.py), each checked against
F.scaled_dot_product_attention in float64, each plant shown to change the output and named by experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import moved, planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round16_state.py")
styles = user_module(STYLES)


def _heads(t, h=4):
    return t.unflatten(-1, (h, -1)).transpose(-3, -2)  # [.., n, h·d] -> [.., h, n, d]


def _merged(t):
    return t.transpose(-3, -2).flatten(-2)  # [.., h, n, d] -> [.., n, h·d]


def _rotated(t, start):
    d = t.shape[-1]
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(torch.arange(start, start + t.shape[-2], dtype=torch.float64), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    return t * cos + torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1) * sin


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        pico = moved(styles.PicoHeads())
        q, k, v = (x @ pico.c_attn_w + pico.c_attn_b).split(32, -1)
        o = F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), is_causal=True)
        want = _merged(o) @ pico.c_proj_w + pico.c_proj_b
        assert torch.allclose(pico(x), want, atol=1e-10)
        assert (planted(styles.PicoHeads, pico, "mask_multiplied", x) - want).abs().max() > 1e-2

        flat = moved(styles.FlatHeads())
        o = F.scaled_dot_product_attention(_heads(flat.q(x)), _heads(flat.k(x)), _heads(flat.v(x)), is_causal=True)
        want = flat.o(_merged(o))
        assert torch.allclose(flat(x), want, atol=1e-10)
        for bug in ("off_by_one", "merge"):
            assert (planted(styles.FlatHeads, flat, bug, x) - want).abs().max() > 1e-2

        ein = moved(styles.EinsumOneSequence())
        q, k, v = ein.to_qkv(x).chunk(3, -1)
        want = ein.to_out(_merged(F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v))))
        assert torch.allclose(ein(x), want, atol=1e-10)
        assert (planted(styles.EinsumOneSequence, ein, "softmax_axis", x) - want).abs().max() > 1e-2

        xb = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
        cached = moved(styles.CachedAttention())
        o = F.scaled_dot_product_attention(_heads(cached.q_proj(xb)), _heads(cached.k_proj(xb)),
                                           _heads(cached.v_proj(xb)), is_causal=True)
        want = cached.output_proj(_merged(o))
        assert torch.allclose(cached(xb), want, atol=1e-10)  # a prefill: a call on the empty cache
        again = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
        o = F.scaled_dot_product_attention(_heads(cached.q_proj(again)), _heads(cached.k_proj(again)),
                                           _heads(cached.v_proj(again)), is_causal=True)
        assert not torch.allclose(cached(again), cached.output_proj(_merged(o)), atol=1e-3)  # both calls' keys
        fresh = styles.CachedAttention(bug="no_scale").double()
        fresh.load_state_dict(cached.state_dict())
        fresh.kv_cache.cache_pos.zero_().add_(torch.arange(16))
        assert (fresh(xb) - want).abs().max() > 1e-2

        stream = moved(styles.StreamingRotary())
        q, k, v = stream.qkv(xb).view(2, 5, 3, 4, 8).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(_rotated(q, 0), _rotated(k, 0), v, is_causal=True)
        want = stream.proj(_merged(o))
        assert torch.allclose(stream(xb), want, atol=1e-10)  # its first call starts at position 0
        assert stream.offset == 5  # the next call turns its queries and keys from position 5 on
        assert (planted(styles.StreamingRotary, stream, "rope_on_values", xb) - want).abs().max() > 1e-2


ONE = [("PicoHeads", ("--causal",)), ("FlatHeads", ("--causal",)), ("EinsumOneSequence", ())]


@pytest.mark.parametrize(("name", "args"), ONE, ids=[o[0] for o in ONE])
def test_a_module_on_one_sequence_runs_on_2d_inputs(runner, name, args):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "n_batch" not in out["params"]["sizes"], out["params"]["sizes"]
    assert any("ran on 2-D ones, one sequence" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--batch", "0", *args)  # asked for
    assert result.exit_code == 0, result.stdout + result.stderr


ONE_BUGS = [("PicoHeads", "mask_multiplied", ("--causal",), "mask.multiplied"),
            ("FlatHeads", "off_by_one", ("--causal",), "mask.off_by_one"),
            ("FlatHeads", "merge", ("--causal",), "heads.merge_without_transpose"),
            ("EinsumOneSequence", "softmax_axis", (), "softmax.axis")]


@pytest.mark.parametrize(("name", "bug", "args", "entry"), ONE_BUGS, ids=[f"{b[0]}-{b[1]}" for b in ONE_BUGS])
def test_mistakes_on_one_sequence_are_named_by_experiment(runner, name, bug, args, entry):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug={bug!r}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == entry and first["evidence"].startswith("by experiment"), first


def test_a_module_holding_a_cache_runs_from_its_built_state(runner):
    """Every run starts on the empty cache (trace runs the code many times; before, the third raised the module's
    own assertion), at the batch the cache was set up for."""
    result, out = trace(runner, f"{STYLES}:CachedAttention", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_batch"] == 2, out["params"]["sizes"]
    assert any("a size of the tensors it holds (kv_cache.k_cache [2, 4, 16, 8]" in n for n in out["notes"]), \
        out["notes"]
    result, out = trace(runner, f"{STYLES}:CachedAttention", "--causal", "--init", "bug='no_scale'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "scale.none", out["first_divergence"]


def test_a_decode_step_of_a_held_cache_reads_its_head_count_first(runner):
    """--cache without --heads, where only a run says the head count (was: KeyError 'n_head', the internal-error
    line): a prefill at the cache's batch reads it, then the decode step runs as with --heads."""
    result, out = trace(runner, f"{STYLES}:CachedAttention", "--causal", "--cache", "3")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_head"] == 4 and out["params"]["sizes"]["n_cache"] == 3, out["params"]["sizes"]
    result, out = trace(runner, f"{STYLES}:CachedAttention", "--causal", "--cache", "3", "--init", "bug='no_scale'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "scale.none", out["first_divergence"]


def test_a_block_reads_its_head_count_from_the_attention_it_calls(runner):
    """torchtune's TransformerSelfAttentionLayer says no head count; the attention it calls does (round 16b
    tune_decode_noheads_ok: its prefill, which would have read the count, needs a mask of torchtune's own, and the
    decode step was refused asking for --heads). One count all its submodules say is the module's."""
    result, out = trace(runner, f"{STYLES}:CachedLayer", "--causal", "--cache", "3")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_head"] == 4, out["params"]["sizes"]
    assert not any("read from a run of your code without the cache" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:CachedLayer", "--causal", "--cache", "3", "--init", "bug='no_scale'")
    assert result.exit_code == 1 and out["first_divergence"]["experiment"] == "scale.none", out["first_divergence"]


def test_a_count_of_positions_starts_where_the_module_was_built(runner):
    """A streaming offset moved by every call: each of trace's runs starts at position 0, as the first call does
    (before, the later runs turned their queries and keys from the positions the earlier ones had counted)."""
    result, out = trace(runner, f"{STYLES}:StreamingRotary", "--rope", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:StreamingRotary", "--rope", "--causal", "--init", "bug='rope_on_values'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "rope.on_values", out["first_divergence"]
