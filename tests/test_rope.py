"""RoPE (rope.py, rope_scaling.py, rope_config.py) against transformers' own: `ROPE_INIT_FUNCTIONS` for every
type, the rotary embedding modules and `apply_rotary_pos_emb` of the families that use each form (LLaMA,
Phi-3 partial, GPT-NeoX partial, GPT-J interleaved, Llama 4's complex product, GLM interleaved partial, Cohere,
Helium, ERNIE 4.5, DeepSeek-V2, Gemma 3's per-layer-type bases), and the float64 reference of check_rope.py
against both."""

from __future__ import annotations

import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import assume, given
from hypothesis import strategies as st

from attnscope import MultiHeadAttention, Rope, sdpa
from attnscope.check.rope import frequencies64, rotate64
from attnscope.errors import UsageError
from attnscope.variants.rope_scaling import TYPES


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    """transformers warns about unusual RoPE parameters (it computes them all the same)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def _exact(ours, reference, rtol=1e-6, atol=1e-7):
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    torch.testing.assert_close(ours.double(), reference.double(), rtol=rtol, atol=atol)


def _f64(ours, reference):
    _exact(ours, reference, rtol=1e-5, atol=2e-6)


def _trace(rope: Rope, n: int, d_head: int, n_head: int = 2, start: int = 0):
    """sdpa over n queries and keys at positions 0 .. n − 1 (or `start` cached positions before the queries)."""
    Q = torch.randn(1, n_head, n, d_head)
    K = torch.randn(1, n_head, start + n, d_head)
    return sdpa(Q, K, K, rope=rope, causal="lower-right" if start else False), Q, K


# --- inv_freq and attention_scaling: ROPE_INIT_FUNCTIONS, for every type and a spread of parameters ---------


@st.composite
def rope_case(draw):
    kind = draw(st.sampled_from([t for t in TYPES if t != "default"]))
    head_dim = draw(st.sampled_from([8, 16, 32, 64, 128]))
    fraction = draw(st.sampled_from([1.0, 1.0, 0.5, 0.25]))
    max_pos = draw(st.sampled_from([32, 64, 2048]))
    assume(kind != "dynamic" or head_dim * fraction > 2)  # transformers divides by (dim − 2); attnscope refuses
    base = draw(st.sampled_from([10000.0, 500000.0, 1e6])) if draw(st.booleans()) else draw(st.floats(2.0, 1e7))
    factor = draw(st.sampled_from([1.0, 2.0, 4.0, 8.0])) if draw(st.booleans()) else draw(st.floats(1.0, 40.0))
    original = draw(st.sampled_from([None, 8, 16, 32]))
    p = {"rope_type": kind, "rope_theta": base}
    if fraction != 1.0:
        p["partial_rotary_factor"] = fraction
    if original is not None and kind in ("yarn", "longrope", "llama3"):
        p["original_max_position_embeddings"] = original
    if kind in ("linear", "dynamic", "llama3", "proportional"):
        p["factor"] = factor
    if kind == "llama3":
        p["low_freq_factor"] = draw(st.floats(0.25, 2.0))
        p["high_freq_factor"] = p["low_freq_factor"] + draw(st.floats(0.25, 6.0))
    if kind == "yarn":
        p["factor"] = None if draw(st.integers(0, 4)) == 0 else factor
        for key, values in (("beta_fast", [16, 32, 64.0]), ("beta_slow", [0.5, 1, 2]), ("mscale", [0.707, 1.0]),
                            ("mscale_all_dim", [0.707, 1.0]), ("attention_factor", [0.5, 1.25]),
                            ("truncate", [False, True])):
            if draw(st.booleans()):
                p[key] = draw(st.sampled_from(values))
    if kind == "longrope":
        pairs = (int(head_dim * fraction) + 1) // 2
        p["short_factor"] = draw(st.lists(st.floats(0.5, 4.0), min_size=pairs, max_size=pairs))
        p["long_factor"] = draw(st.lists(st.floats(1.0, 64.0), min_size=pairs, max_size=pairs))
        if draw(st.booleans()):
            p["factor"] = factor
        if draw(st.booleans()):
            p["attention_factor"] = draw(st.floats(0.5, 2.0))
    seq_len = draw(st.sampled_from([None, 1, 8, 17, 33, 100, 5000]))
    return p, head_dim, max_pos, seq_len


@fuzz_settings(60)
@given(rope_case())
def test_inv_freq_and_attention_scaling_equal_rope_init_functions(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    p, head_dim, max_pos, seq_len = case
    kind = p["rope_type"]
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=dict(p))
    # dynamic_rope_update hands the length over as a tensor, and only beyond max_position_embeddings
    grows = kind == "dynamic" and seq_len is not None and seq_len > max_pos
    ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=torch.tensor(seq_len) if grows
                                                          else seq_len)
    rope = Rope(p["rope_theta"], p, max_position_embeddings=max_pos)
    _exact(rope.inv_freq(head_dim, seq_len), ref_inv_freq)
    assert rope.attention_scaling == pytest.approx(ref_scaling, rel=1e-12)
    ref64, scaling64 = frequencies64({"rope_parameters": dict(p), "head_dim": head_dim,
                                      "max_position_embeddings": max_pos}, seq_len or 0)
    _exact(ref64, ref_inv_freq)
    assert scaling64 == pytest.approx(ref_scaling, rel=1e-12)


@pytest.mark.parametrize(("head_dim", "fraction", "base"), [(16, 1.0, 10000.0), (80, 0.4, 25000.0),
                                                            (96, 0.5, 1e6), (64, 0.25, 10000.0)])
def test_default_frequencies_equal_the_families_own(head_dim, fraction, base):
    """The default type is each family's `compute_default_rope_parameters` (GPT-NeoX's takes the fraction)."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    config = GPTNeoXConfig(hidden_size=head_dim * 2, num_attention_heads=2, rotary_pct=fraction,
                           rotary_emb_base=base)
    reference, scaling = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    rope = Rope.from_config(config.to_dict())
    assert rope is not None and rope.fraction == fraction and scaling == rope.attention_scaling == 1.0
    _exact(rope.inv_freq(head_dim), reference)


