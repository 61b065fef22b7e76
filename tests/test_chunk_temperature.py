"""Chunked attention, Llama 4's temperature tuning and the RoPE options of sdpa/mha (partial rotary, interleaved
pairing), against references that share no code with attnscope: transformers' `chunked_causal_mask_function`
(masking_utils) and its Phi-3 / Llama 4 RoPE functions, F.scaled_dot_product_attention, float64 formulas; and
`--check` failing when a wrong rule is planted in attnscope's own code."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope import MultiHeadAttention, Rope, cost, sdpa
from attnscope.cli import app
from attnscope.errors import UsageError
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.spec import AttentionSpec
from attnscope.variants.temperature import TemperatureTuning


def _chunked_reference(n_Q: int, n_K: int, chunk: int, offset: int) -> torch.Tensor:
    """transformers' own chunked causal mask, `[n_Q, n_K]` boolean, queries from position `offset` on."""
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

    mask = sdpa_mask(1, n_Q, n_K, q_offset=offset, mask_function=chunked_causal_mask_function(
        chunk, torch.zeros(1, dtype=torch.long)), allow_is_causal_skip=False)
    return mask[0, 0]


def _close(ours, reference, atol=1e-5):
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    torch.testing.assert_close(ours.double(), reference.double(), atol=atol, rtol=1e-5)


# --- chunked attention -----------------------------------------------------------------------------------


@fuzz_settings(25)
@given(n_Q=st.integers(1, 12), extra=st.integers(-6, 6), chunk=st.integers(1, 9),
       align=st.sampled_from(["upper-left", "lower-right"]))
def test_chunked_attention_is_transformers_chunked_causal_mask(n_Q, extra, chunk, align):
    """Fewer keys than queries too: lower-right, the first queries sit before key 0 and see none (check's
    reference once took their rows from the end of its blocks)."""
    from attnscope.check.reference import Asked, allowed_mask

    n_K = max(0, n_Q + extra)
    offset = n_K - n_Q if align == "lower-right" else 0
    allowed = _chunked_reference(n_Q, n_K, chunk, offset)
    assert torch.equal(allowed_mask(None, n_Q, n_K, Asked(AttentionSpec(causal=align, chunk=chunk))), allowed)
    Q, K, V = torch.randn(2, 3, n_Q, 8), torch.randn(2, 3, n_K, 8), torch.randn(2, 3, n_K, 4)
    trace = sdpa(Q, K, V, causal=align, chunk=chunk)
    seen = allowed.any(dim=-1)  # F.sdpa gives NaN where a query sees no key; attnscope and _safe_softmax give 0
    reference = F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed)
    _close(trace["out"][..., seen, :], reference[..., seen, :])
    assert bool((trace["attention"][..., ~allowed] == 0).all())
    assert trace.step("masked_scores").op.endswith(f"~chunk({chunk}, {align}), -inf)")


def test_a_decode_step_sees_only_its_own_chunk():
    """With a cache the new queries sit after the cached positions (lower-right), as transformers' cache does."""
    module = MultiHeadAttention(16, 4, bias=False, chunk=4, causal=True)
    cache = (torch.randn(1, 4, 6, 4), torch.randn(1, 4, 6, 4))
    trace = module(torch.randn(1, 3, 16), cache=cache)  # positions 6, 7, 8 over keys 0..8
    assert torch.equal(trace["attention"][0, 0] > 0, _chunked_reference(3, 9, 4, 6))


def test_chunk_with_window_or_below_one_is_refused_by_name():
    with pytest.raises(UsageError, match="window 3 and chunk 4"):
        AttentionSpec(window=3, chunk=4)
    with pytest.raises(UsageError, match="^chunk 0"):
        AttentionSpec(chunk=0)
    assert AttentionSpec(chunk=4).align == "upper-left" and AttentionSpec(chunk=4).structural


# --- temperature tuning ---------------------------------------------------------------------------------------


def _factors(start: int, n: int, floor_scale: float, attn_scale: float) -> torch.Tensor:
    positions = range(start, start + n)
    return torch.tensor([1 + attn_scale * math.log(1 + math.floor((p + 1) / floor_scale)) for p in positions],
                        dtype=torch.float64)


