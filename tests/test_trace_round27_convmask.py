"""`attnscope trace` where it could not tell which operand or which parameter was the mask's. (1) A correct module with
one fused 1x1 Conv1d making q, k and v over [B, C, W], given a key-padding mask (`--mask pad.npy`), was named
`mask.on_queries`: in the column form trace read which scores' axis held the keys from the order of the projections,
which one fused layer does not give, so the mask was not turned to [.., 1, n_K]. The layout now follows the roles
the line-up reads (usertrace/scoreform.py: the operand whose tokens the product with the values contracts is the
keys'). (2) A required mask parameter whose name does not say mask (`keep`, `valid`, `pad`) was read as a second
input (cross-attention), and a required mask the forward only hands to a helper got None; its role is now read from
how the code uses it (usertrace/maskroles.py). Styles of our own (tests/trace_styles_round27_convmask.py), each
checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_convmask.py")
styles = user_module(STYLES)


@pytest.fixture()
def files(tmp_path):
    """A key-padding file [n_batch, n_K] = [2, 7] (True = a real token)."""
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 5:] = False
    pad[1, 6:] = False
    np.save(tmp_path / "pad.npy", pad)
    return {"PAD": str(tmp_path / "pad.npy")}


def _conv(x, layer):
    return torch.einsum("oc,bcw->bow", layer.weight[..., 0], x) + layer.bias[:, None]


def _cols_to_heads(t, n_head):
    """[B, C, W] -> [B, H, W, d]."""
    B, C, W = t.shape
    return t.reshape(B, n_head, C // n_head, W).transpose(-2, -1)


def _heads_to_cols(t):
    """[B, H, W, d] -> [B, C, W]."""
    B, H, W, d = t.shape
    return t.transpose(-2, -1).reshape(B, H * d, W)


def test_the_styles_are_attention():
    torch.manual_seed(0)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    allowed = keep[:, None, None, :]
    bias = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    x = torch.randn(2, 32, 7, dtype=torch.float64)
    rows = x.transpose(1, 2)

    m = styles.FusedChunkConv().double()
    q, k, v = (_cols_to_heads(t, 4) for t in _conv(x, m.qkv).chunk(3, dim=1))
    want = _conv(_heads_to_cols(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)), m.proj)
    torch.testing.assert_close(m(x, bias), want)

    m = styles.FusedHeadsConv().double()
    q, k, v = (_cols_to_heads(t, 4) for t in _conv(x, m.to_qkv).view(2, 3, 32, 7).unbind(1))
    want = _conv(_heads_to_cols(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)), m.to_out)
    torch.testing.assert_close(m(x, allowed), want)

    m = styles.KeepRows().double()
    q, k, v = (w(rows).view(2, 7, 4, 8).transpose(1, 2) for w in (m.wq, m.wk, m.wv))
    want = m.wo(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(m(rows, allowed), want)

    m = styles.ValidHelper().double()
    q, k, v = m.qkv(rows).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
    want = m.out(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(m(rows, allowed), want)

    m = styles.PadConv().double()
    q, k, v = (_cols_to_heads(_conv(x, layer), 4) for layer in (m.q, m.k, m.v))
    want = _heads_to_cols(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
    torch.testing.assert_close(m(x, allowed.double()), want)


MASK = ("--mask", "PAD", "--batch", "2")
CORRECT = [("FusedChunkConv", None, MASK), ("FusedChunkConv", None, ("--layout", "col", *MASK)),
           ("FusedChunkConv", None, ()), ("FusedHeadsConv", None, MASK), ("FusedHeadsConv", None, ()),
           ("KeepRows", None, ()), ("KeepRows", None, MASK), ("ValidHelper", None, ()), ("ValidHelper", None, MASK),
           ("PadConv", None, ()), ("PadConv", None, MASK)]
PLANTS = [("FusedChunkConv", "bug='mask_on_queries'", MASK, "mask.on_queries"),
          ("FusedHeadsConv", "bug='mask_on_queries'", MASK, "mask.on_queries"),
          ("KeepRows", "bug='polarity'", MASK, "mask.polarity"),
          ("ValidHelper", "bug='polarity'", MASK, "mask.polarity"),
          ("PadConv", "bug='polarity'", MASK, "mask.polarity")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    allowed = keep[:, None, None, :]
    bias = torch.zeros(2, 1, 1, 7).masked_fill(~allowed, -1e4)
    x = torch.randn(2, 32, 7)
    given = {"FusedChunkConv": (x, bias), "FusedHeadsConv": (x, allowed), "KeepRows": (x.transpose(1, 2), allowed),
             "ValidHelper": (x.transpose(1, 2), allowed), "PadConv": (x, allowed.float())}
    for name, init, _, _ in PLANTS:
        bug = init.split("'")[1]
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=bug)
        outs = [m(*given[name]) for m in (good, bad)]
        assert not torch.allclose(outs[0], outs[1], atol=1e-3), name


test_correct_styles_pass = passing_test(STYLES, CORRECT, files="files")
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS, files="files")


def test_a_parameter_is_a_mask_where_the_code_combines_it_with_the_scores():
    from attnscope.usertrace import maskroles

    for name, param in (("KeepRows", "keep"), ("ValidHelper", "valid"), ("PadConv", "pad"),
                        ("FusedHeadsConv", "mask")):
        forward = getattr(styles, name)().forward
        assert maskroles.role(forward, param) == "mask", name
        assert maskroles.needed(forward, param), name  # read with no test for None, in a helper of the file too
    assert not maskroles.needed(styles.FusedChunkConv().forward, "attention_mask")  # tested for None


def _cross(self, x, memory):
    """Cross-attention: `memory` projected, never combined with the scores."""
    q, k = self.q(x), self.k(memory)
    return (q @ k.transpose(-1, -2)).softmax(-1) @ self.v(memory)


def _added(scores, bias):
    return scores + bias


def _biased(x, attn_bias):
    return _added(x @ x.transpose(-1, -2), attn_bias)  # only handed on, read in a helper of this file


def _handed_to_torch(x, pad):
    return F.scaled_dot_product_attention(x, x, x, attn_mask=pad)  # torch's: never followed, may test it for None


def test_a_projected_parameter_stays_an_input_and_helpers_are_followed():
    from attnscope.usertrace import maskroles

    assert maskroles.read(_cross, "memory") == {"input"}
    assert maskroles.role(_cross, "memory") is None
    assert maskroles.role(_biased, "attn_bias") == "mask" and maskroles.needed(_biased, "attn_bias")
    assert maskroles.role(_handed_to_torch, "pad") is None and not maskroles.needed(_handed_to_torch, "pad")