# --- cos, sin and the rotated Q and K against the families' own modules ---------------------------------------

LLAMA_TYPES = [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 2.0], "long_factor": [1.0, 4.0, 9.0, 16.0],
     "original_max_position_embeddings": 8, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8, "rope_theta": 500000.0},
    {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0, "rope_theta": 10000.0},
]


@pytest.mark.parametrize("parameters", LLAMA_TYPES, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("n", [6, 20])  # within and beyond max_position_embeddings (16) and the original 8
def test_llama_rotary_embedding_and_apply_rotary_pos_emb(parameters, n):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=16, rope_parameters=dict(parameters))
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(n)[None])  # a fresh module
    rope = Rope.from_config(config.to_dict())
    assert rope is not None and rope.kind == parameters["rope_type"] and rope.pairing == "half-split"
    trace, Q, K = _trace(rope, n, 8)
    q_ref, k_ref = apply_rotary_pos_emb(Q, K, cos, sin)
    _exact(trace["cos"], cos[0])
    _exact(trace["sin"], sin[0])
    _exact(trace["Q_rot"], q_ref)
    _exact(trace["K_rot"], k_ref)
    config_dict = config.to_dict()
    _f64(rotate64(Q, config_dict), q_ref)
    _f64(rotate64(K, config_dict), k_ref)
    assert parameters["rope_type"] in trace.step("cos").op or parameters["rope_type"] == "default"