@pytest.mark.parametrize(("floor_scale", "attn_scale", "align", "n_K"), [
    (2.0, 0.5, None, 9), (3.0, 0.1, "lower-right", 12), (8192.0, 0.1, "upper-left", 9), (1.0, -0.2, None, 9)])
def test_temperature_scales_each_query_by_its_position(floor_scale, attn_scale, align, n_K):
    Q, K, V = torch.randn(1, 2, 9, 8, dtype=torch.float64), torch.randn(1, 2, n_K, 8), torch.randn(1, 2, n_K, 4)
    tuning = TemperatureTuning(floor_scale, attn_scale)
    trace = sdpa(Q, K.double(), V.double(), causal=align, temperature=tuning)
    start = n_K - 9 if align == "lower-right" else 0
    factors = _factors(start, 9, floor_scale, attn_scale)
    _close(trace["attn_scales"], factors, atol=1e-6)
    reference = F.scaled_dot_product_attention(Q * factors[:, None], K.double(), V.double(),
                                               is_causal=align == "upper-left",
                                               attn_mask=torch.ones(9, n_K, dtype=torch.bool).tril(start)
                                               if align == "lower-right" else None)
    _close(trace["out"], reference)
    names = [s.name for s in trace.steps]
    assert names[3:5] == ["attn_scales", "Q_tuned"] and trace.step("attn_scales").dims == ("n_Q",)
    assert "scores" in names and trace.step("scores").op.startswith("Q_tuned @")


def test_temperature_runs_after_rope_and_before_the_cache_joins():
    module = MultiHeadAttention(16, 4, bias=False, rope=Rope(), temperature=TemperatureTuning(2.0, 0.3), causal=True)
    X, cache = torch.randn(1, 3, 16), (torch.randn(1, 4, 5, 4), torch.randn(1, 4, 5, 4))
    trace = module(X, cache=cache)
    names = [s.name for s in trace.steps]
    assert names.index("K_rot") < names.index("attn_scales") < names.index("Q_tuned") < names.index("K_cat")
    _close(trace["attn_scales"], _factors(5, 3, 2.0, 0.3), atol=1e-6)
    _close(trace["Q_tuned"], trace["Q_rot"] * trace["attn_scales"][:, None])
    module.record = False  # the fused path (F.scaled_dot_product_attention) tunes the same queries
    _close(module(X, cache=cache)["x"], trace["x"])


@pytest.mark.parametrize(("kwargs", "message"), [({"floor_scale": 0}, "^floor_scale 0"),
                                                  ({"attn_scale": math.inf}, "^attn_scale inf")])
def test_temperature_refuses_bad_numbers_by_name(kwargs, message):
    with pytest.raises(UsageError, match=message):
        TemperatureTuning(**kwargs)


# --- RoPE options ----------------------------------------------------------------------------------------------


def test_partial_rotary_is_phi3s_apply_rotary_pos_emb():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    Q, K, V = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 4)
    rope = Rope(10000.0, partial_rotary_factor=0.75)
    trace = sdpa(Q, K, V, causal=True, rope=rope)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 12, 2).float() / 12)
    angle = torch.arange(6).float()[:, None] * inv_freq
    emb = torch.cat([angle, angle], dim=-1)[None]  # [1, n, 12]
    q_ref, k_ref = apply_rotary_pos_emb(Q, K, emb.cos(), emb.sin())
    _close(trace["Q_rot"], q_ref)
    _close(trace["K_rot"], k_ref)
    assert trace.step("cos").dims == ("n_K", "d_rot") and trace.step("cos").shape == (6, 12)
    _close(trace["out"], F.scaled_dot_product_attention(q_ref, k_ref, V, is_causal=True))


def test_interleaved_pairing_is_llama4s_complex_rotation():
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    Q, K = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)  # Llama 4 rotates [n_batch, n, n_head, d_head]
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 8, 2).float() / 8)
    angle = torch.arange(5).float()[None, :, None] * inv_freq
    q_ref, k_ref = apply_rotary_emb(Q, K, torch.polar(torch.ones_like(angle), angle)[0][None])
    trace = sdpa(Q.transpose(1, 2), K.transpose(1, 2), torch.randn(1, 2, 5, 4),
                 rope=Rope(500000.0, pairing="interleaved"))
    _close(trace["Q_rot"], q_ref.transpose(1, 2))
    _close(trace["K_rot"], k_ref.transpose(1, 2))


