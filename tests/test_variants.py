"""The attention of today's models, step by step, against references that share no code with attnscope:
transformers' own functions and eager attention modules, F.scaled_dot_product_attention, float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnscope import MultiHeadAttention, Rope, sdpa
from attnscope.errors import UsageError
from attnscope.variants import alibi as alibi_

ATOL = 1e-5


def _close(ours, reference, atol=ATOL):
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    torch.testing.assert_close(ours.double(), reference.double(), atol=atol, rtol=1e-5)


# --- GQA / MQA ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_head", "n_kv_head"), [(8, 2), (6, 3), (4, 1), (4, 4)])
def test_gqa_matches_pytorch_enable_gqa_and_repeat_kv(n_head, n_kv_head):
    from transformers.models.llama.modeling_llama import repeat_kv

    Q = torch.randn(2, n_head, 5, 8)
    K, V = torch.randn(2, n_kv_head, 7, 8), torch.randn(2, n_kv_head, 7, 3)
    trace = sdpa(Q, K, V, enable_gqa=True)
    _close(trace["out"], F.scaled_dot_product_attention(Q, K, V, enable_gqa=True))
    if n_head != n_kv_head:
        _close(trace["K_rep"], repeat_kv(K, n_head // n_kv_head))
        _close(trace["V_rep"], repeat_kv(V, n_head // n_kv_head))
        assert trace.step("K").dims == ("n_batch", "n_kv_head", "n_K", "d_K")
        assert trace.step("K_rep").dims == ("n_batch", "n_head", "n_K", "d_K")
        assert any(f"n_group = {n_head // n_kv_head}" in note for note in trace.notes)
    else:
        assert "K_rep" not in trace


def test_gqa_not_a_multiple_is_refused_with_both_numbers():
    with pytest.raises(UsageError, match="Q has 6 heads and K/V have 4"):
        sdpa(torch.randn(1, 6, 3, 4), torch.randn(1, 4, 3, 4), torch.randn(1, 4, 3, 4), enable_gqa=True)
    with pytest.raises(UsageError, match="enable_gqa=True"):
        sdpa(torch.randn(1, 8, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))


# --- RoPE -----------------------------------------------------------------------------------------------


def _llama_rope(d_head: int, n: int, base: float, scaling=None, offset: int = 0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=d_head * 2, num_attention_heads=2, head_dim=d_head, rope_theta=base,
                         rope_scaling=scaling, max_position_embeddings=4096)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(offset, offset + n)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos, sin  # [1, n, d_head]


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_matches_transformers_apply_rotary_pos_emb(base):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    Q, K, V = torch.randn(2, 3, 6, 16), torch.randn(2, 3, 6, 16), torch.randn(2, 3, 6, 4)
    trace = sdpa(Q, K, V, rope=Rope(base))
    cos, sin = _llama_rope(16, 6, base)
    q_ref, k_ref = apply_rotary_pos_emb(Q, K, cos, sin)
    _close(trace["cos"], cos[0])
    _close(trace["sin"], sin[0])
    _close(trace["Q_rot"], q_ref)
    _close(trace["K_rot"], k_ref)
    _close(trace["out"], F.scaled_dot_product_attention(q_ref, k_ref, V))
    assert trace.step("cos").dims == ("n_K", "d_K")


def test_rope_llama3_scaling_matches_transformers():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cos, sin = Rope(500000.0, scaling).cos_sin(200, 32, torch.float32)
    ref_cos, ref_sin = _llama_rope(32, 200, 500000.0, scaling)
    _close(cos, ref_cos[0])
    _close(sin, ref_sin[0])


def test_rope_as_complex_rotation_in_float64():
    """Independent of transformers: pair (x_i, x_{i+d/2}) is the complex number x_i + i x_{i+d/2}, turned by
    e^{i p θ_i}, θ_i = base^(-2i/d)."""
    d, n, base = 8, 5, 10000.0
    Q = torch.randn(n, d, dtype=torch.float64)
    trace = sdpa(Q, Q, Q, rope=Rope(base))
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * theta  # [n, d/2]
    z = torch.complex(Q[:, : d // 2], Q[:, d // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    _close(trace["Q_rot"], torch.cat([z.real, z.imag], dim=-1), atol=1e-6)


def test_rope_lower_right_puts_queries_at_the_end():
    """With a cache of 4 positions, 2 new queries sit at positions 4 and 5."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    Q, K = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 6, 8)
    trace = sdpa(Q, K, K, rope=Rope(), causal="lower-right")
    cos, sin = _llama_rope(8, 2, 10000.0, offset=4)
    _close(trace["Q_rot"], apply_rotary_pos_emb(Q, Q, cos, sin)[0])
    assert "cos[4:6]" in trace.step("Q_rot").op


def test_rope_refuses_odd_head_size_and_unknown_scaling():
    with pytest.raises(UsageError, match="d_head must be even"):
        sdpa(torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5), rope=Rope())
    with pytest.raises(UsageError, match="RoPE type 'axial' .* is not one attnscope computes"):
        Rope(10000.0, {"rope_type": "axial"})


