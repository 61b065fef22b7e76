"""`attnscope trace` takes the batch from a key-padding mask file `[n_batch, n_K]` where the code's queries and keys
are given apart and no --batch says it (round 20's DistilBERT, forward(query, key, value, mask), traced with its
[2, 6] padding mask alone, was refused: 'mask of shape [2, 6] does not broadcast to the scores' shape [5, 4, 6,
6]'), as transformers' `_prepare_4d_attention_mask` reads a [B, S] mask; where --batch asks for another count, the
refusal says the flag that fits. Styles of our own (tests/trace_styles_round22_padmask.py: DistilBERT's,
BERT's as cross-attention with its extended additive mask, fairseq's key_padding_mask, a function over SDPA), each
checked against F.scaled_dot_product_attention in float64 with the padding as its boolean mask; each plant shown to
change the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import assert_passes, case_ids, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_padmask.py")
styles = user_module(STYLES)
KEEP = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])  # [n_batch, n_K], 1 = a real token


@pytest.fixture
def files(tmp_path):
    """The padding as 0/1 (1 = a real token) and as fairseq's key_padding_mask (True = padded)."""
    np.save(tmp_path / "keep.npy", KEEP.numpy())
    np.save(tmp_path / "padded.npy", (KEEP == 0).numpy())
    return {"KEEP": str(tmp_path / "keep.npy"), "PADDED": str(tmp_path / "padded.npy")}


def _heads(t: torch.Tensor, h: int = 4) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)  # [B, n, d] -> [B, h, n, d/h]


def _merged(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)


def _sdpa(q, k, v) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=KEEP.bool()[:, None, None, :])


def test_the_styles_are_attention_over_the_real_keys():
    torch.manual_seed(0)
    x, mem = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    m = styles.DistilSelf().double()
    want = m.out_lin(_merged(_sdpa(_heads(m.q_lin(x)), _heads(m.k_lin(mem)), _heads(m.v_lin(mem)))))
    torch.testing.assert_close(m(x, mem, mem, KEEP)[0], want)
    m = styles.BertCross().double()
    torch.testing.assert_close(m(x, mem, KEEP), _merged(_sdpa(_heads(m.query(x)), _heads(m.key(mem)),
                                                              _heads(m.value(mem)))))
    m = styles.FairseqPadded().double()
    want = m.out_proj(_merged(_sdpa(_heads(m.q_proj(x)), _heads(m.k_proj(mem)), _heads(m.v_proj(mem)))))
    torch.testing.assert_close(m(x, mem, mem, KEEP == 0), want)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (7, 6, 6))
    torch.testing.assert_close(styles.padded_attention(q, k, v, KEEP), _sdpa(q, k, v))


def test_each_plant_changes_the_output():
    torch.manual_seed(1)
    x, mem = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    for cls, bug, call in ((styles.DistilSelf, "no_scale", lambda m: m(x, mem, mem, KEEP)[0]),
                           (styles.DistilSelf, "fill_zero", lambda m: m(x, mem, mem, KEEP)[0]),
                           (styles.BertCross, "scale_twice", lambda m: m(x, mem, KEEP)),
                           (styles.FairseqPadded, "no_scale", lambda m: m(x, mem, mem, KEEP == 0))):
        right = cls().double()
        wrong = cls(bug=bug).double()
        wrong.load_state_dict(right.state_dict())
        assert not torch.allclose(call(right), call(wrong), atol=1e-6), (cls.__name__, bug)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (7, 6, 6))
    assert not torch.allclose(styles.padded_attention_unscaled(q, k, v, KEEP), _sdpa(q, k, v), atol=1e-6)


CORRECT = [("DistilSelf", ("--mask", "KEEP")),
           ("DistilSelf", ("--mask", "KEEP", "--nq", "6", "--nk", "6")),  # round 20's command less --batch 2
           ("BertCross", ("--mask", "KEEP")),
           ("BertCross", ("--mask", "KEEP", "--nq", "5")),
           ("FairseqPadded", ("--mask", "PADDED")),
           ("padded_attention", ("--mask", "KEEP", "--heads", "2"))]


@pytest.mark.parametrize(("target", "options"), CORRECT, ids=case_ids(CORRECT))
def test_the_batch_is_the_padding_files(runner, files, target, options):
    code, out = run_case(runner, STYLES, target, None, tuple(files.get(o, o) for o in options))
    assert_passes(code, out)
    assert out["params"]["sizes"]["n_batch"] == 2 and out["params"]["sizes"]["n_K"] == 6
    assert any("first axis of --mask" in note for note in out["notes"]), out["notes"]


PLANTS = [("DistilSelf", "bug='no_scale'", ("--mask", "KEEP"), "scale.none"),
          ("DistilSelf", "bug='fill_zero'", ("--mask", "KEEP"), "mask.filled_with_0"),
          ("BertCross", "bug='scale_twice'", ("--mask", "KEEP"), "scale.twice"),
          ("FairseqPadded", "bug='no_scale'", ("--mask", "PADDED"), "scale.none"),
          ("padded_attention_unscaled", None, ("--mask", "KEEP", "--heads", "2"), "scale.none")]


test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_another_batch_is_refused_naming_the_flag_that_fits(runner, files):
    result, out = trace(runner, f"{STYLES}:DistilSelf", "--mask", files["KEEP"], "--batch", "3")
    assert result.exit_code == 2 and out is None
    assert "as key padding [n_batch, n_K] it takes --batch 2" in " ".join(result.stderr.split())