# --- the command line: --check, the estimate, JSON, bad input ----------------------------------------------------

SMALL_SDPA = ["sdpa", "--batch", "2", "--nq", "9", "--nk", "9", "--dk", "8", "--dv", "4"]
SMALL_MHA = ["mha", "--batch", "2", "--nq", "9", "--d-feat", "16", "--heads", "4"]
VARIANTS = [["--chunk", "4"], ["--chunk", "2", "--causal", "lower-right", "--nk", "11"],
            ["--rope", "--rope-fraction", "0.5"], ["--rope", "--rope-pairing", "interleaved"],
            ["--rope", "--rope-fraction", "0.75", "--rope-pairing", "interleaved", "--chunk", "3"],
            ["--temperature-tuning", "--floor-scale", "2", "--attn-scale", "0.4", "--causal"],
            ["--temperature-tuning", "--floor-scale", "3", "--rope", "--chunk", "5", "--pad", "1"]]


def _checked(runner, *args):
    result = runner.invoke(app, [*args, "--check", "--json"])
    assert result.exit_code in (0, 1), result.output
    payload = json.loads(result.stdout)
    return payload, {c["name"]: c for c in payload["check"]}


@pytest.mark.parametrize("extra", VARIANTS)
def test_sdpa_check_passes(runner, extra):
    base = SMALL_SDPA[:5] + SMALL_SDPA[7:] if "--nk" in extra else SMALL_SDPA  # the variant gives its own --nk
    payload, rows = _checked(runner, *base, *extra)
    assert payload["check_passed"], rows


@pytest.mark.parametrize("extra", [*VARIANTS[:1], *VARIANTS[2:], ["--cache", "6", "--chunk", "4", "--rope",
                                                                   "--kv-heads", "2", "--rope-fraction", "0.5"]])
def test_mha_check_passes(runner, extra):
    payload, rows = _checked(runner, *SMALL_MHA, *extra)
    assert payload["check_passed"], rows
    assert set(rows) == {"x_raw", "attention", "x"}


@pytest.mark.parametrize(("target", "planted", "extra"), [
    ("attnscope.masks.chunk_mask", "window", ["--chunk", "3"]),
    ("attnscope.variants.temperature.TemperatureTuning.scales", "scales",
     ["--temperature-tuning", "--floor-scale", "2"]),
    ("attnscope.variants.rope.apply_rope_interleaved", "pairing", ["--rope", "--rope-pairing", "interleaved"]),
])
def test_planted_mistakes_fail_the_check(runner, monkeypatch, target, planted, extra):
    from attnscope import masks
    from attnscope.variants import rope

    wrong = {"window": lambda n_Q, n_K, chunk, align="upper-left", device=None: masks.window_mask(n_Q, n_K, chunk,
                                                                                                   align, device),
             "scales": lambda self, start, n_Q, device=None: torch.ones(n_Q, device=device) * 1.5,
             "pairing": rope.apply_rope}[planted]
    monkeypatch.setattr(target, wrong)
    payload, rows = _checked(runner, *SMALL_SDPA, *extra)
    assert not payload["check_passed"], rows


@pytest.mark.parametrize("options", [{"chunk": 3}, {"rope": True, "rope_fraction": 0.5},
                                     {"rope": True, "rope_fraction": 0.25, "rope_pairing": "interleaved", "cache": 3},
                                     {"temperature_tuning": True, "floor_scale": 2.0, "rope": True}])
