"""`attnscope trace` on attention that adds a relative-position term of its own to its scores (round 14a's ESPnet),
in styles of its own (tests/trace_styles_r14_relpos.py): heads split without the transpose, the term then made from
the mis-split queries too, is `heads.split_without_permute` by experiment (the term taken as the sum less the code's
own q · kᵀ); the masked scores filled with 0 in code that zeroes the masked weights again after the softmax is
`mask.filled_with_0` by experiment. Each correct style is checked against SDPA in float64 (the term its float mask);
each plant is shown to change the output."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r14_relpos.py")
styles = user_module(STYLES)
KEEP = np.ones((2, 7), dtype=bool)
KEEP[0, 5:], KEEP[1, 3:] = False, False


def _heads(t, h=4):
    return t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2)


def _relative(T, table_row):
    """[T, T] indices into a table whose row r holds relative position (query - key) T-1-r."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return table_row(T - 1 - (i - j))


def _sinusoids(T, d):
    pos = torch.arange(T - 1, -T, -1, dtype=torch.float64)[:, None]
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * -(math.log(10000.0) / d))
    table = torch.zeros(2 * T - 1, d, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return table


def _want(m, x, keep, table=None):
    """The style's output from its weights in float64: SDPA with the relative term as its float mask (`table`: the
    relative embedding [2T-1, d] the module is handed)."""
    b, T, d = x.shape
    if isinstance(m, styles.ShawRel):
        q, k, v = _heads(m.query(x)), _heads(m.key(x)), _heads(m.value(x))
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        rel = m.rel_k.weight[(j - i).clamp(-m.max_rel, m.max_rel) + m.max_rel]  # [T, T, d]
        term = (q.unsqueeze(-2) * rel).sum(-1) / math.sqrt(m.d)
        out_proj = m.out
    else:
        q, k, v = _heads(m.linear_q(x)), _heads(m.linear_k(x)), _heads(m.linear_v(x))
        if table is not None:
            pass
        elif isinstance(m, styles.EspnetRel):
            table = _sinusoids(T, d)
        else:
            table = m.rel_table[m.max_len - T: m.max_len + T - 1]
        p = m.linear_pos(table).view(-1, 4, m.d_k).transpose(0, 1)  # [h, 2T-1, d_k]
        index = _relative(T, lambda r: r)  # [T, T]
        rows = p[:, index]  # [h, T, T, d_k]
        u, w = m.pos_bias_u[None, :, None, :], m.pos_bias_v[None, :, None, :]
        term = ((u * k.new_ones(1)) @ k.transpose(-1, -2) + ((q + w).unsqueeze(-2) * rows).sum(-1)) / math.sqrt(m.d_k)
        out_proj = m.linear_out
    bias = term if keep is None else term.masked_fill(~keep[:, None, None, :], -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return out_proj(out.transpose(1, 2).reshape(b, T, d))


CASES = [(name, bug, cause) for name in ("EspnetRel", "NemoRel", "ShawRel")
         for bug, cause in (("split_no_transpose", "heads.split_without_permute"),
                            ("mask_fill_0", "mask.filled_with_0"))]


@pytest.mark.parametrize(("name", "bug", "cause"), CASES)
def test_the_styles_are_sdpa_and_the_plants_change_them(name, bug, cause):
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    keep = torch.from_numpy(KEEP)
    m = getattr(styles, name)().double().eval()
    with torch.no_grad():
        assert (m(x) - _want(m, x, None)).abs().max() < 1e-10
        want = _want(m, x, keep)
        assert (m(x, keep) - want).abs().max() < 1e-10
        wrong = getattr(styles, name)(bug=bug).double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x, keep) - want).abs().max() > 1e-2


@pytest.fixture(scope="module")
def pad(tmp_path_factory):
    path = tmp_path_factory.mktemp("r14rel") / "pad.npy"
    np.save(path, KEEP)
    return str(path)


@pytest.mark.parametrize(("name", "bug", "cause"), CASES)
def test_a_mistake_beside_a_relative_term_is_named_by_experiment(runner, pad, name, bug, cause):
    options = ("--mask", pad, "--batch", "2", "--nq", "7")
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("your code adds a term of its own to its scores") for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def test_a_relative_position_embedding_trace_makes_is_shaped_as_one(runner):
    """ESPnet's class traced by itself (issue 41's round 14a): `pos_emb` gets a relative embedding's shape
    [1, 2n-1, d] where the input's own raised in the code, and the keys as many as the queries; it passes, and a plant
    beside the term is named by experiment."""
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    table = torch.randn(2 * 7 - 1, 32, dtype=torch.float64)
    m = styles.EspnetRelRaw().double().eval()
    with torch.no_grad():
        assert (m(x, x, x, table[None]) - _want(m, x, None, table)).abs().max() < 1e-10
    result, out = trace(runner, f"{STYLES}:EspnetRelRaw")
    assert result.exit_code == 0, result.stdout + result.stderr
    sizes = out["params"]["sizes"]
    assert sizes["n_Q"] == sizes["n_K"], sizes
    assert any(n.startswith("your code failed with keys of another length than the queries") for n in out["notes"])
    result, out = trace(runner, f"{STYLES}:EspnetRelRaw", "--init", "bug='split_no_transpose'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "heads.split_without_permute", out["first_divergence"]


def test_a_position_embedding_no_made_up_shape_fits_is_asked_for_in_one_line(runner):
    result, _ = trace(runner, f"{STYLES}:SpanRelRaw")
    assert result.exit_code == 2, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("attnscope: error: pos_emb: your code raised"), error
    assert "your code raised RuntimeError" not in result.stderr