# --- ALiBi ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_head", [1, 2, 3, 5, 8, 12, 16, 24])
def test_alibi_slopes_match_bloom(n_head):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bloom = build_alibi_tensor(torch.ones(1, 2), n_head, torch.float32)  # [n_head, 1, 2]: slope * key position
    _close(alibi_.slopes(n_head), bloom[:, 0, 1])


@pytest.mark.parametrize("n_head", [3, 8])
def test_alibi_attention_equals_blooms_bias_with_causal(n_head):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    n = 6
    Q, K, V = (torch.randn(2, n_head, n, 4) for _ in range(3))
    trace = sdpa(Q, K, V, alibi=True, causal=True)
    bloom = build_alibi_tensor(torch.ones(2, n), n_head, torch.float32).view(2, n_head, 1, n)  # m_h * j
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    reference = F.scaled_dot_product_attention(Q, K, V, attn_mask=bloom.masked_fill(~causal, float("-inf")))
    _close(trace["out"], reference)
    assert trace.step("alibi_bias").dims == ("n_head", "n_Q", "n_K")
    assert trace["alibi_bias"][0, 3, 1].item() == pytest.approx(-alibi_.slopes(n_head)[0].item() * 2)


# --- sliding window, softcap, masks ---------------------------------------------------------------------


def _mask_from(mask_function, n_Q: int, n_K: int, q_offset: int = 0) -> torch.Tensor:
    t = torch.tensor
    return torch.tensor([[bool(mask_function(t(0), t(0), t(q + q_offset), t(k))) for k in range(n_K)]
                         for q in range(n_Q)])


@pytest.mark.parametrize(("n_Q", "n_K", "window", "causal"), [(8, 8, 3, True), (3, 9, 4, "lower-right"),
                                                               (6, 6, 1, True), (5, 5, 10, True)])
def test_window_matches_transformers_sliding_window_causal(n_Q, n_K, window, causal):
    from transformers.masking_utils import sliding_window_causal_mask_function

    Q, K, V = torch.randn(2, n_Q, 4), torch.randn(2, n_K, 4), torch.randn(2, n_K, 5)
    trace = sdpa(Q, K, V, window=window, causal=causal)
    offset = n_K - n_Q if causal == "lower-right" else 0
    allowed = _mask_from(sliding_window_causal_mask_function(window), n_Q, n_K, offset)
    _close(trace["out"], F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed))
    assert f"window({window}" in trace.step("masked_scores").op


def test_softcap_is_gemma2s_formula_in_float64():
    Q, K, V = (torch.randn(2, 5, 8, dtype=torch.float64) * 10 for _ in range(3))
    trace = sdpa(Q, K, V, softcap=5.0, causal=True)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(8)
    capped = 5.0 * torch.tanh(scores / 5.0)
    _close(trace["capped_scores"], capped, atol=1e-12)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    reference = torch.softmax(capped.masked_fill(~causal, float("-inf")), dim=-1) @ V
    _close(trace["out"], reference, atol=1e-12)
    assert [s.name for s in trace.steps][3:6] == ["scores", "capped_scores", "masked_scores"]


@pytest.mark.parametrize("align", ["upper-left", "lower-right"])
def test_integer_mask_with_causal_is_boolean_not_added(align):
    """The issue's bug: an int 0/1 mask with --causal was added to the scores."""
    Q, K, V = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 3)
    user = torch.randint(0, 2, (4, 6))
    user[:, 0] = 1
    trace = sdpa(Q, K, V, user, causal=align)
    causal = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2 if align == "lower-right" else 0)
    _close(trace["out"], F.scaled_dot_product_attention(Q, K, V, attn_mask=user.bool() & causal))


def test_float_mask_adds_and_boolean_parts_and():
    Q, K, V = torch.randn(1, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 2)
    additive = torch.randn(3, 3)
    trace = sdpa(Q, K, V, additive, causal=True)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    _close(trace["out"], F.scaled_dot_product_attention(Q, K, V, attn_mask=additive.masked_fill(~causal, -math.inf)))
    assert trace.step("masked_scores").op == "(scores + mask).masked_fill(~causal(upper-left), -inf)"


@pytest.mark.parametrize("bad", [torch.tensor([[0, 2]]), torch.tensor([[1j, 0j]])])
def test_other_masks_are_refused(bad):
    with pytest.raises(UsageError):
        sdpa(torch.randn(1, 2), torch.randn(2, 2), torch.randn(2, 2), bad, causal=True)


def test_scale_and_softcap_must_be_finite():
    X = torch.randn(2, 2)
    for kwargs in ({"scale": float("nan")}, {"scale": float("inf")}, {"softcap": 0.0}, {"softcap": float("nan")}):
        with pytest.raises(UsageError):
            sdpa(X, X, X, **kwargs)


# --- multi-head attention against transformers' eager attention modules --------------------------------


def _copy_linear(ours, theirs):
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        if ours.bias is not None:
            ours.bias.copy_(theirs.bias)