def test_the_estimate_equals_the_traced_run(options):
    sdpa_base = {"batch": 2, "nq": 5, "dk": 8, "dv": 4, "nk": None if options.get("cache") else 7}
    from attnscope.runs.options import check_options

    runs = [run_sdpa(SdpaOptions(**sdpa_base, **options, meta=meta)) for meta in (True, False)]
    spec = check_options(SdpaOptions(**sdpa_base, **options))
    n_K = 7 if not options.get("cache") else options["cache"] + 5
    assert runs[0].peak_bytes == runs[1].peak_bytes == cost.sdpa_bytes(2, 5, n_K, 8, 4, spec)
    mha_base = {"batch": 2, "nq": 5, "d_feat": 16, "heads": 4, "kv_heads": 2}
    runs = [run_mha(MhaOptions(**mha_base, **options, meta=meta)) for meta in (True, False)]
    spec = check_options(MhaOptions(**mha_base, **options), n_kv_head=2)
    cache = options.get("cache", 0)
    assert runs[0].peak_bytes == runs[1].peak_bytes == cost.mha_bytes(2, 5, cache + 5, 16, 4, spec)


def test_cos_and_sin_are_counted_at_the_rotated_width():
    full = AttentionSpec(rope=Rope())
    half = AttentionSpec(rope=Rope(partial_rotary_factor=0.5))
    assert cost.sdpa_bytes(1, 4, 4, 8, 8, full) - cost.sdpa_bytes(1, 4, 4, 8, 8, half) == 4 * 2 * 4 * 4


def test_json_params_name_the_new_variants(runner):
    result = runner.invoke(app, [*SMALL_SDPA, "--rope", "--rope-fraction", "0.5", "--rope-pairing", "interleaved",
                                 "--chunk", "4", "--temperature-tuning", "--json"])
    assert result.exit_code == 0, result.output
    params = json.loads(result.stdout)["params"]
    assert params["chunk"] == 4 and params["rope_fraction"] == 0.5 and params["rope_pairing"] == "interleaved"
    assert params["temperature"] == {"floor_scale": 8192.0, "attn_scale": 0.1} and params["causal"] == "upper-left"
    plain = json.loads(runner.invoke(app, [*SMALL_SDPA, "--json"]).stdout)["params"]
    assert plain["chunk"] is None and plain["temperature"] is None and plain["rope_pairing"] is None


def test_the_header_and_mask_say_the_chunks(runner):
    result = runner.invoke(app, [*SMALL_SDPA, "--chunk", "4", "--rope", "--rope-fraction", "0.5", "--show-mask"])
    assert result.exit_code == 0, result.output
    assert "chunks of 4" in result.stdout and "RoPE base 10000, partial 0.5" in result.stdout
    assert "q4 · · · · ■ · · · ·" in result.stdout
    payload = json.loads(runner.invoke(app, ["mask", "--nq", "6", "--chunk", "3", "--json"]).stdout)
    assert payload["params"]["chunk"] == 3
    assert payload["mask"][4] == [False, False, False, True, True, False]


@pytest.mark.parametrize(("args", "message"), [
    (["sdpa", "--chunk", "3", "--window", "2"], "--window 2 and --chunk 3: a layer has a sliding window or chunks"),
    (["sdpa", "--rope-fraction", "0.5"], "--rope-fraction sets how RoPE turns Q and K; add --rope"),
    (["mha", "--rope-pairing", "interleaved"], "--rope-pairing sets how RoPE turns Q and K; add --rope"),
    (["sdpa", "--rope", "--rope-fraction", "1.5"], "--rope-fraction 1.5 must be in (0, 1]"),
    (["sdpa", "--rope", "--rope-fraction", "0.05", "--dk", "8"], "--rope-fraction 0.05 of d_K 8 rotates no coordinate"),
    (["sdpa", "--attn-scale", "0.2"], "--attn-scale sets Llama 4's temperature tuning; add --temperature-tuning"),
    (["mha", "--temperature-tuning", "--floor-scale", "-1"], "--floor-scale -1"),
    (["sdpa", "--layout", "col", "--chunk", "2"], "--chunk work in the row layout"),
    (["mask", "--chunk", "0"], "--chunk"),
    (["sdpa", "--rope", "--rope-pairing", "diagonal"], "--rope-pairing"),
    (["sdpa", "--nq", "6", "--nk", "4", "--causal", "lower-right", "--temperature-tuning"],
     "--temperature-tuning: aligned lower-right with fewer keys than queries, query 0 sits at position -2"),
])
def test_bad_input_is_one_line(args, message):
    from cli_main import assert_usage_error, run_main

    assert_usage_error(run_main(*args), message)
