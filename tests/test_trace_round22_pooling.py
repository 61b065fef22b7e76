"""`attnscope trace` reads pooling attention whose heads' tokens are a grid (round 22's MViTv2 MultiScaleAttention:
an image in, each head's q, k and v pooled by a depthwise strided Conv2d and a LayerNorm, the queries with stride 1,
the pooled queries added back to the output). It was 'none of your tensors has scores's shape': usertrace/pooled.py
now reads a pooling of both sides of a head's grid, read from where the code lays the grid apart, a stride-1 pooling
beside one that shortens another role, and a norm of each pooled token; outterm.py reads the queries added back per
head. Styles of our own (tests/trace_styles_round22_pooling.py), each checked against F.scaled_dot_product_attention
in float64 on its own weights; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_pooling.py")
styles = user_module(STYLES)


def _made(cls, **kw) -> torch.nn.Module:
    return cls(**kw).double().eval()


def _heads_grid(t: torch.Tensor, h: int) -> torch.Tensor:
    """[B, H, W, C] -> [B·h, d, H, W]"""
    b, hh, ww, c = t.shape
    return t.view(b, hh, ww, h, c // h).permute(0, 3, 4, 1, 2).reshape(b * h, c // h, hh, ww)


def _tokens(t: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """[B·h, d, H, W] -> [B, h, H·W, d]"""
    return t.flatten(2).transpose(1, 2).reshape(b, h, -1, t.shape[1])


def _merge(o: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    b, h, n, d = o.shape
    return o.transpose(1, 2).reshape(b, *grid, h * d)


def test_the_styles_are_sdpa_over_what_they_pool():
    x = torch.randn(2, 6, 6, 32, dtype=torch.float64)
    for stride_q, residual in ((1, True), (2, False)):
        m = _made(styles.GridPooling, stride_q=stride_q, residual=residual)
        q = _tokens(F.max_pool2d(_heads_grid(m.to_q(x), 4), 3, stride_q, 1), 2, 4)
        k = m.norm_k(_tokens(m.pool_k(_heads_grid(m.to_k(x), 4)), 2, 4))
        v = m.norm_v(_tokens(m.pool_v(_heads_grid(m.to_v(x), 4)), 2, 4))
        o = F.scaled_dot_product_attention(q, k, v) + (q if residual else 0)
        side = 6 // stride_q
        assert torch.allclose(m(x), m.out(_merge(o, (side, side))), atol=1e-10)
    m = _made(styles.GridPooling)
    want = m(x)
    for bug in ("scale_twice", "softmax_axis", "merge_wrong_permute"):
        assert (_made(styles.GridPooling, bug=bug)(x) - want).abs().max() > 1e-3, bug

    y = torch.randn(2, 36, 32, dtype=torch.float64)
    m = _made(styles.AvgPooledKV, grid=(6, 6))
    q = m.q(y).view(2, 36, 4, 8).transpose(1, 2)
    k, v = (_tokens(F.avg_pool2d(_heads_grid(t.reshape(2, 6, 6, 32), 4), 2), 2, 4) for t in m.kv(y).chunk(2, -1))
    want = m.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 36, 32))
    assert torch.allclose(m(y), want, atol=1e-10)
    for bug in ("softmax_axis", "no_scale"):
        assert (_made(styles.AvgPooledKV, grid=(6, 6), bug=bug)(y) - want).abs().max() > 1e-3, bug

    m = _made(styles.FunctionalPool)
    q, k, v = (_heads_grid(t, 4) for t in m.qkv(x).chunk(3, -1))
    q = _tokens(F.conv2d(q, m.q_conv, padding=1, groups=8), 2, 4)
    k, v = (F.layer_norm(_tokens(F.conv2d(t, m.kv_conv, stride=2, padding=1, groups=8), 2, 4), (8,), m.gain,
                         m.shift) for t in (k, v))
    want = m.o(_merge(F.scaled_dot_product_attention(q, k, v), (6, 6)))
    assert torch.allclose(m(x), want, atol=1e-10)
    for bug in ("merge_wrong_permute", "scale_twice"):
        assert (_made(styles.FunctionalPool, bug=bug)(x) - want).abs().max() > 1e-3, bug


CORRECT = [("GridPooling", None), ("GridPooling", "stride_q=2"), ("GridPooling", "residual=False"),
           ("AvgPooledKV", "grid=(6, 6)"), ("FunctionalPool", None)]


@pytest.mark.parametrize(("name", "init"), CORRECT, ids=case_ids(CORRECT))
def test_pooling_of_each_heads_grid_passes(runner, name, init):
    code, out = run_case(runner, STYLES, name, init, ("--nq", "36"))
    assert_passes(code, out)
    assert out["params"]["sizes"]["n_K"] == 9


PLANTS = [("GridPooling", "bug='scale_twice'", "scale.twice"),
          ("GridPooling", "bug='softmax_axis'", "softmax.axis"),
          ("GridPooling", "bug='merge_wrong_permute'", "heads.merge_wrong_permute"),
          ("AvgPooledKV", "grid=(6, 6), bug='softmax_axis'", "softmax.axis"),
          ("AvgPooledKV", "grid=(6, 6), bug='no_scale'", "scale.none"),
          ("FunctionalPool", "bug='merge_wrong_permute'", "heads.merge_wrong_permute"),
          ("FunctionalPool", "bug='scale_twice'", "scale.twice")]


@pytest.mark.parametrize(("name", "init", "cause"), PLANTS, ids=case_ids(PLANTS))
def test_plants_after_the_pooling_are_named(runner, name, init, cause):
    assert_named(*run_case(runner, STYLES, name, init, ("--nq", "36")), cause)


def test_the_queries_added_back_are_said(runner):
    code, out = run_case(runner, STYLES, "GridPooling", None, ("--nq", "36"))
    assert code == 0 and any("adds its queries, head by head" in note for note in out["notes"]), out["notes"]
