"""`attnscope trace` on attention whose queries' and keys' projections read the input plus a position embedding and
the values' the input alone (DETR, SAM's two-way transformer): the reference reads the sums the projections read (a
note, exit 0), the plants behind them are named by experiment; a padding --mask before scores of [n_batch·n_head,
n_Q, n_K] (DETR's bmm) is judged against the reference's [n_batch, n_head, n_Q, n_K]; a --mask file says n_batch.
Styles: tests/trace_styles_r12_detr.py, checked against transformers' eager DetrSelfAttention / DetrCrossAttention
(weights moved off init) or SDPA in float64; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r12_detr.py")
styles = user_module(STYLES)
NOTE = "the reference's projections read the same sums"


def _hf(kind):
    from transformers import DetrConfig
    from transformers.models.detr import modeling_detr

    config = DetrConfig(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4)
    config._attn_implementation = "eager"
    cls = modeling_detr.DetrSelfAttention if kind == "self" else modeling_detr.DetrCrossAttention
    return cls(config, 32, 4).double().eval()


def _holding(hf, m, out="o_proj"):
    hf.load_state_dict({f"{role}_proj.{p}": getattr(m, f"{role}_proj" if role != "o" else out).state_dict()[p]
                        for role in "qkvo" for p in ("weight", "bias")})
    return hf


def _heads(t, h=4):
    b, n, d = t.shape
    return t.view(b, n, h, d // h).transpose(1, 2)


def _sdpa(q, k, v, mask=None):
    y = F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), attn_mask=mask)
    return y.transpose(1, 2).reshape(q.shape)


def test_the_detr_styles_are_transformers_eager_detr_attention():
    torch.manual_seed(0)
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        m = styles.DetrQuerySelf().double().eval()
        pos = m.query_position_embeddings.weight[:5].unsqueeze(0).expand(2, -1, -1)
        want, _ = _holding(_hf("self"), m)(x, position_embeddings=pos)
        assert torch.allclose(m(x), want, atol=1e-10)
        m = styles.DetrQueryCross().double().eval()
        pos = m.query_position_embeddings.weight[:5].unsqueeze(0).expand(2, -1, -1)
        spatial = styles.sine_positions(9, 32, torch.float64).expand(2, -1, -1)
        want, _ = _holding(_hf("cross"), m)(x, memory, position_embeddings=pos, encoder_position_embeddings=spatial)
        assert torch.allclose(m(x, memory), want, atol=1e-10)
        m = styles.DetrBmm().double().eval()  # transformers 4.4x's form, its 4-D additive mask
        pad = torch.zeros(2, 1, 5, 5, dtype=torch.float64)
        pad[0, ..., 3:] = float("-inf")
        want, _ = _holding(_hf("self"), m, "out_proj")(x, attention_mask=pad, position_embeddings=pos)
        assert torch.allclose(m(x, pad, object_queries=pos), want, atol=1e-10)


def test_the_other_styles_are_sdpa_with_the_position_on_queries_and_keys():
    torch.manual_seed(1)
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    pe, key_pe = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        m = styles.TwoWayCross().double()
        a = m.cross_attn_token_to_image
        want = a.out_proj(_sdpa(a.q_proj(x + pe), a.k_proj(memory + key_pe), a.v_proj(memory)))
        assert torch.allclose(m(x, memory, pe, key_pe), want, atol=1e-10)
        m = styles.PosParamAttention().double()
        want = _sdpa((x + pe) @ m.W_q, (x + pe) @ m.W_k, x @ m.W_v) @ m.W_o
        assert torch.allclose(m(x, pe), want, atol=1e-10)
        m = styles.DetrEncoderSelf().double().eval()  # time-first [n, n_batch, d]
        a = m.self_attn
        w_q, w_k, w_v = a.in_proj_weight.chunk(3)
        b_q, b_k, b_v = a.in_proj_bias.chunk(3)
        padded = torch.zeros(2, 5, dtype=torch.bool)
        padded[1, 3:] = True
        keep = (~padded)[:, None, None, :]
        want = a.out_proj(_sdpa(F.linear(x + pe, w_q, b_q), F.linear(x + pe, w_k, b_k), F.linear(x, w_v, b_v), keep))
        got = m(x.transpose(0, 1), src_key_padding_mask=padded, pos=pe.transpose(0, 1)).transpose(0, 1)
        assert torch.allclose(got, want, atol=1e-10)


PLANTS = [("DetrQuerySelf", "values_from_keys", "kv.values_from_keys", ()),
          ("DetrQueryCross", "values_from_keys", "kv.values_from_keys", ("--nk", "9")),
          ("PosParamAttention", "values_from_keys", "kv.values_from_keys", ()),
          ("DetrBmm", "scale_twice", "scale.twice", ()),
          ("TwoWayCross", "scale_twice", "scale.twice", ("--nk", "9")),
          ("PosParamAttention", "scale_twice", "scale.twice", ()),
          ("DetrQuerySelf", "dropout_left_on", "dropout.left_on", ()),
          ("TwoWayCross", "softmax_axis", "softmax.axis", ("--nk", "9"))]


def _call(m, x, memory, pe, key_pe):
    if isinstance(m, styles.TwoWayCross):
        return m(x, memory, pe, key_pe)
    if isinstance(m, styles.DetrQueryCross):
        return m(x, memory)
    return m(x, pe) if isinstance(m, styles.PosParamAttention) else m(x)


@pytest.mark.parametrize(("name", "bug"), [(n, b) for n, b, _, _ in PLANTS] + [("DetrBmm", "mask_multiplied")])
def test_each_plant_changes_the_output(name, bug):
    torch.manual_seed(2)
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    pe, key_pe = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    cls = getattr(styles, name)
    extra = {"dropout": 0.1} if bug == "dropout_left_on" else {}
    m, wrong = cls(**extra).double().eval(), cls(bug=bug, **extra).double().eval()
    wrong.load_state_dict(m.state_dict())
    with torch.no_grad():
        if bug == "mask_multiplied":
            pad = torch.zeros(2, 1, 5, 5, dtype=torch.float64)
            pad[0, ..., 3:] = float("-inf")
            assert not torch.allclose(m(x, pad, pe), wrong(x, pad, pe), atol=1e-3)
        else:
            assert not torch.allclose(_call(m, x, memory, pe, key_pe), _call(wrong, x, memory, pe, key_pe), atol=1e-3)


@pytest.mark.parametrize(("name", "args", "said"), [
    ("DetrQuerySelf", (), "the queries' and keys' + position_embeddings (line"),
    ("DetrQueryCross", ("--nk", "9"), "the keys' + encoder_position_embeddings (line"),
    ("DetrBmm", (), "the queries' and keys' + object_queries (line"),
    ("TwoWayCross", ("--nk", "9"), "the queries' + query_pe (line"),
    ("PosParamAttention", (), "the queries' and keys' + query_pos (line"),
    ("DetrEncoderSelf", (), "the queries' and keys' + pos (line")])
def test_correct_forms_pass_with_the_position_read_as_the_inputs(runner, name, args, said):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    note = next(n for n in out["notes"] if NOTE in n)
    assert said in note and "the values' your input alone" in note, note


@pytest.mark.parametrize(("name", "bug", "entry", "args"), PLANTS)
def test_the_plants_are_named_by_experiment(runner, name, bug, entry, args):
    init = f"bug='{bug}'" + (", dropout=0.1" if bug == "dropout_left_on" else "")
    result, out = trace(runner, f"{STYLES}:{name}", "--init", init, *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]
    assert out["first_divergence"]["evidence"].startswith("by experiment")


@pytest.fixture
def pad(tmp_path):
    """Key padding [n_batch, 1, 1, n_K], boolean (True = may attend): two sequences padded."""
    allowed = np.ones((3, 1, 1, 7), dtype=bool)
    allowed[0, ..., 5:] = False
    allowed[2, ..., 6:] = False
    path = tmp_path / "pad.npy"
    np.save(path, allowed)
    return str(path)


def test_padding_before_scores_of_heads_folded_into_the_batch(runner, pad):
    """DETR's bmm scores are [n_batch·n_head, n_Q, n_K] and it adds its 4-D mask on a view: the file is judged
    against the reference's [n_batch, n_head, n_Q, n_K]; without --batch the file says n_batch (a note)."""
    result, out = trace(runner, f"{STYLES}:DetrBmm", "--mask", pad)
    assert result.exit_code == 0, result.stdout + result.stderr
    sizes = out["params"]["sizes"]
    assert sizes["n_batch"] == 3 and sizes["n_Q"] == 7, sizes
    assert any(n.startswith("n_batch = 3, the first axis of --mask") for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:DetrBmm", "--mask", pad, "--batch", "3", "--nq", "7", "--init",
                        "bug='mask_multiplied'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "mask.multiplied", out["first_divergence"]


def test_key_padding_to_a_time_first_nn_multihead_attention_with_the_position(runner, pad):
    result, out = trace(runner, f"{STYLES}:DetrEncoderSelf", "--mask", pad)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(NOTE in n and "+ pos (line" in n for n in out["notes"]), out["notes"]
    assert any("time-first" in n for n in out["notes"]), out["notes"]


def test_a_file_of_another_batch_than_asked_is_still_refused(runner, pad):
    result, _ = trace(runner, f"{STYLES}:DetrQuerySelf", "--mask", pad, "--batch", "2")
    assert result.exit_code == 2 and "does not broadcast to the scores' shape [2, " in result.stderr, result.stderr


def test_rope_tables_and_token_positions_are_no_position_embeddings():
    from attnscope.usertrace.load import is_embedding

    assert not is_embedding("freqs_cis", torch.Tensor) and not is_embedding("cos", torch.Tensor)
    assert not is_embedding("position_embeddings", tuple[torch.Tensor, torch.Tensor])
    assert not is_embedding("input_pos") and not is_embedding("start_pos")
    assert is_embedding("position_embeddings", torch.Tensor | None)
    assert all(is_embedding(n) for n in ("object_queries", "query_pos", "pos", "key_pe", "pos_embed"))