def test_phi3_partial_rotary_with_longrope_short_and_long():
    """Phi-3: half the head rotates (`q_rot, q_pass`), longrope's factors switch past the original length;
    the 4.4x config (top-level partial_rotary_factor and original_max_position_embeddings, `rope_scaling` of
    type "yarn", an old name of longrope for Phi-3) reads as the 5.x one does."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    old = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
           "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
           "rope_scaling": {"type": "yarn", "short_factor": [1.0, 1.2, 1.5, 3.0], "long_factor": [1.0, 2.0, 5.0, 11.0]}}
    config = Phi3Config(**{k: v for k, v in old.items() if k != "model_type"})
    new = config.to_dict()
    assert "rope_parameters" in new and "rope_scaling" not in new
    ropes = [Rope.from_config(old), Rope.from_config(new)]
    assert ropes[0] == ropes[1] and ropes[0] is not None and ropes[0].kind == "longrope"
    for n in (10, 30):
        cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1), torch.arange(n)[None])
        trace, Q, K = _trace(ropes[0], n, 16)
        q_ref, k_ref = apply_rotary_pos_emb(Q, K, cos, sin)
        _exact(trace["cos"], cos[0])
        _exact(trace["Q_rot"], q_ref)
        _exact(trace["K_rot"], k_ref)
        assert torch.equal(trace["Q_rot"][..., 8:], Q[..., 8:])  # the pass-through half
        _f64(rotate64(Q, new), q_ref)
        assert trace.step("cos").dims == ("n_K", "d_rot")
        assert ("long_factor" if n > 16 else "short_factor") in trace.step("cos").op
        assert "attention_scaling" in trace.step("cos").op
        assert "Q[..., :8] rotated half-split" in trace.step("Q_rot").op
        assert "partial_rotary_factor 0.5" in trace.step("Q_rot").op


def test_gpt_neox_rotary_pct_from_the_old_config():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    old = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 2, "rotary_pct": 0.25,
           "rotary_emb_base": 20000, "max_position_embeddings": 64}
    config = GPTNeoXConfig(**{k: v for k, v in old.items() if k != "model_type"})
    rope = Rope.from_config(old)
    assert rope == Rope.from_config(config.to_dict()) and rope is not None and rope.fraction == 0.25
    cos, sin = GPTNeoXRotaryEmbedding(config)(torch.zeros(1), torch.arange(7)[None])
    trace, Q, K = _trace(rope, 7, 32)
    q_ref, k_ref = apply_rotary_pos_emb(Q, K, cos, sin)
    _exact(trace["Q_rot"], q_ref)
    _exact(trace["K_rot"], k_ref)
    _f64(rotate64(K, old), k_ref)


@pytest.mark.parametrize("rotary_dim", [8, None])
def test_gptj_interleaved_rotate_every_two(rotary_dim):
    """GPT-J: `rotary_dim` coordinates, pairs (2i, 2i + 1), heads laid out [n_batch, n, n_head, d_head]."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    config = {"model_type": "gptj", "n_embd": 64, "n_head": 2, "rotary_dim": rotary_dim, "n_positions": 64}
    rope = Rope.from_config(config)
    assert rope is not None and rope.pairing == "interleaved" and rope.rotary_dim(32) == (rotary_dim or 32)
    n, width = 9, rotary_dim or 32
    sin, cos = torch.split(create_sinusoidal_positions(n, width)[None], width // 2, dim=-1)  # [1, n, width/2]
    trace, Q, K = _trace(rope, n, 32)
    for name, x in (("Q_rot", Q), ("K_rot", K)):
        x_t = x.transpose(1, 2)  # [n_batch, n, n_head, d_head]
        ref = torch.cat([apply_rotary_pos_emb(x_t[..., :width], sin, cos), x_t[..., width:]], dim=-1)
        _exact(trace[name], ref.transpose(1, 2))
        _f64(rotate64(x, config, pairing="interleaved"), ref.transpose(1, 2))
    assert "rotate_every_two" in trace.step("Q_rot").op and "interleaved" in trace.step("Q_rot").op


@pytest.mark.parametrize("parameters", [{"rope_type": "default", "rope_theta": 500000.0}, LLAMA_TYPES[-2]],
                         ids=["default", "llama3"])
def test_llama4_complex_product(parameters):
    """Llama 4: `view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`, on [n_batch, n, n_head, d_head]."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding, apply_rotary_emb

    config = Llama4TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              max_position_embeddings=16, rope_parameters=dict(parameters))
    freqs_cis = Llama4TextRotaryEmbedding(config)(torch.zeros(1), torch.arange(12)[None])
    rope = Rope.from_config(config.to_dict())
    assert rope is not None and rope.pairing == "interleaved"
    trace, Q, K = _trace(rope, 12, 8)
    q_ref, k_ref = apply_rotary_emb(Q.transpose(1, 2), K.transpose(1, 2), freqs_cis)
    _exact(trace["Q_rot"], q_ref.transpose(1, 2))
    _exact(trace["K_rot"], k_ref.transpose(1, 2))
    _exact(trace["cos"][:, 0::2], freqs_cis[0].real)
    _f64(rotate64(Q, config.to_dict(), pairing="interleaved"), q_ref.transpose(1, 2))


@pytest.mark.parametrize(("family", "names", "fraction"), [
    ("glm", ("GlmConfig", "GlmRotaryEmbedding", "apply_rotary_pos_emb"), 0.5),
    ("glm4", ("Glm4Config", "Glm4RotaryEmbedding", "apply_rotary_pos_emb"), 0.5),
    ("cohere", ("CohereConfig", "CohereRotaryEmbedding", "apply_rotary_pos_emb"), 1.0),
    ("cohere2", ("Cohere2Config", "Cohere2RotaryEmbedding", "apply_rotary_pos_emb"), 1.0),
    ("helium", ("HeliumConfig", "HeliumRotaryEmbedding", "apply_rotary_pos_emb"), 1.0),
    ("ernie4_5", ("Ernie4_5Config", "Ernie4_5RotaryEmbedding", "apply_rotary_pos_emb"), 1.0),
    ("deepseek_v2", ("DeepseekV2Config", "DeepseekV2RotaryEmbedding", "apply_rotary_emb"), 1.0),
])
def test_other_interleaved_families(family, names, fraction):
    """GLM (half the head), Cohere, Helium, ERNIE 4.5 (a `rotate_half` over x[..., 0::2], x[..., 1::2]) and
    DeepSeek-V2 (a complex product): their own rotary module and rotation."""
    import importlib

    import transformers

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config_class, rotary_class, apply_name = names
    sizes = {"qk_rope_head_dim": 16} if family == "deepseek_v2" else {"head_dim": 16}
    config = getattr(transformers, config_class)(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                                 **sizes)
    embedding = getattr(modeling, rotary_class)(config)(torch.zeros(1), torch.arange(5)[None])
    rope = Rope.from_config(config.to_dict())
    assert rope is not None and (rope.pairing, rope.fraction) == ("interleaved", fraction)
    trace, Q, K = _trace(rope, 5, 16)
    apply = getattr(modeling, apply_name)
    q_ref, k_ref = apply(Q, K, *embedding) if isinstance(embedding, tuple) else apply(Q, K, embedding)
    _exact(trace["Q_rot"], q_ref)
    _exact(trace["K_rot"], k_ref)
    _f64(rotate64(Q, config.to_dict(), pairing="interleaved"), q_ref)


def test_gemma3_bases_per_layer_type_in_both_config_forms():
    """Gemma 3: sliding layers turn with rope_local_base_freq (10k), full ones with rope_theta (1M) and
    rope_scaling; 5.x nests rope_parameters by layer type."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding, apply_rotary_pos_emb

    old = {"model_type": "gemma3_text", "hidden_size": 32, "num_attention_heads": 2, "head_dim": 16,
           "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 64}
    config = Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    rotary = Gemma3RotaryEmbedding(config)
    for layer_type, base, kind in (("sliding_attention", 10_000.0, "default"), ("full_attention", 1e6, "linear")):
        ropes = [Rope.from_config(old, layer_type), Rope.from_config(config.to_dict(), layer_type)]
        assert ropes[0] == ropes[1] and ropes[0] is not None and (ropes[0].base, ropes[0].kind) == (base, kind)
        cos, sin = rotary(torch.zeros(1), torch.arange(6)[None], layer_type)
        trace, Q, K = _trace(ropes[0], 6, 16)
        q_ref, _ = apply_rotary_pos_emb(Q, K, cos, sin)
        _exact(trace["Q_rot"], q_ref)
        _f64(rotate64(Q, old, layer_type=layer_type), q_ref)
    with pytest.raises(UsageError, match="gives each layer type its own RoPE .*say which with layer_type"):
        Rope.from_config(config.to_dict())
    with pytest.raises(UsageError, match="no layer type 'chunked_attention'"):
        Rope.from_config(old, "chunked_attention")


def test_a_layer_type_without_rope_is_none():
    config = {"layer_types": ["full_attention", "sliding_attention"],
              "rope_parameters": {"full_attention": None, "sliding_attention": {"rope_theta": 10000.0}}}
    assert Rope.from_config(config, "full_attention") is None
    assert Rope.from_config(config, "sliding_attention") == Rope(10000.0)


def test_mha_decode_step_with_partial_interleaved_yarn_equals_the_reference():
    """A cache of 5 positions, then 2 new queries: positions 5 and 6 of a 7-position forward."""
    config = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                  "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
              "max_position_embeddings": 16, "head_dim": 8}
    rope = Rope.from_config(config)
    assert rope is not None
    rope = Rope(rope.base, rope.scaling, pairing="interleaved", max_position_embeddings=16)
    layer = MultiHeadAttention(16, 2, n_kv_head=1, rope=rope, causal=True)
    trace = layer(torch.randn(1, 2, 16), cache=(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)))
    _f64(trace["Q_rot"], rotate64(trace["Q_split"], config, start=5, pairing="interleaved"))
    _f64(trace["K_rot"], rotate64(trace["K_split"], config, start=5, pairing="interleaved"))
    assert trace.step("cos").dims == ("n_K", "d_rot") and trace["cos"].shape == (7, 4)
    assert "cos[5:7]" in trace.step("Q_rot").op and "Q_split[..., :4] rotated interleaved" in trace.step("Q_rot").op


