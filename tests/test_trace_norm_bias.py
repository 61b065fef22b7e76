"""`attnscope trace` on two styles held out of the trace work (tests/trace_styles_norm_bias.py): timm's Attention
with qk_norm=True, whose own LayerNorms of q and k trace reads as the code's convention by experiment (it was a
false alarm: "describe it with --qk-norm head"), and GPT-2's Conv1D written out, a fused [d, 3d] nn.Parameter used
as x @ W with its bias added on the next line (the bias was missed: a false alarm at Q_feat). Each correct version
exits 0, its output checked apart from attnscope against F.scaled_dot_product_attention holding its weights; each
planted bug exits 1 with the catalog entry whose rerun reproduces it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_norm_bias.py")
INIT = {"TimmAttention": "dim=48, num_heads=4", "Conv1DAttention": "n_embd=48, n_head=4"}
ARGS = {"TimmAttention": (), "Conv1DAttention": ("--causal",)}


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    B, T, _ = t.shape
    return t.view(B, T, n, -1).transpose(1, 2)  # [B, T, n·d] -> [B, n, T, d]


def test_timm_qk_norm_is_read_as_the_codes_own(runner):
    result, out = trace(runner, f"{STYLES}:TimmAttention", "--init", INIT["TimmAttention"])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["params"]["qk_norm_read"] == "head"
    assert any("qk-norm over d_head" in note for note in out["notes"])
    module = user_module(STYLES).TimmAttention(dim=48, num_heads=4)
    with torch.no_grad():
        for p in module.parameters():  # norm weights off 1, biases off 0
            p.add_(torch.randn_like(p) * 0.3)
        x = torch.randn(2, 7, 48)
        q, k, v = module.qkv(x).split(48, dim=-1)
        q, k = module.q_norm(_heads(q, 4)), module.k_norm(_heads(k, 4))
        expected = module.proj(F.scaled_dot_product_attention(q, k, _heads(v, 4)).transpose(1, 2).reshape(2, 7, 48))
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)


def test_conv1d_written_out_takes_its_added_bias(runner):
    result, out = trace(runner, f"{STYLES}:Conv1DAttention", "--init", INIT["Conv1DAttention"], "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None
    module = user_module(STYLES).Conv1DAttention(n_embd=48, n_head=4)
    with torch.no_grad():
        x = torch.randn(2, 7, 48)
        q, k, v = (x @ module.w_attn + module.b_attn).split(48, dim=-1)
        o = F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4), is_causal=True)
        torch.testing.assert_close(module(x), o.transpose(1, 2).reshape(2, 7, 48) @ module.w_proj + module.b_proj,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("style", "bug", "step", "entry"), [
    ("TimmAttention", "scale_dmodel", "scores", "scale.d_model"),
    ("TimmAttention", "axis", "attention", "softmax.axis"),
    ("TimmAttention", "merge", "x_rsh2", "heads.merge_without_transpose"),
    ("Conv1DAttention", "kv_swap", "scores", "kv.swapped"),
    ("Conv1DAttention", "mask_after", "masked_scores", "mask.after_softmax"),
])
def test_planted_bugs_are_named_by_experiment(runner, style, bug, step, entry):
    result, out = trace(runner, f"{STYLES}:{style}", "--init", f"{INIT[style]}, bug={bug!r}", *ARGS[style])
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == (step, entry), first
