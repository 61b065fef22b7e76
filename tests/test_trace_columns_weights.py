"""`attnscope trace` on attention written in the column convention with weights (tests/trace_styles_columns.py):
one token a column, projections W @ x, scores Kᵀ Q, the softmax over dim -2. trace reads the convention from the
code (its rows fail, its columns run: a note, exit 0), projects with W as it stands (W @ x holds W [d_out, d_in]),
reads the head count from per-head weight stacks, and names planted bugs by experiment.

Each correct style exits 0 with every step lined up; apart from attnscope, its output on column inputs equals
F.scaled_dot_product_attention on the same inputs transposed, holding its weights (transposed for x @ W)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_columns.py")
ALIGNED = {"equal", "permuted", "unseen"}


def _moved(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # off their init values
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module


def _traced(runner, target: str, *args: str) -> dict:
    """trace's --json of correct column code: exit 0, every step lined up, the convention said."""
    result, out = trace(runner, target, *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    _clean(out)
    return out


def _clean(out: dict) -> None:
    assert out["first_divergence"] is None, out["first_divergence"]
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]
    assert {"attention", "x"} <= {row["reference"] for row in out["alignment"] if row["status"] != "unseen"}
    assert any("column convention" in note for note in out["notes"]), out["notes"]
    assert out["params"]["layout"] == "col"


