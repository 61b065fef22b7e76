"""`--check` builds its reference from the user's raw inputs and options alone: it passes when attnscope is
right, and fails when a wrong combination is planted in attnscope's own code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from attnscope import cost
from attnscope.check.comparison import compare
from attnscope.cli import app
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.spec import AttentionSpec
from attnscope.variants.rope import Rope

SMALL_SDPA = ["sdpa", "--batch", "2", "--nq", "5", "--nk", "7", "--dk", "8", "--dv", "4"]
SMALL_MHA = ["mha", "--batch", "2", "--nq", "6", "--d-feat", "16", "--heads", "4"]


def _checked(runner, *args):
    result = runner.invoke(app, [*args, "--check", "--json"])
    assert result.exit_code in (0, 1), result.output
    payload = json.loads(result.stdout)
    return payload, {c["name"]: c for c in payload["check"]}


@pytest.mark.parametrize("extra", [
    [], ["--causal"], ["--causal", "lower-right"], ["--window", "3"], ["--softcap", "2"], ["--alibi", "--causal"],
    ["--rope"], ["--rope", "--rope-base", "500000", "--causal", "lower-right"], ["--pad", "2", "--causal"],
    ["--scale", "0.3", "--window", "2", "--pad", "1"],
])
def test_sdpa_variants_pass(runner, extra):
    payload, rows = _checked(runner, *SMALL_SDPA, *extra)
    assert payload["check_passed"], rows


def test_sdpa_cache_passes_and_sets_nk(runner):
    payload, _ = _checked(runner, "sdpa", "--batch", "1", "--nq", "3", "--cache", "5", "--dk", "8", "--dv", "8",
                          "--rope", "--window", "4")
    assert payload["check_passed"]
    assert payload["params"]["nk"] == 8 and payload["params"]["causal"] == "lower-right"


@pytest.mark.parametrize("extra", [
    [], ["--causal"], ["--kv-heads", "2", "--rope", "--causal"], ["--kv-heads", "1"], ["--d-head", "6"],
    ["--scale", "0.25"], ["--softcap", "3", "--window", "2"], ["--alibi"],
    ["--cache", "4", "--rope", "--kv-heads", "2"], ["--no-bias", "--pad", "1"],
    ["--nk", "9", "--causal", "lower-right"],
])
def test_mha_variants_pass(runner, extra):
    payload, rows = _checked(runner, *SMALL_MHA, *extra)
    assert payload["check_passed"], rows
    assert set(rows) == {"x_raw", "attention", "x"}


def test_plain_mha_is_checked_against_nn_multiheadattention(runner):
    _, rows = _checked(runner, *SMALL_MHA, "--causal")
    assert rows["x"]["reference"] == "nn.MultiheadAttention"
    _, rows = _checked(runner, *SMALL_MHA, "--kv-heads", "2")
    assert rows["x"]["reference"] == "float64 formula"


@pytest.fixture()
def mask_files(tmp_path):
    rng = np.random.default_rng(0)
    int_mask = (rng.random((5, 7)) > 0.4).astype(np.int64)
    int_mask[:, 0] = 1
    np.save(tmp_path / "int.npy", int_mask)
    np.save(tmp_path / "keys.npy", np.array([1, 1, 0, 1, 1, 1, 0], dtype=bool))
    np.save(tmp_path / "none.npy", np.zeros((5, 7), dtype=bool))
    np.save(tmp_path / "keys6.npy", np.array([1, 1, 0, 1, 1, 1], dtype=bool))
    return tmp_path


@pytest.mark.parametrize("extra", [["--causal"], ["--causal", "lower-right"], ["--pad", "2"]])
def test_integer_mask_with_causal_or_pad_matches_pytorch(runner, mask_files, extra):
    """The issue's bug: an int 0/1 mask with --causal or --pad was added to the scores, and --check said PASS."""
    payload, rows = _checked(runner, *SMALL_SDPA, "--mask", str(mask_files / "int.npy"), *extra)
    assert payload["check_passed"], rows
    result = run_sdpa(SdpaOptions(batch=2, nq=5, nk=7, dk=8, dv=4, mask=str(mask_files / "int.npy"),
                                  causal=None if "--pad" in extra else extra[-1].replace("--causal", "upper-left"),
                                  pad=2 if "--pad" in extra else 0))
    trace = result.trace
    allowed = torch.from_numpy(np.load(mask_files / "int.npy")).bool()
    if "--pad" in extra:
        allowed[:, 5:] = False
    else:
        allowed &= torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2 if "lower-right" in extra else 0)
    expected = torch.nn.functional.scaled_dot_product_attention(trace["Q"], trace["K"], trace["V"], attn_mask=allowed)
    torch.testing.assert_close(trace["out"], expected)