def _load_from(module: MultiHeadAttention, reference) -> MultiHeadAttention:
    for ours, theirs in ((module.W_q, reference.q_proj), (module.W_k, reference.k_proj),
                         (module.W_v, reference.v_proj), (module.W_o, reference.o_proj)):
        _copy_linear(ours, theirs)
    return module.eval()


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("record", [True, False])
def test_mha_equals_llama_attention_with_gqa_and_rope(record):
    from transformers import LlamaConfig
    from transformers.masking_utils import causal_mask_function
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
                         rope_theta=10000.0, attention_bias=True)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    reference = LlamaAttention(config, layer_idx=0).eval()
    ours = _load_from(MultiHeadAttention(32, 8, n_kv_head=2, rope=Rope(10000.0), causal=True, record=record),
                      reference)
    X = torch.randn(2, 7, 32)
    cos, sin = LlamaRotaryEmbedding(config)(X, torch.arange(7)[None])
    with torch.no_grad():
        expected, weights = reference(X, (cos, sin), _additive(_mask_from(causal_mask_function, 7, 7)))
        trace = ours(X)
    _close(trace["x"], expected)
    if record:
        _close(trace["attention"], weights)
        assert trace.step("K_split").dims == ("n_batch", "n_kv_head", "n_K", "d_head")
        assert trace.step("K_feat").dims == ("n_batch", "n_K", "n_kv_head·d_head")
        assert [s.name for s in trace.steps][6:12] == ["cos", "sin", "Q_rot", "K_rot", "K_rep", "V_rep"]


def test_mha_equals_gemma2_attention_with_softcap_window_and_decoupled_head():
    from transformers import Gemma2Config
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding

    config = Gemma2Config(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          query_pre_attn_scalar=12, attn_logit_softcapping=5.0, sliding_window=3,
                          num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                          rope_theta=10000.0)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    reference = Gemma2Attention(config, layer_idx=0).eval()
    ours = _load_from(MultiHeadAttention(24, 4, bias=False, n_kv_head=2, d_head=16, scale=12 ** -0.5, softcap=5.0,
                                         window=3, causal=True, rope=Rope(10000.0)), reference)
    X = torch.randn(1, 9, 24) * 3
    cos, sin = Gemma2RotaryEmbedding(config)(X, torch.arange(9)[None])
    allowed = _mask_from(sliding_window_causal_mask_function(3), 9, 9)
    with torch.no_grad():
        expected, weights = reference(X, (cos, sin), _additive(allowed))
        trace = ours(X)
    _close(trace["x"], expected)
    _close(trace["attention"], weights)
    assert trace.step("Q_feat").dims == ("n_batch", "n_Q", "n_head·d_head")
    assert "capped_scores" in trace


def test_kv_cache_decode_step_equals_the_full_sequence():
    """Run 6 tokens at once; then 4 as the cache and 2 as the decode step: the last 2 outputs agree."""
    torch.manual_seed(3)
    full = MultiHeadAttention(16, 4, n_kv_head=2, rope=Rope(), causal="lower-right").eval()
    X = torch.randn(1, 6, 16)
    with torch.no_grad():
        whole = full(X)
        step = full(X[:, 4:], cache=(whole["K_rot"][:, :, :4], whole["V_split"][:, :, :4]))
    _close(step["x"], whole["x"][:, 4:])
    assert step.step("K_cat").dims == ("n_batch", "n_kv_head", "n_K", "d_head")
    assert step.step("K_split").dims == ("n_batch", "n_kv_head", "n_new", "d_head")
    assert "cos[4:6]" in step.step("Q_rot").op


@pytest.mark.parametrize("kwargs", [{"alibi": True, "causal": True}, {"window": 2}, {"softcap": 3.0},
                                    {"n_kv_head": 1, "causal": "lower-right"}])
def test_mha_record_false_computes_the_same(kwargs):
    torch.manual_seed(4)
    traced = MultiHeadAttention(16, 4, **kwargs).eval()
    fast = MultiHeadAttention(16, 4, record=False, **kwargs).eval()
    fast.load_state_dict(traced.state_dict())
    X = torch.randn(2, 5, 16)
    with torch.no_grad():
        _close(fast(X)["x"], traced(X)["x"])


def test_mha_refuses_kv_heads_that_do_not_divide():
    with pytest.raises(UsageError, match="n_head 8 is not a multiple of n_kv_head 3"):
        MultiHeadAttention(32, 8, n_kv_head=3)


# --- half precision ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_finite_and_as_close_as_pytorch(dtype):
    """Large Q and K (x100, d_K = 64): scores overflow float16; attnscope computes them in float32."""
    torch.manual_seed(5)
    Q, K, V = (torch.randn(2, 6, 64, dtype=torch.float64) * s for s in (100, 100, 1))
    truth = F.scaled_dot_product_attention(Q, K, V)
    half = [t.to(dtype) for t in (Q, K, V)]
    trace = sdpa(*half)
    ours = (trace["out"].double() - truth).abs().max().item()
    theirs = (F.scaled_dot_product_attention(*half).double() - truth).abs().max().item()
    assert math.isfinite(ours)
    assert ours <= 2 * theirs + 1e-3
    assert trace.step("scores").dtype == "float32" and trace.step("out").dtype == str(dtype)[6:]
    assert any("computed in float32" in note for note in trace.notes)