def _causal_cols(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()  # [n_Q, n_K], for F.scaled_dot_product_attention


@pytest.mark.parametrize("args", [("--init", "d=12, d_attn=8"), ("--init", "d=12, d_attn=8", "--causal"),
                                  ("--init", "d=12, d_attn=8, causal=True", "--causal"),
                                  ("--init", "d=12, d_attn=8, bias=True", "--causal")])
def test_parameter_module_in_columns_is_read_as_the_column_form(runner, args):
    out = _traced(runner, f"{STYLES}:ColumnAttention", *args)
    assert out["params"]["sizes"]["d_feat"] == 12 and out["params"]["sizes"]["n_head"] == 1
    q_feat = next(row for row in out["alignment"] if row["reference"] == "Q_feat")
    assert q_feat["shape"][-2] == 8 and q_feat["status"] == "equal"  # W_q @ x: [n_batch, d_attn, n_Q]
    m = _moved(user_module(STYLES).ColumnAttention(d=12, d_attn=8, causal=True, bias=True))
    with torch.no_grad():
        x = torch.randn(3, 12, 5)  # [n_batch, d, n]
        rows = x.transpose(-2, -1)  # [n_batch, n, d]
        y = F.scaled_dot_product_attention(F.linear(rows, m.W_q, m.b_q), F.linear(rows, m.W_k, m.b_k),
                                           F.linear(rows, m.W_v, m.b_v), is_causal=True)
        torch.testing.assert_close(m(x), F.linear(y, m.W_o, m.b_o[:, 0]).transpose(-2, -1), atol=1e-5, rtol=1e-5)


def test_explicit_layout_col_works_with_weights(runner):
    result, out = trace(runner, f"{STYLES}:ColumnAttention", "--init", "d=12, d_attn=12", "--layout", "col",
                        "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["params"]["layout"] == "col"
    result, out = trace(runner, f"{STYLES}:ColumnAttention", "--init", "d=12, d_attn=12, bug='no_scale'",
                        "--layout", "col", "--causal")
    assert result.exit_code == 1
    assert (out["first_divergence"]["reference"], out["first_divergence"]["experiment"]) == ("scores", "scale.none")


def test_multi_head_columns_read_the_head_count_from_the_weight_stacks(runner):
    out = _traced(runner, f"{STYLES}:ColumnMultiHead", "--init", "d=24, d_head=4, n_stack=3", "--causal")
    assert out["params"]["sizes"]["n_head"] == 3
    assert any("per-head weights" in note for note in out["notes"]), out["notes"]
    scores = next(row for row in out["alignment"] if row["reference"] == "scores")
    assert scores["status"] == "equal" and scores["shape"][1] == 3  # [n_batch, n_head, n_K, n_Q]
    module = _moved(user_module(STYLES).ColumnMultiHead(d=24, d_head=4, n_stack=3))
    with torch.no_grad():
        x = torch.randn(2, 24, 6)  # [n_batch, d, n]
        rows = x.transpose(-2, -1)[:, None]  # [n_batch, 1, n, d]
        q, k, v = (rows @ w.transpose(-2, -1) for w in (module.W_q, module.W_k, module.W_v))  # [B, H, n, d_head]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, n, d_head]
        merged = y.transpose(1, 2).reshape(2, 6, 12)  # [B, n, H·d_head]
        mask = _causal_cols(6).T[None]  # the column form's [1, n_K, n_Q]
        torch.testing.assert_close(module(x, mask), (merged @ module.W_o.T).transpose(-2, -1), atol=1e-5, rtol=1e-5)


def test_dropout_in_training_mode_is_applied_to_the_column_reference(runner):
    """--train: the mask the code's dropout drew, read off its pattern [n_batch, n_head, n_K, n_Q], applied to the
    reference's, and the steps after it (V @ pattern, the merge, W_o) computed again in the column form."""
    result, out = trace(runner, f"{STYLES}:ColumnMultiHead", "--init", "d=24, d_head=4, n_stack=3, dropout=0.3",
                        "--train", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None
    assert any("dropout in training mode" in note and "of the attention" in note for note in out["notes"])
    x_row = next(row for row in out["alignment"] if row["reference"] == "x")
    assert x_row["status"] == "equal" and x_row["shape"] == [x_row["shape"][0], 24, x_row["shape"][2]]


def test_a_function_taking_its_weights_in_columns(runner):
    """self_attention(x, W_q, W_k, W_v, W_o, mask): trace gives the weight arguments weights, sized by --d-feat."""
    out = _traced(runner, f"{STYLES}:self_attention", "--d-feat", "10", "--causal")
    assert out["params"]["sizes"]["d_feat"] == 10
    assert any("weights as arguments" in note for note in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:self_attention", "--causal", "--forward", "bug='softmax_axis'")
    assert result.exit_code == 1
    assert (out["first_divergence"]["reference"], out["first_divergence"]["experiment"]) == ("attention",
                                                                                             "softmax.axis")
    fn = user_module(STYLES).self_attention
    W = [torch.randn(10, 10) for _ in range(4)]
    x = torch.randn(2, 10, 7)  # [n_batch, d, n]
    rows = x.transpose(-2, -1)
    y = F.scaled_dot_product_attention(rows @ W[0].T, rows @ W[1].T, rows @ W[2].T, is_causal=True)  # [B, n, d]
    mask = _causal_cols(7).T  # [n_K, n_Q]
    torch.testing.assert_close(fn(x, *W, mask), (y @ W[3].T).transpose(-2, -1), atol=1e-5, rtol=1e-5)


def test_a_row_function_taking_its_weights_reads_their_side(runner):
    """x @ w: the reference holds wᵀ (the same square weights held as they stand would diverge at Q_feat)."""
    result, out = trace(runner, f"{STYLES}:row_attention", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["params"]["layout"] == "row"
    assert next(row for row in out["alignment"] if row["reference"] == "Q_feat")["status"] == "equal"
    fn = user_module(STYLES).row_attention
    W = [torch.randn(12, 12) for _ in range(3)]
    x = torch.randn(2, 5, 12)
    y = F.scaled_dot_product_attention(x @ W[0], x @ W[1], x @ W[2], is_causal=True)
    torch.testing.assert_close(fn(x, *W, _causal_cols(5)), y, atol=1e-5, rtol=1e-5)


def test_weightless_column_code_is_read_without_the_flag(runner):
    """docs/examples/textbook.py's attention_cols, traced without --layout col: rows fail, columns run."""
    docs = str(Path(__file__).resolve().parent.parent / "docs" / "examples" / "textbook.py")
    result, out = trace(runner, f"{docs}:attention_cols", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["params"]["layout"] == "col"
    assert any("column convention" in note for note in out["notes"]), out["notes"]


def test_column_code_that_runs_on_rows_is_read_by_what_lines_up(runner):
    """self_columns(X) runs on rows without an error, computing Xᵀ X [d, d]: only its columns line up."""
    result, out = trace(runner, f"{STYLES}:self_columns")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["params"]["layout"] == "col"
    assert any("lines up with the reference only on columns" in note for note in out["notes"]), out["notes"]
    X = torch.randn(2, 6, 5)  # [n_batch, d, n]
    rows = X.transpose(-2, -1)
    torch.testing.assert_close(user_module(STYLES).self_columns(X),
                               F.scaled_dot_product_attention(rows, rows, rows).transpose(-2, -1), atol=1e-5, rtol=1e-5)


def test_the_papers_function_on_one_sequence(runner):
    """docs/examples/columns.py's Algorithm 3, attention(X, Z, W_q, W_k, W_v, mask): [d, n] inputs (.T, dim=0),
    queries' tokens and a context of another length."""
    docs = str(Path(__file__).resolve().parent.parent / "docs" / "examples" / "columns.py")
    out = _traced(runner, f"{docs}:attention", "--causal")
    sizes = out["params"]["sizes"]
    assert sizes["n_Q"] != sizes["n_K"] and "n_batch" not in sizes
    fn = user_module(docs).attention
    W = [torch.randn(12, 12) for _ in range(3)]
    X, Z = torch.randn(12, 4), torch.randn(12, 7)  # [d, n_Q], [d, n_K]
    y = F.scaled_dot_product_attention(X.T @ W[0].T, Z.T @ W[1].T, Z.T @ W[2].T)  # [n_Q, d]
    torch.testing.assert_close(fn(X, Z, *W), y.T, atol=1e-5, rtol=1e-5)


def test_einsum_projections_in_columns(runner):
    """torch.einsum("hcd,bdn->bhcn", W, x): a projection, the weight on the side its contracted index says."""
    out = _traced(runner, f"{STYLES}:EinsumColumns")
    assert out["params"]["sizes"]["n_head"] == 4
    assert "q=W_q, k=W_k, v=W_v, o=W_o" in out["reference"]
    result, out = trace(runner, f"{STYLES}:EinsumColumns", "--init", "bug='no_scale'")
    assert result.exit_code == 1 and out["first_divergence"]["experiment"] == "scale.none"
    module = _moved(user_module(STYLES).EinsumColumns())
    with torch.no_grad():
        x = torch.randn(2, 20, 6)  # [n_batch, d, n]
        rows = x.transpose(-2, -1)[:, None]  # [n_batch, 1, n, d]
        q, k, v = (rows @ w.transpose(-2, -1) for w in (module.W_q, module.W_k, module.W_v))  # [B, H, n, d_head]
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 6, 20)  # [B, n, H·d_head]
        torch.testing.assert_close(module(x), (y @ module.W_o.T).transpose(-2, -1), atol=1e-5, rtol=1e-5)


def test_unbatched_module_in_columns(runner):
    out = _traced(runner, f"{STYLES}:UnbatchedColumns", "--causal")
    assert "n_batch" not in out["params"]["sizes"]
    module = _moved(user_module(STYLES).UnbatchedColumns(d=12))
    with torch.no_grad():
        X = torch.randn(12, 5)
        y = F.scaled_dot_product_attention(X.T @ module.W_q.T, X.T @ module.W_k.T, X.T @ module.W_v.T,
                                           is_causal=True)
        torch.testing.assert_close(module(X, _causal_cols(5).T), (y @ module.W_o.T).T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("style", "init", "step", "entry"), [
    ("ColumnAttention", "d=12, d_attn=8, bug='softmax_axis'", "attention", "softmax.axis"),
    ("ColumnAttention", "d=12, d_attn=8, bug='scale_d_model'", "scores", "scale.d_model"),
    ("ColumnAttention", "d=12, d_attn=8, bug='no_scale'", "scores", "scale.none"),
    ("ColumnAttention", "d=12, d_attn=8, bug='kv_swapped'", "scores", "kv.swapped"),
    ("ColumnAttention", "d=12, d_attn=8, causal=True, bug='polarity'", "masked_scores", "mask.polarity"),
    ("ColumnAttention", "d=12, d_attn=8, causal=True, bug='after_softmax'", "masked_scores", "mask.after_softmax"),
    ("ColumnMultiHead", "d=24, d_head=4, n_stack=3, bug='scale_d_model'", "scores", "scale.d_model"),
    ("ColumnMultiHead", "d=24, d_head=4, n_stack=3, bug='merge_without_transpose'", "x_rsh2",
     "heads.merge_without_transpose"),
    ("UnbatchedColumns", "bug='softmax_axis'", "attention", "softmax.axis"),
])
def test_planted_bugs_in_columns_are_named_by_experiment(runner, style, init, step, entry):
    result, out = trace(runner, f"{STYLES}:{style}", "--init", init, "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == (step, entry), first
    if entry == "softmax.axis":
        assert "dim=-2 of scores [.., n_K, n_Q]" in first["diagnosis"]


def test_the_projection_is_written_as_the_code_writes_it(runner):
    result, out = trace(runner, f"{STYLES}:ColumnAttention", "--init", "d=12, d_attn=8")
    ops = [step["op"] for step in out["steps"]]
    assert any(op.endswith("W_q @ x") for op in ops), ops
    assert math.isfinite(out["alignment"][-1]["max_abs_diff"])


def _padding(tmp_path: Path) -> tuple[str, torch.Tensor]:
    import numpy as np

    keys = torch.ones(2, 6, dtype=torch.bool)
    keys[1, 4:] = False  # the second sequence's last two keys padded
    path = tmp_path / "padding.npy"
    np.save(path, keys.numpy())
    return str(path), keys


def test_key_padding_for_square_column_scores_is_handed_along_the_keys(runner, tmp_path):
    """Square scores turned to rows (Qᵀ K [.., n_Q, n_K]) in code that indexes its key padding itself: the
    padding is handed as [n_batch, n_K] along the keys, where the mask handed whole ([.., n_K, n_Q]) raised. It
    once was read along the queries' axis of the column mask, padding nothing: a false 'mask not applied'."""
    file, keys = _padding(tmp_path)
    out = _traced(runner, f"{STYLES}:PaddedColumns", "--batch", "2", "--nq", "6", "--mask", file)
    assert any("[n_batch, n_K] key padding" in note for note in out["notes"]), out["notes"]
    m = _moved(user_module(STYLES).PaddedColumns())
    with torch.no_grad():
        x = torch.randn(2, 16, 6, dtype=torch.float64)
        m = m.double()
        rows = x.transpose(-2, -1)
        q, k, v = (F.linear(rows, w).view(2, 6, 2, 8).transpose(1, 2) for w in (m.W_q, m.W_k, m.W_v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None, :])
        expected = F.linear(y.transpose(1, 2).reshape(2, 6, 16), m.W_o).transpose(-2, -1)
        torch.testing.assert_close(m(x, keys), expected)


@pytest.mark.parametrize(("bug", "entry"), [("keys_from_values", "kv.keys_from_values"),
                                            ("on_queries", "mask.on_queries")])
def test_plants_beside_key_padding_in_columns_are_named(runner, tmp_path, bug, entry):
    file, keys = _padding(tmp_path)
    planted = _moved(user_module(STYLES).PaddedColumns(bug=bug)).double()
    right = user_module(STYLES).PaddedColumns().double()
    right.load_state_dict(planted.state_dict())
    x = torch.randn(2, 16, 6, dtype=torch.float64)
    with torch.no_grad():
        assert (planted(x, keys) - right(x, keys)).abs().max() > 1e-3
    result, out = trace(runner, f"{STYLES}:PaddedColumns", "--init", f"bug='{bug}'", "--batch", "2", "--nq", "6",
                        "--mask", file)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == entry, out["first_divergence"]