@pytest.mark.parametrize(("command", "mask", "extra"), [
    (SMALL_SDPA, "keys.npy", []), (SMALL_SDPA, "keys.npy", ["--causal"]), (SMALL_SDPA, "none.npy", []),
    (SMALL_MHA, "keys6.npy", []), (SMALL_MHA, "keys6.npy", ["--pad", "1"]),
])
def test_one_dimensional_and_all_hiding_masks_are_checked(runner, mask_files, command, mask, extra):
    payload, rows = _checked(runner, *command, "--mask", str(mask_files / mask), *extra)
    assert payload["check_passed"], rows


def test_mha_pad_one_check(runner):
    payload, rows = _checked(runner, *SMALL_MHA, "--pad", "1")
    assert payload["check_passed"], rows


# --- planted mistakes: the reference does not share attnscope's code, so it sees them ------------------------


def _plant(monkeypatch, module, name, replacement):
    monkeypatch.setattr(module, name, replacement)


def test_planted_or_instead_of_and_fails(runner, monkeypatch, mask_files):
    from attnscope import masks

    def wrong_combine(first, second):
        if first is None or second is None:
            return first if second is None else second
        return masks.normalize(first) | masks.normalize(second)

    _plant(monkeypatch, masks, "combine", wrong_combine)
    result = runner.invoke(app, [*SMALL_SDPA, "--mask", str(mask_files / "int.npy"), "--pad", "3", "--check"])
    assert result.exit_code == 1 and "FAIL" in result.stdout


def test_planted_window_without_causal_fails(runner, monkeypatch):
    from attnscope import masks

    real = masks.window_mask
    _plant(monkeypatch, masks, "window_mask",
           lambda n_Q, n_K, window, align="upper-left", device=None: real(n_Q, n_K, window, align, device)
           | ~masks.causal_mask(n_Q, n_K, align, device))
    result = runner.invoke(app, [*SMALL_SDPA, "--window", "2", "--check"])
    assert result.exit_code == 1 and "FAIL" in result.stdout


def test_planted_rope_sign_error_fails(runner, monkeypatch):
    from attnscope.variants import rope

    _plant(monkeypatch, rope, "apply_rope", lambda x, cos, sin: x * cos - rope.rotate_half(x) * sin)
    result = runner.invoke(app, [*SMALL_MHA, "--rope", "--kv-heads", "2", "--check"])
    assert result.exit_code == 1 and "FAIL" in result.stdout


def test_planted_wrong_kv_head_sharing_fails(runner, monkeypatch):
    from attnscope.attention import dot_product as attention

    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                        lambda self, n, dim=None: self.repeat(*[n if d == self.dim() + dim else 1
                                                                for d in range(self.dim())]) if dim == -3
                        else real(self, n, dim=dim))
    assert attention  # the planted repeat (tile instead of interleave) is what sdpa calls
    result = runner.invoke(app, [*SMALL_MHA, "--heads", "4", "--kv-heads", "2", "--check"])
    assert result.exit_code == 1 and "FAIL" in result.stdout


# --- NaN-aware comparison ----------------------------------------------------------------------------------


def test_compare_agrees_on_matching_nan_and_inf():
    ours = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    same = compare("out", "ref", ours, ours.clone())
    assert same.passed and same.max_abs_diff == 0 and "same places" in same.detail and math.isfinite(same.tolerance)
    lonely = compare("out", "ref", ours, torch.tensor([1.0, 0.0, float("inf"), 2.0]))
    assert not lonely.passed and "1 NaN on one side only" in lonely.detail


def test_nan_inputs_are_counted_and_checked(runner, tmp_path):
    q = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    q[1, 2, 3] = np.nan
    np.save(tmp_path / "q.npy", q)
    payload, rows = _checked(runner, "sdpa", "--q", str(tmp_path / "q.npy"))
    assert payload["check_passed"], rows
    assert any("Q: 1 NaN, 0 Inf" in note for note in payload["notes"])
    assert all(isinstance(c["tolerance"], float) for c in payload["check"])


