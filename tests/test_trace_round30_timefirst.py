"""`attnscope trace --causal` on time-first attention, `[n, n_batch, d]`, that takes its masks in its own convention
(issue #41): trace's own inputs must not break correct code. A first run on batch-first inputs raises at the mask
(the code reads the batch as its tokens); the mask is then given again on the inputs as the code is read to take
them (time-first, one tensor for all three where the code never reads its key and value), so it reaches the argument
the code reads it from: fairseq-like `attn_mask` `[n_Q, n_K]` additive and `key_padding_mask` `[n_batch, n_K]`
True = pad, nn.MultiheadAttention-like boolean attn_mask True = masked, Megatron-like `[b, 1, s, s]` boolean
attention_mask. Styles of our own (tests/trace_styles_round30_timefirst.py), each checked first against
F.scaled_dot_product_attention in float64; the plants named by experiment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round30_timefirst.py")
styles = user_module(STYLES)
CAUSAL = ("--causal",)
N_HEAD, N, B, D = 4, 6, 2, 32


def split(t: torch.Tensor) -> torch.Tensor:
    """[n, b, d] -> [b, n_head, n, d_head]."""
    n, b, d = t.shape
    return t.view(n, b, N_HEAD, d // N_HEAD).permute(1, 2, 0, 3)


def merged(o: torch.Tensor) -> torch.Tensor:
    """[b, n_head, n, d_head] -> [n, b, d]."""
    b, h, n, d = o.shape
    return o.permute(2, 0, 1, 3).reshape(n, b, h * d)


def keep(pad: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, N, N] True = may attend: the causal rule, and the key padding (True = pad) where given."""
    rule = torch.ones(N, N, dtype=torch.bool).tril()[None, None].expand(B, 1, N, N)
    return rule if pad is None else rule & ~pad[:, None, None, :]


