"""`attnscope diff A B`: two saved runs compared step by step (issue 23).

Files are written by the commands themselves (`mha --save`, `trace --save`) or by safetensors/torch/numpy
directly; every max |diff| is checked against the same difference computed here with torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_main import INTERNAL, run_main
from safetensors.torch import save_file

DOCS = Path(__file__).resolve().parent.parent / "docs" / "examples"


def saved(path: Path, tensors: dict[str, torch.Tensor], dims: dict[str, list[str]] | None = None) -> str:
    """A run as --save writes it: tensors, and in the header each one's dims and op."""
    meta = {name: {"dims": (dims or {}).get(name), "op": f"made {name}"} for name in tensors}
    save_file(tensors, str(path), metadata={"attnscope": json.dumps(meta)})
    return str(path)


def diff(*args: str):
    outcome = run_main("diff", *args, "--json")
    payload = json.loads(outcome.stdout) if outcome.stdout.strip().startswith("{") else None
    return outcome, payload


def steps_of(payload) -> dict[str, dict]:
    return {row["name"]: row for row in payload["steps"]}


def test_two_runs_of_the_same_command_agree_and_a_different_seed_diverges_at_its_first_step(tmp_path):
    runs = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        outcome = run_main("mha", "--heads", "2", "--d-feat", "8", "--batch", "2", "--nq", "5", "--seed", seed,
                           "--save", str(tmp_path / f"{name}.safetensors"))
        assert outcome.code == 0, outcome.stderr
        runs[name] = str(tmp_path / f"{name}.safetensors")
    outcome, out = diff(runs["a"], runs["b"])
    assert outcome.code == 0, outcome.stderr
    assert out["first_divergence"] is None and {r["status"] for r in out["steps"]} == {"agrees"}
    assert [r["name"] for r in out["steps"]][:3] == ["Q_feat", "K_feat", "V_feat"]  # in the run's own order
    assert steps_of(out)["scores"]["dims"] == ["n_batch", "n_head", "n_Q", "n_K"]

    outcome, out = diff(runs["a"], runs["c"])
    assert outcome.code == 1
    assert out["first_divergence"]["name"] == "Q_feat"
    assert any("did not start from the same numbers" in n for n in out["notes"])
    from safetensors.torch import load_file

    a, c = load_file(runs["a"]), load_file(runs["c"])
    assert steps_of(out)["x"]["max_abs_diff"] == pytest.approx(float((c["x"] - a["x"]).abs().max()), rel=1e-6)


def test_a_planted_scale_bug_is_named_with_traces_diagnosis(tmp_path):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    dims = {"Q": ["n_batch", "n_head", "n_Q", "d_K"], "K": ["n_batch", "n_head", "n_K", "d_K"],
            "scores": ["n_batch", "n_head", "n_Q", "n_K"], "attention": ["n_batch", "n_head", "n_Q", "n_K"]}
    a = saved(tmp_path / "a.safetensors", {"Q": q, "K": k, "scores": scores, "attention": scores.softmax(-1)}, dims)
    wrong = scores * math.sqrt(8)  # not divided at all
    b = saved(tmp_path / "b.safetensors", {"Q": q, "K": k, "scores": wrong, "attention": wrong.softmax(-1)}, dims)
    outcome, out = diff(a, b)
    assert outcome.code == 1
    assert out["first_divergence"]["name"] == "scores"
    assert "√8 ≈ 2.83 = √d_K times too large: not divided by √d_K" in out["first_divergence"]["diagnosis"]
    assert steps_of(out)["Q"]["status"] == steps_of(out)["K"]["status"] == "agrees"


