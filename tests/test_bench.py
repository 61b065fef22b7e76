"""`attnscope bench`: every contender computes the same result as the traced path, and the report says so."""

from __future__ import annotations

import json

import pytest
import torch

from attnscope.cli import app
from attnscope.runs.race import mha_race, run, sdpa_race


def bench_sdpa(batch, nq, nk, dk, dv, *, causal, device, dtype, runs, warmup):
    """`attnscope bench sdpa`'s race, run as the command runs it (runs/bench.py)."""
    return run(sdpa_race(batch, nq, nk, dk, dv, causal=causal, device=device, dtype=dtype), runs, warmup)


def bench_mha(batch, nq, nk, d_feat, heads, *, bias, causal, device, dtype, runs, warmup, kv_heads=None,
              tick=lambda _: None):
    """`attnscope bench mha`'s race, run as the command runs it."""
    race = mha_race(batch, nq, nk, d_feat, heads, bias=bias, causal=causal, device=device, dtype=dtype,
                    kv_heads=kv_heads)
    return run(race, runs, warmup, tick)


def test_bench_sdpa_contenders_agree_and_report_rates():
    result = bench_sdpa(2, 8, 12, 16, 8, causal="upper-left", device="cpu", dtype="float32", runs=2, warmup=0)
    assert [c.name for c in result.contenders] == ["attnscope sdpa (traced)", "F.scaled_dot_product_attention"]
    for c in result.contenders:
        assert c.max_abs_diff < 1e-5
        assert c.median_ms > 0 and c.gflops_per_s == pytest.approx(result.flops / (c.median_ms / 1e3) / 1e9)
    assert result.backends == []  # listed on CUDA only


def test_bench_mha_includes_torch_and_the_fast_path():
    ticks = []
    result = bench_mha(2, 6, 6, 16, 4, bias=True, causal=None, device="cpu", dtype="float64", runs=2, warmup=1,
                       tick=ticks.append)
    names = [c.name for c in result.contenders]
    assert names == ["attnscope MultiHeadAttention (traced)", "attnscope MultiHeadAttention(record=False)",
                     "torch.nn.MultiheadAttention"]
    assert all(c.max_abs_diff < 1e-10 for c in result.contenders)
    assert len(ticks) == 3 * (2 + 1)  # the progress bar advances once per run


def test_bench_mha_gqa_times_enable_gqa_against_expanded_kv():
    result = bench_mha(2, 6, 6, 16, 4, bias=True, causal="upper-left", device="cpu", dtype="float64", runs=2,
                       warmup=0, kv_heads=2)
    names = [c.name for c in result.contenders]
    assert names == ["attnscope MultiHeadAttention (traced)",
                     "record=False: F.scaled_dot_product_attention(enable_gqa=True)",
                     "K/V expanded first (repeat_kv), then F.scaled_dot_product_attention"]
    assert all(c.max_abs_diff < 1e-10 for c in result.contenders)
    assert result.params["kv_heads"] == 2


def test_bench_mha_kv_heads_must_divide(runner):
    result = runner.invoke(app, ["bench", "mha", "--heads", "8", "--kv-heads", "3"])
    assert result.exit_code == 2 and "not a multiple of --kv-heads 3" in result.stderr