def reference(name: str, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA in float64 on the style's own weights, x [N, B, D] time-first."""
    m = getattr(styles, name)().double()
    if name == "SeqFirstMHA":
        q, k, v, out = m.q_proj(x), m.k_proj(x), m.v_proj(x), m.out_proj
    elif name == "PackedMHA":
        q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
        out = m.out_proj
    else:
        n, b, _ = x.shape
        q, k, v = m.query_key_value(x).view(n, b, N_HEAD, 3, D // N_HEAD).unbind(3)
        q, k, v = (t.reshape(n, b, D) for t in (q, k, v))
        out = m.dense
    return out(merged(F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=keep(pad))))


def run_style(name: str, x: torch.Tensor, bug: str = "", pad: torch.Tensor | None = None) -> torch.Tensor:
    """The style in its own convention: attn_mask [N, N] (additive for SeqFirstMHA, boolean True = masked for
    PackedMHA), key_padding_mask [B, N] True = pad; CoreSBH's attention_mask [B, 1, N, N] True = masked."""
    future = torch.ones(N, N, dtype=torch.bool).triu(1)
    if name == "SeqFirstMHA":
        m = styles.SeqFirstMHA(self_attn=True, bug=bug).double()
        additive = torch.zeros(N, N, dtype=torch.float64).masked_fill(future, float("-inf"))
        return m(x, x, x, key_padding_mask=pad, attn_mask=additive)[0]
    if name == "PackedMHA":
        return styles.PackedMHA(bug=bug).double()(x, x, x, key_padding_mask=pad, attn_mask=future)[0]
    return styles.CoreSBH(bug=bug).double()(x, ~keep(pad))


CORRECT = [("SeqFirstMHA", "self_attn=True", CAUSAL), ("SeqFirstMHA", None, CAUSAL), ("PackedMHA", None, CAUSAL),
           ("PackedMHA", "batch_first=False", CAUSAL), ("CoreSBH", None, CAUSAL),
           ("CoreSBH", "bug='qvk_layout'", CAUSAL)]
PLANTS = [("SeqFirstMHA", "self_attn=True, bug='scaled_twice'", CAUSAL, "scale.twice"),
          ("SeqFirstMHA", "self_attn=True, bug='pad_zero'", CAUSAL, "mask.filled_with_0"),
          ("SeqFirstMHA", "self_attn=True, bug='kv_swapped'", CAUSAL, "kv.swapped"),
          ("PackedMHA", "bug='softmax_axis'", CAUSAL, "softmax.axis"),
          ("PackedMHA", "bug='merge'", CAUSAL, "heads.merge_without_transpose"),
          ("CoreSBH", "bug='merge'", CAUSAL, "heads.merge_without_transpose"),
          ("CoreSBH", "bug='kv_swapped'", CAUSAL, "kv.swapped"),
          ("CoreSBH", "bug='softmax_axis'", CAUSAL, "softmax.axis")]


@pytest.mark.parametrize("name", ["SeqFirstMHA", "PackedMHA", "CoreSBH"])
def test_the_styles_are_sdpa_in_their_own_mask_convention(name):
    x = torch.randn(N, B, D, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 4:] = True
    for padding in (None, pad):
        want = reference(name, x, padding)
        assert torch.allclose(run_style(name, x, pad=padding), want, atol=1e-10), (name, padding)
        for _, init, _, _ in (p for p in PLANTS if p[0] == name):
            bug = init.split("'")[1]
            if bug != "pad_zero" or padding is not None:  # the padding's fill shows only where keys are padded
                assert not torch.allclose(run_style(name, x, bug, padding), want, atol=1e-3), (name, bug)  # (NaN: a
                # softmax over the queries of a padded key's column, all -inf)


test_correct_styles_pass = passing_test(STYLES, CORRECT)


def test_a_per_head_order_its_split_names_is_a_layout(runner):
    """Each head's rows laid q | v | k and split under those names (CodeGen's order): the module is SDPA on the
    weights read so, and trace says the layout, not kv.swapped; the same split with the names and the uses crossed
    (`key_layer, value_layer = value_layer, key_layer`) is the swap."""
    m = styles.CoreSBH(bug="qvk_layout").double()
    x = torch.randn(N, B, D, dtype=torch.float64)
    q, v, k = m.query_key_value(x).view(N, B, N_HEAD, 3, D // N_HEAD).unbind(3)
    want = m.dense(merged(F.scaled_dot_product_attention(*(split(t.reshape(N, B, D)) for t in (q, k, v)),
                                                         is_causal=True)))
    assert torch.allclose(m(x, ~keep(None)), want, atol=1e-10)
    code, out = run_case(runner, STYLES, "CoreSBH", "bug='qvk_layout'", CAUSAL)
    assert_passes(code, out)
    assert any("rows hold q, v, k in each of its 4 blocks" in note for note in out["notes"]), out["notes"]
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_mask_reaches_self_attention_that_never_reads_its_key(runner):
    """fairseq's shape of the problem: `self_attention` projects q, k, v from `query`, and the first run's mask,
    sized by a key of another length on batch-first inputs, raised. The mask is given on time-first inputs, one
    tensor for all three, in the code's convention, never left at its default."""
    code, out = run_case(runner, STYLES, "SeqFirstMHA", "self_attn=True", CAUSAL)
    assert_passes(code, out)
    notes = " ".join(out["notes"])
    assert "runs on time-first ones" in notes and "never reads them" in notes, notes
    assert "at their default" not in notes and "attn_mask: additive float" in notes, notes
    assert "key_padding_mask: keys" in notes, notes  # trace's padding runs the code's own padding


def test_a_key_padding_file_goes_to_key_padding_mask(runner, tmp_path):
    """--mask of key padding [n_batch, n_K] (True = may attend): handed to key_padding_mask as the code reads it
    (True = pad), the causal rule to attn_mask, on time-first inputs; a pad filled with 0 is named."""
    keep_keys = np.ones((B, N), dtype=bool)
    keep_keys[0, 4:] = False
    path = tmp_path / "pad.npy"
    np.save(path, keep_keys)
    options = ("--causal", "--mask", str(path))
    code, out = run_case(runner, STYLES, "SeqFirstMHA", "self_attn=True", options)
    assert_passes(code, out)
    notes = " ".join(out["notes"])
    assert "at their default" not in notes and "key_padding_mask: boolean, True = masked out" in notes, notes
    code, out = run_case(runner, STYLES, "SeqFirstMHA", "self_attn=True, bug='pad_zero'", options)
    assert code == 1 and out["first_divergence"]["experiment"] == "mask.filled_with_0", out["first_divergence"]
