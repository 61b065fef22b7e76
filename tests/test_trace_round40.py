"""`attnscope trace` on what held-out round 40 found: channels-first code (VITS' 1x1 Conv1d projections) whose scores
are Q Kᵀ all the same, given key padding (trace laid the padding along the column form's axes, the code raised, and
the forms tried next read it as rows: the code got a `[2, 1, 1, 1]` mask, nothing padded); a required `attn_bias`
beside `key_padding_mask` and `attn_mask` (Graphormer's), which got None where --position-bias gave the bias; and
BROS' relative key table handed in as `bbox_pos_emb`, which trace took for a position embedding to add to an input
(it made one, the code raised, the run was refused) where --position-bias gave the table. Each style is checked
against a float64 formula, each plant shown to change its output and named by experiment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round40.py")
styles = user_module(STYLES)


@pytest.fixture()
def files(tmp_path):
    keep = np.ones((2, 9), dtype=bool)
    keep[1, 6:] = False
    np.save(tmp_path / "pad9.npy", keep)
    np.save(tmp_path / "pad6.npy", keep[:, :6])
    g = torch.Generator().manual_seed(40)
    np.save(tmp_path / "bias.npy", torch.randn(2, 4, 6, 6, generator=g).numpy())
    np.save(tmp_path / "keys.npy", torch.randn(6, 6, 8, generator=g).numpy())
    return {name: str(tmp_path / f"{name}.npy") for name in ("pad9", "pad6", "bias", "keys")}


def test_the_styles_are_their_formulas_and_the_plants_change_them(files):
    g = torch.Generator().manual_seed(4)
    keep = torch.from_numpy(np.load(files["pad9"]))
    m = styles.ConvHeads().double().eval()
    x, c = torch.randn(2, 32, 7, generator=g, dtype=torch.float64), torch.randn(2, 32, 9, generator=g,
                                                                                 dtype=torch.float64)
    mask = keep[:, None, None, :].expand(2, 1, 7, 9).double()
    with torch.no_grad():
        q, k, v = (conv(t).transpose(1, 2).unflatten(-1, (4, 8)).transpose(1, 2)
                   for conv, t in ((m.conv_q, x), (m.conv_k, c), (m.conv_v, c)))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        want = m.conv_o(heads.transpose(1, 2).reshape(2, 7, 32).transpose(1, 2))
        assert torch.allclose(m(x, c, mask), want, atol=1e-10)
        for bug in ("scale_dk", "merge"):
            assert (planted(styles.ConvHeads, m, bug, x, c, mask) - want).abs().max() > 1e-3, bug

        gb = styles.GraphBias().double().eval()
        x = torch.randn(6, 2, 32, generator=g, dtype=torch.float64)
        bias = torch.from_numpy(np.load(files["bias"])).double()
        pad = ~keep[:, :6]
        q, k, v = (p(x).transpose(0, 1).unflatten(-1, (4, 8)).transpose(1, 2)
                   for p in (gb.q_proj, gb.k_proj, gb.v_proj))
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + bias
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        want = gb.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32)).transpose(0, 1)
        assert torch.allclose(gb(x, x, x, bias, pad)[0], want, atol=1e-10)
        wrong = planted(styles.GraphBias, gb, "bias_after", x, x, x, bias, pad)[0]
        assert (wrong - want).abs().max() > 1e-3


def test_channels_first_code_with_row_scores_takes_key_padding(runner, files):
    code, out = run_case(runner, STYLES, "ConvHeads", None, ("--batch", "2", "--nq", "7", "--nk", "9", "--mask",
                                                             files["pad9"]))
    assert_passes(code, out)
    mask = next(s for s in out["steps"] if s["name"] == "mask")
    assert mask["shape"][0] == 2 and mask["shape"][-1] == 9, mask  # the keys' padding, laid as the scores are
    masked = next(row for row in out["alignment"] if row["reference"] == "masked_scores")
    assert masked["status"] in ("equal", "permuted"), masked


@pytest.mark.parametrize(("bug", "entry"), [("scale_dk", "scale.d_head"), ("merge", "heads.merge_without_transpose")])
def test_its_plants_are_named(runner, files, bug, entry):
    assert_named(*run_case(runner, STYLES, "ConvHeads", f"bug={bug!r}",
                           ("--batch", "2", "--nq", "7", "--nk", "9", "--mask", files["pad9"])), entry)


def test_a_required_attn_bias_beside_masks_takes_the_position_bias(runner, files):
    options = ("--batch", "2", "--nq", "6", "--mask", files["pad6"], "--position-bias", files["bias"])
    code, out = run_case(runner, STYLES, "GraphBias", None, options)
    assert_passes(code, out)
    bias = next(s for s in out["steps"] if s["name"] == "attn_bias")
    assert bias["shape"] == [2, 4, 6, 6], bias
    assert_named(*run_case(runner, STYLES, "GraphBias", "bug='bias_after'", options), "t5.after_softmax")


def test_without_the_bias_the_refusal_names_the_option(runner, files):
    from test_trace_command import trace

    result, out = trace(runner, f"{STYLES}:GraphBias", "--batch", "2", "--nq", "6", "--mask", files["pad6"])
    assert result.exit_code == 2 and out is None, result.stdout
    line = result.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("attnscope: error: attn_bias: your code adds a position bias"), \
        line
    assert "--position-bias FILE" in line and "Traceback" not in line, line


def test_a_relative_key_table_handed_in_as_an_embedding_takes_the_position_bias(runner, files):
    g = torch.Generator().manual_seed(6)
    m = styles.BoxKeys().double().eval()
    x = torch.randn(1, 6, 32, generator=g, dtype=torch.float64)
    table = torch.from_numpy(np.load(files["keys"])).double()  # P[i, j], [n_Q, n_K, d_head]
    with torch.no_grad():
        q, k, v = (p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.query, m.key, m.value))
        scores = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, table)) / 8 ** 0.5
        want = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 32)
        assert torch.allclose(m(x, table), want, atol=1e-10)
        assert (planted(styles.BoxKeys, m, "box_transposed", x, table) - want).abs().max() > 1e-3
    options = ("--batch", "1", "--nq", "6", "--position-bias", files["keys"])
    code, out = run_case(runner, STYLES, "BoxKeys", None, options)
    assert_passes(code, out)
    assert next(s for s in out["steps"] if s["name"] == "bbox_pos_emb")["shape"] == [6, 6, 8]
    assert_named(*run_case(runner, STYLES, "BoxKeys", "bug='box_transposed'", options), "t5.transposed")


def test_time_first_code_that_permutes_before_adding_the_position(runner):
    """The position added after the code's own permute (Mask2Former's `hidden_states.permute(1, 0, 2)`): the sum is
    still read as the input plus a position, laid back as the input, so the code is read time-first and lines up."""
    g = torch.Generator().manual_seed(7)
    m = styles.PermutedPos().double().eval()
    x, pos = (torch.randn(6, 2, 32, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        b = (x + pos).transpose(0, 1)
        q, k = (p(b).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj))
        v = m.v_proj(x.transpose(0, 1)).unflatten(-1, (4, 8)).transpose(1, 2)
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        want = m.out_proj(heads.transpose(1, 2).reshape(2, 6, 32)).transpose(0, 1)
        assert torch.allclose(m(x, pos), want, atol=1e-10)
        assert (planted(styles.PermutedPos, m, "no_scale", x, pos) - want).abs().max() > 1e-3
    code, out = run_case(runner, STYLES, "PermutedPos", None, ("--batch", "2", "--nq", "6"))
    assert_passes(code, out)
    assert any("time-first" in n for n in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "PermutedPos", "bug='no_scale'", ("--batch", "2", "--nq", "6")),
                 "scale.none")
