"""Issue 19's core variants in one attention: qk-norm (fa1), chunks, RoPE fraction/pairing and temperature tuning
(fa2), sinks and both-sided windows (fb), in the order transformers runs them (norm, RoPE, temperature, repeat_kv,
mask, sinks). The reference is written here from transformers' own pieces (`apply_rotary_pos_emb`, GPT-OSS's
`eager_attention_forward`, `F.rms_norm`, the mask rules in plain Python, Llama 4's temperature formula), sharing
no code with attnscope; then the memory guard's estimate against the traced run and --check, all at once."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from attnscope import MultiHeadAttention, Rope, cost
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.options import check_options
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.variants.qknorm import QkNorm
from attnscope.variants.temperature import TemperatureTuning


def _allowed(n: int, chunk: int | None, both: int | None) -> torch.Tensor:
    """The mask rule in plain Python: chunks (causal, same chunk) or a window of `both` seen from either side."""
    rows = []
    for i in range(n):
        if chunk is not None:
            rows.append([j <= i and j // chunk == i // chunk for j in range(n)])
        else:
            rows.append([abs(i - j) <= both // 2 for j in range(n)])
    return torch.tensor(rows)


def _reference(module: MultiHeadAttention, x: torch.Tensor, *, over: str, chunk: int | None, both: int | None,
               tuning: TemperatureTuning | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x and attention in float64, as transformers' Qwen3 (norm before RoPE), Llama 4 (temperature after RoPE)
    and GPT-OSS (sinks, repeat_kv) write them."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n_batch, n, _ = x.shape
    d, h, g = module.d_head, module.n_head, module.n_kv_head
    x = x.double()

    def project(W: torch.nn.Linear, heads: int, norm: torch.nn.Module | None) -> torch.Tensor:
        y = F.linear(x, W.weight.double(), None if W.bias is None else W.bias.double())  # [n_batch, n, heads·d]
        if norm is not None and over == "proj":
            y = F.rms_norm(y, (heads * d,), norm.weight.double(), 1e-6)
        y = y.view(n_batch, n, heads, d).transpose(1, 2)  # [n_batch, heads, n, d]
        return F.rms_norm(y, (d,), norm.weight.double(), 1e-6) if norm is not None and over == "head" else y

    q, k, v = project(module.W_q, h, module.q_norm), project(module.W_k, g, module.k_norm), project(module.W_v, g, None)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # [1, n, d]
    q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    if tuning is not None:  # Llama4TextAttention: log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
        scales = torch.log1p(torch.floor((torch.arange(n, dtype=torch.float64) + 1) / tuning.floor_scale))
        q = q * (scales * tuning.attn_scale + 1.0)[:, None]
    mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~_allowed(n, chunk, both), torch.finfo(torch.float64).min)
    layer = types.SimpleNamespace(sinks=module.sinks.detach().double(), num_key_value_groups=h // g, training=False)
    out, attention = eager_attention_forward(layer, q, k, v, mask, scaling=d ** -0.5)
    merged = out.reshape(n_batch, n, h * d)  # eager returns [n_batch, n, n_head, d_head]
    return F.linear(merged, module.W_o.weight.double(), module.W_o.bias.double()), attention


@pytest.mark.parametrize(("over", "chunk", "both", "tuned"), [
    ("head", 3, None, True),  # Qwen3's norm, Llama 4's chunks and temperature, GPT-OSS's sinks
    ("proj", None, 4, False),  # OLMo 2's norm, ModernBERT's window, sinks
    ("head", None, 5, True),  # temperature without a causal mask
])
def test_every_variant_at_once_equals_transformers_pieces(over, chunk, both, tuned):
    torch.manual_seed(0)
    tuning = TemperatureTuning(floor_scale=2, attn_scale=0.5) if tuned else None
    module = MultiHeadAttention(32, 4, n_kv_head=2, rope=Rope(), qk_norm=QkNorm(over), chunk=chunk,
                                window=both, window_side="both" if both else None, temperature=tuning,
                                sinks=True, causal=chunk is not None)
    with torch.no_grad():
        for weight in (module.q_norm.weight, module.k_norm.weight):
            weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 32)
    trace = module(x)
    names = [step.name for step in trace.steps]
    first = "Q_normed" if over == "proj" else "Q_split"
    wanted = [first, "Q_normed", "Q_rot", "Q_tuned", "K_rep", "masked_scores", "sinks", "attention", "sink_weight"]
    wanted = [name for name in wanted if tuned or name != "Q_tuned"]
    assert [name for name in names if name in wanted] == list(dict.fromkeys(wanted))
    expected_x, expected_attention = _reference(module, x, over=over, chunk=chunk, both=both, tuning=tuning)
    torch.testing.assert_close(trace["attention"].double(), expected_attention, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trace["x"].double(), expected_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trace["sink_weight"].double(), 1 - expected_attention.sum(-1), atol=1e-5, rtol=1e-5)
    fused = MultiHeadAttention(32, 4, record=False, spec=module.spec)
    fused.load_state_dict(module.state_dict())
    torch.testing.assert_close(fused(x)["x"], trace["x"], atol=1e-5, rtol=1e-5)


SDPA_MIXES = [
    {"rope": True, "qk_norm": "head", "chunk": 3, "temperature_tuning": True, "floor_scale": 2.0, "sinks": "random"},
    {"rope": True, "rope_fraction": 0.5, "qk_norm": "head", "window": 4, "window_side": "both", "sinks": "0.5"},
    {"rope": True, "rope_pairing": "interleaved", "qk_norm": "head", "chunk": 4, "cache": 3, "sinks": "random",
     "temperature_tuning": True, "floor_scale": 2.0},
]
MHA_MIXES = [
    {"kv_heads": 2, "rope": True, "qk_norm": "proj", "chunk": 3, "temperature_tuning": True, "floor_scale": 2.0,
     "sinks": "random", "cache": 3},
    {"kv_heads": 2, "rope": True, "qk_norm": "head", "window": 4, "window_side": "both", "sinks": "0.5,-1,2,0"},
]


@pytest.mark.parametrize("options", SDPA_MIXES)
def test_sdpa_mixes_estimate_equals_the_traced_run_and_check_passes(options):
    base = {"batch": 2, "nq": 5, "dk": 8, "dv": 4, "nk": None if options.get("cache") else 7}
    meta, real = (run_sdpa(SdpaOptions(**base, **options, meta=meta, check=not meta)) for meta in (True, False))
    spec = check_options(SdpaOptions(**base, **options))
    n_K = 7 if not options.get("cache") else options["cache"] + 5
    assert meta.peak_bytes == real.peak_bytes == cost.sdpa_bytes(2, 5, n_K, 8, 4, spec)
    assert real.comparisons and not real.check_failed, real.comparisons
    assert {c.name for c in real.comparisons} >= {"out", "attention", "sink_weight"}


@pytest.mark.parametrize("options", MHA_MIXES)
def test_mha_mixes_estimate_equals_the_traced_run_and_check_passes(options):
    base = {"batch": 2, "nq": 5, "d_feat": 16, "heads": 4}
    meta, real = (run_mha(MhaOptions(**base, **options, meta=meta, check=not meta)) for meta in (True, False))
    spec = check_options(MhaOptions(**base, **options), n_kv_head=options["kv_heads"])
    n_K = options.get("cache", 0) + 5
    assert meta.peak_bytes == real.peak_bytes == cost.mha_bytes(2, 5, n_K, 16, 4, spec)
    assert real.comparisons and not real.check_failed, real.comparisons
    assert math.isclose(float(real.trace["attention"].sum(-1).add(real.trace["sink_weight"]).mean()), 1.0,
                        rel_tol=1e-6)
