"""qk-norm (Q_normed, K_normed): per head (Qwen3, Gemma 3's (1 + w)) and over the whole projection (OLMo 2), in
sdpa, MultiHeadAttention, --check, the cost model and the command line, against transformers' own attention
modules and PyTorch's F.rms_norm, which share no code with attnscope."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope import MultiHeadAttention, QkNorm, Rope, cost, sdpa
from attnscope.cli import app
from attnscope.errors import UsageError
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.spec import AttentionSpec


def _close(ours, reference, atol=1e-5):
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    torch.testing.assert_close(ours.double(), reference.double(), atol=atol, rtol=1e-5)


def _causal(n: int) -> torch.Tensor:
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def _load(ours: MultiHeadAttention, reference) -> MultiHeadAttention:
    """The reference module's projections and q/k norms, copied into ours by name."""
    with torch.no_grad():
        for mine, theirs in (("W_q", "q_proj"), ("W_k", "k_proj"), ("W_v", "v_proj"), ("W_o", "o_proj")):
            getattr(ours, mine).weight.copy_(getattr(reference, theirs).weight)
        ours.q_norm.weight.copy_(reference.q_norm.weight)
        ours.k_norm.weight.copy_(reference.k_norm.weight)
    return ours.eval()


def _reference(kind: str):
    """(transformers' eager attention module with random weights, its rotary embedding, our module's keywords)."""
    import transformers as tf

    sizes = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "num_hidden_layers": 1}
    if kind == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as Attention
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary

        config = tf.Qwen3Config(**sizes)
        ours = {"qk_norm": "head"}
    elif kind == "olmo2":
        from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention as Attention
        from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding as Rotary

        config = tf.Olmo2Config(**sizes)
        ours = {"qk_norm": "proj"}
    else:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention as Attention
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding as Rotary

        config = tf.Gemma3TextConfig(**sizes, query_pre_attn_scalar=12, layer_types=["full_attention"])
        ours = {"qk_norm": QkNorm("head", eps=1e-6, offset=True), "scale": 12 ** -0.5}
    config._attn_implementation = "eager"
    torch.manual_seed(4)
    reference = Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0.0, 0.5)  # norm weights far from 1, so a dropped or misplaced weight shows
    return reference, Rotary(config), ours


@pytest.mark.parametrize("kind", ["qwen3", "olmo2", "gemma3"])
@pytest.mark.parametrize("record", [True, False])
def test_mha_equals_transformers_attention_with_qk_norm(kind, record):
    reference, rotary, keywords = _reference(kind)
    base = 1_000_000.0 if kind == "gemma3" else 10000.0
    ours = _load(MultiHeadAttention(32, 4, bias=False, n_kv_head=2, d_head=8, causal=True, rope=Rope(base),
                                    record=record, **keywords), reference)
    X = torch.randn(2, 7, 32)
    position = torch.arange(7)[None]
    cos, sin = rotary(X, position, "full_attention") if kind == "gemma3" else rotary(X, position)
    with torch.no_grad():
        expected, weights = reference(X, (cos, sin), _causal(7))
        trace = ours(X)
    _close(trace["x"], expected)
    if not record:
        return
    _close(trace["attention"], weights)
    names = [s.name for s in trace.steps]
    if kind == "olmo2":  # over the projection, before the split: the split is a view of the normed projection
        assert names[3:8] == ["Q_normed", "K_normed", "Q_split", "K_split", "V_split"]
        assert trace.step("Q_normed").dims == ("n_batch", "n_Q", "d_feat")
        assert trace.step("K_normed").dims == ("n_batch", "n_K", "n_kv_head·d_head")
        assert trace.step("Q_split").op.startswith("Q_normed.view(")
        assert "over the whole projection" in trace.step("Q_normed").op
    else:
        assert names[3:10] == ["Q_split", "K_split", "V_split", "Q_normed", "K_normed", "cos", "sin"]
        assert trace.step("K_normed").dims == ("n_batch", "n_kv_head", "n_K", "d_head")
        assert "RMSNorm of each head over d_head" in trace.step("Q_normed").op
        assert ("(1 + q_norm.weight)" in trace.step("Q_normed").op) == (kind == "gemma3")
    assert trace.step("Q_rot").op.startswith("Q_split * cos" if kind == "olmo2" else "Q_normed * cos")