def test_nan_in_the_same_places_agrees_and_on_one_side_only_diverges(tmp_path):
    x = torch.randn(4, 6)
    x[1, 2] = float("nan")
    a = saved(tmp_path / "a.safetensors", {"x": x})
    b = saved(tmp_path / "b.safetensors", {"x": x.clone()})
    outcome, out = diff(a, b)
    assert outcome.code == 0 and "NaN on both sides" in steps_of(out)["x"]["detail"]
    y = x.clone()
    y[3, 3] = float("nan")
    c = saved(tmp_path / "c.safetensors", {"x": y})
    outcome, out = diff(a, c)
    assert outcome.code == 1 and "NaN on one side only" in steps_of(out)["x"]["detail"]
    assert out["steps"][0]["max_abs_diff"] is None  # infinite: null in JSON, never Infinity
    assert "Infinity" not in outcome.stdout and "NaN" not in outcome.stdout.replace("NaN on", "")


def test_different_dtypes_compare_within_the_looser_tolerance(tmp_path):
    torch.manual_seed(1)
    x = torch.randn(16, 16)
    a = saved(tmp_path / "fp32.safetensors", {"x": x})
    b = saved(tmp_path / "bf16.safetensors", {"x": x.bfloat16()})
    outcome, out = diff(a, b)
    assert outcome.code == 0, outcome.stdout
    row = steps_of(out)["x"]
    assert (row["dtype_a"], row["dtype_b"]) == ("float32", "bfloat16")
    assert row["max_abs_diff"] == pytest.approx(float((x.bfloat16().float() - x).abs().max()), rel=1e-6)
    assert row["tolerance"] == pytest.approx(2e-2 + 2e-2 * float(x.abs().max()), rel=1e-6)  # bfloat16's
    outcome, out = diff(a, b, "--atol", "0", "--rtol", "0")
    assert outcome.code == 1 and steps_of(out)["x"]["tolerance"] == 0
    c = saved(tmp_path / "off.safetensors", {"x": (x + 0.5).bfloat16()})
    assert diff(a, c)[0].code == 1


def test_eager_and_fused_nanogpt_agree_step_by_step(tmp_path):
    """trace --save of nanoGPT's eager path and of its F.scaled_dot_product_attention path: the fused run's
    scores and attention are recomputed (said), and every step agrees."""
    eager = tmp_path / "eager.py"
    eager.write_text((DOCS / "nanogpt.py").read_text().replace(
        "self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')", "self.flash = False"))
    files = {}
    for name, source in (("eager", str(eager)), ("fused", str(DOCS / "nanogpt.py"))):
        files[name] = str(tmp_path / f"{name}.safetensors")
        outcome = run_main("trace", f"{source}:CausalSelfAttention", "--init", "config=GPTConfig(n_embd=64, n_head=4)",
                           "--causal", "--save", files[name])
        assert outcome.code == 0, outcome.stderr
    outcome, out = diff(files["eager"], files["fused"])
    assert outcome.code == 0, outcome.stdout
    names = [row["name"] for row in out["steps"]]
    assert {"Q_feat", "scores", "masked_scores", "attention", "x_raw", "x"} <= set(names)
    assert any("recomputed by trace" in n and "attention" in n for n in out["notes"])


def test_a_traced_bug_against_the_corrected_module(tmp_path):
    example = str(DOCS / "my_attention.py")
    files = {}
    for name in ("MultiHeadedAttention", "FixedAttention"):
        files[name] = str(tmp_path / f"{name}.pt")
        outcome = run_main("trace", f"{example}:{name}", "--init", "d_feat=200, n_head=5", "--save", files[name])
        assert outcome.code in (0, 1), outcome.stderr
    outcome, out = diff(files["FixedAttention"], files["MultiHeadedAttention"])
    assert outcome.code == 1
    assert out["first_divergence"]["name"] == "scores"
    assert "divided by √d_feat, not √d_head" in out["first_divergence"]["diagnosis"]


