"""Round 24's perceiver resampler: the queries are the forward's latents, the keys and values projected from the
context joined to those latents along the tokens (transformers' Idefics2 `k_proj(torch.concat([context, latents],
dim=-2))`), read from the data flow as the reference's key and value input, n_K its length (usertrace/queries.py
input_keys), whichever input comes first and whichever the queries read. And with as many queries as heads, a correct
`view(b, n, h, d).transpose(1, 2)` is not said to be heads split without the transpose (headcauses._swapped_to).
Styles of our own (tests/trace_styles_round24_resampler.py), each checked against F.scaled_dot_product_attention in
float64 over the joined keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import case_ids, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round24_resampler.py")
styles = user_module(STYLES)


def _sdpa(q, k, v, heads, kv_heads=None):
    """F.scaled_dot_product_attention over [n_batch, n, heads·d] projections, merged back to [n_batch, n_Q, ..]."""
    kv_heads = kv_heads or heads
    split = [t.unflatten(-1, (h, -1)).transpose(1, 2) for t, h in ((q, heads), (k, kv_heads), (v, kv_heads))]
    return F.scaled_dot_product_attention(*split, enable_gqa=kv_heads != heads).transpose(1, 2).flatten(2)


def test_the_styles_are_attention_over_the_joined_keys():
    torch.manual_seed(0)
    lat, ctx = torch.randn(2, 4, 24, dtype=torch.float64), torch.randn(2, 6, 24, dtype=torch.float64)
    m = styles.ResamplerAttention().double()
    j = torch.cat([ctx, lat], 1)
    torch.testing.assert_close(m(lat, ctx), m.o_proj(_sdpa(m.q_proj(lat), m.k_proj(j), m.v_proj(j), 4, 2)),
                               rtol=1e-6, atol=1e-6)  # its softmax runs in float32, as transformers' does
    m = styles.PerceiverAttention().double()
    k, v = m.to_kv(j).chunk(2, -1)
    torch.testing.assert_close(m(ctx, lat), m.to_out(_sdpa(m.to_q(lat), k, v, 3)))
    m = styles.FlamingoCrossAttention().double()
    j = torch.cat([lat, ctx], 1)
    torch.testing.assert_close(m(lat, ctx), m.proj(_sdpa(m.q(lat), m.k(j), m.v(j), 4)))


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    lat, ctx = torch.randn(2, 4, 24), torch.randn(2, 6, 24)
    for name, bug in (("ResamplerAttention", "gqa_tiled"), ("ResamplerAttention", "no_scale"),
                      ("ResamplerAttention", "values_from_keys"), ("ResamplerAttention", "merge_no_transpose"),
                      ("PerceiverAttention", "no_scale"), ("PerceiverAttention", "values_from_keys"),
                      ("PerceiverAttention", "merge_no_transpose"), ("FlamingoCrossAttention", "no_scale"),
                      ("FlamingoCrossAttention", "values_from_keys"),
                      ("FlamingoCrossAttention", "merge_no_transpose"), ("ContextAttention", "keys_squashed")):
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=bug)
        assert (good(lat, ctx) - bad(lat, ctx)).abs().max() > 1e-3, (name, bug)


SIZES = ("--nq", "4", "--nk", "6", "--batch", "2")
CORRECT = [("ResamplerAttention", None, SIZES), ("ResamplerAttention", None, ("--nq", "3", "--nk", "5")),
           ("PerceiverAttention", None, SIZES), ("FlamingoCrossAttention", None, SIZES)]
test_correct_styles_pass = passing_test(STYLES, CORRECT)

PLANTS = [("ResamplerAttention", "bug='gqa_tiled'", SIZES, "gqa.tiled"),
          ("ResamplerAttention", "bug='no_scale'", SIZES, "scale.none"),
          ("ResamplerAttention", "bug='values_from_keys'", SIZES, "kv.values_from_keys"),
          ("ResamplerAttention", "bug='merge_no_transpose'", SIZES, "heads.merge_without_transpose"),
          ("PerceiverAttention", "bug='no_scale'", SIZES, "scale.none"),
          ("PerceiverAttention", "bug='values_from_keys'", SIZES, "kv.values_from_keys"),
          ("PerceiverAttention", "bug='merge_no_transpose'", SIZES, "heads.merge_without_transpose"),
          ("FlamingoCrossAttention", "bug='no_scale'", SIZES, "scale.none"),
          ("FlamingoCrossAttention", "bug='values_from_keys'", SIZES, "kv.values_from_keys"),
          ("FlamingoCrossAttention", "bug='merge_no_transpose'", SIZES, "heads.merge_without_transpose")]
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize("target", ["ResamplerAttention", "PerceiverAttention"], ids=case_ids([("R",), ("P",)]))
def test_the_note_says_the_keys_are_joined(runner, target):
    code, out = run_case(runner, STYLES, target, None, SIZES)
    said = [" ".join(n.split()) for n in out["notes"] if "joined along the tokens" in n]
    assert code == 0 and said and "n_K = 10" in said[0], out["notes"]


def test_a_correct_split_is_not_said_to_lack_the_transpose_with_as_many_queries_as_heads(runner):
    code, out = run_case(runner, STYLES, "ContextAttention", "bug='keys_squashed'", SIZES)
    found = out["first_divergence"]
    assert code == 1 and found is not None, out
    assert "split without the transpose" not in found["diagnosis"], found


def test_the_inputs_dims_follow_the_reading(runner):
    """`forward(x, latents)`: the queries turn out to be the second input's projection, so its axis is n_Q, and the
    context's own length (4 here, n_K = 4 + 6 joined) is neither n_Q nor n_K: the op table says its size, not the
    argument position's n_Q."""
    code, out = run_case(runner, STYLES, "PerceiverAttention", None, SIZES)
    given = {step["name"]: step for step in out["steps"][:2]}
    assert code == 0 and given["x"]["dims"] == ["n_batch", "4", "d_feat"], given
    assert given["latents"]["dims"] == ["n_batch", "n_Q", "d_feat"], given
    assert given["x"]["op"] == "input: torch.randn(n_batch, 4, d_feat)", given
