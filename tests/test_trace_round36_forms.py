"""`attnscope trace` on what stop 70 found in Swin V2, torchtune and gpt-fast styles: a fused qkv Linear with no
output projection (Swin V2's window attention without its `proj`, refused before: no reference), now compared up to
the merge of its heads; a constant the scores are scaled by on top of a learned temperature, said in the
temperature's note; torch.nn layers in `--init` (torchtune's `MultiHeadAttention` takes its projections as modules,
refused before); the convention note of a mask parameter no op reads; gpt-fast's rotary pairs named `d_head/2, 2`
(they were `n_head·n_kv_head, n_kv_head`, a product that happened to be as wide). Each correct style is checked
against a float64 formula, each plant shown to change its output and named by experiment."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import planted
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round36_forms.py")
ROUND34 = str(HERE / "trace_styles_round34_forms.py")
styles = user_module(STYLES)
LAYERS = ("embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, q_proj=nn.Linear(32, 32, bias=False), "
          "k_proj=torch.nn.Linear(32, 16, bias=False), v_proj=nn.Linear(32, 16, bias=False), "
          "output_proj=Linear(32, 32, bias=False)")


def _torchtune(bug=None):
    from torch import nn

    return styles.TorchtuneAttention(embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                                     q_proj=nn.Linear(32, 32, bias=False), k_proj=nn.Linear(32, 16, bias=False),
                                     v_proj=nn.Linear(32, 16, bias=False), output_proj=nn.Linear(32, 32, bias=False),
                                     bug=bug)


def test_the_styles_are_their_formulas_and_the_plants_change_them():
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        m = styles.SwinV2Window().double().eval()
        x = torch.randn(4, 9, 32, generator=g, dtype=torch.float64)
        w = m.qkv.weight
        bias = torch.cat((m.q_bias, torch.zeros_like(m.q_bias), m.v_bias))
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (x @ w.T + bias).chunk(3, dim=-1))
        cosine = (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).transpose(-1, -2)
        gain = m.logit_scale.clamp(max=math.log(100.0)).exp()
        table = m.cpb_mlp(m.relative_coords_table).reshape(-1, 4)[m.relative_position_index.reshape(-1)]
        position = 16 * torch.sigmoid(table.reshape(9, 9, 4).permute(2, 0, 1))
        want = (torch.softmax(cosine * gain + position, dim=-1) @ v).transpose(1, 2).reshape(4, 9, 32)
        assert torch.allclose(m(x), want, atol=1e-10)
        for bug in ("bias_transposed", "kv_swapped", "softmax_axis", "extra_sqrt_d"):
            assert (planted(styles.SwinV2Window, m, bug, x) - want).abs().max() > 1e-3, bug

        t = _torchtune().double().eval()
        x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
        q = t.q_proj(x).unflatten(-1, (4, 8)).transpose(1, 2)
        k, v = (p(x).unflatten(-1, (2, 8)).transpose(1, 2).repeat_interleave(2, 1) for p in (t.k_proj, t.v_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
        want = t.output_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 7, 32))
        assert torch.allclose(t(x), want, atol=1e-10)
        for bug in ("tiled", "merge_no_transpose"):
            wrong = _torchtune(bug).double().eval()
            wrong.load_state_dict(t.state_dict())
            assert (wrong(x) - want).abs().max() > 1e-3, bug


def test_a_fused_projection_without_an_output_projection_is_compared_up_to_the_merge(runner):
    code, out = run_case(runner, STYLES, "SwinV2Window", None, ("--nq", "9"))
    assert_passes(code, out)
    assert "o=(none) (a fused projection, split in thirds, q | k | v; your code has no output projection" in \
        out["reference"], out["reference"]


@pytest.mark.parametrize(("bug", "entry"), [("bias_transposed", "t5.transposed"), ("kv_swapped", "kv.swapped"),
                                            ("softmax_axis", "softmax.axis")])
def test_its_plants_are_named(runner, bug, entry):
    assert_named(*run_case(runner, STYLES, "SwinV2Window", f"bug={bug!r}", ("--nq", "9")), entry)


def test_a_constant_on_top_of_a_learned_temperature_is_said(runner):
    code, out = run_case(runner, STYLES, "SwinV2Window", "bug='extra_sqrt_d'", ("--nq", "9"))
    assert_passes(code, out)  # a temperature times a constant is a convention (Llama 4 scales so), said in words
    said = [n for n in out["notes"] if "learned temperature" in n]
    assert len(said) == 1 and "then times 0.3536 = 1/√d_head, on top of the temperature" in said[0], said
    code, out = run_case(runner, STYLES, "SwinV2Window", None, ("--nq", "9"))
    assert not any("on top of the temperature" in n for n in out["notes"]), out["notes"]


def test_projections_given_as_torch_layers_in_init(runner):
    assert_passes(*run_case(runner, STYLES, "TorchtuneAttention", LAYERS, ("--causal",)))
    assert_named(*run_case(runner, STYLES, "TorchtuneAttention", f"{LAYERS}, bug='tiled'", ("--causal",)),
                 "gqa.tiled")
    assert_named(*run_case(runner, STYLES, "TorchtuneAttention", f"{LAYERS}, bug='merge_no_transpose'",
                           ("--causal",)), "heads.merge_without_transpose")


@pytest.mark.parametrize(("init", "message"), [
    ("embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8",
     'needs q_proj: give it with --init "q_proj=...", a torch.nn layer: --init "q_proj=nn.Linear(64, 64, '
     'bias=False)" with its widths'),
    (LAYERS.replace("nn.Linear(32, 32, bias=False)", "nn.Linear(32, 10**12)", 1), "is not a Python literal"),
    (LAYERS.replace("nn.Linear(32, 32, bias=False)", "nn.Linear(32, 1000000000000)", 1),
     "nn.Linear(32, 1000000000000) would hold more than 67,108,864 numbers"),
    (LAYERS.replace("nn.Linear(32, 32, bias=False)", "nn.Linear(32, torch.float32)", 1),
     "attribute access (torch.float32) is not allowed"),
    (LAYERS.replace("nn.Linear(32, 32, bias=False)", "nn.Transformer(32)", 1), "is called through an attribute"),
    (LAYERS.replace("nn.Linear(32, 32, bias=False)", "nn.Linear(-3, 32)", 1), "is given a negative size"),
    (LAYERS.replace("nn.Linear(32, 32, bias=False)", "nn.Linear(32)", 1),
     "nn.Linear(32): missing a required argument: 'out_features'"),
])
def test_init_refuses_what_no_layer_is_in_one_line(init, message):
    from cli_main import run_main

    outcome = run_main("trace", f"{STYLES}:TorchtuneAttention", "--init", init, "--causal")
    assert outcome.code == 2 and len(outcome.error_lines) == 1 and message in " ".join(outcome.stderr.split()), \
        outcome.stderr


def test_a_mask_parameter_no_op_reads_is_said_unread(runner, tmp_path):
    keep = np.ones((3, 9), dtype=bool)
    keep[1, 6:] = False
    np.save(tmp_path / "pad.npy", keep)
    options = ("--nq", "5", "--nk", "9", "--mask", str(tmp_path / "pad.npy"))
    code, out = run_case(runner, ROUND34, "BlipCross", "bug='encoder_mask_ignored'", options)
    assert_named(code, out, "mask.not_applied")
    said = [n for n in out["notes"] if n.startswith("encoder_attention_mask: given boolean")]
    assert len(said) == 1 and said[0].endswith("no op of your code's run reads it"), out["notes"]
    assert not any("as your code reads it" in n for n in out["notes"]), out["notes"]
    code, out = run_case(runner, ROUND34, "BlipCross", None, options)  # read: its reading is said as before
    assert any(n.startswith("encoder_attention_mask:") and "as your code reads it" in n for n in out["notes"]), \
        out["notes"]


def test_rotary_pairs_are_named_as_halves_of_a_head(runner):
    code, out = run_case(runner, ROUND34, "GptFastAttention", None,
                         ("--causal", "--rope", "--rope-pairing", "interleaved"))
    assert_passes(code, out)
    dims = {(s["name"], tuple(s["shape"])): s["dims"] for s in out["steps"]}
    assert dims[("xshaped", (5, 7, 4, 8, 2))] == ["n_batch", "n_Q", "n_head", "d_head/2", "2"]
    assert dims[("freqs_cis", (1, 7, 1, 8, 2))] == ["1", "n_Q", "1", "d_head/2", "2"]
    assert not any("n_head·n_kv_head" in "".join(s["dims"]) for s in out["steps"])


# --- held-out round 36/37: CPM-Ant's [b, len_q, len_k] mask and its second fill, `tokeys`, a muP key multiplier ---


def _cpm_files(tmp_path):
    keep = np.tril(np.ones((6, 6), dtype=bool))[None].repeat(2, 0)
    keep[1, :, 4:] = False
    keep[1, 4:, 4] = True
    bias = np.random.default_rng(0).standard_normal((4, 6, 6)).astype(np.float32)
    np.save(tmp_path / "mask.npy", keep)
    np.save(tmp_path / "bias.npy", bias)
    return keep, bias, ("--nq", "6", "--nk", "6", "--mask", str(tmp_path / "mask.npy"), "--position-bias",
                        str(tmp_path / "bias.npy"))


def test_the_round_37_styles_are_their_formulas_and_the_plants_change_them(tmp_path):
    keep, bias, _ = _cpm_files(tmp_path)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        c = styles.CpmAntAttention().double().eval()
        x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
        allowed, added = torch.from_numpy(keep)[:, None], torch.from_numpy(bias).double()
        q, k, v = (p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (c.project_q, c.project_k, c.project_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=added.masked_fill(~allowed, float("-inf")))
        want = c.attention_out(out.transpose(1, 2).flatten(2))
        assert torch.allclose(c(x, x, allowed[:, 0], added), want, atol=1e-10)
        wrong = planted(styles.CpmAntAttention, c, "bias_after_softmax", x, x, allowed[:, 0], added)
        assert (wrong - want).abs().max() > 1e-3

        f = styles.Former().double().eval()
        q, k, v = (p(x).unflatten(-1, (4, 8)).transpose(1, 2) for p in (f.toqueries, f.tokeys, f.tovalues))
        want = f.unifyheads(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        assert torch.allclose(f(x), want, atol=1e-10)
        assert (planted(styles.Former, f, "kv_swapped", x) - want).abs().max() > 1e-3

        m = styles.KeyMultiplied().double().eval()
        x = torch.randn(2, 6, 48, generator=g, dtype=torch.float64)
        q, k, v = (p(x).unflatten(-1, (4, 12)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=0.75 / math.sqrt(12))
        want = m.o_proj(out.transpose(1, 2).flatten(2))
        assert torch.allclose(m(x), want, atol=1e-10)  # scores q · kᵀ · key_multiplier / √d_head
        assert (planted(styles.KeyMultiplied, m, "queries_prescaled", x) - m(x)).abs().max() > 1e-3


def test_a_mask_per_sequence_and_a_second_fill_after_the_softmax(runner, tmp_path):
    *_, options = _cpm_files(tmp_path)
    code, out = run_case(runner, STYLES, "CpmAntAttention", None, options)
    assert_passes(code, out)  # [n_batch, n_Q, n_K]: read per sequence, where it was refused as a mask a head
    assert any("[n_batch, n_Q, n_K] = [2, 6, 6], one mask a sequence, read as [2, 1, 6, 6]" in n
               for n in out["notes"]), out["notes"]
    found = assert_named(*run_case(runner, STYLES, "CpmAntAttention", "bug='bias_after_softmax'", options),
                         "t5.after_softmax")
    assert "the masked ones then set to 0, as your code does" in found["diagnosis"], found


def test_role_words_glued_to_a_projections(runner):
    code, out = run_case(runner, STYLES, "Former")
    assert_passes(code, out)
    assert_named(*run_case(runner, STYLES, "Former", "bug='kv_swapped'"), "kv.swapped")
    assert "q=toqueries, k=tokeys, v=tovalues, o=unifyheads" in out["reference"], out["reference"]


def test_the_queries_scaled_by_the_heads_root_under_a_models_scale(runner):
    scale = ("--scale", f"{0.75 / math.sqrt(12):.8f}")
    assert_passes(*run_case(runner, STYLES, "KeyMultiplied", None, scale))
    found = assert_named(*run_case(runner, STYLES, "KeyMultiplied", "bug='queries_prescaled'", scale), "scale.twice")
    assert "queries already scaled (multiplied by 1/√d_head = 0.2887)" in found["diagnosis"], found


# --- held-out round 38: FSMT's forward(query, key) that never reads its key, and its key_padding_mask ---


def _fsmt_pad(tmp_path):
    keep = np.ones((2, 9), dtype=bool)
    keep[1, 6:] = False
    np.save(tmp_path / "pad.npy", keep)
    return keep, ("--batch", "2", "--nq", "9", "--mask", str(tmp_path / "pad.npy"))


def test_fsmt_is_its_formula_and_its_plant_changes_it(tmp_path):
    keep, _ = _fsmt_pad(tmp_path)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        m = styles.FsmtAttention().double().eval()
        x = torch.randn(9, 2, 32, generator=g, dtype=torch.float64)  # time-first
        xb = x.transpose(0, 1)
        q, k, v = (p(xb).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        allowed = torch.from_numpy(keep)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).flatten(2)
        want = m.out_proj(out).transpose(0, 1)
        padded = ~torch.from_numpy(keep)
        assert torch.allclose(m(x, torch.randn_like(x), padded)[0], want, atol=1e-10)
        wrong = planted(styles.FsmtAttention, m, "padding_after_softmax", x, x, padded)[0]
        assert (wrong - want).abs().max() > 1e-3


def test_a_key_never_read_and_the_padding_to_the_parameter_named_for_it(runner, tmp_path):
    _, options = _fsmt_pad(tmp_path)
    code, out = run_case(runner, STYLES, "FsmtAttention", None, options)
    assert_passes(code, out)
    assert any(n.startswith("key: your code never reads it (its queries, keys and values all come from query") and
               "handed one tensor for both" in n for n in out["notes"]), out["notes"]
    assert any(n.startswith("key_padding_mask:") for n in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "FsmtAttention", "bug='padding_after_softmax'", options),
                 "mask.after_softmax")


def test_labml_is_its_formula_and_its_plant_changes_it():
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        m = styles.LabmlAttention().double().eval()
        x = torch.randn(7, 3, 32, generator=g, dtype=torch.float64)  # time-first
        xb = x.transpose(0, 1)
        q, k, v = (p(xb).unflatten(-1, (4, 8)).transpose(1, 2) for p in (m.query, m.key, m.value))
        want = m.output(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        causal = torch.ones(7, 7, dtype=torch.bool).tril()[:, :, None]  # [seq_q, seq_k, 1]
        assert torch.allclose(m(query=x, key=x, value=x, mask=causal), want.transpose(0, 1), atol=1e-10)
        plant = styles.LabmlAttention(bug="softmax_last").double().eval()
        plant.load_state_dict(m.state_dict())
        wrong = plant(query=x, key=x, value=x, mask=causal)  # a cell all heads mask is 0/0 over the heads: NaN
        assert not torch.allclose(wrong, want.transpose(0, 1), atol=1e-3)


def test_a_time_first_mask_with_the_batch_after_the_keys(runner):
    code, out = run_case(runner, STYLES, "LabmlAttention", None, ("--causal",))
    assert_passes(code, out)  # it asserts [seq_q, seq_k, batch]: a form trace tries last, where it ran unmasked
    assert any(n.startswith("mask: your code raised on a [.., n_Q, n_K] mask and runs on one shaped [n_Q, n_K, ")
               for n in out["notes"]), out["notes"]
    assert_named(*run_case(runner, STYLES, "LabmlAttention", "bug='softmax_last'", ("--causal",)), "softmax.axis")
