"""heads.split_without_permute where each head is normed before the wrong view (a qk-norm over d_head on
[n_batch, n, n_head, d_head], then `reshape(b, h, n, d)`): held-out round 13b's Persimmon plant was named only in
words, "not by experiment", the catalog's rerun skipping any role with a norm and rotating the whole head where
the code rotates a share. The view keeps each head's d_head whole, so the reference's norm viewed so is the code's.
Each style is checked in float64 (SDPA on its own weights), its plant changes the output and is named by
experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_normed_split.py")
styles = user_module(STYLES)


def _rope64(x, share):  # [B, H, T, D]: the first `share` coordinates rotated half-split at positions 0.., base 10000
    r = share
    inv = 1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    angles = torch.outer(torch.arange(x.shape[2], dtype=torch.float64), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    head, rest = x[..., :r], x[..., r:]
    turned = torch.cat([-head[..., r // 2:], head[..., :r // 2]], -1)
    return torch.cat([head * cos + turned * sin, rest], -1)


def _ln64(x, norm):
    return F.layer_norm(x, x.shape[-1:], norm.weight.double(), norm.bias.double(), norm.eps)


def _moved(module):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module.double().eval()


def _want(name, m, x):
    b, n, _ = x.shape
    if name == "PersimmonLike":
        q, k, v = m.query_key_value(x).view(b, n, 4, 3, 8).unbind(3)
        q, k = _ln64(q, m.q_layernorm), _ln64(k, m.k_layernorm)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rope64(q, 4), _rope64(k, 4)
        return m.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, 32))
    if name == "Olmo2Like":
        def rms(t, w):
            return w * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.eps)
        q = rms(m.q_proj(x).view(b, n, 4, 8), m.q_norm).transpose(1, 2)
        k = rms(m.k_proj(x).view(b, n, 4, 8), m.k_norm).transpose(1, 2)
        v = m.v_proj(x).view(b, n, 4, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(_rope64(q, 8), _rope64(k, 8), v, is_causal=True)
        return m.o_proj(y.transpose(1, 2).reshape(b, n, 32))
    q, k, v = m.qkv(x).view(b, n, 3, 4, 8).unbind(2)
    q, k, v = _ln64(q, m.q_norm).transpose(1, 2), _ln64(k, m.k_norm).transpose(1, 2), v.transpose(1, 2)
    return m.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32))


CASES = [("PersimmonLike", ("--rope", "--causal")), ("Olmo2Like", ("--rope", "--causal")), ("NormedNoRope", ())]


@pytest.mark.parametrize(("name", "flags"), CASES, ids=[c[0] for c in CASES])
def test_the_style_is_sdpa_and_the_plant_changes_it(name, flags):
    m = _moved(getattr(styles, name)())
    x = torch.randn(2, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    causal = torch.full((6, 6), float("-inf"), dtype=torch.float64).triu(1) if name == "PersimmonLike" else None
    with torch.no_grad():
        want = _want(name, m, x)
        got = m(x, causal) if causal is not None else m(x)
        assert torch.allclose(got, want, atol=1e-10)
        m.bug = "split_no_transpose"
        assert not torch.allclose(m(x, causal) if causal is not None else m(x), want, atol=1e-3)


@pytest.mark.parametrize(("name", "flags"), CASES, ids=[c[0] for c in CASES])
def test_the_split_without_the_transpose_after_a_norm_is_named_by_experiment(runner, name, flags):
    result, _ = trace(runner, f"{STYLES}:{name}", *flags)
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:{name}", *flags, "--init", "bug='split_no_transpose'")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "heads.split_without_permute" and first["evidence"].startswith("by experiment"), \
        first
