"""Bidirectional sliding windows (ModernBERT's local attention): the mask against transformers' own mask function,
sdpa and mha against PyTorch, the spec's refusals, the cost model and the command line. Causal windows keep
their behaviour and JSON."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope import MultiHeadAttention, masks, sdpa
from attnscope.cli import app
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec


def _transformers_mask(n_Q: int, n_K: int, local_attention: int) -> torch.Tensor:
    """ModernBERT's local layers: masking_utils' bidirectional window function, sliding_window = local_attention // 2
    (ModernBertConfig.sliding_window), asked at every (query, key)."""
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    allowed = sliding_window_bidirectional_mask_function(local_attention // 2)
    return torch.tensor([[bool(allowed(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(n_K)]
                         for i in range(n_Q)])


@pytest.mark.parametrize(("n_Q", "n_K", "window"),
                         [(9, 9, 4), (9, 9, 5), (6, 11, 6), (8, 3, 2), (5, 5, 1), (4, 4, 128)])
def test_mask_is_transformers_bidirectional_window(n_Q, n_K, window):
    spec = AttentionSpec(window=window, window_side="both")
    allowed, said = masks.structural(spec, n_Q, n_K)
    assert torch.equal(allowed, _transformers_mask(n_Q, n_K, window))
    assert said == f"window({window}, both sides)"
    assert spec.align is None and spec.structural and spec.offset(n_Q, n_K) == 0


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_sdpa_equals_pytorch_with_the_window_as_its_mask(enable_gqa):
    n_kv = 2 if enable_gqa else 4
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, n_kv, 10, 8), torch.randn(2, n_kv, 10, 8)
    trace = sdpa(q, k, v, window=6, window_side="both", enable_gqa=enable_gqa)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_transformers_mask(10, 10, 6), enable_gqa=enable_gqa)
    torch.testing.assert_close(trace["out"], expected)
    assert trace.step("masked_scores").op == "scores.masked_fill(~window(6, both sides), -inf)"
    far = torch.ones(10, 10, dtype=torch.bool).triu(4) | torch.ones(10, 10, dtype=torch.bool).tril(-4)
    assert bool((trace["attention"][..., far] == 0).all())


def test_modernbert_local_attention_module_equals_ours():
    """ModernBertAttention on a sliding layer (its eager attention and transformers' own mask) against
    MultiHeadAttention with the fused Wqkv split into W_q, W_k, W_v."""
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_sliding_window_mask
    from transformers.models.modernbert.modeling_modernbert import ModernBertAttention

    config = ModernBertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=3, local_attention=4,
                              attention_bias=True)
    config._attn_implementation = "eager"
    theirs = ModernBertAttention(config, layer_idx=1).eval()  # global every 3rd layer: layer 1 is local
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.5)
    X = torch.randn(1, 9, 32)
    mask = create_bidirectional_sliding_window_mask(config, X, None, allow_is_bidirectional_skip=False)
    no_rotation = (torch.ones(1, 9, 8), torch.zeros(1, 9, 8))
    ours = MultiHeadAttention(32, 4, window=4, window_side="both")
    W, b = theirs.Wqkv.weight.chunk(3), theirs.Wqkv.bias.chunk(3)
    ours.load_state_dict({"W_q.weight": W[0], "W_k.weight": W[1], "W_v.weight": W[2], "W_q.bias": b[0],
                          "W_k.bias": b[1], "W_v.bias": b[2], "W_o.weight": theirs.Wo.weight,
                          "W_o.bias": theirs.Wo.bias})
    with torch.no_grad():
        x, weights = theirs(X, no_rotation, mask)
        trace = ours(X)
    torch.testing.assert_close(trace["attention"], weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trace["x"], x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("spec", "message"), [
    ({"window_side": "both"}, "window_side both says which way the window looks; give window too"),
    ({"window": 4, "window_side": "both", "causal": True}, "cannot go with causal"),
    ({"window": 4, "window_side": "both", "cache": 3}, "cannot go with cache (a decode step, which is causal)"),
    ({"window": 4, "window_side": "right"}, "window_side 'right': use 'left'"),
])
def test_bad_window_sides_name_the_parameter(spec, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AttentionSpec(**spec)


def test_describe_says_the_reach():
    assert AttentionSpec(window=128, window_side="both").describe(64) == (
        "bidirectional (no causal mask), sliding window 128 both sides (|i − j| ≤ 64), scale 1/√64")
    assert AttentionSpec(window=4).describe(8) == "causal, sliding window 4, scale 1/√8"


def test_estimates_equal_the_traced_runs():
    from attnscope import cost
    from attnscope.runs.mha import MhaOptions, run_mha
    from attnscope.runs.sdpa import SdpaOptions, run_sdpa

    spec = AttentionSpec(window=4, window_side="both")
    sizes = {"batch": 2, "nq": 6, "nk": 9, "dk": 4, "dv": 3, "window": 4, "window_side": "both"}
    meta, real = run_sdpa(SdpaOptions(**sizes, meta=True)), run_sdpa(SdpaOptions(**sizes))
    assert meta.peak_bytes == real.peak_bytes == cost.sdpa_bytes(2, 6, 9, 4, 3, spec)
    options = {"batch": 2, "nq": 5, "d_feat": 12, "heads": 3, "window": 4, "window_side": "both"}
    meta, real = run_mha(MhaOptions(**options, meta=True)), run_mha(MhaOptions(**options))
    assert meta.peak_bytes == real.peak_bytes == cost.mha_bytes(2, 5, 5, 12, 3, spec)


@pytest.mark.parametrize("args", [
    ["sdpa", "--batch", "2", "--nq", "6", "--nk", "9", "--dk", "8", "--dv", "4", "--window", "5"],
    ["mha", "--batch", "2", "--nq", "7", "--d-feat", "16", "--heads", "4", "--window", "4"],
    ["mha", "--batch", "1", "--nq", "7", "--d-feat", "16", "--heads", "4", "--kv-heads", "2", "--window", "4",
     "--rope"],
])
def test_check_passes_and_json_says_the_side(runner, args):
    result = runner.invoke(app, [*args, "--window-side", "both", "--check", "--json", "--show-mask"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["params"]["window_side"] == "both" and payload["params"]["causal"] is None
    assert all(c["passed"] for c in payload["check"])
    assert payload["mask"]["alignment"] == "none"
    table = runner.invoke(app, [*args, "--window-side", "both"]).stdout
    assert "both sides (|i − j| ≤" in table and "causal upper-left" not in table


def test_causal_windows_keep_their_json(runner):
    """Today's --window: the same params as before, with window_side added (and sinks, null)."""
    args = ["sdpa", "--batch", "1", "--nq", "4", "--nk", "4", "--dk", "2", "--dv", "2", "--window", "2", "--json"]
    payload = json.loads(runner.invoke(app, args).stdout)
    assert payload["params"]["causal"] == "upper-left" and payload["params"]["window"] == 2
    assert payload["params"]["window_side"] == "left" and payload["params"]["sinks"] is None
    plain = json.loads(runner.invoke(app, args[:-3] + ["--json"]).stdout)
    assert plain["params"]["window_side"] is None


def test_mask_command_draws_and_translates_it(runner):
    result = runner.invoke(app, ["mask", "--nq", "5", "--window", "4", "--window-side", "both", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["mask"] == _transformers_mask(5, 5, 4).tolist()
    assert payload["alignment"] == "none" and payload["params"]["window_side"] == "both"
    assert "window_size=(2, 2)" in payload["translations"]["flash-attn"]
    assert "causal" not in payload["translations"]["flash-attn"].split("\n")[-1]
    uneven = runner.invoke(app, ["mask", "--nq", "3", "--nk", "5", "--window", "4", "--window-side", "both", "--json"])
    assert json.loads(uneven.stdout)["translations"]["flash-attn"].startswith("not expressible")


@pytest.mark.parametrize(("args", "message"), [
    (["mask", "--nq", "4", "--window-side", "both"], "--window-side both says which way the window looks"),
    (["sdpa", "--window", "3", "--window-side", "both", "--causal"], "cannot go with --causal"),
    (["mha", "--window", "3", "--window-side", "both", "--cache", "2"], "cannot go with --cache"),
    (["sdpa", "--window", "3", "--window-side", "both", "--layout", "col"], "--window-side both"),
    (["sdpa", "--window", "3", "--window-side", "up"], "'up' is not one of"),
])
def test_bad_sides_on_the_command_line(runner, args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr


@fuzz_settings(100)
@given(st.integers(0, 9), st.integers(0, 9), st.integers(1, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_any_bidirectional_window_is_pytorchs_with_transformers_mask(n_Q, n_K, window, seed, padded):
    """Any sizes (empty too), any window: the mask is transformers' rule and out is PyTorch's with it (a query
    that sees no key gets zeros, as F.scaled_dot_product_attention gives)."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 4, generator=generator) for n in (n_Q, n_K, n_K))
    allowed = _transformers_mask(n_Q, n_K, window) if n_Q and n_K else torch.ones(n_Q, n_K, dtype=torch.bool)
    mask = torch.arange(n_K) < n_K - 1 if padded and n_K else None
    trace = sdpa(q, k, v, mask, window=window, window_side="both")
    combined = allowed & mask if mask is not None else allowed
    if n_Q and n_K:
        assert torch.equal(masks.structural(AttentionSpec(window=window, window_side="both"), n_Q, n_K)[0], allowed)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=combined.expand(n_Q, n_K))
    expected = torch.where(combined.any(-1, keepdim=True), expected, 0.0)  # no key: PyTorch's _safe_softmax zeros
    torch.testing.assert_close(trace["out"], expected)