def test_ops_say_the_type_the_fraction_and_the_pairing():
    trace, _, _ = _trace(Rope(500000.0), 4, 8)
    assert trace.step("cos").op == "cos(position · inv_freq), inv_freq = 500000^(-2i/d_K)"
    assert trace.step("Q_rot").op == "Q * cos + rotate_half(Q) * sin, half-split"
    rope = Rope(10000.0, {"rope_type": "dynamic", "factor": 2.0}, partial_rotary_factor=0.5,
                max_position_embeddings=4)
    trace, _, _ = _trace(rope, 6, 16)
    assert "dynamic NTK, n_pos 6 > 4" in trace.step("sin").op
    assert trace.step("K_rot").op.startswith("cat(K[..., :8] * cos + rotate_half(K[..., :8]) * sin, K[..., 8:])")
    assert rope.describe() == "base 10000, dynamic scaling, partial 0.5"


# --- refusals: one line, naming the config field -------------------------------------------------------------

BAD = [
    ({"scaling": {"rope_type": "ntk-by-parts"}}, "RoPE type 'ntk-by-parts' (rope_parameters.rope_type) is not"),
    ({"scaling": {"rope_type": "linear"}}, "RoPE type 'linear' needs rope_parameters.factor"),
    ({"scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_parameters.factor is -2.0; it must be a finite"),
    ({"scaling": {"rope_type": "linear", "factor": float("nan")}}, "rope_parameters.factor is nan"),
    ({"scaling": {"rope_type": "linear", "factor": "2"}}, "rope_parameters.factor is '2'"),
    ({"scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' needs max_position_embeddings"),
    ({"scaling": {"rope_type": "yarn", "factor": 2.0}}, "needs rope_parameters.original_max_position_embeddings"),
    ({"scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "beta_fast": -1}},
     "rope_parameters.beta_fast is -1"),
    ({"scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "truncate": "no"}},
     "rope_parameters.truncate is 'no'; it must be true or false"),
    ({"scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}},
     "rope_parameters.original_max_position_embeddings is 0"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                  "original_max_position_embeddings": 8}}, "high_freq_factor (1) must be above low_freq_factor"),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1, 0], "long_factor": [1, 2],
                  "original_max_position_embeddings": 8}}, "rope_parameters.short_factor[1] is 0"),
    ({"scaling": {"rope_type": "longrope", "short_factor": "1,2", "long_factor": [1, 2],
                  "original_max_position_embeddings": 8}}, "short_factor is '1,2'; it must be a list of numbers"),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1, 1], "long_factor": [1, 2],
                  "original_max_position_embeddings": 1}, "max_position_embeddings": 16},
     "rope_parameters.original_max_position_embeddings is 1; longrope scales cos and sin"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor is 1.5; it must be a number in (0, 1]"),
    ({"scaling": {"partial_rotary_factor": 0}}, "partial_rotary_factor is 0"),
    ({"base": float("inf")}, "RoPE base inf (rope_parameters.rope_theta) must be a finite number above 1"),
    ({"pairing": "complex"}, "RoPE pairing 'complex' is not one of half-split, interleaved"),
    ({"max_position_embeddings": -5}, "max_position_embeddings is -5"),
    ({"scaling": [1, 2]}, "rope_parameters is [1, 2]; it must be a dict"),
]


