"""Masks and scale against PyTorch's own attention: the same mask must give the same numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from attnscope import MultiHeadAttention, sdpa
from attnscope.check.comparison import reference_mha
from attnscope.errors import UsageError
from attnscope.masks import causal_mask, key_padding_mask

ATOL = 1e-5


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # n_Q > n_K: the point
@pytest.mark.parametrize(("n_Q", "n_K"), [(4, 4), (3, 7), (6, 2)])
def test_causal_masks_match_torch_bias(n_Q, n_K):
    assert torch.equal(causal_mask(n_Q, n_K, "upper-left"), causal_upper_left(n_Q, n_K)._materialize())
    assert torch.equal(causal_mask(n_Q, n_K, "lower-right"), causal_lower_right(n_Q, n_K)._materialize())


@pytest.mark.parametrize(("n_Q", "n_K"), [(5, 5), (3, 8)])
def test_upper_left_causal_matches_is_causal(n_Q, n_K):
    Q, K, V = torch.randn(2, n_Q, 8), torch.randn(2, n_K, 8), torch.randn(2, n_K, 3)
    trace = sdpa(Q, K, V, causal_mask(n_Q, n_K))
    torch.testing.assert_close(trace["out"], F.scaled_dot_product_attention(Q, K, V, is_causal=True),
                               atol=ATOL, rtol=ATOL)
    assert "masked_scores" in trace


def test_lower_right_causal_matches_torch():
    Q, K, V = torch.randn(2, 3, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
    trace = sdpa(Q, K, V, causal_mask(3, 7, "lower-right"))
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=causal_lower_right(3, 7))
    torch.testing.assert_close(trace["out"], expected, atol=ATOL, rtol=ATOL)


def test_boolean_float_and_integer_masks_match_pytorch():
    Q, K, V = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 5)
    allowed = torch.rand(2, 4, 6) > 0.3
    allowed[..., 0] = True
    additive = torch.randn(4, 6)
    expected_bool = F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed)
    torch.testing.assert_close(sdpa(Q, K, V, allowed)["out"], expected_bool, atol=ATOL, rtol=ATOL)
    # the tutorials' 0/1 integer masks mean the same as booleans
    torch.testing.assert_close(sdpa(Q, K, V, allowed.long())["out"], expected_bool, atol=ATOL, rtol=ATOL)
    expected_float = F.scaled_dot_product_attention(Q, K, V, attn_mask=additive)
    torch.testing.assert_close(sdpa(Q, K, V, additive)["out"], expected_float, atol=ATOL, rtol=ATOL)


def test_fully_masked_row_gives_zeros_like_pytorch_and_is_flagged():
    Q, K, V = torch.randn(1, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 2)
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    trace = sdpa(Q, K, V, allowed)
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed)
    torch.testing.assert_close(trace["out"], expected, atol=ATOL, rtol=ATOL)
    assert torch.equal(trace["out"][0, 1], torch.zeros(2))
    assert torch.equal(trace["attention"][0, 1], torch.zeros(5))
    assert not torch.isnan(trace["attention"]).any()
    assert any("n_Q index 1" in note for note in trace.notes)


def test_key_padding_hides_the_last_keys():
    Q, K, V = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 3)
    trace = sdpa(Q, K, V, key_padding_mask(6, 2))
    assert torch.equal(trace["attention"][..., 4:], torch.zeros(2, 4, 2))
    expected = F.scaled_dot_product_attention(Q[..., :, :], K[:, :4], V[:, :4])
    torch.testing.assert_close(trace["out"], expected, atol=ATOL, rtol=ATOL)


def test_scale_replaces_one_over_sqrt_dk():
    Q, K, V = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 3)
    trace = sdpa(Q, K, V, scale=0.3)
    torch.testing.assert_close(trace["out"], F.scaled_dot_product_attention(Q, K, V, scale=0.3),
                               atol=ATOL, rtol=ATOL)
    assert "* 0.3" in trace.step("scores").op


def test_mask_that_does_not_broadcast_names_both_shapes():
    Q, K, V = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 3)
    with pytest.raises(UsageError, match=r"\[3, 5\].*\[2, 4, 6\]"):
        sdpa(Q, K, V, torch.ones(3, 5, dtype=torch.bool))


def test_integer_mask_with_other_values_is_refused():
    Q = torch.randn(1, 2, 4)
    with pytest.raises(UsageError, match="only 0"):
        sdpa(Q, Q, Q, torch.tensor([[0, 2], [1, 1]]))


def test_mha_masks_match_torch_with_the_inverted_convention():
    mha = MultiHeadAttention(32, 4).eval()
    ref = reference_mha(mha)
    Q = torch.randn(2, 5, 32)
    allowed = causal_mask(5, 5)
    with torch.no_grad():
        ours = mha(Q, mask=allowed)
        # nn.MultiheadAttention: True means "masked out", the opposite of attnscope and F.sdpa
        x, attention = ref(Q, Q, Q, attn_mask=~allowed, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(ours["x"], x, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(ours["attention"], attention, atol=ATOL, rtol=ATOL)


def test_mha_three_dim_mask_is_shared_by_every_head():
    mha = MultiHeadAttention(16, 2).eval()
    Q = torch.randn(3, 4, 16)
    allowed = torch.rand(3, 4, 4) > 0.4
    allowed[..., 0] = True
    with torch.no_grad():
        trace = mha(Q, mask=allowed)
        expected = F.scaled_dot_product_attention(trace["Q_split"], trace["K_split"], trace["V_split"],
                                                  attn_mask=allowed.unsqueeze(1))
    torch.testing.assert_close(trace["x_raw"], expected, atol=ATOL, rtol=ATOL)


def test_combined_boolean_and_float_masks_match_pytorch():
    from attnscope.masks import combine

    Q, K, V = torch.randn(2, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 3)
    allowed = causal_mask(4, 6, "lower-right")
    bias = torch.randn(4, 6)
    both = combine(allowed, bias)
    assert both.dtype == torch.float32
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=bias.masked_fill(~allowed, float("-inf")))
    torch.testing.assert_close(sdpa(Q, K, V, both)["out"], expected, atol=ATOL, rtol=ATOL)
    assert torch.equal(combine(allowed, key_padding_mask(6, 1)), allowed & key_padding_mask(6, 1))
