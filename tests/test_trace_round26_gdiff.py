"""`attnscope trace` reads a pointwise Conv1d (kernel 1, stride 1, no padding, one group) over [B, C, T] as the
projection it is, the column form's `W @ x` (usertrace/pointwise.py): round 26's OpenAI guided-diffusion
AttentionBlock (GroupNorm, a fused 1x1 `qkv` conv split per head or q | k | v, ch**-0.25 on q and on k, a 1x1
`proj_out`, the residual) was refused under `--layout col` ("its Linear layers are none") and, without it, raised on
rows [B, T, 3C] it was handed because its width was read off the fused kernel, so the column form was never tried.
Styles of our own (tests/trace_styles_round26_gdiff.py), each checked against F.scaled_dot_product_attention in
float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round26_gdiff.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, heads):
    """[B, C, T] each, channels head-major: F.scaled_dot_product_attention per head, handed back [B, C, T]."""
    B, C, T = q.shape
    q, k, v = (t.reshape(B, heads, C // heads, T).transpose(-2, -1) for t in (q, k, v))  # [B, H, T, d]
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(-2, -1).reshape(B, C, T)


def _conv(x, weight, bias):
    return torch.einsum("oc,bct->bot", weight[..., 0], x) + bias[:, None]


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 7, dtype=torch.float64)
    for order in ("legacy", "new"):
        m = styles.DiffusionBlock(order=order).double()
        qkv = _conv(m.norm(x), m.qkv.weight, m.qkv.bias)  # [B, 3C, T]
        if order == "legacy":  # per head [H, 3, ch]
            q, k, v = (qkv.reshape(2, 4, 3, 8, 7)[:, :, i].reshape(2, 32, 7) for i in range(3))
        else:
            q, k, v = qkv.chunk(3, dim=1)
        want = x + _conv(_sdpa(q, k, v, 4), m.proj_out.weight, m.proj_out.bias)
        torch.testing.assert_close(m(x), want)
    m = styles.ConvHeads().double()
    q, k, v = (_conv(x, layer.weight, layer.bias) for layer in (m.to_q, m.to_k, m.to_v))
    torch.testing.assert_close(m(x), _conv(_sdpa(q, k, v, 4), m.to_out.weight, m.to_out.bias))
    m = styles.FunctionalConv().double()
    q, k, v = _conv(x, m.w_qkv, m.b_qkv).chunk(3, dim=1)
    torch.testing.assert_close(m(x), _conv(_sdpa(q, k, v, 2), m.w_out, m.b_out))


CORRECT = [("DiffusionBlock", None, ()), ("DiffusionBlock", "order='new'", ("--layout", "col")),
           ("ConvHeads", None, ()), ("FunctionalConv", None, ("--layout", "col"))]
PLANTS = [("DiffusionBlock", "bug='k_share'", (), "scale.half"),
          ("DiffusionBlock", "bug='softmax_queries'", ("--layout", "col"), "softmax.axis"),
          ("DiffusionBlock", "order='new', bug='no_scale'", (), "scale.none"),
          ("DiffusionBlock", "order='new', bug='kv_swapped'", ("--layout", "col"), "kv.swapped"),
          ("ConvHeads", "bug='no_scale'", ("--layout", "col"), "scale.none"),
          ("FunctionalConv", "bug='softmax_queries'", (), "softmax.axis")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 7)
    for name, init, _, _ in PLANTS:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows' own literals
        good = getattr(styles, name)(**{k: v for k, v in kwargs.items() if k != "bug"})
        assert (good(x) - getattr(styles, name)(**kwargs)(x)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_column_form_and_the_norm_are_read_from_the_run(runner):
    code, out = run_case(runner, STYLES, "DiffusionBlock")
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and out["params"]["layout"] == "col" and out["params"]["sizes"]["d_feat"] == 32, notes
    assert any("runs on columns [n_batch, d_feat, n]" in n for n in notes), notes
    assert any("normalizes its input before its projections" in n for n in notes), notes
    assert "split per head" in out["reference"]
    ops = [step["op"] for step in out["steps"]]
    assert any(op.startswith("line ") and "qkv @ " in op for op in ops), ops


def test_only_a_pointwise_convolution_is_a_projection():
    from attnscope.usertrace import pointwise

    x, w = torch.randn(2, 8, 5), torch.randn(4, 8, 1)
    assert pointwise.conv_args([x, w, None, 1, 0, 1, 1], {}) is not None
    assert pointwise.conv_args([x, w], {"padding": "valid"}) is not None
    assert pointwise.conv_args([x, w, None, 2], {}) is None  # a stride skips tokens
    assert pointwise.conv_args([x, w, None, 1, 1], {}) is None  # padding adds tokens
    assert pointwise.conv_args([x, torch.randn(4, 8, 3)], {}) is None  # a wider kernel mixes neighbours
    assert pointwise.conv_args([x, torch.randn(8, 1, 1)], {"groups": 8}) is None  # depthwise
    assert pointwise.is_pointwise(torch.nn.Conv1d(8, 4, 1)) and not pointwise.is_pointwise(torch.nn.Conv1d(8, 4, 3))
