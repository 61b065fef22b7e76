"""`attnscope trace` on what the code's data flow and its config declare (issue 41, round 7).

- Column-form self-attention with square scores (n_Q = n_K): which axis of the code's scores holds the keys is read
  from the product that makes them (which input, or which projection's weight, each operand comes from), never from
  the shape, so `Qᵀ K` [n_Q, n_K] and `Kᵀ Q` [n_K, n_Q] both line up, and --causal is handed in the orientation of
  the code's scores. A softmax over the queries' axis is still `softmax.axis` by experiment; a mask laid over the
  scores transposed is still a divergence, mask.transposed by experiment.
- A config --init hands an __init__ that does not keep it (gpt-fast's `__init__(self, config)` copying fields): its
  softcap, scale and RoPE base are read from it (usertrace/declared.py, the one place every declared value is read).

The styles are tests/trace_styles_round7_declared.py. Every correct one is checked apart from attnscope against
F.scaled_dot_product_attention or a float64 formula and exits 0; every planted bug changes the output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round7_declared.py")
styles = user_module(STYLES)

SQUARE = ("--layout", "col", "--batch", "0", "--nq", "6", "--nk", "6")
HEADS = "d_model=16, n_heads=2"
CAPPED = "config=FastArgs(attn_logit_softcapping=2.0)"
SCALED = "config=FastArgs(query_pre_attn_scalar=24)"
ROTARY = "config=FastArgs(rope_base=500000, attn_logit_softcapping=2.0, query_pre_attn_scalar=24)"

CORRECT = [
    ("textbook_qtk", None, SQUARE),
    ("textbook_qtk", None, (*SQUARE, "--causal")),
    ("textbook_qtk_mask_transposed", None, SQUARE),  # given no mask, it computes what the reference computes
    ("textbook_ktq", None, (*SQUARE, "--causal")),
    ("ColumnHeads", HEADS, ("--layout", "col")),
    ("ColumnHeads", HEADS, ("--layout", "col", "--causal")),
    ("ColumnKeysFirst", HEADS, ("--layout", "col", "--causal")),
    ("FastCapped", CAPPED, ("--causal",)),
    ("FastScaled", SCALED, ("--causal",)),
    ("FastRotary", ROTARY, ("--causal", "--rope")),
]
PLANTED = [  # (target, init, options, the catalog's entry; None: a divergence no entry names)
    ("textbook_qtk_softmax_dim0", None, (*SQUARE, "--causal"), "softmax.axis"),
    ("textbook_qtk_softmax_dim0", None, SQUARE, "softmax.axis"),
    ("textbook_ktq_softmax_dim1", None, (*SQUARE, "--causal"), "softmax.axis"),
    ("ColumnHeads", f"{HEADS}, bug='softmax_queries'", ("--layout", "col", "--causal"), "softmax.axis"),
    ("ColumnKeysFirst", f"{HEADS}, bug='softmax_queries'", ("--layout", "col"), "softmax.axis"),
    ("textbook_qtk_mask_transposed", None, (*SQUARE, "--causal"), "mask.transposed"),
    ("ColumnKeysFirst", f"{HEADS}, bug='mask_transposed'", ("--layout", "col", "--causal"), "mask.transposed"),
    ("FastCapped", f"{CAPPED}, bug='no_softcap'", ("--causal",), "softcap.missing"),
    ("FastScaled", f"{SCALED}, bug='d_head'", ("--causal",), "scale.none"),
    ("FastRotary", f"{ROTARY}, bug='default_base'", ("--causal", "--rope"), "rope.base"),
]


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_styles_pass(runner, target, init, options):
    assert_passes(*run_case(runner, STYLES, target, init, options))


@pytest.mark.parametrize(("target", "init", "options", "entry"), PLANTED,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(PLANTED)])
def test_planted_bugs_diverge_and_are_named_by_experiment(runner, target, init, options, entry):
    code, out = run_case(runner, STYLES, target, init, options)
    found = out["first_divergence"]
    assert code == 1 and found is not None, out
    assert found["experiment"] == entry, found
    if entry is not None:
        assert found["evidence"].startswith("by experiment"), found


def test_square_scores_read_in_the_codes_orientation(runner):
    """Qᵀ K [n_Q, n_K]: the scores line up permuted (their keys' axis read from the product), the mask is handed as
    they are laid out, and a softmax down the queries is said in the code's own axes (dim=-2 of [.., n_Q, n_K])."""
    code, out = run_case(runner, STYLES, "textbook_qtk", None, (*SQUARE, "--causal"))
    rows = {row["reference"]: row for row in out["alignment"]}
    assert rows["scores"]["status"] == "permuted" and rows["scores"]["layout"] == "as [n_Q, n_K]", rows["scores"]
    assert any("given [.., n_Q, n_K], as your scores are laid out" in n for n in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "textbook_qtk_softmax_dim0", None, (*SQUARE, "--causal"))
    assert "dim=-2 where the keys' axis is dim=-1 of scores [.., n_Q, n_K]" in out["first_divergence"]["diagnosis"]
    code, out = run_case(runner, STYLES, "textbook_ktq", None, (*SQUARE, "--causal"))  # the column form's own
    assert not any("as your scores are laid out" in n for n in out["notes"]), out["notes"]


def test_config_values_read_from_a_config_the_init_does_not_keep(runner):
    code, out = run_case(runner, STYLES, "FastRotary", ROTARY, ("--causal", "--rope"))
    said = " ".join(out["notes"])
    assert "RoPE base 500000" in said and "softcap 2, read from your module" in said, out["notes"]
    assert "query_pre_attn_scalar = 24" in said, out["notes"]


# --- the styles checked apart from attnscope ----------------------------------------------------------------


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_column_styles_are_pytorchs_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 6), torch.randn(8, 6), torch.randn(10, 6)  # [d, n], one token a column
    for mask in (None, _causal(6)):
        want = F.scaled_dot_product_attention(q.T[None], k.T[None], v.T[None], attn_mask=mask)[0].T  # [d_v, n_q]
        torch.testing.assert_close(styles.textbook_qtk(q, k, v, mask), want)
        torch.testing.assert_close(styles.textbook_ktq(q, k, v, None if mask is None else mask.T), want)
        torch.testing.assert_close(styles.textbook_qtk_mask_transposed(q, k, v, None), styles.textbook_qtk(q, k, v))
    c = _causal(6)
    right = styles.textbook_qtk(q, k, v, c)
    assert not torch.allclose(styles.textbook_qtk_softmax_dim0(q, k, v, c), right)
    assert not torch.allclose(styles.textbook_qtk_softmax_dim0(q, k, v), styles.textbook_qtk(q, k, v))
    assert not torch.allclose(styles.textbook_qtk_mask_transposed(q, k, v, c), right)
    assert not torch.allclose(styles.textbook_ktq_softmax_dim1(q, k, v, c.T), styles.textbook_ktq(q, k, v, c.T))

    x = torch.randn(3, 16, 7)  # [n_batch, d, n]
    with torch.no_grad():
        for cls, mask in ((styles.ColumnHeads, _causal(7)), (styles.ColumnKeysFirst, _causal(7).T)):
            m = cls().eval()
            heads = [(w @ x).view(3, 2, 8, 7).transpose(-2, -1) for w in (m.W_q, m.W_k, m.W_v)]  # [b, h, n, d_head]
            y = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(-2, -1).reshape(3, 16, 7)
            torch.testing.assert_close(m(x, mask[None, None]), m.W_o @ y, atol=1e-5, rtol=1e-5)
            bugs = ("softmax_queries", "mask_transposed") if cls is styles.ColumnKeysFirst else ("softmax_queries",)
            for bug in bugs:
                planted = cls(bug=bug).eval()
                planted.load_state_dict(m.state_dict())
                assert not torch.allclose(planted(x, mask[None, None]), m(x, mask[None, None]), atol=1e-4)


