"""A --mask file that does not fit the scores is refused with the flags that make it fit, read from its shape: its
last axis the keys' count (--nk where the code takes its keys apart: an optional memory, keys given apart; --nq for
self-attention, n_K = n_Q), its rows the batch's where it is key padding `[n_batch, n_K]` (--batch). Before, a
module with an optional memory given a [2, 9] key-padding file under --nq 6 was refused 'mask of shape [2, 9] does
not broadcast to the scores' shape [2, 2, 6, 6]' alone. Styles of our own (tests/trace_styles_round22_maskargs.py:
perceiver-pytorch's, BART's, a torch-style block over SDPA with key_padding_mask, self-attention alone, a function),
each checked against F.scaled_dot_product_attention in float64; run again with the flags said, each passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_maskargs.py")
styles = user_module(STYLES)
KEEP = torch.ones(2, 9, dtype=torch.bool)
KEEP[0, 6:] = False
KEEP[1, 8:] = False  # [n_batch, n_K] = [2, 9], True = a real key


@pytest.fixture
def files(tmp_path):
    """The padding as booleans (True = a real token) and as key_padding_mask (True = padded)."""
    np.save(tmp_path / "keep.npy", KEEP.numpy())
    np.save(tmp_path / "padded.npy", (~KEEP).numpy())
    return {"KEEP": str(tmp_path / "keep.npy"), "PADDED": str(tmp_path / "padded.npy")}


def _sdpa(q, k, v, keep=KEEP) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)  # [b, n, h·d] -> [b, h, n, d]


def test_the_styles_are_attention_over_the_real_keys():
    torch.manual_seed(0)
    x, mem = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 9, 16, dtype=torch.float64)
    m = styles.PerceiverCross().double()
    k, v = m.to_kv(mem).chunk(2, -1)
    want = m.to_out(_sdpa(_heads(m.to_q(x), 2), _heads(k, 2), _heads(v, 2)).transpose(1, 2).flatten(2))
    torch.testing.assert_close(m(x, mem, KEEP), want)
    m = styles.BartLike().double()
    want = m.out_proj(_sdpa(*(_heads(p(t), 4) for p, t in ((m.q_proj, x), (m.k_proj, mem), (m.v_proj, mem))))
                      .transpose(1, 2).flatten(2))
    torch.testing.assert_close(m(x, mem, KEEP.long()), want)
    m = styles.SdpaMemory().double()
    want = m.wo(_sdpa(*(_heads(p(t), 2) for p, t in ((m.wq, x), (m.wk, mem), (m.wv, mem)))).transpose(1, 2)
                .flatten(2))
    torch.testing.assert_close(m(x, mem, ~KEEP), want)
    m = styles.SelfPadded().double()
    q, k, v = m.qkv(mem).chunk(3, -1)
    want = m.proj(_sdpa(_heads(q, 2), _heads(k, 2), _heads(v, 2)).transpose(1, 2).flatten(2))
    torch.testing.assert_close(m(mem, KEEP), want)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (6, 9, 9))
    torch.testing.assert_close(styles.padded_attend(q, k, v, KEEP), _sdpa(q, k, v))


def test_each_plant_changes_the_output():
    torch.manual_seed(1)
    x, mem = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 9, 16, dtype=torch.float64)
    for cls, bug, mask in ((styles.PerceiverCross, "no_scale", KEEP), (styles.BartLike, "scale_twice", KEEP.long()),
                           (styles.SdpaMemory, "no_scale", ~KEEP)):
        right, wrong = cls().double(), cls(bug=bug).double()
        wrong.load_state_dict(right.state_dict())
        assert not torch.allclose(right(x, mem, mask), wrong(x, mem, mask), atol=1e-6), (cls.__name__, bug)


# (target, mask file, the other flags, what the refusal says, the flags to pass instead)
REFUSED = [("PerceiverCross", "KEEP", ("--nq", "6"), "--nk 9 (n_K is 6)", ("--nq", "6", "--nk", "9")),
           ("BartLike", "KEEP", ("--nq", "6", "--batch", "3"), "--nk 9 --batch 2 (n_K is 6, n_batch is 3)",
            ("--nq", "6", "--nk", "9")),
           ("SdpaMemory", "PADDED", ("--nq", "6", "--nk", "7"), "--nk 9 (n_K is 7)", ("--nq", "6", "--nk", "9")),
           ("SelfPadded", "KEEP", ("--nq", "6"), "--nq 9 (n_Q is 6)", ("--nq", "9")),
           ("padded_attend", "KEEP", ("--nq", "6", "--nk", "5", "--heads", "2"), "--nk 9 (n_K is 5)",
            ("--nq", "6", "--nk", "9", "--heads", "2"))]


@pytest.mark.parametrize(("target", "mask", "options", "said", "fitting"), REFUSED, ids=case_ids(REFUSED))
def test_a_file_that_does_not_fit_is_refused_with_the_flags_that_fit(runner, files, target, mask, options, said,
                                                                     fitting):
    result, out = trace(runner, f"{STYLES}:{target}", "--mask", files[mask], *options)
    assert result.exit_code == 2 and out is None
    line = " ".join(result.stderr.split())
    assert line.count("error:") == 1 and "Traceback" not in line, line
    assert f"as key padding [n_batch, n_K] it takes {said}" in line, line
    code, out = run_case(runner, STYLES, target, None, ("--mask", files[mask], *fitting))
    assert_passes(code, out)
    assert out["params"]["sizes"]["n_K"] == 9 and out["params"]["sizes"]["n_batch"] == 2


PLANTS = [("PerceiverCross", "bug='no_scale'", "KEEP", "scale.none"),
          ("BartLike", "bug='scale_twice'", "KEEP", "scale.twice"),
          ("SdpaMemory", "bug='no_scale'", "PADDED", "scale.none")]


@pytest.mark.parametrize(("target", "init", "mask", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_plants_under_the_flags_said_are_named_by_experiment(runner, files, target, init, mask, entry):
    assert_named(*run_case(runner, STYLES, target, init, ("--mask", files[mask], "--nq", "6", "--nk", "9")), entry)
