"""The matrix form in the column layout (`sdpa --x --wq --wk --wv --layout col`): Q = W_Q X as the seed
derivation writes it, checked against PyTorch's attention on the same numbers (issue 18)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from cli_main import assert_usage_error, run_main

from attnscope.runs.sdpa import SdpaOptions, run_sdpa


def _files(tmp_path, shapes):
    rng = np.random.default_rng(3)
    paths = {}
    for name, shape in shapes.items():
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], rng.standard_normal(shape))
    return paths


def test_column_matrix_form_is_pytorchs_attention_transposed(tmp_path):
    """X [p, n] (a token a column), W [d, p]: out = V · softmax(Kᵀ Q / √d_K) with Q = W_Q X, which is
    F.scaled_dot_product_attention on the row form (W X)ᵀ, transposed back."""
    files = _files(tmp_path, {"x": (2, 6, 5), "wq": (8, 6), "wk": (8, 6), "wv": (4, 6)})
    result = run_sdpa(SdpaOptions(**files, layout="col", check=True, causal="upper-left"))
    X, W_Q, W_K, W_V = (torch.from_numpy(np.load(files[n])) for n in ("x", "wq", "wk", "wv"))
    Q, K, V = ((W @ X).transpose(-2, -1) for W in (W_Q, W_K, W_V))  # [2, n, d]
    expected = F.scaled_dot_product_attention(Q, K, V, is_causal=True).transpose(-2, -1)  # [2, d_V, n_Q]
    torch.testing.assert_close(result.trace["out"], expected)
    assert [s.name for s in result.trace.steps][:7] == ["X", "W_Q", "W_K", "W_V", "Q", "K", "V"]
    assert result.trace.step("Q").dims == ("n_batch", "d_K", "n_Q") and result.trace.step("Q").op == "W_Q @ X"
    assert result.trace.step("X").dims == ("n_batch", "p", "n")
    assert all(c.passed for c in result.comparisons) and result.comparisons


def test_column_matrix_form_on_the_command_line(tmp_path):
    files = _files(tmp_path, {"x": (6, 5), "wq": (8, 6), "wk": (8, 6), "wv": (4, 6)})
    args = [token for name in ("x", "wq", "wk", "wv") for token in (f"--{name}", files[name])]
    outcome = run_main("sdpa", *args, "--layout", "col", "--check", "--json")
    assert outcome.code == 0, outcome.stderr
    payload = outcome.json()
    Q = next(t for t in payload["tensors"] if t["name"] == "Q")
    assert Q["shape"] == [8, 5] and payload["params"]["layout"] == "col" and payload["params"]["nq"] == 5


def test_column_matrix_form_names_what_does_not_fit(tmp_path):
    files = _files(tmp_path, {"x": (6, 5), "wq": (8, 7), "wk": (8, 6), "wv": (4, 6)})
    args = [token for name in ("x", "wq", "wk", "wv") for token in (f"--{name}", files[name])]
    assert_usage_error(run_main("sdpa", *args, "--layout", "col"), "W X needs W_Q's columns (7)",
                       "X's rows (p = 6)")