def _capped(q, k, v, scale, cap):
    """softmax(cap · tanh(q kᵀ scale / cap), causal) v in float64."""
    scores = q.double() @ k.double().transpose(-2, -1) * scale
    scores = cap * torch.tanh(scores / cap) if cap is not None else scores
    return scores.masked_fill(~_causal(q.shape[-2]), float("-inf")).softmax(-1) @ v.double()


def test_config_styles_are_float64_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        m = styles.FastCapped(styles.FastArgs(attn_logit_softcapping=2.0)).eval()
        q, k, v = (t.view(2, 5, 4, 8).transpose(1, 2) for t in m.wqkv(x).split(32, -1))
        want = _capped(q, k, v, 8 ** -0.5, 2.0).transpose(1, 2).reshape(2, 5, 32).float()
        torch.testing.assert_close(m(x), m.wo(want), atol=1e-5, rtol=1e-5)
        planted = styles.FastCapped(styles.FastArgs(attn_logit_softcapping=2.0), bug="no_softcap").eval()
        planted.load_state_dict(m.state_dict())
        assert not torch.allclose(planted(x), m(x), atol=1e-4)

        s = styles.FastScaled(styles.FastArgs(query_pre_attn_scalar=24)).eval()
        q, k, v = (w(x).view(2, 5, 4, 8).transpose(1, 2) for w in (s.wq, s.wk, s.wv))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=24 ** -0.5)
        torch.testing.assert_close(s(x, _causal(5)), s.wo(want.transpose(1, 2).reshape(2, 5, 32)), atol=1e-5, rtol=1e-5)
        planted = styles.FastScaled(styles.FastArgs(query_pre_attn_scalar=24), bug="d_head").eval()
        planted.load_state_dict(s.state_dict())
        assert not torch.allclose(planted(x, _causal(5)), s(x, _causal(5)), atol=1e-4)

        r = styles.FastRotary(styles.FastArgs(rope_base=500000, attn_logit_softcapping=2.0,
                                              query_pre_attn_scalar=24)).eval()
        q, k, v = r.attn(x).view(2, 5, 3, 4, 8).permute(2, 0, 3, 1, 4)
        angles = torch.arange(5, dtype=torch.float64)[:, None] * 500000.0 ** (-torch.arange(0, 8, 2) / 8)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

        def rotated(t):
            t = t.double()
            return t * cos + torch.cat([-t[..., 4:], t[..., :4]], -1) * sin

        want = _capped(rotated(q), rotated(k), v, 24 ** -0.5, 2.0).transpose(1, 2).reshape(2, 5, 32).float()
        torch.testing.assert_close(r(x), r.proj(want), atol=1e-5, rtol=1e-5)
        planted = styles.FastRotary(styles.FastArgs(rope_base=500000, attn_logit_softcapping=2.0,
                                                    query_pre_attn_scalar=24), bug="default_base").eval()
        planted.load_state_dict(r.state_dict())
        assert not torch.allclose(planted(x), r(x), atol=1e-4)
