"""Attention sinks (GPT-OSS): sdpa and MultiHeadAttention against transformers' own GPT-OSS attention
(`eager_attention_forward`, `GptOssAttention`), --check's float64 formula, the cost model, the command line and the
sink in each library's words."""

from __future__ import annotations

import json
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from test_properties import attention_case

from attnscope import MultiHeadAttention, sdpa
from attnscope.cli import app
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec


def _eager(q, k, v, sinks, allowed=None, scale=None):
    """transformers' GPT-OSS eager attention: (out [.., n_Q, d], weights), the mask as eager takes it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    mask = None
    if allowed is not None:
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    layer = types.SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    out, weights = eager_attention_forward(layer, q, k, v, mask, scaling=scale or q.shape[-1] ** -0.5)
    return out.transpose(1, 2), weights


@pytest.mark.parametrize(("n_head", "n_kv_head", "n_Q", "n_K", "causal", "window"), [
    (4, 4, 5, 5, None, None), (4, 2, 6, 6, True, None), (6, 2, 3, 8, "lower-right", None), (2, 1, 7, 7, True, 3)])
def test_sdpa_with_sinks_equals_gpt_oss_eager(n_head, n_kv_head, n_Q, n_K, causal, window):
    q, k = torch.randn(2, n_head, n_Q, 8) * 2, torch.randn(2, n_kv_head, n_K, 8) * 2
    v = torch.randn(2, n_kv_head, n_K, 8)
    sinks = torch.randn(n_head) * 2
    trace = sdpa(q, k, v, causal=causal, window=window, sinks=sinks, enable_gqa=n_head != n_kv_head)
    spec = AttentionSpec(causal=causal, window=window)
    allowed = None
    if spec.structural:
        from attnscope.check.reference import Asked, allowed_mask

        allowed = allowed_mask(None, n_Q, n_K, Asked(spec))
    out, weights = _eager(q, k, v, sinks, allowed)
    torch.testing.assert_close(trace["attention"], weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trace["out"], out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trace["sink_weight"], 1 - weights.sum(-1), atol=1e-6, rtol=1e-5)
    names = [step.name for step in trace.steps]
    assert names[names.index("sinks") :][:3] == ["sinks", "attention", "sink_weight"]
    assert trace.step("sinks").dims == ("n_head",)
    assert trace.step("sink_weight").dims == ("n_batch", "n_head", "n_Q")
    assert bool((trace["attention"].sum(-1) < 1).all())
    assert any("each attention row sums to 1 - sink_weight" in note for note in trace.notes)


@pytest.mark.parametrize(("n_head", "n_Q", "n_K", "causal"), [(4, 5, 5, None), (3, 3, 6, "lower-right"),
                                                            (2, 6, 4, "lower-right"), (6, 4, 4, True)])
def test_alibi_with_sinks_is_the_papers_bias(n_head, n_Q, n_K, causal):
    """BLOOM's `m_h · j` and the paper's `−m_h · (i − j)` give the same softmax, but not beside a sink, whose
    logit stays put: attnscope adds the paper's, and --check's float64 formula once added BLOOM's."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from attnscope.check.reference import Asked, allowed_mask, formula

    q, k, v = torch.randn(1, n_head, n_Q, 8), torch.randn(1, n_head, n_K, 8), torch.randn(1, n_head, n_K, 8)
    sinks = torch.randn(n_head)
    spec = AttentionSpec(causal=causal, alibi=True)
    trace = sdpa(q, k, v, spec=spec, sinks=sinks)
    slope = build_alibi_tensor(torch.ones(1, 2), n_head, torch.float32)[:, 0, 1]  # [n_head]: m_h
    start = n_K - n_Q if causal == "lower-right" else 0
    distance = torch.arange(n_Q)[:, None] + start - torch.arange(n_K)  # query position − key position
    bias = -slope[:, None, None] * distance  # [n_head, n_Q, n_K]
    allowed = allowed_mask(None, n_Q, n_K, Asked(spec))
    if allowed is not None:
        bias = bias.masked_fill(~allowed, torch.finfo(torch.float32).min)
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    layer = types.SimpleNamespace(sinks=sinks, num_key_value_groups=1, training=False)
    out, weights = eager_attention_forward(layer, q, k, v, bias[None], scaling=8**-0.5)
    seen = allowed.any(-1) if allowed is not None else torch.ones(n_Q, dtype=torch.bool)
    torch.testing.assert_close(trace["attention"][..., seen, :], weights[..., seen, :], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trace["out"][..., seen, :], out.transpose(1, 2)[..., seen, :], atol=1e-6, rtol=1e-5)
    out64, attention64 = formula(q, k, v, None, Asked(spec), sinks=sinks)
    torch.testing.assert_close(attention64[..., seen, :], weights[..., seen, :].double(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out64, trace["out"].double(), atol=1e-6, rtol=1e-5)


def test_a_query_that_sees_no_key_gives_all_to_the_sink():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    trace = sdpa(q, k, v, mask, sinks=torch.tensor([0.5, -2.0]))
    assert not torch.isnan(trace["attention"]).any()
    assert torch.equal(trace["attention"][:, :, 1], torch.zeros(1, 2, 5))
    torch.testing.assert_close(trace["sink_weight"][:, :, 1], torch.ones(1, 2))
    _, weights = _eager(q, k, v, torch.tensor([0.5, -2.0]), mask)
    torch.testing.assert_close(trace["attention"], weights)


def test_one_sink_for_every_head_and_sdpa_without_a_head_axis():
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 6, 8), torch.randn(3, 6, 8)
    trace = sdpa(q, k, v, sinks=torch.tensor([1.5]))
    out, weights = _eager(q[:, None], k[:, None], v[:, None], torch.tensor([1.5]))
    torch.testing.assert_close(trace["attention"], weights[:, 0])
    assert trace.step("sink_weight").dims == ("n_batch", "n_Q")
    shared = sdpa(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), sinks=torch.tensor(0.7))
    assert shared["sinks"].shape == (1,)


