"""--check's tolerance is the dtype the run computed in: against the float64 formula, a float16 run's attention
is float32 but its Q and K were projected and rotated in float16; a float64 run made RoPE's tables, the qk-norm,
ALiBi's bias and the temperature's factors in float32, as transformers makes them. And the looser tolerance
still fails a planted error."""

from __future__ import annotations

import pytest
import torch
from test_check import _checked, _plant

from attnscope.cli import app


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("extra", [["--rope"], ["--alibi", "--causal"], ["--kv-heads", "2"], ["--softcap", "2"],
                                   ["--sinks", "random"], ["--qk-norm", "head", "--rope"], ["--temperature-tuning"]])
def test_half_precision_files_on_the_formula_path(runner, tmp_path, dtype, extra):
    """Against the float64 formula the tolerance is the dtype the run computed in: a float16 run holds its
    attention in float32, but projected and rotated Q and K in float16 (it once took float32's and failed);
    a float32 run keeps float32's; a float64 run keeps float64's, but float32's where it made RoPE's tables,
    the qk-norm, ALiBi's bias or the temperature's factors in float32, as transformers makes them (it once
    failed by a hair)."""
    from attnscope.check.comparison import TOLERANCES

    made_in_float32 = {"--rope", "--alibi", "--qk-norm", "--temperature-tuning"} & set(extra)
    expected = torch.float32 if dtype == "float64" and made_in_float32 else getattr(torch, dtype)
    torch.save(torch.randn(2, 5, 16).to(getattr(torch, dtype)), tmp_path / "q.pt")
    commands = [["mha", "--q", str(tmp_path / "q.pt"), "--heads", "4", *extra]]
    if "--kv-heads" not in extra and "--qk-norm" not in extra:
        commands.append(["sdpa", "--q", str(tmp_path / "q.pt"), *extra])
    for command in commands:
        payload, rows = _checked(runner, *command)
        assert payload["check_passed"], rows
        atol, rtol = TOLERANCES[expected]
        for row in rows.values():
            assert row["reference"] == "float64 formula"
            assert atol <= row["tolerance"] <= atol + 10 * rtol, row  # atol + rtol·max|reference|, values of order 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_files_still_fail_a_planted_error(runner, tmp_path, monkeypatch, dtype):
    from attnscope.variants import rope

    torch.save(torch.randn(2, 5, 16).to(getattr(torch, dtype)), tmp_path / "q.pt")
    _plant(monkeypatch, rope, "apply_rope", lambda x, cos, sin: x * cos - rope.rotate_half(x) * sin)
    result = runner.invoke(app, ["mha", "--q", str(tmp_path / "q.pt"), "--heads", "4", "--rope", "--check"])
    assert result.exit_code == 1 and "FAIL" in result.stdout
