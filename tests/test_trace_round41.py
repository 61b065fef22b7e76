"""`attnscope trace` on what held-out round 41 found: CLIP's `causal_attention_mask`, size-checked as `[bsz, 1, tgt_len,
src_len]`, was given the causal rule as `[n_Q, n_K]` only, raised, and was left None (the rule then missing: a false
alarm on correct code); a cross-attention whose keys' width (`kdim`) differs from the queries', its k_proj made
first, was refused under --nk (the queries' width read off k_proj, every memory width tried beside it and none
with the queries at their own); Jukebox's `attention_multiplier`, a factor of the projections' width, was read as
the scores' scale (Granite's meaning of the name); and block attention that multiplies its own causal tril into the
scores (`w * mask`) was refused under --causal as code that "masks nothing by itself". Each style is checked
against a float64 formula, each plant shown to change its output and named by experiment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round41.py")
styles = user_module(STYLES)
BLOCKS = "config=BlockConfig()"


@pytest.fixture()
def files(tmp_path):
    keep = np.ones((2, 9), dtype=bool)
    keep[1, 5:] = False
    np.save(tmp_path / "pad9.npy", keep)
    np.save(tmp_path / "pad7.npy", keep[:, :7])
    return {name: str(tmp_path / f"{name}.npy") for name in ("pad9", "pad7")}


def _heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    return t.unflatten(-1, (n_head, -1)).transpose(1, 2)


def test_the_styles_are_their_formulas_and_the_plants_change_them():
    g = torch.Generator().manual_seed(41)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        m = styles.TwoMasks().double().eval()
        x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
        keep = torch.ones(2, 7, dtype=torch.bool)
        keep[1, 5:] = False
        allowed = torch.ones(7, 7, dtype=torch.bool).tril() & keep[:, None, None, :]
        q, k, v = (_heads(p(x), 4) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = m.out_proj(sdpa(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(2, 7, 32))
        causal = torch.zeros(2, 1, 7, 7, dtype=torch.float64).masked_fill(~torch.ones(7, 7).tril().bool(), -1e30)
        padding = torch.zeros(2, 1, 7, 7, dtype=torch.float64).masked_fill(~keep[:, None, None, :], -1e30)
        assert torch.allclose(m(x, padding, causal)[0], want, atol=1e-10)
        for bug in ("causal_after", "no_scale"):
            assert (planted(styles.TwoMasks, m, bug, x, padding, causal)[0] - want).abs().max() > 1e-3, bug

        m = styles.WideMemory().double().eval()
        x, memory = torch.randn(2, 7, 32, generator=g, dtype=torch.float64), torch.randn(2, 9, 24, generator=g,
                                                                                          dtype=torch.float64)
        keep = torch.ones(2, 9, dtype=torch.bool)
        keep[1, 5:] = False
        q, k, v = _heads(m.q_proj(x), 4), _heads(m.k_proj(memory), 4), _heads(m.v_proj(memory), 4)
        want = m.out_proj(sdpa(q, k, v, attn_mask=keep[:, None, None, :]).transpose(1, 2).reshape(2, 7, 32))
        mask = torch.zeros(2, 1, 7, 9, dtype=torch.float64).masked_fill(~keep[:, None, None, :], -1e30)
        assert torch.allclose(m(x, memory, mask)[0], want, atol=1e-10)
        assert (planted(styles.WideMemory, m, "kv_swapped", x, memory, mask)[0] - want).abs().max() > 1e-3

        config = styles.BlockConfig()
        m = styles.BlockAttn(config).double().eval()
        x = torch.randn(2, 9, 32, generator=g, dtype=torch.float64)
        want = styles.block_reference(m, x)
        assert torch.allclose(m(x), want, atol=1e-10)
        wrong = styles.BlockAttn(config, bug="multiplied").double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-3


def test_a_causal_mask_parameter_size_checked_as_4d_takes_the_rule(runner, files):
    options = ("--causal", "--batch", "2", "--nq", "7", "--mask", files["pad7"])
    code, out = run_case(runner, STYLES, "TwoMasks", None, options)
    assert_passes(code, out)
    assert any(n.startswith("causal_attention_mask: given the causal rule [n_batch, 1, n_Q, n_K]")
               for n in out["notes"]), out["notes"]
    assert not any(n == "causal_attention_mask = None" for n in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "TwoMasks", "bug='causal_after'", options), "mask.after_softmax")
    assert_named(*run_case(runner, STYLES, "TwoMasks", "bug='no_scale'", options), "scale.none")


@pytest.mark.parametrize("padded", [False, True], ids=["nk", "nk-and-padding"])
def test_a_memory_narrower_than_the_queries_takes_nk(runner, files, padded):
    options = ("--batch", "2", "--nq", "7", "--nk", "9", *(("--mask", files["pad9"]) if padded else ()))
    code, out = run_case(runner, STYLES, "WideMemory", None, options)
    assert_passes(code, out)
    memory = next(s for s in out["steps"] if s["name"] == "key_value_states")
    queries = next(s for s in out["steps"] if s["name"] == "hidden_states")
    assert memory["shape"] == [2, 9, 24] and queries["shape"] == [2, 7, 32], (memory, queries)
    assert_named(*run_case(runner, STYLES, "WideMemory", "bug='kv_swapped'", options), "kv.swapped")


def test_a_width_multiplier_is_no_scale_and_a_multiplied_block_mask_is_named(runner):
    options = ("--causal", "--nq", "9", "--batch", "2")
    code, out = run_case(runner, STYLES, "BlockAttn", BLOCKS, options)
    assert_passes(code, out)
    assert not any("attention_multiplier" in n for n in out["notes"]), out["notes"]
    assert "scale 1)" not in out["reference"], out["reference"]
    assert_named(*run_case(runner, STYLES, "BlockAttn", f"{BLOCKS}, bug='multiplied'", options), "mask.multiplied")