@pytest.mark.parametrize(("arguments", "phrase"), BAD, ids=[phrase for _, phrase in BAD])
def test_bad_parameters_are_refused_in_one_line(arguments, phrase):
    with pytest.raises(UsageError) as caught:
        Rope(**arguments)
    message = str(caught.value)
    assert phrase in message and "\n" not in message, message


@pytest.mark.parametrize(("config", "d_head", "phrase"), [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4,
                       "original_max_position_embeddings": 8}, "max_position_embeddings": 32}, 8,
     "rope_scaling.short_factor has 3 numbers; a head of 8 rotating 8 coordinates needs 4"),
    ({"rope_parameters": {"rope_type": "default"}, "head_dim": 7}, None, "d_head must be even; it is 7"),
    ({"rope_parameters": {"partial_rotary_factor": 0.01}}, 16, "partial_rotary_factor 0.01 of d_head 16 rotates no"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.125},
      "max_position_embeddings": 8}, 16, "dynamic RoPE rescales by (d/(d−2))"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.3125},
      "max_position_embeddings": 8}, 16, "yarn RoPE needs an even number of rotated coordinates"),
    ({"rope_parameters": "yarn"}, 8, "rope_parameters is 'yarn'; it must be a dict"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 0.5}}, "layer_types": ["full_attention"]}, 8,
     "RoPE base 0.5 (rope_parameters.full_attention.rope_theta)"),
    ({"model_type": "gptj", "n_embd": 16, "n_head": 2, "rotary_dim": 10}, None, "rotary_dim 10 is more than"),
])
def test_bad_configs_are_refused_in_one_line(config, d_head, phrase):
    with pytest.raises(UsageError) as caught:
        Rope.from_config(config, "full_attention" if "layer_types" in config else None, head_dim=d_head)
    message = str(caught.value)
    assert phrase in message and "\n" not in message, message


