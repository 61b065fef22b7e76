"""`attnscope trace` names the attention weights multiplied with the values transposed, `attn.transpose(-2, -1) @ v`
(taming-transformers' `torch.bmm(v, w_)` without `w_.permute(0, 2, 1)`, `einsum("bhqk,bhqd->bhkd", attn, v)`): it
runs only where n_Q = n_K, and trace exited 1 at the step after the softmax (or at the scores, in the column form)
with no experiment named, since no catalog entry reran the reference so. Now pattern.transposed does
(usertrace/patterntrials.py), distinct from softmax.axis (a softmax over the queries normalizes the scores' columns;
here the rows are normalized right and their transpose meets the values). Styles of our own
(tests/trace_styles_round27_pattrans.py), each correct one checked against F.scaled_dot_product_attention in
float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_pattrans.py")
styles = user_module(STYLES)


def _sdpa_heads(q, k, v, n_head, causal=False):
    """[B, S, C] each -> SDPA over n_head heads, merged back to [B, S, C] (float64)."""
    B, S, C = q.shape
    q, k, v = (t.reshape(B, S, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, S, C)


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    m = styles.HeadsMatmul().double()
    want = m.out_proj(_sdpa_heads(m.q_proj(x), m.k_proj(x), m.v_proj(x), 4, causal=True))
    torch.testing.assert_close(m(x, causal), want)
    m = styles.EinsumHeads().double()
    q, k, v = m.to_qkv(x).chunk(3, dim=-1)
    for causal_flag in (False, True):
        torch.testing.assert_close(m(x, causal_flag), m.to_out(_sdpa_heads(q, k, v, 4, causal=causal_flag)))
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.FoldedBmm().double()
    q, k, v = m.in_proj(x).chunk(3, dim=-1)
    torch.testing.assert_close(m(x), m.out_proj(_sdpa_heads(q, k, v, 3)))
    fmap = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    m = styles.AttnBlock().double()
    rows = m.norm(fmap).reshape(2, 16, 12).transpose(1, 2)  # [B, hw, C]
    q, k, v = (F.linear(rows, c.weight[..., 0, 0], c.bias) for c in (m.q, m.k, m.v))
    out = F.linear(_sdpa_heads(q, k, v, 1), m.proj_out.weight[..., 0, 0], m.proj_out.bias)
    torch.testing.assert_close(m(fmap), fmap + out.transpose(1, 2).reshape(fmap.shape))


def test_the_plant_is_the_weights_transposed():
    """Each plant computes attnᵀ @ v, by a float64 formula: not a softmax over the queries."""
    torch.manual_seed(1)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    good, bad = styles.EinsumHeads().double(), styles.EinsumHeads(bug="pattern_t").double()
    bad.load_state_dict(good.state_dict())  # the same weights: torch's own init draws them
    q, k, v = (t.reshape(2, 7, 4, 8).transpose(1, 2) for t in good.to_qkv(x).chunk(3, dim=-1))
    attn = (q @ k.transpose(-2, -1) / 8 ** 0.5).softmax(-1)
    planted = good.to_out((attn.transpose(-2, -1) @ v).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(bad(x), planted)
    by_queries = (q @ k.transpose(-2, -1) / 8 ** 0.5).softmax(-2)  # softmax.axis's plant, for contrast
    columns = good.to_out((by_queries @ v).transpose(1, 2).reshape(2, 7, 32))
    assert (bad(x) - columns).abs().max() > 1e-3 and (bad(x) - good(x)).abs().max() > 1e-3


CORRECT = [("HeadsMatmul", None, ()), ("HeadsMatmul", None, ("--causal",)), ("FoldedBmm", None, ()),
           ("AttnBlock", None, ()), ("AttnBlock", None, ("--layout", "col")), ("EinsumHeads", None, ()),
           ("EinsumHeads", None, ("--causal",))]
PLANTS = [("HeadsMatmul", "bug='pattern_t'", (), "pattern.transposed"),
          ("HeadsMatmul", "bug='pattern_t'", ("--causal",), "pattern.transposed"),
          ("FoldedBmm", "bug='pattern_t'", (), "pattern.transposed"),
          ("AttnBlock", "bug='pattern_t'", (), "pattern.transposed"),
          ("AttnBlock", "bug='pattern_t'", ("--layout", "col"), "pattern.transposed"),
          ("EinsumHeads", "bug='pattern_t'", ("--causal",), "pattern.transposed")]

test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_words_say_what_was_reproduced(runner):
    code, out = run_case(runner, STYLES, "FoldedBmm", "bug='pattern_t'")
    words = " ".join(out["first_divergence"]["diagnosis"].split())
    assert "with the weights transposed before they meet the values: [n_K, n_Q] used where [n_Q, n_K]" in words



def test_the_column_form_names_it_in_its_own_layout(tmp_path, runner):
    """The catalog's column-form function (`V @ A2`, A2 = softmax(Kᵀ Q) over the keys) with `V @ A2.transpose(-2, -1)`,
    square (--nq 6 --nk 6: with n_K ≠ n_Q the plant cannot run)."""
    from test_trace_catalog import COLUMNS, source_of
    from test_trace_command import trace, write

    path = write(tmp_path, source_of(COLUMNS, [("return V @ A2", "return V @ A2.transpose(-2, -1)")]), "cols.py")
    result, out = trace(runner, f"{path}:attention_cols", "--layout", "col", "--causal", "--nq", "6", "--nk", "6")
    assert result.exit_code == 1 and out["first_divergence"]["experiment"] == "pattern.transposed", result.output