# --- what the variants cost -------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"rope": True}, {"softcap": 2.0}, {"alibi": True}, {"window": 3}, {"causal": "lower-right", "rope": True},
    {"cache": 4, "rope": True, "alibi": True},
])
def test_sdpa_estimate_equals_the_traced_run_with_variants(options):
    base = {"batch": 2, "nq": 5, "dk": 8, "dv": 4}
    base["nk"] = None if options.get("cache") else 7
    meta = run_sdpa(SdpaOptions(**base, **options, meta=True))
    real = run_sdpa(SdpaOptions(**base, **options))
    n_K = 7 if not options.get("cache") else options["cache"] + 5
    causal = options.get("causal") or ("lower-right" if options.get("cache") else None)
    spec = AttentionSpec(causal=causal, window=options.get("window"), softcap=options.get("softcap"),
                         alibi=options.get("alibi", False), rope=Rope() if options.get("rope") else None,
                         cache=options.get("cache", 0))
    analytic = cost.sdpa_bytes(2, 5, n_K, 8, 4, spec)
    assert meta.peak_bytes == real.peak_bytes == analytic


@pytest.mark.parametrize("options", [
    {"kv_heads": 2}, {"kv_heads": 1, "rope": True}, {"d_head": 6}, {"softcap": 2.0, "window": 2},
    {"alibi": True, "causal": "upper-left"}, {"cache": 3, "rope": True, "kv_heads": 2}, {"nk": 9, "rope": True},
])
def test_mha_estimate_equals_the_traced_run_with_variants(options):
    base = {"batch": 2, "nq": 5, "d_feat": 16, "heads": 4}
    meta = run_mha(MhaOptions(**base, **options, meta=True))
    real = run_mha(MhaOptions(**base, **options))
    n_new = options.get("nk", 5)
    cache = options.get("cache", 0)
    spec = AttentionSpec(causal=options.get("causal") or ("lower-right" if cache else None),
                         window=options.get("window"), softcap=options.get("softcap"),
                         alibi=options.get("alibi", False), rope=Rope() if options.get("rope") else None,
                         n_kv_head=options.get("kv_heads"), cache=cache)
    analytic = cost.mha_bytes(2, 5, cache + n_new, 16, 4, spec, cross=n_new != 5, d_head=options.get("d_head"))
    assert meta.peak_bytes == real.peak_bytes == analytic


def test_kv_cache_bytes_of_a_gqa_layer():
    result = run_mha(MhaOptions(batch=2, nq=3, d_feat=16, heads=4, kv_heads=2, cache=5))
    assert result.kv_cache_bytes == 2 * 2 * 2 * 8 * 4 * 4  # 2 · n_batch · n_kv_head · n_K · d_head · bytes


