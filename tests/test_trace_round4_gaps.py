"""`attnscope trace` on the gaps a held-out round left (tests/trace_styles_round4_gaps.py): time-first inputs
(fairseq's MultiheadAttention, Megatron's [s, b, h] core, nn.MultiheadAttention with batch_first=False), Keras
kernels whose key_dim is not d_model / num_heads, a context of another width than the queries (nn.Parameter
weights, nn.MultiheadAttention's kdim), a function's non-square weights, --train on one head, and --json's
params.causal in a decode step.

Correct code exits 0 with every step lined up; each style is checked apart from attnscope against
F.scaled_dot_product_attention holding its weights; planted bugs get their catalog entry."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED, _moved
from test_trace_command import trace, user_module
from tracecases import assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round4_gaps.py")
LLAMA = str(Path(__file__).resolve().parent.parent / "docs" / "examples" / "llama.py")


def _clean(runner, target: str, *args: str) -> dict:
    code, out = run_case(runner, STYLES, target, options=args)
    assert_passes(code, out)
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]
    return out


def _named(runner, target: str, bug: str, entry: str, *args: str) -> dict:
    result, out = trace(runner, f"{STYLES}:{target}", "--init", f"bug={bug!r}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]
    return out


def _time_first(out: dict) -> None:
    assert any("time-first ones [n, n_batch, d_feat]" in note for note in out["notes"]), out["notes"]


# --- time-first inputs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [("--causal",), ()])
def test_fairseq_time_first_correct(runner, args):
    out = _clean(runner, "FairseqStyle", *args)
    _time_first(out)
    assert out["params"]["sizes"]["n_batch"] != out["params"]["sizes"]["n_Q"]
    query = next(s for s in out["steps"] if s["name"] == "query")
    assert query["dims"] == ["n_Q", "n_batch", "d_feat"], query


# q · scaling · scaling: the queries held scaled twice, scale.twice (its numbers are scale.d_head's)
@pytest.mark.parametrize(("bug", "entry"), [("scale_twice", "scale.twice"), ("axis", "softmax.axis"),
                                            ("merge", "heads.merge_without_transpose")])
def test_fairseq_time_first_bugs_named(runner, bug, entry):
    _time_first(_named(runner, "FairseqStyle", bug, entry, "--causal"))


def _padding(tmp_path) -> str:
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 4:] = False  # the first sequence padded after 4 tokens
    path = tmp_path / "pad.pt"
    torch.save(keep, path)
    return str(path)


def test_fairseq_key_padding_goes_to_its_parameter(runner, tmp_path):
    """A [n_batch, n_K] padding file: the code's attn_mask takes [n_Q, n_K] only, so the mask goes to the other mask
    parameter, key_padding_mask, in the convention it reads (True = padded)."""
    out = _clean(runner, "FairseqStyle", "--mask", _padding(tmp_path), "--batch", "2", "--nq", "7")
    _time_first(out)
    assert any(note.startswith("key_padding_mask: boolean, True = masked out") for note in out["notes"]), out["notes"]


def test_fairseq_key_padding_filled_with_zero(runner, tmp_path):
    _named(runner, "FairseqStyle", "fill0", "mask.filled_with_0", "--mask", _padding(tmp_path), "--batch", "2",
           "--nq", "7")


def test_megatron_seq_first_einsum(runner):
    out = _clean(runner, "SeqFirstEinsum", "--causal")
    _time_first(out)
    assert out["params"]["sizes"]["n_head"] == 3


@pytest.mark.parametrize(("bug", "entry"), [("kv_swap", "kv.swapped"), ("no_scale", "scale.none")])
def test_megatron_seq_first_bugs_named(runner, bug, entry):
    _named(runner, "SeqFirstEinsum", bug, entry, "--causal")


@pytest.mark.parametrize("args", [("--causal",), ()])
def test_wrapped_multihead_attention_time_first(runner, args):
    _time_first(_clean(runner, "WrappedTimeFirst", *args))


def test_time_first_styles_against_sdpa():
    """The styles apart from attnscope: fed [T, B, C], each equals F.scaled_dot_product_attention on [B, T, C]."""
    styles = user_module(STYLES)
    x = torch.randn(7, 3, 32)  # [T, B, C]
    keep = torch.ones(7, 7, dtype=torch.bool).tril()
    fairseq = _moved(styles.FairseqStyle())
    wrapped = _moved(styles.WrappedTimeFirst())
    megatron = _moved(styles.SeqFirstEinsum())
    with torch.no_grad():
        for module, w, b, out in ((fairseq, fairseq.in_proj_weight, fairseq.in_proj_bias, fairseq.out_proj),
                                  (wrapped, wrapped.attn.in_proj_weight, wrapped.attn.in_proj_bias,
                                   wrapped.attn.out_proj)):
            q, k, v = (F.linear(x.transpose(0, 1), w, b).chunk(3, dim=-1))
            heads = [t.reshape(3, 7, 4, 8).transpose(1, 2) for t in (q, k, v)]  # [B, H, T, d]
            y = F.scaled_dot_product_attention(*heads, attn_mask=keep).transpose(1, 2).reshape(3, 7, 32)
            additive = torch.zeros(7, 7).masked_fill(~keep, float("-inf"))
            torch.testing.assert_close(module(x, attn_mask=additive), out(y).transpose(0, 1), atol=1e-5, rtol=1e-5)
        h = torch.randn(7, 3, 24)
        q, k, v = (lin(h.transpose(0, 1)).reshape(3, 7, 3, 8).transpose(1, 2)
                   for lin in (megatron.query, megatron.key, megatron.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(3, 7, 24)
        torch.testing.assert_close(megatron(h), megatron.dense(y).transpose(0, 1), atol=1e-5, rtol=1e-5)


# --- Keras kernels, key_dim != d_model / num_heads ------------------------------------------------------------------

def test_keras_key_dim_read_from_kernels(runner):
    out = _clean(runner, "KerasWide", "--causal")
    assert out["params"]["sizes"]["d_feat"] == 24 and out["params"]["sizes"]["n_head"] == 3
    assert out["params"]["sizes"]["d_head"] == 12  # key_dim, not 24 / 3
    assert "d_head=12" in out["reference"]


def test_keras_key_dim_bug_named(runner):
    _named(runner, "KerasWide", "no_scale", "scale.none", "--causal")


# --- a context of another width --------------------------------------------------------------------------------------

def test_parameter_cross_attention_context_width(runner):
    out = _clean(runner, "ParamContext")
    assert out["params"]["sizes"]["d_feat"] == 24 and out["params"]["sizes"]["d_kv_in"] == 20
    assert out["params"]["sizes"]["n_K"] != out["params"]["sizes"]["n_Q"]


@pytest.mark.parametrize(("bug", "entry"), [("kv_swap", "kv.swapped"), ("no_scale", "scale.none")])
def test_parameter_cross_attention_bugs_named(runner, bug, entry):
    _named(runner, "ParamContext", bug, entry)


def test_wrapped_kdim(runner):
    out = _clean(runner, "WrappedKdim")
    assert out["params"]["sizes"]["d_kv_in"] == 20


def test_context_styles_against_sdpa():
    styles = user_module(STYLES)
    module, wrapped = _moved(styles.ParamContext()), _moved(styles.WrappedKdim())
    x, z = torch.randn(2, 5, 24), torch.randn(2, 9, 20)
    with torch.no_grad():
        q = (x @ module.W_q).reshape(2, 5, 4, 8).transpose(1, 2)
        k, v = ((z @ w).reshape(2, 9, 4, 8).transpose(1, 2) for w in (module.W_k, module.W_v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32)
        torch.testing.assert_close(module(x, z), y @ module.W_o, atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 5, 32)
        mha = wrapped.mha
        q = F.linear(x, mha.q_proj_weight, mha.in_proj_bias[:32]).reshape(2, 5, 4, 8).transpose(1, 2)
        k = F.linear(z, mha.k_proj_weight, mha.in_proj_bias[32:64]).reshape(2, 9, 4, 8).transpose(1, 2)
        v = F.linear(z, mha.v_proj_weight, mha.in_proj_bias[64:]).reshape(2, 9, 4, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32)
        torch.testing.assert_close(wrapped(x, z), mha.out_proj(y), atol=1e-5, rtol=1e-5)


# --- a function's non-square weights -------------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "n_head", "d_head"), [("attention_heads", 4, 3), ("attention_sized", 2, 10),
                                                          ("attention_linear", 2, 10)])
def test_function_weights_of_the_right_shapes(runner, target, n_head, d_head):
    out = _clean(runner, target, *(("--causal",) if target == "attention_linear" else ()))
    assert out["params"]["sizes"]["n_head"] == n_head
    if target != "attention_linear":
        assert out["params"]["sizes"]["d_head"] == d_head
    assert any(f"[12, {n_head * d_head}]" in note or f"[{n_head * d_head}, 12]" in note for note in out["notes"])


def test_function_heads_flag(runner):
    out = _clean(runner, "attention_heads", "--heads", "3")
    assert out["params"]["sizes"]["n_head"] == 3


def test_function_non_square_bug_named(runner):
    result, out = trace(runner, f"{STYLES}:attention_sized_unscaled")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "scale.none", out["first_divergence"]


def test_function_styles_against_sdpa():
    styles = user_module(STYLES)
    x = torch.randn(2, 7, 12)
    w_q, w_k, w_v = (torch.randn(12, 20) / math.sqrt(12) for _ in range(3))
    w_o = torch.randn(20, 12) / math.sqrt(20)
    q, k, v = ((x @ w).reshape(2, 7, 2, 10).transpose(1, 2) for w in (w_q, w_k, w_v))
    y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 7, 20) @ w_o
    torch.testing.assert_close(styles.attention_sized(x, w_q, w_k, w_v, w_o), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(styles.attention_heads(x, w_q, w_k, w_v, w_o, 2), y, atol=1e-5, rtol=1e-5)


# --- --train on one head ---------------------------------------------------------------------------------------------

def test_train_one_head(runner):
    out = _clean(runner, "OneHeadDropout", "--train")
    assert out["params"]["sizes"]["n_head"] == 1
    assert any("the reference applies that same mask" in note for note in out["notes"]), out["notes"]


# --- params.causal says what the reference did ---------------------------------------------------------------------

def test_bare_causal_in_a_decode_step_reports_lower_right(runner):
    result, out = trace(runner, f"{LLAMA}:Attention", "--init", "dim=64, n_heads=4, n_kv_heads=2", "--rope",
                        "--causal", "--cache", "3")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["causal"] == "lower-right"
    assert "lower-right" in out["reference"]
    result, out = trace(runner, f"{LLAMA}:Attention", "--init", "dim=64, n_heads=4, n_kv_heads=2", "--rope",
                        "--causal")
    assert out["params"]["causal"] == "upper-left"


# --- further styles: GPT-2's Conv1D, HF 4.x, Megatron's baddbmm core, a 'bqhd' function, fairseq's cross-attention ---

def test_gpt2_conv1d_addmm(runner):
    out = _clean(runner, "GPT2Attention", "--causal")
    assert "q=c_attn.weight" in out["reference"], out["reference"]


@pytest.mark.parametrize(("bug", "entry"), [("merge", "heads.merge_without_transpose"), ("no_scale", "scale.none"),
                                            ("off_by_one", "mask.off_by_one"), ("kv_swap", "kv.swapped")])
def test_gpt2_conv1d_bugs_named(runner, bug, entry):
    _named(runner, "GPT2Attention", bug, entry, "--causal")


def test_hf4_tuple_and_mask_after(runner):
    _clean(runner, "HF4Attention", "--causal")
    _named(runner, "HF4Attention", "mask_after", "mask.after_softmax", "--causal")
    _named(runner, "HF4Attention", "tiled", "gqa.tiled", "--causal")


def test_megatron_baddbmm_core(runner):
    out = _clean(runner, "MegatronCore", "--causal")
    _time_first(out)
    assert out["params"]["sizes"]["n_head"] == 4
    assert any("[n_batch·n_head, n_Q, d_head]" in note for note in out["notes"]), out["notes"]
    _named(runner, "MegatronCore", "no_scale", "scale.none", "--causal")
    _named(runner, "MegatronCore", "axis", "softmax.axis", "--causal")


def test_function_heads_behind_the_tokens(runner):
    result, out = trace(runner, f"{STYLES}:dot_product_attention", "--causal", "--heads", "4")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None, out["first_divergence"]
    assert any("runs on [n_batch, n, n_head, d]" in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize("args", [(), ("--mask", "PAD", "--batch", "2", "--nq", "5", "--nk", "7")])
def test_fairseq_cross_attention(runner, tmp_path, args):
    args = tuple(_padding(tmp_path) if a == "PAD" else a for a in args)
    _time_first(_clean(runner, "FairseqCross", *args))
    _named(runner, "FairseqCross", "values_from_keys", "kv.values_from_keys", *args)
    _named(runner, "FairseqCross", "axis", "softmax.axis", *args)


def test_further_styles_against_sdpa():
    styles = user_module(STYLES)
    gpt2, megatron, cross = _moved(styles.GPT2Attention()), _moved(styles.MegatronCore()), _moved(styles.FairseqCross())
    with torch.no_grad():
        x = torch.randn(2, 7, 32)
        q, k, v = (x @ gpt2.c_attn.weight + gpt2.c_attn.bias).split(32, dim=-1)
        q, k, v = (t.reshape(2, 7, 4, 8).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, 32)
        torch.testing.assert_close(gpt2(x)[0], y @ gpt2.c_proj.weight + gpt2.c_proj.bias, atol=1e-5, rtol=1e-5)
        h = torch.randn(7, 2, 32)  # [s, b, h]
        mixed = megatron.query_key_value(h.transpose(0, 1)).reshape(2, 7, 4, 3, 8)  # per head [q | k | v]
        q, k, v = (mixed[..., i, :].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, 32)
        masked = ~torch.ones(7, 7, dtype=torch.bool).tril()
        torch.testing.assert_close(megatron(h, masked), megatron.dense(y).transpose(0, 1), atol=1e-5, rtol=1e-5)
        q_in, kv_in = torch.randn(5, 2, 32), torch.randn(9, 2, 32)
        q = cross.q_proj(q_in.transpose(0, 1)).reshape(2, 5, 4, 8).transpose(1, 2)
        k, v = (p(kv_in.transpose(0, 1)).reshape(2, 9, 4, 8).transpose(1, 2) for p in (cross.k_proj, cross.v_proj))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32)
        torch.testing.assert_close(cross(q_in, kv_in, kv_in), cross.out_proj(y).transpose(0, 1), atol=1e-5,
                                   rtol=1e-5)
        b = torch.randn(2, 6, 4, 10)  # [B, T, H, D]
        y = F.scaled_dot_product_attention(*(b.transpose(1, 2),) * 3).transpose(1, 2)
        torch.testing.assert_close(styles.dot_product_attention(b, b, b), y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("init", ["batch_first=False", "batch_first=True"])
def test_padding_and_causal_rule_each_to_its_mask(runner, tmp_path, init):
    """--causal with a padding file: key_padding_mask takes the padding, attn_mask the causal rule."""
    out = _clean(runner, "WrappedBothMasks", "--init", init, "--causal", "--mask", _padding(tmp_path), "--batch", "2",
                 "--nq", "7")
    assert any(note.startswith("attn_mask: given the causal rule [n_Q, n_K]") for note in out["notes"]), out["notes"]
    assert not any(note.startswith("attn_mask = None") for note in out["notes"]), out["notes"]


def test_fairseq_padding_beside_the_causal_rule(runner, tmp_path):
    args = ("--causal", "--mask", _padding(tmp_path), "--batch", "2", "--nq", "7")
    _time_first(_clean(runner, "FairseqStyle", *args))
    _named(runner, "FairseqStyle", "axis", "softmax.axis", *args)
    _named(runner, "FairseqStyle", "fill0", "mask.filled_with_0", *args)  # only the padding filled with 0


def test_fairseq_padding_branch_runs_under_causal_alone(runner):
    """--causal alone: attn_mask takes the rule, and key_padding_mask keys trace pads (the reference pads them too),
    so that a mistake in the padding branch shows."""
    out = _clean(runner, "FairseqStyle", "--causal")
    assert any(note.startswith("key_padding_mask: keys ") and "padded by trace" in note for note in out["notes"])
    _named(runner, "FairseqStyle", "fill0", "mask.filled_with_0", "--causal")
