"""`attnscope trace --position-bias` given a relative key table [n_Q, n_K, d_head] (round 28's HF SpeechT5Attention,
whose `position_bias` is Shaw et al.'s relative keys: `q_i · P[i, j]` added to score (i, j)). Before, trace refused
it in one line ("the bias must broadcast"); now the reference computes the same term from its own queries, so the
correct code passes, a mistake beside it is named by experiment, the table read transposed (P[j, i]) is t5.transposed,
and a table of neither shape is refused in one line that says both. Styles in tests/trace_styles_round28_shawbias.py,
each checked first against a float64 formula written out here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_command import trace, user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round28_shawbias.py")
styles = user_module(STYLES)
N = 6


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Key tables [N, N, d_head] for d_head 16 (SpeechT5's) and 8, and a [2·4 + 1, 8] distance table."""
    folder = tmp_path_factory.mktemp("shaw")
    g = torch.Generator().manual_seed(5)
    paths = {}
    for name, shape in (("T16", (N, N, 16)), ("T8", (N, N, 8)), ("D9", (9, 8))):
        paths[name] = str(folder / f"{name}.npy")
        np.save(paths[name], torch.randn(*shape, generator=g).numpy())
    return paths


def _shaw(q, k, v, table):
    """softmax((q_i · k_j + q_i · P[i, j]) / √d) v, index by index, float64: q, k, v [.., n, d]."""
    n, d = q.shape[-2], q.shape[-1]
    scores = torch.empty(*q.shape[:-2], n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            scores[..., i, j] = ((q[..., i, :] * (k[..., j, :] + table[i, j])).sum(-1)) / math.sqrt(d)
    return scores.softmax(-1) @ v


def _heads(t, h):
    b, n, c = t.shape
    return t.view(b, n, h, c // h).transpose(1, 2)


def test_the_styles_compute_shaws_formula():
    torch.manual_seed(0)
    x = torch.randn(2, N, 64, dtype=torch.float64)
    table = torch.randn(N, N, 16, dtype=torch.float64)
    m = styles.SpeechT5Attention().double()
    q, k, v = (_heads(f(x), 4) for f in (m.q_proj, m.k_proj, m.v_proj))
    y = _shaw(q, k, v, table).transpose(1, 2).reshape(2, N, 64)
    torch.testing.assert_close(m(x, position_bias=table)[0], m.out_proj(y))

    x, table = x[..., :32], table[..., :8]
    s = styles.ShawRelKeys().double()
    q, k, v = (_heads(t, 4) for t in s.qkv(x).chunk(3, -1))
    torch.testing.assert_close(s(x, table), s.out(_shaw(q, k, v, table).transpose(1, 2).reshape(2, N, 32)))
    q, k, v = torch.randn(3, 2, N, 8, dtype=torch.float64).unbind(0)
    torch.testing.assert_close(styles.shaw_attention(q, k, v, table), _shaw(q, k, v, table))


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x, table = torch.randn(2, N, 64), torch.randn(N, N, 16)
    good = styles.SpeechT5Attention()
    for bug in ("scale_twice", "kv_swapped", "merge_no_transpose", "relpos_transposed"):
        bad = styles.SpeechT5Attention(bug=bug)
        bad.load_state_dict(good.state_dict())
        assert (good(x, position_bias=table)[0] - bad(x, position_bias=table)[0]).abs().max() > 1e-3, bug


CORRECT = [("SpeechT5Attention", "embed_dim=64, num_heads=4", ("--position-bias", "T16", "--nq", "6")),
           ("ShawRelKeys", None, ("--position-bias", "T8", "--nq", "6")),
           ("shaw_attention", None, ("--position-bias", "T8", "--nq", "6", "--nk", "6"))]
PLANTS = [("SpeechT5Attention", "bug='scale_twice'", ("--position-bias", "T16", "--nq", "6"), "scale.twice"),
          ("SpeechT5Attention", "bug='kv_swapped'", ("--position-bias", "T16", "--nq", "6"), "kv.swapped"),
          ("SpeechT5Attention", "bug='merge_no_transpose'", ("--position-bias", "T16", "--nq", "6"),
           "heads.merge_without_transpose"),
          ("SpeechT5Attention", "bug='relpos_transposed'", ("--position-bias", "T16", "--nq", "6"), "t5.transposed"),
          ("ShawRelKeys", "bug='no_scale'", ("--position-bias", "T8", "--nq", "6"), "scale.none"),
          ("ShawRelKeys", "bug='table_transposed'", ("--position-bias", "T8", "--nq", "6"), "t5.transposed"),
          ("ShawRelKeys", "bug='kv_swapped'", ("--position-bias", "T8", "--nq", "6"), "kv.swapped"),
          ("shaw_attention_softmax_axis", None, ("--position-bias", "T8", "--nq", "6", "--nk", "6"), "softmax.axis")]

test_correct_styles_pass = passing_test(STYLES, CORRECT, files="tables")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="tables")


def test_the_key_table_is_said_in_a_note(runner, tables):
    result, out = trace(runner, f"{STYLES}:ShawRelKeys", "--position-bias", tables["T8"], "--nq", "6")
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert result.exit_code == 0 and any("read as a relative key table [n_Q, n_K, d_head]" in n for n in notes), notes


def test_a_table_of_neither_shape_is_refused_in_one_line(runner, tables):
    result, _ = trace(runner, f"{STYLES}:ShawGathered", "--position-bias", tables["D9"], "--nq", "6")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    assert said.count("error:") == 1 and "[9, 8]" in said, said
    assert "[.., n_Q, n_K]" in said and "[n_Q, n_K, d_head] = [6, 6, 8]" in said, said