def test_bench_cli_json(runner):
    result = runner.invoke(app, ["bench", "mha", "--batch", "2", "--nq", "4", "--d-feat", "8", "--heads", "2",
                                 "--runs", "2", "--warmup", "0", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "bench mha"
    assert {"name", "median_ms", "gflops_per_s", "peak_bytes", "max_abs_diff"} <= set(payload["contenders"][0])


def test_bench_cli_table(runner):
    result = runner.invoke(app, ["bench", "sdpa", "--runs", "2", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert "F.scaled_dot_product_attention" in result.stdout and "GFLOP/s" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_bench_cuda_without_cuda_is_one_line(runner):
    result = runner.invoke(app, ["bench", "sdpa", "--device", "cuda"])
    assert result.exit_code == 2
    assert "no CUDA device" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_bench_rejects_unknown_dtype(runner):
    result = runner.invoke(app, ["bench", "sdpa", "--dtype", "float8"])
    assert result.exit_code == 2 and "--dtype float8" in result.stderr


@pytest.mark.parametrize("causal", [None, "upper-left"])
def test_peak_memory_sees_every_allocation_and_meets_the_estimate(causal):
    """The traced path keeps every step: what one call holds at its peak, plus the inputs, is what
    cost.sdpa_bytes / cost.mha_bytes estimate (within 25%; measured exactly here: profiler events)."""
    for result in (bench_sdpa(2, 64, 96, 32, 16, causal=causal, device="cpu", dtype="float32", runs=1, warmup=0),
                   bench_mha(2, 48, 48, 64, 4, bias=True, causal=causal, device="cpu", dtype="float32", runs=1,
                             warmup=0)):
        traced = result.contenders[0]
        assert traced.peak_bytes is not None and traced.peak_bytes > 0
        measured = result.inputs_bytes + traced.peak_bytes
        assert abs(measured - result.estimate_bytes) <= 0.25 * result.estimate_bytes, (measured, result.estimate_bytes)
        assert all(c.peak_bytes is not None and c.peak_bytes > 0 for c in result.contenders)


def test_bench_header_json_and_memory_lines(runner):
    result = runner.invoke(app, ["bench", "sdpa", "--batch", "2", "--nq", "8", "--nk", "8", "--dk", "4", "--dv", "4",
                                 "--runs", "1", "--warmup", "0"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "bench sdpa  n_batch=2  n_Q=8  n_K=8  d_K=4  d_V=4\n" in result.stdout and "None" not in result.stdout
    assert "attnscope estimates the traced path at" in result.stdout
    payload = json.loads(runner.invoke(app, ["bench", "sdpa", "--batch", "2", "--nq", "8", "--nk", "8", "--runs", "1",
                                             "--warmup", "0", "--json"]).stdout)
    assert payload["params"]["batch"] == 2 and payload["params"]["batch_shape"] == [2]
    assert payload["estimate_bytes"] > payload["inputs_bytes"] > 0


def test_a_long_bench_says_how_long_first(runner, monkeypatch):
    from attnscope.cli import bench as cli_bench

    monkeypatch.setattr(cli_bench, "LONG_SECONDS", 0.0)
    result = runner.invoke(app, ["bench", "mha", "--batch", "1", "--nq", "8", "--d-feat", "16", "--heads", "2",
                                 "--runs", "3", "--warmup", "1"])
    assert result.exit_code == 0, result.output
    line = result.stderr.strip()
    assert line.startswith("attnscope: bench mha: ") and "a call x 18 calls at about" in line, line
    assert "GFLOP/s (a matmul, measured here)" in line


def test_seconds_estimate_is_flops_times_calls_over_a_measured_rate():
    from attnscope.runs import race as bench

    race = bench.sdpa_race(2, 16, 16, 8, 8, causal=None, device="cpu", dtype="float32")
    seconds, calls, rate = bench.seconds_estimate(race, runs=10, warmup=2)
    assert calls == 2 * (10 + 2 + 2) and rate > 1e6
    assert seconds == pytest.approx(race.flops * calls / rate)


def test_bench_advice_names_only_bench_options(runner):
    result = runner.invoke(app, ["bench", "sdpa", "--batch", "100000", "--nq", "100000", "--nk", "100000"])
    assert result.exit_code == 1
    assert "shrink --batch, --nq or --nk" in result.stderr and "--meta" not in result.stderr
    heads = runner.invoke(app, ["bench", "mha", "--heads", "7"])
    assert heads.exit_code == 2 and "try --heads 4 or --heads 8" in heads.stderr and "--d-head" not in heads.stderr


def test_bench_stderr_stays_clean():
    """Some torch builds log every profiler start and stop on stderr; none of it reaches the user."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "attnscope", "bench", "sdpa", "--batch", "1", "--nq", "8", "--nk",
                             "8", "--dk", "4", "--dv", "4", "--runs", "1", "--warmup", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.parametrize("causal", [None, "lower-right"])
def test_flops_of_a_call_are_counted_exactly_before_it_runs(causal):
    from attnscope import MultiHeadAttention, sdpa
    from attnscope.runs import race as bench

    race = bench.sdpa_race(3, 5, 7, 4, 6, causal=causal, device="cpu", dtype="float32")
    mask = None if causal is None else torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)
    assert race.flops == sdpa(torch.randn(3, 5, 4), torch.randn(3, 7, 4), torch.randn(3, 7, 6), mask).total_flops
    race = bench.mha_race(3, 5, 7, 8, 2, bias=True, causal=causal, device="cpu", dtype="float32")
    with torch.no_grad():
        full = MultiHeadAttention(8, 2)(torch.randn(3, 5, 8), torch.randn(3, 7, 8), torch.randn(3, 7, 8), mask)
    assert race.flops == full.total_flops


def test_cpp_warnings_of_the_eligibility_checks_are_read_back_not_printed(capfd):
    """PyTorch 2.11+cu130 (an H100, 2026-11-25) printed the SDPA eligibility checks' reasons straight to fd 2 as
    c10 warning lines, so `bench --device cuda` showed "not eligible" with no reason and a stderr full of them:
    measure.stderr_of reads them back and cpp_warnings takes their messages."""
    import os

    from attnscope.runs.measure import cpp_warnings, stderr_of

    line = (b"[W1125 15:36:41.001379443 sdp_utils_cpp.h:262] Warning: Flash Attention does not support non-null "
            b"attn_mask. (function check_for_attn_mask)\n")
    result, printed = stderr_of(lambda: (os.write(2, line), "ok")[1])
    assert result == "ok" and capfd.readouterr().err == ""
    assert cpp_warnings(printed) == ["Flash Attention does not support non-null attn_mask."]