def test_steps_in_one_file_only_are_listed_and_npz_compares_by_name(tmp_path):
    x, y = np.ones((2, 3), np.float32), np.zeros(4, np.float32)
    np.savez(tmp_path / "a.npz", x=x, only_a=y)
    np.savez(tmp_path / "b.npz", x=x, only_b=y)
    outcome, out = diff(str(tmp_path / "a.npz"), str(tmp_path / "b.npz"))
    assert outcome.code == 0
    assert out["only_a"] == ["only_a"] and out["only_b"] == ["only_b"] and [r["name"] for r in out["steps"]] == ["x"]
    text = run_main("diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"))
    assert "only in A: only_a" in text.stdout and "only in B: only_b" in text.stdout


def test_a_shape_or_a_boolean_mask_that_differs_diverges(tmp_path):
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    a = saved(tmp_path / "a.safetensors", {"mask": mask, "x": torch.zeros(2, 3)})
    b = saved(tmp_path / "b.safetensors", {"mask": ~mask, "x": torch.zeros(3, 2)})
    outcome, out = diff(a, b)
    assert outcome.code == 1 and out["first_divergence"]["name"] == "mask"
    assert steps_of(out)["x"]["status"] == "shape" and steps_of(out)["mask"]["max_abs_diff"] == 1.0


@pytest.mark.parametrize(("b", "message"), [
    ("missing.safetensors", "no such file"), ("notes.txt", "not a saved run"),
    ("truncated.safetensors", "not a valid .safetensors file"), ("other.safetensors", "hold no step of the same name"),
    ("folder.npz", "is a folder"),
])
def test_bad_files_are_one_line_and_exit_2(tmp_path, b, message):
    a = saved(tmp_path / "a.safetensors", {"x": torch.zeros(2)})
    saved(tmp_path / "other.safetensors", {"y": torch.zeros(2)})
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "truncated.safetensors").write_bytes((tmp_path / "other.safetensors").read_bytes()[:10])
    (tmp_path / "folder.npz").mkdir()
    outcome = run_main("diff", a, str(tmp_path / b))
    assert outcome.code == 2 and len(outcome.error_lines) == 1, outcome.stderr
    assert message in outcome.stderr and INTERNAL not in outcome.stderr, outcome.stderr


def test_bad_tolerances_are_refused(tmp_path):
    a = saved(tmp_path / "a.safetensors", {"x": torch.zeros(2)})
    for flag, value in (("--atol", "-1"), ("--rtol", "nan")):
        outcome = run_main("diff", a, a, flag, value)
        assert outcome.code == 2 and "give a tolerance of 0 or more" in outcome.stderr, outcome.stderr


def test_json_contract(tmp_path):
    a = saved(tmp_path / "a.safetensors", {"x": torch.zeros(2)}, {"x": ["n_Q"]})
    outcome, out = diff(a, a)
    assert set(out) >= {"command", "params", "steps", "only_a", "only_b", "first_divergence", "notes"}
    assert out["command"] == "diff" and out["params"]["a"] == a
    assert set(out["steps"][0]) >= {"name", "dims", "shape_a", "shape_b", "dtype_a", "dtype_b", "max_abs_diff",
                                    "tolerance", "status", "detail"}


def test_a_mask_read_the_other_way_round_is_named(tmp_path):
    torch.manual_seed(2)
    scores = torch.randn(2, 6, 6)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    dims = {name: ["n_batch", "n_Q", "n_K"] for name in ("scores", "masked_scores", "attention")}

    def run(path: Path, keep: torch.Tensor) -> str:
        masked = scores.masked_fill(~keep, float("-inf"))
        attention = torch.softmax(masked, -1).nan_to_num(0.0)
        return saved(path, {"scores": scores, "masked_scores": masked, "attention": attention}, dims)

    outcome, out = diff(run(tmp_path / "a.safetensors", allowed), run(tmp_path / "b.safetensors", ~allowed))
    assert outcome.code == 1 and out["first_divergence"]["name"] == "masked_scores"
    assert "the mask is read the other way round" in out["first_divergence"]["diagnosis"]
