"""The run layer behind `sdpa` and `mha`: inputs from files, projections, the column layout, --check, --save."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnscope import load_tensor
from attnscope.errors import ResourceError, UsageError
from attnscope.runs import sdpa as sdpa_run
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa

ATOL = 1e-5


@pytest.fixture()
def qkv_files(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"q": rng.standard_normal((2, 4, 8)), "k": rng.standard_normal((2, 6, 8)),
              "v": rng.standard_normal((2, 6, 3))}
    for name, array in arrays.items():
        np.save(tmp_path / f"{name}.npy", array.astype(np.float32))
    return {name: str(tmp_path / f"{name}.npy") for name in arrays}, arrays


def test_sdpa_from_files_matches_pytorch(qkv_files):
    files, arrays = qkv_files
    result = run_sdpa(SdpaOptions(q=files["q"], k=files["k"], v=files["v"], check=True))
    Q, K, V = (torch.from_numpy(arrays[n]).float() for n in "qkv")
    torch.testing.assert_close(result.trace["out"], F.scaled_dot_product_attention(Q, K, V))
    assert result.trace.step("Q").op == f"loaded from {files['q']}"
    assert [c.passed for c in result.comparisons] == [True]


def test_float64_inputs_stay_float64(tmp_path):
    np.save(tmp_path / "q.npy", np.random.default_rng(1).standard_normal((3, 4)))
    result = run_sdpa(SdpaOptions(q=str(tmp_path / "q.npy"), check=True))
    assert result.trace["out"].dtype == torch.float64
    assert not result.check_failed


def test_only_q_means_self_attention(qkv_files):
    files, arrays = qkv_files
    result = run_sdpa(SdpaOptions(q=files["q"]))
    Q = torch.from_numpy(arrays["q"]).float()
    torch.testing.assert_close(result.trace["out"], F.scaled_dot_product_attention(Q, Q, Q))


def test_projection_form_with_small_integer_matrices(tmp_path):
    X = np.array([[1, 0, 1], [0, 2, 0], [1, 1, 1], [0, 1, 2]])
    W = {"wq": np.array([[1, 0], [0, 1], [1, 1]]), "wk": np.array([[0, 1], [1, 0], [1, 0]]),
         "wv": np.array([[1, 2, 0], [0, 1, 1], [1, 0, 1]])}
    np.save(tmp_path / "x.npy", X)
    for name, w in W.items():
        np.save(tmp_path / f"{name}.npy", w)
    result = run_sdpa(SdpaOptions(x=str(tmp_path / "x.npy"), **{n: str(tmp_path / f"{n}.npy") for n in W},
                                  check=True))
    assert list(result.trace)[:7] == ["X", "W_Q", "W_K", "W_V", "Q", "K", "V"]
    Xt = torch.tensor(X, dtype=torch.float32)
    Q, K, V = (Xt @ torch.tensor(W[n], dtype=torch.float32) for n in ("wq", "wk", "wv"))
    torch.testing.assert_close(result.trace["Q"], Q)
    assert result.trace.step("Q").op == "X @ W_Q"
    torch.testing.assert_close(result.trace["out"], F.scaled_dot_product_attention(Q, K, V))
    assert any("integer inputs" in note for note in result.trace.notes)


def test_column_layout_equals_row_form_transposed():
    result = run_sdpa(SdpaOptions(layout="col", batch=2, nq=5, nk=7, dk=4, dv=3, causal="lower-right", check=True))
    Q, K, V = (result.trace[n] for n in ("Q", "K", "V"))
    assert Q.shape == (2, 4, 5) and result.trace["scores"].shape == (2, 7, 5)
    assert result.trace["out"].shape == (2, 3, 5)
    # every column of the attention (one query) sums to 1 over the keys
    torch.testing.assert_close(result.trace["attention"].sum(dim=-2), torch.ones(2, 5))
    from torch.nn.attention.bias import causal_lower_right

    row = F.scaled_dot_product_attention(Q.mT, K.mT, V.mT, attn_mask=causal_lower_right(5, 7))
    torch.testing.assert_close(result.trace["out"], row.mT, atol=ATOL, rtol=ATOL)
    assert any("transposed" in note for note in result.trace.notes)
    assert not result.check_failed


def test_mha_from_file_self_and_cross_attention(qkv_files, tmp_path):
    np.save(tmp_path / "feat.npy", np.random.default_rng(2).standard_normal((2, 5, 12)).astype(np.float32))
    np.save(tmp_path / "mem.npy", np.random.default_rng(3).standard_normal((2, 9, 12)).astype(np.float32))
    own = run_mha(MhaOptions(q=str(tmp_path / "feat.npy"), heads=3, check=True))
    assert own.trace["scores"].shape == (2, 3, 5, 5) and not own.check_failed
    cross = run_mha(MhaOptions(q=str(tmp_path / "feat.npy"), k=str(tmp_path / "mem.npy"), heads=4, check=True,
                               causal="upper-left"))
    assert cross.trace["scores"].shape == (2, 4, 5, 9) and not cross.check_failed


def test_check_catches_the_sqrt_d_feat_pitfall(monkeypatch):
    """--check must fail when the math is wrong: scale by sqrt(d_feat) inside MHA, as the pitfall does."""
    from dataclasses import replace

    from attnscope.attention import dot_product as attention

    real_sdpa = attention.sdpa

    def pitfall(Q, K, V, mask=None, *, spec, **kwargs):
        d_feat = Q.shape[-1] * Q.shape[-3]
        return real_sdpa(Q, K, V, mask, spec=replace(spec, scale=1 / math.sqrt(d_feat)), **kwargs)

    monkeypatch.setattr(attention, "sdpa", pitfall)
    result = run_mha(MhaOptions(batch=2, nq=6, d_feat=40, heads=5, check=True))
    verdicts = {c.name: c.passed for c in result.comparisons}
    assert verdicts == {"x_raw": False, "attention": False, "x": False}
    assert result.check_failed


def test_check_against_torch_with_pad_and_fully_masked_rows():
    result = run_mha(MhaOptions(batch=2, nq=4, nk=6, d_feat=16, heads=2, pad=2, causal="lower-right", check=True))
    assert not result.check_failed
    masked = run_sdpa(SdpaOptions(batch=1, nq=6, nk=3, dk=4, dv=2, causal="lower-right", check=True))
    assert not masked.check_failed
    assert torch.equal(masked.trace["out"][0, :3], torch.zeros(3, 2))  # the first 3 queries see no key
    assert any("may attend to no key" in n for n in masked.trace.notes)


def test_save_writes_every_step_by_name(tmp_path):
    target = tmp_path / "mha.safetensors"
    result = run_mha(MhaOptions(batch=2, nq=3, d_feat=8, heads=2, save=str(target)))
    assert result.saved == target
    for name in ("Q_feat", "Q_split", "scores", "attention", "x_raw", "x_rsh1", "x"):
        torch.testing.assert_close(load_tensor(f"{target}:{name}"), result.trace[name])


def test_save_onto_existing_file_is_refused_before_any_work(tmp_path, monkeypatch):
    target = tmp_path / "out.npz"
    target.write_bytes(b"keep me")
    monkeypatch.setattr(sdpa_run, "_sdpa_trace", lambda *a, **k: pytest.fail("computed before refusing"))
    with pytest.raises(UsageError, match="--force"):
        run_sdpa(SdpaOptions(save=str(target)))
    assert target.read_bytes() == b"keep me"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (SdpaOptions(meta=True, check=True), "--meta"),
        (SdpaOptions(k="k.npy"), "need --q"),
        (SdpaOptions(x="x.npy"), "all four"),
        (SdpaOptions(pad=50), "pad 50"),  # the core's words; the command line says --pad (test_cli)
        (MhaOptions(dropout=0.2, check=True), "dropout"),
        (MhaOptions(d_feat=10, heads=4), "--d-feat 10 is not divisible by --heads 4"),
    ],
)
def test_bad_option_combinations(options, message):
    run = run_sdpa if isinstance(options, SdpaOptions) else run_mha
    with pytest.raises(UsageError, match=message):
        run(options)


def test_memory_guard_refuses_with_the_estimate():
    with pytest.raises(ResourceError, match=r"needs about .* --max-memory .* --meta"):
        run_sdpa(SdpaOptions(max_memory=1000))


def test_mha_float64_and_integer_files_take_the_inputs_dtype(tmp_path):
    np.save(tmp_path / "d.npy", np.random.default_rng(4).standard_normal((2, 5, 8)))
    np.save(tmp_path / "i.npy", np.arange(80).reshape(2, 5, 8) % 3)
    wide = run_mha(MhaOptions(q=str(tmp_path / "d.npy"), heads=2, check=True))
    assert wide.trace["x"].dtype == torch.float64 and not wide.check_failed
    ints = run_mha(MhaOptions(q=str(tmp_path / "i.npy"), heads=2, check=True))
    assert ints.trace["x"].dtype == torch.float32 and not ints.check_failed
    assert any("float32" in note for note in ints.trace.notes)


def test_guard_counts_what_check_and_save_add(tmp_path):
    traced = run_sdpa(SdpaOptions()).peak_bytes
    run_sdpa(SdpaOptions(max_memory=int(traced * 1.5)))  # fits alone
    with pytest.raises(ResourceError, match="needs about"):
        run_sdpa(SdpaOptions(max_memory=int(traced * 1.5), check=True))
    with pytest.raises(ResourceError, match="needs about"):
        run_sdpa(SdpaOptions(max_memory=int(traced * 1.5), save=str(tmp_path / "s.npz")))
    assert not (tmp_path / "s.npz").exists()


def test_a_nan_never_passes_the_check():
    from attnscope.check.comparison import compare

    ours = torch.zeros(2, 3)
    reference = ours.clone()
    reference[1, 2] = float("nan")
    assert not compare("out", "ref", ours, reference).passed
    assert compare("out", "ref", ours, ours.clone()).passed


def test_mha_file_of_the_wrong_rank_says_so(tmp_path):
    np.save(tmp_path / "flat.npy", np.ones(8, dtype=np.float32))
    with pytest.raises(UsageError, match=r"is \[8\] but multi-head attention takes \[n_batch, n, d_feat\]"):
        run_mha(MhaOptions(q=str(tmp_path / "flat.npy")))


@pytest.mark.parametrize(("nk", "causal"), [(None, None), (7, "lower-right")])
def test_mha_save_can_be_checked_again_by_anyone(tmp_path, nk, causal):
    """A saved mha run holds its inputs, its mask and the module's parameters under PyTorch's names: loading
    them into torch.nn.MultiheadAttention reproduces the saved x and attention."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = tmp_path / "run.safetensors"
    result = run_mha(MhaOptions(batch=2, nq=5, nk=nk, d_feat=16, heads=4, causal=causal, save=str(path)))
    saved = load_file(path)
    names = {f"W_{p}.{kind}" for p in "qkvo" for kind in ("weight", "bias")}
    assert names <= set(saved) and "Q" in saved and set(result.trace) <= set(saved)
    assert ("K" in saved) == (nk is not None) and ("causal_mask" in saved) == (causal is not None)
    assert len(result.saved_names) == len(saved)
    Q = saved["Q"]
    K = saved.get("K", Q)
    V = saved.get("V", K)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([saved["W_q.weight"], saved["W_k.weight"], saved["W_v.weight"]]))
        ref.in_proj_bias.copy_(torch.cat([saved["W_q.bias"], saved["W_k.bias"], saved["W_v.bias"]]))
        ref.out_proj.weight.copy_(saved["W_o.weight"])
        ref.out_proj.bias.copy_(saved["W_o.bias"])
        mask = None if "causal_mask" not in saved else ~saved["causal_mask"]  # nn.MultiheadAttention: True = masked
        x, attention = ref(Q, K, V, attn_mask=mask, need_weights=True, average_attn_weights=False)
    assert torch.allclose(x, saved["x"], atol=ATOL) and torch.allclose(attention, saved["attention"], atol=ATOL)
    with safe_open(str(path), "pt") as f:
        import json

        described = json.loads(f.metadata()["attnscope"])
    assert described["W_q.weight"]["dims"] == ["out_features", "in_features"]
    assert described["Q"]["dims"] == ["n_batch", "n_Q", "d_feat"]
