"""`attnscope trace` on talking-heads attention (usertrace/headmix.py): each head's logits mixed with all heads' by a
learned [h, h] matrix before the softmax, and its weights after it (x-transformers' einsum over the heads, its 1x1
Conv2d, a matmul over the heads moved last). Before, a correct module exited 1 with "the mask is not applied: your
dots equals the unmasked scores" (the mask was applied, after the mixing), and the plants around the mixing were
misread the same way or named not by experiment. Now the mixing is read from the run (the matrix, its bias), the
reference mixes as the code does with a note, the correct styles exit 0, and the plants before the mixing and after
it are named by experiment; a mixing the reference cannot hold (beside a bias trace reads no reference for) is said
so, never a mask or scale misread. Each style is first checked against a float64 formula of talking-heads attention.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_trace_command import user_module
from tracecases import case_ids, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round28_headmix.py")
styles = user_module(STYLES)


def _talking_heads(q, k, v, heads, pre, post, scale, allowed=None, bias=None):
    """[B, N, h·d] each, float64: talking-heads attention merged back to [B, N, h·d]. pre, post: [h_out, h_in + 1]
    (the last column a bias per head; post may be None), out[k] = Σ_h M[k, h] · in[h] + M[k, -1]; allowed [N_Q, N_K]
    or [B, N_K] (True = may attend); bias [h, N_Q, N_K] added to the mixed logits."""
    B, N, _ = q.shape
    d = q.shape[-1] // heads
    q, k, v = (t.reshape(B, N, heads, d).transpose(1, 2) for t in (q, k, v))
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    logits = torch.einsum("kh,bhij->bkij", pre[:, :-1], logits) + pre[:, -1][None, :, None, None]
    if bias is not None:
        logits = logits + bias
    if allowed is not None:
        cells = allowed[:, None, None, :] if allowed.dim() == 2 and allowed.shape[0] == B else allowed
        logits = logits.masked_fill(~cells, -math.inf)
    weights = torch.softmax(logits, dim=-1)
    if post is not None:
        weights = torch.einsum("kh,bhij->bkij", post[:, :-1], weights) + post[:, -1][None, :, None, None]
    return (weights @ v).transpose(1, 2).reshape(B, N, heads * d)


def _with_bias(matrix, bias=None):
    return torch.cat([matrix, (torch.zeros(matrix.shape[0], dtype=matrix.dtype) if bias is None else bias)[:, None]],
                     dim=1)


def _conv(layer):
    return None if layer is None else _with_bias(layer.weight[:, :, 0, 0], layer.bias)


def test_the_styles_compute_talking_heads():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        m = styles.XTalkingHeads().double()
        q, k, v = m.to_qkv(x).chunk(3, dim=-1)
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        want = _talking_heads(q, k, v, 4, _with_bias(m.pre_softmax_proj.T), _with_bias(m.post_softmax_proj.T),
                              8 ** -0.5, causal)
        torch.testing.assert_close(m(x), m.to_out(want))
        for init in ({}, {"post": False}, {"bias": True}, {"rel_bias": True}):
            c = styles.ConvTalkingHeads(**init).double()
            k, v = c.to_kv(x).chunk(2, dim=-1)
            bias = c.rel_bias[:, :6, :6] if c.rel_bias is not None else None
            want = _talking_heads(c.to_q(x), k, v, 4, _conv(c.pre_softmax_talking_heads),
                                  _conv(c.post_softmax_talking_heads), 8 ** -0.5, bias=bias)
            torch.testing.assert_close(c(x), c.to_out(want))
        p = styles.MatmulTalkingHeads().double()
        pad = torch.ones(2, 6, dtype=torch.bool)
        pad[0, 4:] = False
        want = _talking_heads(p.q_proj(x), p.k_proj(x), p.v_proj(x), 4, _with_bias(p.mix_logits.T),
                              _with_bias(p.mix_weights.T), 8 ** -0.5, pad)
        torch.testing.assert_close(p(x, pad), p.o_proj(want))


CORRECT = [("XTalkingHeads", None, ("--causal",)), ("ConvTalkingHeads", None, ()),
           ("ConvTalkingHeads", "post=False", ()), ("ConvTalkingHeads", "bias=True", ()),
           ("ConvTalkingHeads", "rel_bias=True", ("--nq", "6")), ("MatmulTalkingHeads", None, ())]
PLANTS = [("XTalkingHeads", "bug='no_scale'", ("--causal",), "scale.none"),
          ("XTalkingHeads", "bug='split_no_permute'", ("--causal",), "heads.split_without_permute"),
          ("XTalkingHeads", "bug='causal_diagonal'", ("--causal",), "mask.off_by_one"),
          ("XTalkingHeads", "bug='softmax_axis'", ("--causal",), "softmax.axis"),
          ("XTalkingHeads", "bug='merge_d_h'", ("--causal",), "heads.merge_wrong_permute"),
          ("ConvTalkingHeads", "rel_bias=True, bias=True, bug='no_scale'", ("--nq", "6"), "scale.none"),
          ("ConvTalkingHeads", "post=False, bug='softmax_axis'", (), "softmax.axis"),
          ("ConvTalkingHeads", "bug='split_no_permute'", (), "heads.split_without_permute"),
          ("MatmulTalkingHeads", "bug='no_scale'", (), "scale.none"),
          ("MatmulTalkingHeads", "bug='merge_d_h'", (), "heads.merge_wrong_permute")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    mask = torch.ones(2, 6, dtype=torch.bool)
    for target, init, _, _ in PLANTS:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows above
        bug = kwargs.pop("bug")
        good, bad = getattr(styles, target)(**kwargs), getattr(styles, target)(bug=bug, **kwargs)
        args = (x, mask) if target == "MatmulTalkingHeads" else (x,)
        assert (good(*args) - bad(*args)).abs().max() > 1e-3, (target, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize(("target", "init", "options"), CORRECT[:2], ids=case_ids(CORRECT[:2]))
def test_the_mixing_is_said_in_a_note(runner, target, init, options):
    code, out = run_case(runner, STYLES, target, init, options)
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any(n.startswith("your code mixes its heads") and "talking-heads" in n for n in notes), notes


def test_a_mixing_the_reference_cannot_hold_is_said_so(runner):
    code, out = run_case(runner, STYLES, "ConvTalkingHeads", "rel_bias='whole'", ("--nq", "8"))
    found = out["first_divergence"]
    assert code == 1 and found is not None and found["experiment"] is None, found
    said = " ".join(found["diagnosis"].split())
    assert said.startswith("your code mixes the heads' scores (line ") and "talking-heads" in said, said
    assert "compared up to scores" in said and "mask" not in said and "scale" not in said, said
