"""A decode step (--cache N) of code whose head count only its run says: before, trace drew the cache before any
run had read the count, and stopped with the internal-error line (KeyError: 'n_head'; held-out round 13a, ChatGLM's
SelfAttention). Now a run without the cache reads the count, and the decode step runs with it: each style is SDPA
over the cache joined (float64), passes, and its cache-order plant is named by experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_heads_cache.py")
styles = user_module(STYLES)


def _lin(layer, x):
    return F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())


def _decode64(q, k, v):  # [B, H, T, D] queries after the cached positions of k, v [B, H, S, D]: lower-right
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _heads(t, h):  # [B, T, h·d] -> [B, h, T, d]
    return t.view(*t.shape[:2], h, -1).transpose(1, 2)


def _moved(module):
    torch.manual_seed(2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module.eval()


def test_the_styles_are_sdpa_over_the_joined_cache_and_the_plant_changes_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
    ck, cv = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64), torch.randn(2, 4, 3, 8, generator=g,
                                                                                  dtype=torch.float64)
    with torch.no_grad():
        m = _moved(styles.DictConfigured().double())
        q, k, v = _lin(m.qkv, x).split(32, -1)
        k, v = torch.cat([ck, _heads(k, 4)], 2), torch.cat([cv, _heads(v, 4)], 2)
        want = _lin(m.out, _decode64(_heads(q, 4), k, v).transpose(1, 2).flatten(2))
        assert torch.allclose(m(x, (ck, cv)), want, atol=1e-10)
        m.bug = "new_first"
        assert not torch.allclose(m(x, (ck, cv)), want, atol=1e-3)

        m = _moved(styles.LiteralHeads().double())
        q, k, v = (_heads(_lin(w, x), 4) for w in (m.wq, m.wk, m.wv))
        want = _lin(m.wo, _decode64(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2)).transpose(1, 2).flatten(2))
        assert torch.allclose(m(x, {"k": ck, "v": cv}), want, atol=1e-10)
        m.bug = "new_first"
        assert not torch.allclose(m(x, {"k": ck, "v": cv}), want, atol=1e-3)

        m = _moved(styles.GlmLike().double())  # time-first; 2 groups, each serving 2 query heads in turn
        gk, gv = ck[:, :2], cv[:, :2]
        q, k, v = _lin(m.query_key_value, x).split([32, 16, 16], -1)
        k, v = torch.cat([gk, _heads(k, 2)], 2), torch.cat([gv, _heads(v, 2)], 2)
        y = _decode64(_heads(q, 4), k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
        want = _lin(m.dense, y.transpose(1, 2).flatten(2))
        held = (gk.permute(2, 0, 1, 3), gv.permute(2, 0, 1, 3))  # [S, B, G, D]
        assert torch.allclose(m(x.transpose(0, 1), held).transpose(0, 1), want, atol=1e-10)
        m.bug = "new_first"
        assert not torch.allclose(m(x.transpose(0, 1), held).transpose(0, 1), want, atol=1e-3)


@pytest.mark.parametrize("name", ["GlmLike", "DictConfigured", "LiteralHeads"])
def test_the_head_count_is_read_before_the_cache_is_drawn(runner, name):
    args = (f"{STYLES}:{name}", "--causal", "--cache", "3")
    result, out = trace(runner, *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_head"] == 4 and out["params"]["sizes"]["n_cache"] == 3
    assert any(n.startswith("n_head = 4, read from a run of your code without the cache") for n in out["notes"])
    planted, out = trace(runner, *args, "--init", "bug='new_first'")
    assert planted.exit_code == 1, planted.stdout + planted.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "cache.order" and first["evidence"].startswith("by experiment"), first


def test_a_count_no_run_says_is_refused_in_one_line_naming_heads(runner):
    """Code that cannot run without its cache says its head count in no run trace can make: one line asking for
    --heads, exit 2; with --heads the decode step runs and passes (the style is SDPA over the joined cache,
    float64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
    ck, cv = (torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        m = _moved(styles.NeedsItsCache().double())
        q, k, v = (_heads(_lin(w, x), 4) for w in (m.wq, m.wk, m.wv))
        want = _lin(m.wo, _decode64(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2)).transpose(1, 2).flatten(2))
        assert torch.allclose(m(x, (ck, cv)), want, atol=1e-10)
    result, _ = trace(runner, f"{STYLES}:NeedsItsCache", "--causal", "--cache", "3")
    assert result.exit_code == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert "cannot tell how many heads NeedsItsCache has" in result.stderr and "pass --heads" in lines[-1], lines
    told, _ = trace(runner, f"{STYLES}:NeedsItsCache", "--causal", "--cache", "3", "--heads", "4")
    assert told.exit_code == 0, told.stdout + told.stderr
