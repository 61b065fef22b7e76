"""`attnscope trace` on what held-out rounds 40 and 42 found. A dropout after the merge of the heads, on the way
to what the module returns, left active in eval() mode (MMCV's proj_drop written `F.dropout(out, p)`, whose
`training` defaults to True; a keep-mask drawn by hand whatever the mode) passed as correct: the line-up ends at
the output, and the code's ops after it, run again from the same seed, drew the same mask. It is now named
dropout.left_on, by experiment where the dropout's input holds a step of the reference's. MMCV's `batch_first`
wrapper adds its position embedding and then turns the sum time-first for nn.MultiheadAttention: the sum is now
read through that transpose (correct code had Q_feat unseen). Keys and values swapped where only the keys read a
position (at nn.MultiheadAttention's arguments, or DETR's projections each fed its own input) are named kv.swapped.
Megatron-LM's grouped-query attention, its fused query_key_value laid out per group and drawn with `normal_`, was
refused as correct code twice over: trace drew its inputs from the stream the module's __init__ had drawn its
weights from (W = 0.02·x, so the fused output held values made twice, symmetric), and one value two outputs hold by
chance stopped the rows being read by value. Each style is checked against a float64 formula, each plant shown to
change its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round42.py")
styles = user_module(STYLES)


def test_the_styles_are_their_formulas_and_the_plants_change_them():
    g = torch.Generator().manual_seed(42)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        m = styles.MMCVAttention().double().eval()
        w, b = m.attn.in_proj_weight, m.attn.in_proj_bias
        q, k, v = (torch.nn.functional.linear(x, w[i * 32:(i + 1) * 32], b[i * 32:(i + 1) * 32])
                   .unflatten(-1, (4, 8)).transpose(1, 2) for i in range(3))
        want = x + m.attn.out_proj(sdpa(q, k, v).transpose(1, 2).reshape(2, 7, 32))
        assert torch.allclose(m(x), want, atol=1e-10)
        wrong = styles.MMCVAttention(bug="proj_drop_on").double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-3

        pos = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
        q, k, v = (torch.nn.functional.linear(t, w[i * 32:(i + 1) * 32], b[i * 32:(i + 1) * 32])
                   .unflatten(-1, (4, 8)).transpose(1, 2) for i, t in enumerate((x + pos, x + pos, x)))
        want = x + m.attn.out_proj(sdpa(q, k, v).transpose(1, 2).reshape(2, 7, 32))
        assert torch.allclose(m(x, query_pos=pos), want, atol=1e-10)
        wrong = styles.MMCVAttention(bug="kv_swapped").double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x, query_pos=pos) - want).abs().max() > 1e-3

        m = styles.DetrSelfAttention().double().eval()
        q, k = (p(x + pos).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj))
        v = m.v_proj(x).unflatten(-1, (4, 8)).transpose(1, 2)
        want = m.out_proj(sdpa(q, k, v).transpose(1, 2).reshape(2, 7, 32))
        assert torch.allclose(m(x, object_queries=pos)[0], want, atol=1e-10)
        wrong = styles.DetrSelfAttention(bug="proj_swapped").double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x, object_queries=pos)[0] - want).abs().max() > 1e-3

        torch.manual_seed(0)
        m = styles.MegatronGQA().double().eval()
        xt = torch.randn(7, 2, 64, generator=g, dtype=torch.float64)  # [s, b, h]
        fused = (xt @ m.qkv_weight.T).unflatten(-1, (2, 4, 16))  # per group: 2 query heads, a key, a value
        q = fused[..., :2, :].flatten(2, 3).permute(1, 2, 0, 3)
        k, v = (fused[..., i, :].repeat_interleave(2, dim=2).permute(1, 2, 0, 3) for i in (2, 3))
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        want = (sdpa(q, k, v, attn_mask=causal).permute(2, 0, 1, 3).reshape(7, 2, 64)) @ m.dense_weight.T
        assert torch.allclose(m(xt, ~causal), want, atol=1e-10)
        wrong = styles.MegatronGQA(bug="kv_tiled").double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(xt, ~causal) - want).abs().max() > 1e-4

        m = styles.KeepMaskAttention().double().eval()
        q, k, v = (p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = m.out_proj(sdpa(q, k, v).transpose(1, 2).reshape(2, 7, 32))
        assert torch.allclose(m(x), want, atol=1e-10)
        wrong = styles.KeepMaskAttention(bug="keep_always").double().eval()
        wrong.load_state_dict(m.state_dict())
        assert (wrong(x) - want).abs().max() > 1e-3


@pytest.mark.parametrize("target", ["MMCVAttention", "KeepMaskAttention"])
def test_a_dropout_left_on_after_the_merge_is_named(runner, target):
    options = ("--batch", "2", "--nq", "7")
    assert_passes(*run_case(runner, STYLES, target, None, options))
    bug = "proj_drop_on" if target == "MMCVAttention" else "keep_always"
    found = assert_named(*run_case(runner, STYLES, target, f"bug='{bug}'", options), "dropout.left_on")
    assert "eval() mode" in found["diagnosis"], found
    assert "training=self.training" in found["diagnosis"], found


@pytest.mark.parametrize(("target", "bug"), [("MMCVAttention", "kv_swapped"), ("DetrSelfAttention", "proj_swapped")])
def test_keys_and_values_swapped_where_only_the_keys_read_a_position(runner, target, bug):
    options = ("--batch", "2", "--nq", "7")
    code, out = run_case(runner, STYLES, target, None, options)
    assert_passes(code, out)
    assert any("position embedding no input makes" in n for n in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, target, f"bug='{bug}'", options), "kv.swapped")


def test_grouped_query_megatron_drawn_with_normal_is_read_per_group(runner):
    options = ("--causal",)
    code, out = run_case(runner, STYLES, "MegatronGQA", None, options)
    assert_passes(code, out)
    # read from the code's own q, k and v, or from its split of each group's rows (the same rows)
    assert "its rows read from your code's own q, k and v" in out["reference"] \
        or "in each of 2 groups of rows" in out["reference"], out["reference"]
    assert_named(*run_case(runner, STYLES, "MegatronGQA", "bug='kv_tiled'", options), "gqa.tiled")


def test_a_value_two_outputs_hold_by_chance_is_placed_where_it_fits():
    from attnscope.usertrace.fused import row_order
    from attnscope.usertrace.valueindex import ValueIndex, tie_placings

    g = torch.Generator().manual_seed(7)
    output = torch.randn(5, 12, generator=g)  # [tokens, rows]
    output[3, 10] = output[1, 2]  # one value made twice
    assert ValueIndex.of(output) is None
    lookup, ties = ValueIndex.of_few_ties(output)
    part = output[:, 8:12].T  # rows 8..11 read as [rows, tokens]
    source = lookup.positions(part)
    orders = [row_order(placed % 12, placed // 12) for placed in tie_placings(source, ties)]
    assert [8, 9, 10, 11] in orders
    many = output.clone()
    many[:, 0] = many[:, 1]  # a column made twice: a structure, not a chance
    assert ValueIndex.of_few_ties(many) is None
