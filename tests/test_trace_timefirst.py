"""`attnscope trace` on attention in Keras' EinsumDense style (tests/trace_styles_timefirst.py): 3-D kernels
[d, n_head, d_head] used as torch.einsum("btd,dhk->bthk", x, W) and the output's [n_head, d_head, d] as
"bthk,hkd->btd". trace reads the width and the head count from the kernels, records each einsum as a projection,
and names planted bugs by experiment.

The correct style exits 0 with every step lined up; apart from attnscope, its output equals
F.scaled_dot_product_attention holding its kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED, _moved
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_timefirst.py")


def test_keras_kernels_correct(runner):
    result, out = trace(runner, f"{STYLES}:KerasSelfAttention", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None, out["first_divergence"]
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]
    assert out["params"]["sizes"]["d_feat"] == 24 and out["params"]["sizes"]["n_head"] == 3
    assert "q=q_kernel, k=k_kernel, v=v_kernel, o=o_kernel" in out["reference"]
    assert "d_head=10" in out["reference"]


@pytest.mark.parametrize(("bug", "entry"), [("no_scale", "scale.none"), ("kv_swap", "kv.swapped"),
                                            ("axis", "softmax.axis")])
def test_keras_kernels_bugs_named(runner, bug, entry):
    result, out = trace(runner, f"{STYLES}:KerasSelfAttention", "--init", f"bug={bug!r}", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]


def test_keras_kernels_against_sdpa():
    """The style itself, apart from attnscope: F.scaled_dot_product_attention holding its kernels, heads outer."""
    module = _moved(user_module(STYLES).KerasSelfAttention())
    x = torch.randn(2, 7, 24)
    keep = torch.ones(7, 7, dtype=torch.bool).tril()
    with torch.no_grad():
        q, k, v = ((x @ w.reshape(24, -1)).reshape(2, 7, 3, 10).transpose(1, 2)
                   for w in (module.q_kernel, module.k_kernel, module.v_kernel))  # [B, H, T, key_dim]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(2, 7, 30)
        expected = y @ module.o_kernel.reshape(30, 24)
        torch.testing.assert_close(module(x, keep[None].expand(2, 7, 7)), expected, atol=1e-5, rtol=1e-5)