def test_per_head_norm_equals_qwen3s_rmsnorm_on_the_split():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    reference, rotary, keywords = _reference("qwen3")
    ours = _load(MultiHeadAttention(32, 4, bias=False, n_kv_head=2, d_head=8, rope=Rope(), **keywords), reference)
    X = torch.randn(1, 5, 32)
    norm = Qwen3RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(reference.k_norm.weight)
        expected = norm(reference.k_proj(X).view(1, 5, 2, 8)).transpose(1, 2)
        trace = ours(X)
    _close(trace["K_normed"], expected)


def test_sdpa_qk_norm_is_the_unit_rmsnorm_before_rope():
    Q, K, V = torch.randn(2, 3, 5, 8) * 4, torch.randn(2, 3, 7, 8) * 4, torch.randn(2, 3, 7, 6)
    trace = sdpa(Q, K, V, qk_norm="head", rope=Rope(), causal="lower-right")
    _close(trace["Q_normed"], F.rms_norm(Q, (8,), eps=1e-6))
    _close(trace["K_normed"], F.rms_norm(K, (8,), eps=1e-6))
    assert [s.name for s in trace.steps][3:7] == ["Q_normed", "K_normed", "cos", "sin"]
    assert trace.step("Q_normed").op == ("Q * rsqrt(mean(Q², dim=-1) + 1e-06): RMSNorm of each head over d_K, "
                                         "unit weight")
    assert trace.step("Q_normed").flops == cost.rms_norm_flops((2, 3, 5, 8), False) == 3 * 240 + 3 * 30
    # Normalised, the scores are bounded by d_K (|q|, |k| = sqrt(d_K)) however large the inputs
    assert float(trace["scores"].abs().max()) <= 8 / 8 ** 0.5 + 1e-4


@pytest.mark.parametrize("over", ["head", "proj"])
def test_mha_check_uses_the_modules_norm_weights(over):
    """--check's reference norms with the module's own weights (F.rms_norm in float64): it passes, and a weight
    changed after the run makes it fail."""
    from attnscope.check import comparison as check

    torch.manual_seed(5)
    module = MultiHeadAttention(24, 3, d_head=8, n_kv_head=1, qk_norm=over, rope=Rope(), causal=True).eval()
    with torch.no_grad():
        module.q_norm.weight.normal_(1.0, 0.5)
        module.k_norm.weight.normal_(1.0, 0.5)
        X = torch.randn(2, 6, 24)
        trace = module(X)
    asked = check.Asked(module.spec)
    assert all(c.passed for c in check.check_mha(module, trace, X, X, X, None, asked))
    with torch.no_grad():
        module.k_norm.weight.mul_(3.0)
    assert not all(c.passed for c in check.check_mha(module, trace, X, X, X, None, asked))


def test_decode_step_with_qk_norm_equals_the_full_sequence():
    """The cache holds keys already normed and rotated: 4 cached + 2 new give the last 2 rows of 6 at once."""
    torch.manual_seed(6)
    module = MultiHeadAttention(16, 4, n_kv_head=2, rope=Rope(), causal="lower-right", qk_norm="proj").eval()
    with torch.no_grad():
        module.k_norm.weight.normal_(1.0, 0.5)
        X = torch.randn(1, 6, 16)
        whole = module(X)
        step = module(X[:, 4:], cache=(whole["K_rot"][:, :, :4], whole["V_split"][:, :, :4]))
    _close(step["x"], whole["x"][:, 4:])
    assert step.step("K_normed").dims == ("n_batch", "n_new", "n_kv_head·d_head")


def test_half_precision_norm_is_computed_in_float32():
    x = (torch.randn(3, 16) * 100).to(torch.bfloat16)
    trace = sdpa(x, x, x, qk_norm="head")
    assert trace.step("Q_normed").dtype == "bfloat16"
    _close(trace["Q_normed"], F.rms_norm(x.float(), (16,), eps=1e-6).to(torch.bfloat16), atol=0)


