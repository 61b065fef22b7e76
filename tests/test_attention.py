"""sdpa and MultiHeadAttention against PyTorch's own attention, to float32 precision."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnscope import MultiHeadAttention, merge_heads, sdpa, split_heads
from attnscope.check.comparison import reference_mha
from attnscope.errors import UsageError

ATOL = 1e-5

SHAPES = [
    # (Q shape, K shape, V shape)
    ((3, 30, 128), (3, 50, 128), (3, 50, 256)),  # the tutorial demo: n_Q != n_K, d_V != d_K
    ((7, 16), (9, 16), (9, 5)),  # 2-D: no batch at all
    ((2, 4, 6, 8), (2, 4, 10, 8), (2, 4, 10, 3)),  # two leading batch dims
    ((1, 1, 4), (1, 1, 4), (1, 1, 4)),  # one query, one key
    ((5, 3, 8), (1, 12, 8), (1, 12, 8)),  # K and V broadcast over the batch
]


@pytest.mark.parametrize(("q_shape", "k_shape", "v_shape"), SHAPES)
def test_sdpa_matches_pytorch(q_shape, k_shape, v_shape):
    Q, K, V = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    trace = sdpa(Q, K, V)
    expected = F.scaled_dot_product_attention(Q, K, V)
    torch.testing.assert_close(trace["out"], expected, atol=ATOL, rtol=ATOL)
    # the attention weights are what PyTorch's math computes: softmax(Q Kᵀ / sqrt(d_K))
    weights = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(q_shape[-1]), dim=-1)
    torch.testing.assert_close(trace["attention"], weights, atol=ATOL, rtol=ATOL)


def test_sdpa_steps_in_order_with_dims_for_the_demo():
    trace = sdpa(torch.randn(3, 30, 128), torch.randn(3, 50, 128), torch.randn(3, 50, 256))
    assert list(trace) == ["Q", "K", "V", "scores", "attention", "out"]
    expected = {
        "Q": ((3, 30, 128), ("n_batch", "n_Q", "d_K")),
        "K": ((3, 50, 128), ("n_batch", "n_K", "d_K")),
        "V": ((3, 50, 256), ("n_batch", "n_K", "d_V")),
        "scores": ((3, 30, 50), ("n_batch", "n_Q", "n_K")),
        "attention": ((3, 30, 50), ("n_batch", "n_Q", "n_K")),
        "out": ((3, 30, 256), ("n_batch", "n_Q", "d_V")),
    }
    for name, (shape, dims) in expected.items():
        assert trace.step(name).shape == shape
        assert trace.step(name).dims == dims
    assert trace.step("out").dims_text() == "[n_batch, n_Q, d_V] = [3, 30, 256]"


def test_sdpa_flops_follow_the_matmul_rule():
    trace = sdpa(torch.randn(3, 30, 128), torch.randn(3, 50, 128), torch.randn(3, 50, 256))
    assert trace.step("scores").flops == 3 * (2 * 30 * 128 * 50 + 30 * 50)  # matmul + scaling
    assert trace.step("out").flops == 3 * 2 * 30 * 50 * 256


def test_sdpa_2d_dims_have_no_batch():
    trace = sdpa(torch.randn(7, 16), torch.randn(9, 16), torch.randn(9, 5))
    assert trace.step("scores").dims == ("n_Q", "n_K")
    assert trace.step("out").shape == (7, 5)


def test_sdpa_is_pure():
    Q, K, V = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    before = [t.clone() for t in (Q, K, V)]
    first, second = sdpa(Q, K, V), sdpa(Q, K, V)
    torch.testing.assert_close(first["out"], second["out"], rtol=0, atol=0)
    for original, kept in zip((Q, K, V), before, strict=True):
        assert torch.equal(original, kept)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "message"),
    [
        ((3, 4, 8), (3, 5, 9), (3, 5, 2), "d_Q = 8 but d_K = 9"),
        ((3, 4, 8), (3, 5, 8), (3, 6, 2), "n_K = 5 but n_V = 6"),
        ((3, 4, 8), (2, 5, 8), (2, 5, 2), "do not broadcast"),
        ((8,), (5, 8), (5, 2), "rank 1"),
    ],
)
def test_sdpa_rejects_bad_shapes_with_a_message(q_shape, k_shape, v_shape, message):
    with pytest.raises(UsageError, match=message):
        sdpa(torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape))


def test_integer_inputs_are_computed_in_float32_and_say_so():
    Q = torch.randint(0, 3, (2, 3, 4))
    trace = sdpa(Q, Q, Q)
    assert trace["out"].dtype == torch.float32
    assert any("float32" in note for note in trace.notes)
    torch.testing.assert_close(trace["out"], F.scaled_dot_product_attention(Q.float(), Q.float(), Q.float()))


def test_float64_stays_float64():
    Q = torch.randn(2, 3, 4, dtype=torch.float64)
    trace = sdpa(Q, Q, Q)
    assert trace["out"].dtype == torch.float64
    torch.testing.assert_close(trace["out"], F.scaled_dot_product_attention(Q, Q, Q), atol=1e-12, rtol=1e-12)


def test_split_and_merge_heads_are_inverse():
    x = torch.randn(4, 7, 12)
    split = split_heads(x, 3)
    assert split.shape == (4, 3, 7, 4)
    torch.testing.assert_close(merge_heads(split), x, rtol=0, atol=0)
    # head h holds features h*d_head:(h+1)*d_head, as BERT's transpose_for_scores lays them out
    torch.testing.assert_close(split[:, 1], x[:, :, 4:8], rtol=0, atol=0)


MHA_CASES = [
    # (n_batch, n_Q, n_K, d_feat, n_head, bias)
    (128, 32, 32, 200, 5, True),  # the tutorial demo
    (4, 16, 40, 64, 4, True),  # cross-attention: n_Q != n_K
    (2, 1, 9, 24, 8, False),  # one query, no bias
    (3, 10, 10, 30, 1, True),  # one head is plain SDPA with projections
]


@pytest.mark.parametrize(("n_batch", "n_Q", "n_K", "d_feat", "n_head", "bias"), MHA_CASES)
def test_mha_matches_torch_multihead_attention(n_batch, n_Q, n_K, d_feat, n_head, bias):
    mha = MultiHeadAttention(d_feat, n_head, bias=bias).eval()
    ref = reference_mha(mha)
    Q = torch.randn(n_batch, n_Q, d_feat)
    KV = torch.randn(n_batch, n_K, d_feat)
    with torch.no_grad():
        trace = mha(Q, KV, KV)
        x, attention = ref(Q, KV, KV, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(trace["x"], x, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(trace["attention"], attention, atol=ATOL, rtol=ATOL)


def test_reference_mha_is_really_torch_with_our_weights():
    # Guard the guard: the reference is torch.nn.MultiheadAttention itself, holding our weights
    mha = MultiHeadAttention(16, 4)
    ref = reference_mha(mha)
    assert type(ref) is torch.nn.MultiheadAttention
    torch.testing.assert_close(ref.in_proj_weight[:16], mha.W_q.weight)
    torch.testing.assert_close(ref.out_proj.weight, mha.W_o.weight)


def test_mha_demo_steps_and_shapes():
    mha = MultiHeadAttention(200, 5)
    with torch.no_grad():
        trace = mha(torch.randn(128, 32, 200))
    expected = {
        "Q_feat": (128, 32, 200), "K_feat": (128, 32, 200), "V_feat": (128, 32, 200),
        "Q_split": (128, 5, 32, 40), "K_split": (128, 5, 32, 40), "V_split": (128, 5, 32, 40),
        "scores": (128, 5, 32, 32), "attention": (128, 5, 32, 32), "x_raw": (128, 5, 32, 40),
        "x_rsh1": (128, 32, 5, 40), "x_rsh2": (128, 32, 200), "x": (128, 32, 200),
    }
    assert list(trace) == list(expected)
    for name, shape in expected.items():
        assert trace.step(name).shape == shape, name
    assert trace.step("Q_split").dims_text() == "[n_batch, n_head, n_Q, d_head] = [128, 5, 32, 40]"
    assert trace.step("Q_split").op == "Q_feat.view(n_batch, -1, n_head, d_head).permute(0, 2, 1, 3)"
    assert trace.step("x_rsh1").dims == ("n_batch", "n_Q", "n_head", "d_head")


def test_mha_scales_by_sqrt_d_head_not_sqrt_d_feat():
    mha = MultiHeadAttention(200, 5)
    with torch.no_grad():
        trace = mha(torch.randn(2, 6, 200))
    raw = trace["Q_split"] @ trace["K_split"].transpose(-2, -1)
    torch.testing.assert_close(trace["scores"], raw / math.sqrt(40))
    assert not torch.allclose(trace["scores"], raw / math.sqrt(200))


def test_mha_inner_step_is_sdpa():
    mha = MultiHeadAttention(32, 4)
    with torch.no_grad():
        trace = mha(torch.randn(2, 5, 32), torch.randn(2, 7, 32), torch.randn(2, 7, 32))
        inner = sdpa(trace["Q_split"], trace["K_split"], trace["V_split"])
    torch.testing.assert_close(trace["x_raw"], inner["out"], rtol=0, atol=0)


def test_mha_record_false_matches_and_only_holds_x():
    recorded = MultiHeadAttention(64, 8).eval()
    fast = MultiHeadAttention(64, 8, record=False).eval()
    fast.load_state_dict(recorded.state_dict())
    Q = torch.randn(3, 11, 64)
    with torch.no_grad():
        slow_out, fast_out = recorded(Q), fast(Q)
    assert list(fast_out) == ["x"]
    torch.testing.assert_close(fast_out["x"], slow_out["x"], atol=ATOL, rtol=ATOL)


def test_mha_not_divisible_names_both_numbers_and_the_nearest_divisors():
    with pytest.raises(UsageError, match=r"d_feat = 200 is not divisible by n_head = 7.*5 or 8"):
        MultiHeadAttention(200, 7)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_mha_rejects_dropout_outside_unit_interval(p):
    with pytest.raises(UsageError, match="dropout"):
        MultiHeadAttention(16, 4, dropout_p=p)


def test_mha_dropout_applies_only_in_training():
    mha = MultiHeadAttention(16, 4, dropout_p=0.5)
    Q = torch.randn(2, 6, 16)
    with torch.no_grad():
        mha.eval()
        first, second = mha(Q)["attention"], mha(Q)["attention"]
        torch.testing.assert_close(first, second)
        mha.train()
        dropped = mha(Q)["attention"]
    assert (dropped == 0).any()
    assert "dropout" in mha.train()(Q).step("attention").op


def test_gradients_match_pytorch_with_and_without_a_mask():
    from attnscope.masks import causal_mask

    for mask in (None, causal_mask(3, 5, "lower-right"), causal_mask(6, 5, "lower-right")):  # the last: empty rows
        leaves = [torch.randn(2, n, 4, requires_grad=True) for n in ((6 if mask is not None and mask.shape[0] == 6
                                                                       else 3), 5, 5)]
        ours = sdpa(*leaves, mask)["out"]
        torch.autograd.backward(ours.sum())
        ours_grads = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        F.scaled_dot_product_attention(*leaves, attn_mask=mask).sum().backward()
        for mine, theirs in zip(ours_grads, [t.grad for t in leaves], strict=True):
            torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=ATOL)


def test_mha_gradients_reach_every_weight():
    mha = MultiHeadAttention(16, 4)
    mha(torch.randn(2, 5, 16), mask=torch.tril(torch.ones(5, 5, dtype=torch.bool)))["x"].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mha.parameters())
