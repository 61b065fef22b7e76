"""`attnscope trace` on held-out round 33's styles: Keras' MultiHeadAttention ported (EinsumDense kernels named
`_key_dense`, `_value_dense`: the names hold the roles, so scores of the values are `kv.swapped`; a 0/1 mask's
polarity stated in a comment at the top of the helper that applies it), CLIPAttention's `causal_attention_mask`
multiplied after the softmax (a mask by its name and its `== 0`, never a head_mask's weight: `mask.after_softmax`),
and a file whose opening comments state its `key_padding_mask`'s polarity (`mask.polarity` where the code reads it
the other way). Each correct style is checked against F.scaled_dot_product_attention in float64, each plant shown
to change its output and named by experiment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

HERE = Path(__file__).resolve().parent
KERAS = str(HERE / "trace_styles_round33_keras.py")
HEADER = str(HERE / "trace_styles_round33_header.py")
keras, header = user_module(KERAS), user_module(HEADER)


def _pad(tmp_path):
    """[2, 9] boolean, True = may attend: the second sequence's last 3 keys padded."""
    keep = np.ones((2, 9), dtype=bool)
    keep[1, 6:] = False
    np.save(tmp_path / "pad.npy", keep)
    return str(tmp_path / "pad.npy")


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 32, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 6:] = False
    with torch.no_grad():
        m = keras.KerasMultiHeadAttention().double().eval()
        q, k, v = (d(x).transpose(1, 2) for d in (m._query_dense, m._key_dense, m._value_dense))
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        want = m._output_dense(heads.transpose(1, 2))
        mask = keep[:, None, :].expand(2, 9, 9).double()
        assert torch.allclose(m(x, attention_mask=mask), want, atol=1e-10)
        for bug in ("kv_swapped", "mask_polarity"):
            wrong = keras.KerasMultiHeadAttention(bug=bug).double().eval()
            wrong.load_state_dict(m.state_dict())
            assert (wrong(x, attention_mask=mask) - want).abs().max() > 1e-2, bug

        c = keras.CLIPLike().double().eval()
        heads = lambda t: t.unflatten(-1, (4, 8)).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(heads(c.q_proj(x)), heads(c.k_proj(x)), heads(c.v_proj(x)),
                                             is_causal=True)
        want = c.out_proj(out.transpose(1, 2).flatten(2))
        causal = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        assert torch.allclose(c(x, causal_attention_mask=causal)[0], want, atol=1e-10)
        wrong = keras.CLIPLike(bug="causal_after_softmax").double().eval()
        wrong.load_state_dict(c.state_dict())
        assert (wrong(x, causal_attention_mask=causal)[0] - want).abs().max() > 1e-2

        s = header.CausalSDPAttention().double().eval()
        y = torch.randn(2, 9, 48, generator=g, dtype=torch.float64)
        q, k, v = (t.unflatten(-1, (3, 16)).transpose(1, 2) for t in s.qkv(y).chunk(3, dim=-1))
        allowed = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        want = s.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).flatten(2))
        assert torch.allclose(s(y, key_padding_mask=~keep), want, atol=1e-10)
        wrong = header.CausalSDPAttention(bug="padding_polarity").double().eval()
        wrong.load_state_dict(s.state_dict())
        assert (wrong(y, key_padding_mask=~keep) - want).abs().max() > 1e-2


KERAS_INIT = "num_heads=4, key_dim=8, model_dim=32"


def _options(tmp_path, target):
    if target == "KerasMultiHeadAttention":
        return ("--batch", "2", "--nq", "9", "--mask", _pad(tmp_path))
    if target == "CLIPLike":
        return ("--causal",)
    return ("--causal", "--batch", "2", "--nq", "9", "--mask", _pad(tmp_path))


@pytest.mark.parametrize("styles, target", [(KERAS, "KerasMultiHeadAttention"), (KERAS, "CLIPLike"),
                                            (HEADER, "CausalSDPAttention")])
def test_the_correct_styles_pass(runner, tmp_path, styles, target):
    init = KERAS_INIT if target.startswith("Keras") else None
    assert_passes(*run_case(runner, styles, target, init, _options(tmp_path, target)))


def test_the_keras_kernels_hold_their_roles_by_name(runner, tmp_path):
    """`_key_dense` is the keys' kernel ("dense" a layer's word, o only alone), so scores of the values swap them."""
    init = f"{KERAS_INIT}, bug='kv_swapped'"
    code, out = run_case(runner, KERAS, "KerasMultiHeadAttention", init, _options(tmp_path, "KerasMultiHeadAttention"))
    assert "k=_key_dense.kernel, v=_value_dense.kernel" in " ".join(out["reference"].split()), out["reference"]
    assert_named(code, out, "kv.swapped")


def test_a_comment_atop_the_helper_states_the_polarity(runner, tmp_path):
    init = f"{KERAS_INIT}, bug='mask_polarity'"
    code, out = run_case(runner, KERAS, "KerasMultiHeadAttention", init, _options(tmp_path, "KerasMultiHeadAttention"))
    assert_named(code, out, "mask.polarity")
    assert any("1 = attend" in note for note in out["notes"]), out["notes"]


def test_a_causal_mask_multiplied_after_the_softmax_is_no_head_mask(runner, tmp_path):
    code, out = run_case(runner, KERAS, "CLIPLike", "bug='causal_after_softmax'", _options(tmp_path, "CLIPLike"))
    assert_named(code, out, "mask.after_softmax")


def test_a_files_opening_comments_state_the_padding_polarity(runner, tmp_path):
    code, out = run_case(runner, HEADER, "CausalSDPAttention", "bug='padding_polarity'",
                         _options(tmp_path, "CausalSDPAttention"))
    assert_named(code, out, "mask.polarity")
    assert any("True marks a padded" in note for note in out["notes"]), out["notes"]


def test_keras_words_for_its_mask_are_read():
    """Keras' docstring: "1 indicates attention and 0 indicates no attention" says True = may attend; "attention"
    before a value is the weights' word, not a meaning."""
    from attnscope.usertrace.statedmask import _statements

    said = _statements("The boolean mask specifies which query elements can attend to which key elements, 1 "
                       "indicates attention and 0 indicates no attention.", 1, "attention_mask", ())
    assert {s.kind for s in said} == {"attend"} and len(said) == 2, said
    assert not _statements("attention weights are 0 where the mask is set", 1, "mask", ())