# --- the spec ----------------------------------------------------------------------------------------------


def test_spec_reads_a_word_and_refuses_what_it_does_not_know():
    assert AttentionSpec(qk_norm="proj").qk_norm == QkNorm("proj")
    assert "qk-norm (RMSNorm per head over d_head, (1 + w))" in AttentionSpec(qk_norm=QkNorm(offset=True)).describe(8)
    with pytest.raises(UsageError, match=r"^qk_norm 'rows': use 'head'"):
        AttentionSpec(qk_norm="rows")
    with pytest.raises(UsageError, match="qk_norm"):
        AttentionSpec(qk_norm=True)
    with pytest.raises(UsageError, match="epsilon"):
        QkNorm(eps=-1.0)
    with pytest.raises(UsageError, match="sdpa has no projection"):
        sdpa(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4), qk_norm="proj")
    with pytest.raises(UsageError, match="not both"):
        MultiHeadAttention(8, 2, spec=AttentionSpec(), qk_norm="head")


def test_state_dict_holds_the_norms_as_transformers_names_them():
    per_head = MultiHeadAttention(32, 4, n_kv_head=2, qk_norm="head").state_dict()
    whole = MultiHeadAttention(32, 4, n_kv_head=2, qk_norm="proj").state_dict()
    assert per_head["q_norm.weight"].shape == per_head["k_norm.weight"].shape == (8,)
    assert whole["q_norm.weight"].shape == (32,) and whole["k_norm.weight"].shape == (16,)
    assert bool((per_head["q_norm.weight"] == 1).all())
    assert bool((MultiHeadAttention(8, 2, qk_norm=QkNorm(offset=True)).state_dict()["k_norm.weight"] == 0).all())


# --- the cost model stays equal to the traced run ------------------------------------------------------------


@pytest.mark.parametrize("rope", [False, True])
def test_sdpa_estimate_with_qk_norm_equals_the_traced_run(rope):
    options = {"batch": 2, "nq": 5, "nk": 9, "dk": 8, "dv": 4, "qk_norm": "head", "rope": rope}
    meta, real = run_sdpa(SdpaOptions(**options, meta=True)), run_sdpa(SdpaOptions(**options))
    spec = AttentionSpec(qk_norm="head", rope=Rope() if rope else None)
    assert meta.peak_bytes == real.peak_bytes == cost.sdpa_bytes(2, 5, 9, 8, 4, spec)


@pytest.mark.parametrize("over", ["head", "proj"])
@pytest.mark.parametrize(("nk", "kv_heads", "cache", "d_head"), [(None, None, 0, None), (9, 2, 0, 6),
                                                                (None, 1, 3, None)])
def test_mha_estimate_with_qk_norm_equals_the_traced_run(over, nk, kv_heads, cache, d_head):
    options = {"batch": 2, "nq": 4, "nk": nk, "d_feat": 16, "heads": 4, "kv_heads": kv_heads, "cache": cache,
               "d_head": d_head, "qk_norm": over, "rope": True}
    meta, real = run_mha(MhaOptions(**options, meta=True)), run_mha(MhaOptions(**options))
    n_new = 4 if nk is None else nk
    spec = AttentionSpec(qk_norm=over, rope=Rope(), n_kv_head=kv_heads, cache=cache, causal=bool(cache) or None)
    analytic = cost.mha_bytes(2, 4, cache + n_new, 16, 4, spec, cross=n_new != 4, d_head=d_head)
    assert meta.peak_bytes == real.peak_bytes == analytic


# --- the command line ----------------------------------------------------------------------------------------