def test_llama3_8b_shaped_layer_meta_answers_at_any_size(runner):
    result = runner.invoke(app, ["mha", "--d-feat", "4096", "--heads", "32", "--kv-heads", "8", "--rope", "--causal",
                                 "--batch", "1", "--nq", "8192", "--meta", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    shapes = {t["name"]: t["shape"] for t in payload["tensors"]}
    assert shapes["K_split"] == [1, 8, 8192, 128] and shapes["K_rep"] == [1, 32, 8192, 128]
    assert payload["totals"]["kv_cache_bytes"] == 2 * 1 * 8 * 8192 * 128 * 4


# --- the variants on the command line ---------------------------------------------------------------------


def test_save_keeps_the_variant_steps(runner, tmp_path):
    from safetensors.torch import load_file

    target = tmp_path / "steps.safetensors"
    result = runner.invoke(app, [*SMALL_MHA, "--kv-heads", "2", "--rope", "--softcap", "5", "--save", str(target)])
    assert result.exit_code == 0, result.output
    saved = load_file(str(target))
    assert {"cos", "sin", "Q_rot", "K_rot", "K_rep", "V_rep", "capped_scores"} <= set(saved)
    assert list(saved["K_rep"].shape) == [2, 4, 6, 4]


def test_sdpa_four_d_files_with_fewer_kv_heads_are_gqa(runner, tmp_path):
    rng = np.random.default_rng(0)
    for name, heads in (("q", 6), ("k", 2), ("v", 2), ("k4", 4)):
        np.save(tmp_path / f"{name}.npy", rng.standard_normal((1, heads, 5, 8)).astype(np.float32))
    payload, rows = _checked(runner, "sdpa", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"),
                             "--v", str(tmp_path / "v.npy"), "--causal")
    assert payload["check_passed"], rows
    names = {t["name"]: t["dims"] for t in payload["tensors"]}
    assert names["K"] == ["n_batch", "n_kv_head", "n_K", "d_K"] and names["K_rep"][1] == "n_head"
    bad = runner.invoke(app, ["sdpa", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k4.npy"),
                              "--v", str(tmp_path / "k4.npy")])
    assert bad.exit_code == 2 and "Q has 6 heads and K/V have 4" in bad.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["sdpa", "--rope-base", "500000"], "add --rope"),
    (["sdpa", "--rope", "--rope-base", "1"], "above 1"),
    (["sdpa", "--softcap", "0"], "positive"),
    (["sdpa", "--softcap", "nan"], "positive"),
    (["sdpa", "--cache", "3", "--causal", "upper-left"], "aligns lower-right"),
    (["sdpa", "--cache", "3", "--nq", "2", "--nk", "9"], "n_K = 5, not 9"),
    (["sdpa", "--layout", "col", "--rope"], "drop --layout col"),
    (["sdpa", "--dk", "7", "--rope"], "d_head must be even"),
    (["mha", "--heads", "8", "--kv-heads", "3", "--d-feat", "32"], "not a multiple of --kv-heads 3"),
    (["mha", "--cache", "2", "--nk", "9"], "decode step of self-attention"),
    (["mha", "--scale", "inf"], "finite"),
    (["mha", "--d-feat", "30", "--heads", "4"], "or give --d-head"),
])
def test_variant_mistakes_are_one_line(runner, args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_decoupled_head_runs_where_d_feat_does_not_divide(runner):
    payload, rows = _checked(runner, "mha", "--batch", "1", "--nq", "4", "--d-feat", "30", "--heads", "4",
                             "--d-head", "8")
    assert payload["check_passed"], rows
    shapes = {t["name"]: t["shape"] for t in payload["tensors"]}
    assert shapes["Q_feat"] == [1, 4, 32] and shapes["x"] == [1, 4, 30]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mha_check_of_half_precision_inputs(runner, tmp_path, dtype):
    """attnscope's attention is float32 (computed as PyTorch's math path); nn.MultiheadAttention's is in the
    inputs' precision, so they agree to that precision."""
    q = torch.randn(2, 5, 16).to(getattr(torch, dtype))
    torch.save(q, tmp_path / "q.pt")
    payload, rows = _checked(runner, "mha", "--q", str(tmp_path / "q.pt"), "--heads", "4", "--causal")
    assert payload["check_passed"], rows


@pytest.mark.parametrize("command", [SMALL_SDPA, SMALL_MHA])
def test_a_float64_additive_mask_with_float32_inputs(runner, tmp_path, command):
    """F.scaled_dot_product_attention wants a float mask in the queries' dtype (found by the long fuzz run)."""
    n_K = 7 if command is SMALL_SDPA else 6
    mask = np.random.default_rng(0).standard_normal((command is SMALL_SDPA and 5 or 6, n_K))
    mask[:, 1] = -np.inf
    np.save(tmp_path / "m.npy", mask)
    payload, rows = _checked(runner, *command, "--mask", str(tmp_path / "m.npy"), "--causal")
    assert payload["check_passed"], rows


@pytest.mark.parametrize(("n_Q", "n_K"), [(3, 7), (5, 5), (1, 4)])
def test_lower_right_reference_is_what_causal_lower_right_materializes(n_Q, n_K):
    """--check builds lower-right causal with `tril`, not through torch.nn.attention.bias (whose import pulls in
    torch's compiler and writes $TMPDIR/torchinductor_*); the two are the same mask."""
    from torch.nn.attention.bias import causal_lower_right

    from attnscope.check.reference import Asked, sdpa_mask

    mask, is_causal = sdpa_mask(None, n_Q, n_K, Asked(AttentionSpec(causal="lower-right")))
    assert not is_causal and torch.equal(mask, causal_lower_right(n_Q, n_K)._materialize())
