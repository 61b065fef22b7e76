"""`attnscope trace` on round 12b's gaps, with styles of its own (tests/trace_styles_r12b.py):

- a memory parameter no name gives away (Mllama's `cross_attention_states=None` beside `use_cache=None`, a
  Perceiver's `kv_input=None` behind `pos=None`, a function's `source=None` behind `scale=None`): each parameter
  defaulting to None is given keys of their own in turn, and the one the key and value projections read is the
  memory (data flow), with --nk, --k, or where the code raised with it None.

Each correct style is checked against a float64 formula, F.scaled_dot_product_attention or transformers' eager
module; each plant is shown to change the output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_trace_command import trace, user_module
from test_trace_f12_kv import _heads, _sdpa

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r12b.py")
styles = user_module(STYLES)


# --- a memory parameter read from the data flow ---------------------------------------------------------------

def test_vision_cross_attention_is_transformers_mllama_and_the_plants_change_it():
    from transformers import MllamaTextConfig
    from transformers.models.mllama.modeling_mllama import MllamaTextCrossAttention

    config = MllamaTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                              num_hidden_layers=1, vocab_size=64, cross_attention_layers=[0], rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    hf = MllamaTextCrossAttention(config, layer_idx=0).eval()
    ours = styles.VisionCrossAttention()
    hf.load_state_dict(ours.state_dict())
    x, image = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        want = hf(x, cross_attention_states=image, attention_mask=None)[0]
        assert torch.allclose(ours(x, image)[0], want, atol=1e-5)
        for bug in ("softmax_queries", "v_from_k"):
            wrong = styles.VisionCrossAttention(bug=bug)
            assert (wrong(x, image)[0] - want).abs().max() > 1e-2
        with pytest.raises(TypeError):  # None reads the cache, which is None too
            ours(x)


def test_latent_cross_and_the_function_are_sdpa_and_the_plants_change_them():
    m = styles.LatentCross().double()
    x, ctx = torch.randn(2, 4, 24, dtype=torch.float64), torch.randn(2, 6, 24, dtype=torch.float64)
    with torch.no_grad():
        k, v = m.to_kv(ctx).chunk(2, -1)
        want = m.to_out(_sdpa(m.to_q(x), k, v, 3))
        assert torch.allclose(m(x, kv_input=ctx), want, atol=1e-10)
        wrong = styles.LatentCross(bug="no_scale").double()
        assert (wrong(x, kv_input=ctx) - want).abs().max() > 1e-2
    W = [torch.randn(12, 12, dtype=torch.float64) / 3 for _ in range(4)]
    x, src = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 6, 12, dtype=torch.float64)
    q, k, v = _heads(x @ W[0], 4), _heads(src @ W[1], 4), _heads(src @ W[2], 4)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(3), -1)
    want = (p @ v).transpose(1, 2).reshape(2, 4, 12) @ W[3]
    assert torch.allclose(styles.attend_source(x, *W, 4, source=src), want, atol=1e-10)
    assert (styles.attend_source_d_model(x, *W, 4, source=src) - want).abs().max() > 1e-2


MEMORIES = [("VisionCrossAttention", "vision_states"), ("LatentCross", "kv_input"), ("attend_source", "source")]


@pytest.mark.parametrize(("name", "memory"), MEMORIES)
def test_the_memory_is_the_parameter_the_key_projection_reads(runner, name, memory):
    result, out = trace(runner, f"{STYLES}:{name}", "--nk", "5")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == 5
    assert any(n.startswith(f"{memory}: the memory your code takes its keys and values from (cross-attention, "
                            "n_K = 5), read from its data flow") for n in out["notes"]), out["notes"]


def test_code_that_raises_without_its_memory_is_given_one(runner):
    """Mllama's cross-attention reads its cache when it has no vision states: run with None it raised (exit 1,
    "your code raised"); the memory is then read as above, and the note says why."""
    result, out = trace(runner, f"{STYLES}:VisionCrossAttention")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = [n for n in out["notes"] if n.startswith("vision_states: the memory")]
    assert said and "your code raised with vision_states = None (line" in said[0], out["notes"]


def test_files_for_the_queries_and_the_memory(runner, tmp_path):
    torch.manual_seed(0)
    torch.save(torch.randn(2, 4, 32), tmp_path / "x.pt")
    torch.save(torch.randn(2, 6, 32), tmp_path / "image.pt")
    result, out = trace(runner, f"{STYLES}:VisionCrossAttention", "--q", str(tmp_path / "x.pt"), "--k",
                        str(tmp_path / "image.pt"))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == 6


@pytest.mark.parametrize(("name", "args", "cause"), [
    ("VisionCrossAttention", ("--init", "bug='softmax_queries'", "--nk", "5"), "softmax.axis"),
    ("VisionCrossAttention", ("--init", "bug='v_from_k'"), "kv.values_from_keys"),
    ("LatentCross", ("--init", "bug='no_scale'", "--nk", "5"), "scale.none"),
    ("attend_source_d_model", ("--nk", "5"), "scale.d_model"),
])
def test_mistakes_beside_a_memory_are_named_by_experiment(runner, name, args, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")


def test_a_self_attention_with_other_optional_parameters_still_refuses_nk(runner):
    result, _ = trace(runner, f"{STYLES}:attend_source", "--nk", "5", "--forward", "source=None")
    assert result.exit_code == 2
    assert "takes one tensor (self-attention), so n_K = n_Q: none of scale (defaulting to None)" in result.stderr