def test_cli_bare_qk_norm_is_per_head_and_checks(runner):
    result = runner.invoke(app, ["mha", "--batch", "2", "--nq", "5", "--d-feat", "32", "--heads", "4", "--kv-heads",
                                 "2", "--qk-norm", "--rope", "--causal", "--check", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["params"]["qk_norm"] == "head" and payload["params"]["causal"] == "upper-left"
    assert [c["name"] for c in payload["check"]] == ["x_raw", "attention", "x"]
    assert all(c["passed"] and c["reference"] == "float64 formula" for c in payload["check"])
    steps = {t["name"]: t for t in payload["tensors"]}
    assert steps["K_normed"]["dims"] == ["n_batch", "n_kv_head", "n_K", "d_head"]
    assert steps["Q_normed"]["flops"] == cost.rms_norm_flops((2, 4, 5, 8), True)


def test_cli_refuses_in_one_line():
    from cli_main import assert_usage_error, run_main

    assert_usage_error(run_main("sdpa", "--qk-norm", "proj"), "--qk-norm proj: sdpa has no projection")
    assert_usage_error(run_main("sdpa", "--qk-norm", "--layout", "col"), "--qk-norm", "drop --layout col")
    assert_usage_error(run_main("mha", "--qk-norm", "rows"), "'rows' is not one of 'head', 'proj'")


def test_cli_save_holds_the_norms_and_the_normed_steps(runner, tmp_path):
    from safetensors import safe_open

    target = tmp_path / "run.safetensors"
    result = runner.invoke(app, ["mha", "--batch", "1", "--nq", "3", "--d-feat", "8", "--heads", "2", "--qk-norm",
                                 "proj", "--save", str(target)])
    assert result.exit_code == 0, result.output
    assert "qk-norm over the projection" in result.stdout
    with safe_open(str(target), "pt") as handle:
        names = set(handle.keys())
        metadata = json.loads(handle.metadata()["attnscope"])
        assert handle.get_tensor("q_norm.weight").shape == (8,)
    assert {"Q_normed", "K_normed", "q_norm.weight", "k_norm.weight"} <= names
    assert metadata["q_norm.weight"]["dims"] == ["n_head·d_head"]
    assert metadata["Q_normed"]["dims"] == ["n_batch", "n_Q", "d_feat"]


def test_cli_meta_shows_the_norm_at_any_size(runner):
    result = runner.invoke(app, ["mha", "--d-feat", "4096", "--heads", "32", "--kv-heads", "8", "--d-head", "128",
                                 "--qk-norm", "--rope", "--causal", "--batch", "1", "--nq", "100000", "--meta",
                                 "--json"])
    assert result.exit_code == 0, result.output
    steps = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert steps["Q_normed"]["shape"] == [1, 32, 100000, 128]
    assert steps["K_normed"]["bytes"] == 8 * 100000 * 128 * 4


# --- properties over random sizes ------------------------------------------------------------------------------


@st.composite
def qk_norm_case(draw):
    """A MultiHeadAttention with qk-norm (either placement), random sizes, GQA, RoPE or not, and random inputs of
    any magnitude."""
    n_kv_head = draw(st.sampled_from([1, 2]))
    n_head = n_kv_head * draw(st.integers(1, 3))
    d_head = draw(st.sampled_from([2, 4, 6]))
    d_feat = draw(st.integers(1, 12))
    over, rope = draw(st.sampled_from(["head", "proj"])), draw(st.booleans())
    n_batch, n = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    return n_head, n_kv_head, d_head, d_feat, over, rope, n_batch, n, magnitude, draw(st.integers(0, 2**31 - 1))


@fuzz_settings(40)
@given(qk_norm_case())
def test_qk_norm_property_check_passes_and_estimate_equals_the_run(case):
    """For any sizes and input magnitudes: --check's float64 reference (F.rms_norm with the module's weights, before
    or after the split) agrees, and the memory estimate equals the meta-traced run."""
    from attnscope.check import comparison as check

    n_head, n_kv_head, d_head, d_feat, over, rope, n_batch, n, magnitude, seed = case
    torch.manual_seed(seed)
    module = MultiHeadAttention(d_feat, n_head, n_kv_head=n_kv_head, d_head=d_head, qk_norm=over, causal=True,
                                rope=Rope() if rope else None).eval()
    with torch.no_grad():
        module.q_norm.weight.normal_(1.0, 0.5)
        module.k_norm.weight.normal_(1.0, 0.5)
        X = torch.randn(n_batch, n, d_feat) * magnitude
        trace = module(X)
    comparisons = check.check_mha(module, trace, X, X, X, None, check.Asked(module.spec))
    assert all(c.passed for c in comparisons), comparisons
    with torch.device("meta"):
        shadow = MultiHeadAttention(d_feat, n_head, n_kv_head=n_kv_head, d_head=d_head, qk_norm=over, causal=True,
                                    rope=Rope() if rope else None)
    meta = shadow(X.to("meta"))
    held = sum(p.numel() * 4 for p in shadow.parameters()) + X.numel() * 4 + n * n  # weights, input, causal mask
    assert cost.traced_peak_bytes(meta.steps, held) == cost.mha_bytes(n_batch, n, n, d_feat, n_head, module.spec,
                                                                      d_head=d_head)


# --- the LayerNorm kind (timm's Attention with qk_norm=True, norm_layer=nn.LayerNorm) --------------------------


def _timm_layer_norm_attention(module: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Plain torch, sharing no code with attnscope: timm's Attention.forward with qk_norm=True and
    norm_layer=nn.LayerNorm (F.layer_norm of q and k over each head's d_head, then
    F.scaled_dot_product_attention), the key/value heads repeated for grouped queries."""
    B, T, _ = x.shape
    H, Hkv, d = module.n_head, module.n_kv_head, module.d_head
    q = F.linear(x, module.W_q.weight, module.W_q.bias).view(B, T, H, d).transpose(1, 2)
    k = F.linear(x, module.W_k.weight, module.W_k.bias).view(B, T, Hkv, d).transpose(1, 2)
    v = F.linear(x, module.W_v.weight, module.W_v.bias).view(B, T, Hkv, d).transpose(1, 2)
    q = F.layer_norm(q, (d,), module.q_norm.weight, module.q_norm.bias, 1e-5)
    k = F.layer_norm(k, (d,), module.k_norm.weight, module.k_norm.bias, 1e-5)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, d]
    return F.linear(y.transpose(1, 2).reshape(B, T, H * d), module.W_o.weight, module.W_o.bias)


@pytest.mark.parametrize("record", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_mha_with_a_layernorm_qk_norm_equals_plain_torch(record, kv_heads):
    torch.manual_seed(11)
    norm = QkNorm("head", eps=1e-5, kind="layer")
    module = MultiHeadAttention(32, 4, n_kv_head=kv_heads, qk_norm=norm, causal=True, record=record).eval()
    with torch.no_grad():
        for layer in (module.q_norm, module.k_norm):
            layer.weight.normal_(1.0, 0.3)
            layer.bias.normal_(0.0, 0.3)
        x = torch.randn(2, 6, 32)
        _close(module(x)["x"], _timm_layer_norm_attention(module, x))
        if record:
            trace = module(x)
            assert trace.step("Q_normed").op.startswith("(Q_split - mean(Q_split, dim=-1)) * rsqrt(var(Q_split")
            assert "+ q_norm.bias: LayerNorm of each head over d_head" in trace.step("Q_normed").op
            before = module(x)["x"]
            module.q_norm.bias.add_(1.0)  # the bias is used: moving it moves the output (a key bias would not)
            assert not torch.allclose(module(x)["x"], before)


def test_layernorm_qk_norm_in_the_spec_the_state_dict_and_check():
    from attnscope.check import comparison as check

    norm = QkNorm(kind="layer", eps=1e-5)
    assert AttentionSpec(qk_norm=norm).qk_norm.layer and not QkNorm().layer
    assert "qk-norm (LayerNorm per head over d_head)" in AttentionSpec(qk_norm=norm).describe(8)
    assert "qk-norm (RMSNorm per head over d_head)" in AttentionSpec(qk_norm="head").describe(8)  # unchanged
    with pytest.raises(UsageError, match="kind 'batch'"):
        QkNorm(kind="batch")
    with pytest.raises(UsageError, match="Gemma's RMSNorm"):
        QkNorm(offset=True, kind="layer")
    state = MultiHeadAttention(32, 4, qk_norm=norm).state_dict()
    assert bool((state["q_norm.bias"] == 0).all()) and state["k_norm.bias"].shape == (8,)
    assert "q_norm.bias" not in MultiHeadAttention(32, 4, qk_norm="head").state_dict()
    torch.manual_seed(12)
    module = MultiHeadAttention(24, 3, qk_norm=QkNorm("proj", eps=1e-5, kind="layer"), causal=True).eval()
    with torch.no_grad():
        module.q_norm.bias.normal_(0.0, 0.5)
        X = torch.randn(2, 5, 24)
        trace = module(X)
        whole = F.layer_norm(F.linear(X, module.W_q.weight, module.W_q.bias), (24,), module.q_norm.weight,
                             module.q_norm.bias, 1e-5)
    _close(trace["Q_normed"], whole)
    asked = check.Asked(module.spec)
    assert all(c.passed for c in check.check_mha(module, trace, X, X, X, None, asked))
    with torch.no_grad():
        module.q_norm.bias.add_(0.5)
    assert not all(c.passed for c in check.check_mha(module, trace, X, X, X, None, asked))


def _either_side(over: str, seed: int, **kw):
    """A MultiHeadAttention with RoPE whose qk-norm (`over`, gains off 1) runs after the rotation, its run, and the
    output of the same weights with the norm before it."""
    torch.manual_seed(seed)
    late = MultiHeadAttention(32, 4, rope=Rope(), causal=True, qk_norm=QkNorm(over, after_rope=True), **kw).eval()
    early = MultiHeadAttention(32, 4, rope=Rope(), causal=True, qk_norm=over, **kw).eval()
    with torch.no_grad():
        late.q_norm.weight.normal_(1.0, 0.5)
        late.k_norm.weight.normal_(1.0, 0.5)
        early.load_state_dict(late.state_dict())
        X = torch.randn(2, 6, 32)
        return late, late(X), early(X)


def test_a_norm_after_rope_runs_on_the_rotated_heads():
    """QkNorm(after_rope=True), nGPT's placement: the rotated heads normed, with weights a channel that turn with no
    rotary pair (another output than the norm before RoPE); sdpa's weightless one gives the same numbers either way."""
    late, trace, before = _either_side("head", 7, n_kv_head=2)
    names = [s.name for s in trace.steps]
    assert names.index("Q_rot") < names.index("Q_normed") < names.index("scores")
    _close(trace["K_normed"], F.rms_norm(trace["K_rot"], (8,), late.k_norm.weight, eps=1e-6))
    _close(trace["Q_rot"].norm(dim=-1), trace["Q_split"].norm(dim=-1))  # rotated from the split heads, unnormed
    assert not torch.allclose(trace["x"], before["x"], atol=1e-3)
    assert "after RoPE" in late.spec.describe(8)
    Q, K, V = torch.randn(2, 3, 5, 8) * 4, torch.randn(2, 3, 5, 8) * 4, torch.randn(2, 3, 5, 6)
    either = [sdpa(Q, K, V, rope=Rope(), qk_norm=QkNorm(after_rope=after)) for after in (False, True)]
    _close(either[0]["out"], either[1]["out"])


def test_a_norm_over_the_projection_after_rope_runs_on_each_position_s_rotated_heads():
    """QkNorm("proj", after_rope=True), OLMo 2's norm moved past the rotation: each position's rotated heads merged,
    normed over every head's coordinates at once, split back (another output than before RoPE: the gains multiply
    rotated coordinates)."""
    late, trace, before = _either_side("proj", 8)
    names = [s.name for s in trace.steps]
    assert names.index("Q_rot") < names.index("Q_normed") < names.index("scores")
    merged = trace["K_rot"].transpose(1, 2).flatten(2)  # [2, 6, 32]
    want = F.rms_norm(merged, (32,), late.k_norm.weight, eps=1e-6).view(2, 6, 4, 8).transpose(1, 2)
    _close(trace["K_normed"], want)
    assert not torch.allclose(trace["x"], before["x"], atol=1e-3)
    assert "after RoPE" in late.spec.describe(8)
