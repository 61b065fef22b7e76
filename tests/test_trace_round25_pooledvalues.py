"""`attnscope trace` names the values pooled from the keys' projection where the code holds its pooled tensors in a
spatial layout of heads (round 22's MViTv2 `values_from_keys`: V pooled from `qkv.reshape(3, B·heads, H, W, d)[1]`,
held as [B·heads, H, W, d]). The pooled reading (usertrace/pooled.py) found the values' pooling only where the
values' own projection reached it, so the reference attended over n_Q keys the code never has ('none of your
tensors has scores's shape ... not by experiment'). Now the values' operand pooled from a tensor that holds another
role's projection is read too, and what the code pools for each role, laid out as the reference's `_feat`, is
compared with it (a layout of heads and grid no single view gives): V_feat diverges, and kv.values_from_keys names
it by experiment. Styles of our own (tests/trace_styles_round25_pooledvalues.py), each checked against a float64
formula with torch's own pooling and F.scaled_dot_product_attention."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_pooledvalues.py")
styles = user_module(STYLES)
GRID = ("--nq", "16")


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H, W, C] -> [B, heads, H·W, d]."""
    B, H, W, C = t.shape
    return t.reshape(B, H * W, heads, C // heads).transpose(1, 2)


def _grid_pool(t: torch.Tensor, H: int, W: int, pool) -> torch.Tensor:
    """[B, heads, H·W, d] pooled on each head's H × W grid by `pool` ([n, d, H, W] -> [n, d, H', W'])."""
    B, heads, _, d = t.shape
    grid = t.transpose(-1, -2).reshape(B * heads, d, H, W)
    return pool(grid).reshape(B, heads, d, -1).transpose(-1, -2)


def test_the_styles_are_attention_over_pooled_keys_and_values():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 4, 32, dtype=torch.float64)
    m = styles.MViTv2Attention().double()
    q, k, v = (_heads(t, 4) for t in m.qkv(x).chunk(3, -1))
    k, v = (F.layer_norm(_grid_pool(t, 4, 4, conv), (8,), norm.weight, norm.bias)
            for t, conv, norm in ((k, m.pool_k, m.norm_k), (v, m.pool_v, m.norm_v)))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, 4, 32)
    torch.testing.assert_close(m(x), m.proj(out))
    m = styles.AvgPooledAttention().double()
    q, k, v = (_heads(t, 4) for t in F.linear(x, m.w_qkv, m.b_qkv).chunk(3, -1))
    k, v = (_grid_pool(t, 4, 4, lambda g: F.adaptive_avg_pool2d(g, 2)) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, 4, 32)
    torch.testing.assert_close(m(x), F.linear(out, m.w_out, m.b_out))
    x = torch.randn(2, 4, 4, 24, dtype=torch.float64)
    m = styles.MViTv1Attention().double()
    q, k, v = (_heads(t, 3) for t in m.qkv(x).chunk(3, -1))
    k, v = (_grid_pool(t, 4, 4, lambda g: F.max_pool2d(g, 3, 2, 1)) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, 4, 24)
    torch.testing.assert_close(m(x), m.proj(out))


PLANTS = [("MViTv2Attention", "bug='values_from_keys'", GRID, "kv.values_from_keys"),
          ("MViTv1Attention", "bug='values_from_keys'", GRID, "kv.values_from_keys"),
          ("AvgPooledAttention", "bug='values_from_keys'", GRID, "kv.values_from_keys")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    for name, init, _, _ in PLANTS:
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=init.split("'")[1])
        x = torch.randn(2, 4, 4, 24 if name == "MViTv1Attention" else 32)
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


CORRECT = [("MViTv2Attention", None, GRID), ("MViTv1Attention", None, GRID), ("AvgPooledAttention", None, GRID)]
test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)