def test_a_refused_type_in_a_model_folder_names_the_file():
    from attnscope.models.config import Config
    from attnscope.models.families.llama import Llama

    family = Llama.__new__(Llama)
    family.config, family.d_head = Config("config.json", {"rope_scaling": {"type": "su"}}), 8  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"^config.json: RoPE type 'su' \(rope_scaling.rope_type\) is not one"):
        family.rope()


# --- a LLaMA-shaped checkpoint of each type, through `head --text`, against transformers' eager pattern ----


@pytest.mark.parametrize("parameters", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 3.0, 9.0, 27.0],
     "original_max_position_embeddings": 4, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
], ids=lambda p: p["rope_type"])
def test_llama_checkpoint_of_each_type_traces_as_eager(tmp_path, parameters):
    """max_position_embeddings 8 and an original length of 4: the sentence is longer than both, so dynamic
    rescales and longrope takes its long factors."""
    from tiny_models import SENTENCE, build
    from transformers import AutoTokenizer

    from attnscope.runs.head import HeadOptions, run_head

    model = build("llama", tmp_path, num_hidden_layers=2, max_position_embeddings=8, rope_parameters=parameters)
    encoded = AutoTokenizer.from_pretrained(tmp_path)(SENTENCE, return_tensors="pt")
    assert encoded["input_ids"].shape[1] > 8
    with torch.no_grad():
        attentions = model(**encoded, output_attentions=True).attentions
    for head in range(4):
        result = run_head(HeadOptions(model=str(tmp_path), layer=1, head=head, text=SENTENCE))
        torch.testing.assert_close(result.attention, attentions[1][0, head], atol=1e-5, rtol=1e-5)
    assert parameters["rope_type"] in result.run.layer.step("cos").op


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_the_float64_reference_rotates_an_empty_batch(pairing):
    """An empty batch has no pair to infer a -1 from (found by the CLI fuzz: mha --q empty.npy --rope
    --rope-pairing interleaved --check was an internal error)."""
    config = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "head_dim": 8}
    rotated = rotate64(torch.zeros(0, 2, 5, 8), config, pairing=pairing)
    assert rotated.shape == (0, 2, 5, 8)