def test_sinks_follow_the_inputs_device():
    """Sinks given on the CPU for inputs elsewhere (here PyTorch's meta device): moved, not refused."""
    q, k, v = (torch.empty(2, 4, 3, 8, device="meta") for _ in range(3))
    trace = sdpa(q, k, v, sinks=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert trace["attention"].device.type == "meta" and trace["sink_weight"].shape == (2, 4, 3)


def test_sinks_keep_gradients():
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    sdpa(q, k, v, sinks=sinks, causal=True)["out"].sum().backward()
    grad = sinks.grad.clone()
    sinks.grad = None
    out, _ = _eager(q, k, v, sinks, torch.ones(3, 3, dtype=torch.bool).tril())
    out.sum().backward()
    torch.testing.assert_close(grad, sinks.grad)


@pytest.mark.parametrize(("sinks", "spec", "message"), [
    (torch.randn(3), None, r"sinks has shape \[3\] but the attention has 4 heads"),
    (torch.randn(2, 2), None, r"shape \[2, 2\]"),
    (torch.tensor([1.0, float("nan"), 0, 0]), None, "NaN or infinity"),
    (None, AttentionSpec(sinks=True), "no values were given"),
])
def test_bad_sinks_are_one_line(sinks, spec, message):
    with pytest.raises(UsageError, match=message):
        sdpa(torch.randn(1, 4, 3, 4), torch.randn(1, 4, 3, 4), torch.randn(1, 4, 3, 4), sinks=sinks, spec=spec)


# --- MultiHeadAttention: the module owns them -----------------------------------------------------------------


def test_module_owns_sinks_and_equals_gpt_oss_attention():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    config = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_hidden_layers=2, attention_bias=True)
    config._attn_implementation = "eager"
    theirs = GptOssAttention(config, layer_idx=1).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.5)
    ours = MultiHeadAttention(32, 4, n_kv_head=2, d_head=8, causal=True, sinks=True)
    assert "sinks" in ours.state_dict() and ours.state_dict()["sinks"].shape == (4,)
    state = {f"W_{n}.{p}": getattr(theirs, f"{n}_proj").__getattr__(p) for n in "qkvo" for p in ("weight", "bias")}
    ours.load_state_dict({**state, "sinks": theirs.sinks})
    X = torch.randn(2, 6, 32)
    causal = torch.zeros(6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    no_rotation = (torch.ones(1, 6, 4), torch.zeros(1, 6, 4))  # GPT-OSS: cos, sin [n, d_head / 2]
    with torch.no_grad():
        x, weights = theirs(X, no_rotation, causal)
        trace = ours(X)
        fused = MultiHeadAttention(32, 4, n_kv_head=2, d_head=8, causal=True, sinks=True, record=False)
        fused.load_state_dict(ours.state_dict())
        torch.testing.assert_close(fused(X)["x"], x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trace["x"], x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trace["attention"], weights, atol=1e-6, rtol=1e-5)
    assert not trace.step("sinks").allocates and trace["sinks"].data_ptr() == ours.sinks.data_ptr()


def test_module_without_sinks_has_no_parameter():
    assert "sinks" not in MultiHeadAttention(8, 2).state_dict()
    with pytest.raises(UsageError, match="either as spec"):
        MultiHeadAttention(8, 2, sinks=True, spec=AttentionSpec())


# --- the cost model, --check, the command line -----------------------------------------------------------------


@pytest.mark.parametrize("causal", [None, "upper-left"])
def test_estimates_equal_the_traced_runs(causal):
    from attnscope import cost
    from attnscope.runs.mha import MhaOptions, run_mha
    from attnscope.runs.sdpa import SdpaOptions, run_sdpa

    sizes = {"batch": 2, "nq": 5, "nk": 7, "dk": 4, "dv": 3}
    meta = run_sdpa(SdpaOptions(**sizes, causal=causal, sinks="random", meta=True))
    real = run_sdpa(SdpaOptions(**sizes, causal=causal, sinks="0.5"))
    spec = AttentionSpec(causal=causal, sinks=True)
    assert meta.peak_bytes == real.peak_bytes == cost.sdpa_bytes(2, 5, 7, 4, 3, spec)
    options = {"batch": 2, "nq": 4, "d_feat": 12, "heads": 3, "causal": causal, "sinks": "random"}
    meta, real = run_mha(MhaOptions(**options, meta=True)), run_mha(MhaOptions(**options))
    assert meta.peak_bytes == real.peak_bytes == cost.mha_bytes(2, 4, 4, 12, 3, spec)


def test_check_fails_when_the_sinks_differ():
    """The reference reads the raw sinks: a trace made with other values FAILs."""
    from attnscope.check import comparison as check

    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    asked = check.Asked(AttentionSpec(sinks=True))
    raw = {"Q": q, "K": k, "V": v, "sinks": torch.tensor([1.0, 2.0])}
    good = check.check_sdpa(sdpa(q, k, v, sinks=raw["sinks"]), raw, None, asked)
    assert [c.name for c in good] == ["out", "attention", "sink_weight"] and all(c.passed for c in good)
    bad = check.check_sdpa(sdpa(q, k, v, sinks=torch.tensor([1.0, 2.5])), raw, None, asked)
    assert not all(c.passed for c in bad)


@pytest.mark.parametrize("args", [
    ["sdpa", "--batch", "2", "--nq", "4", "--nk", "6", "--dk", "8", "--dv", "8", "--causal", "--sinks"],
    ["sdpa", "--batch", "1", "--nq", "3", "--nk", "5", "--dk", "4", "--dv", "4", "--sinks", "-1.5", "--window", "2"],
    ["mha", "--batch", "2", "--nq", "5", "--d-feat", "16", "--heads", "4", "--kv-heads", "2", "--sinks", "--rope"],
    ["mha", "--batch", "1", "--nq", "4", "--nk", "6", "--d-feat", "12", "--heads", "3", "--sinks", "0,1,-2"],
])
def test_check_passes_and_json_says_the_sinks(runner, args):
    result = runner.invoke(app, [*args, "--check", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    sinks = args[args.index("--sinks") + 1] if args.index("--sinks") + 1 < len(args) else "random"
    assert payload["params"]["sinks"] == (sinks if not sinks.startswith("--") else "random")
    names = [t["name"] for t in payload["tensors"]]
    assert names.index("sinks") < names.index("attention") < names.index("sink_weight")
    assert {c["name"] for c in payload["check"]} >= {"attention", "sink_weight"}
    assert all(c["passed"] for c in payload["check"])


def test_given_sinks_reach_the_module_and_save_keeps_them(runner, tmp_path):
    target = tmp_path / "run.safetensors"
    result = runner.invoke(app, ["mha", "--batch", "1", "--nq", "3", "--d-feat", "8", "--heads", "2", "--sinks",
                                 "0.25,-3", "--save", str(target)])
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    saved = load_file(target)
    torch.testing.assert_close(saved["sinks"], torch.tensor([0.25, -3.0]))
    assert saved["sink_weight"].shape == (1, 2, 3) and "W_q.weight" in saved
    assert "attention sinks (rows sum to less than 1)" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["sdpa", "--sinks", "1,2"], "--sinks has shape [2] but the attention has 1 head"),
    (["sdpa", "--sinks", "nan"], "--sinks 'nan': give random"),
    (["sdpa", "--sinks", "x"], "--sinks 'x': give random"),
    (["sdpa", "--sinks", "--layout", "col"], "--sinks"),
    (["mha", "--heads", "4", "--d-feat", "8", "--sinks", "1,2,3"], "--sinks has shape [3] but the attention has 4"),
])
def test_bad_sinks_on_the_command_line(runner, args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_meta_with_sinks(runner):
    result = runner.invoke(app, ["mha", "--d-feat", "4096", "--heads", "64", "--kv-heads", "8", "--batch", "1",
                                 "--nq", "8192", "--causal", "--sinks", "--meta", "--json"])
    assert result.exit_code == 0, result.output
    tensors = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert tensors["sink_weight"]["shape"] == [1, 64, 8192] and tensors["sinks"]["shape"] == [64]


# --- the sinks in each library's words -----------------------------------------------------------------------


@pytest.mark.parametrize(("n_Q", "n_K", "spec", "pad"), [
    (5, 5, AttentionSpec(causal=True, sinks=True), 0),
    (4, 7, AttentionSpec(causal="lower-right", window=3, sinks=True), 1),
    (6, 6, AttentionSpec(window=4, window_side="both", sinks=True), 0),
    (3, 4, AttentionSpec(sinks=True), 0),
])
def test_each_sink_translation_gives_sdpas_output(n_Q, n_K, spec, pad):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnscope.readings.maskview import view
    from attnscope.readings.translations import FLASH, FLEX, HF, MHA, SDPA

    shown = view(n_Q, n_K, spec, pad=pad)
    q, k, v = torch.randn(1, 3, n_Q, 8), torch.randn(1, 3, n_K, 8), torch.randn(1, 3, n_K, 8)
    sinks = torch.randn(3)
    expected = sdpa(q, k, v, torch.tensor(shown.grid), sinks=sinks)["out"]
    for library in (SDPA, HF, FLEX):
        scope = {"torch": torch, "F": F, "q": q, "k": k, "v": v, "sinks": sinks, "n_batch": 1,
                 "create_block_mask": lambda *a, **kw: create_block_mask(*a, **kw, device="cpu"),
                 "flex_attention": flex_attention}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention without torch.compile says it is unfused
            exec(shown.translations[library], scope)
        torch.testing.assert_close(scope["out"], expected, atol=1e-5, rtol=1e-5, msg=library)
    assert shown.translations[MHA].startswith("not expressible")
    assert shown.translations[FLASH].startswith("not expressible")
    assert any("attention sinks" in part for part in shown.parts)


def test_mask_command_takes_sinks(runner):
    result = runner.invoke(app, ["mask", "--nq", "3", "--causal", "--sinks", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["params"]["sinks"] == "random"
    assert payload["mask"] == [[True, False, False], [True, True, False], [True, True, True]]
    assert "s_aux" in payload["translations"]["transformers"]


# --- any shapes, masks, alignments and scales (property-based) -------------------------------------------------


@fuzz_settings(100)
@given(attention_case(), st.data())
def test_sinks_on_any_attention_equal_the_float64_formula(case, data):
    """Rows and their sink sum to 1, nothing is NaN, and out is the float64 formula's (GPT-OSS's concatenation)
    within the rounding that the scores' size allows."""
    from test_properties import EPS, allowed_and_bias

    Q, K, V, mask, causal, scale = (t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16,
                                    torch.bfloat16) else t for t in case)
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2])
    n_head = batch[-1] if len(batch) >= 2 else 1
    sinks = torch.tensor(data.draw(st.lists(st.floats(-8, 8), min_size=n_head, max_size=n_head)), dtype=Q.dtype)
    trace = sdpa(Q, K, V, mask, scale, causal=causal, sinks=sinks)
    n_Q, n_K = Q.shape[-2], K.shape[-2]
    allowed, bias = allowed_and_bias(mask, causal, n_Q, n_K)
    scores = Q.double() @ K.double().transpose(-2, -1) * (Q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores + bias if bias is not None else scores
    scores = scores.masked_fill(~allowed, float("-inf")) if allowed is not None else scores
    column = sinks.double().reshape(-1, 1, 1) if scores.dim() >= 3 else sinks.double().reshape(1, 1)
    full = torch.softmax(torch.cat([scores, column.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)
    expected = full[..., :-1] @ V.double()
    assert not torch.isnan(trace["attention"]).any() and not torch.isnan(trace["out"]).any()
    if not expected.numel():
        return
    torch.testing.assert_close(trace["attention"].double().sum(-1) + trace["sink_weight"].double(),
                               torch.ones_like(full[..., 0]), atol=1e-5, rtol=0)
    finite = scores[torch.isfinite(scores)]
    score_size = float(finite.abs().max()) if finite.numel() else 0.0
    v_size = float(V.double().abs().max()) if V.numel() else 0.0
    floor = 8 * EPS[Q.dtype] * (1 + score_size + 8) * v_size * math.sqrt(n_K + 1) + EPS[Q.dtype]
    assert float((trace["out"].double() - expected).abs().max()) <= floor
