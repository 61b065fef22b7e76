"""`attnscope bench`: every contender computes the same result as the traced path, and the report says so."""

from __future__ import annotations

import json

import pytest
import torch

from attnscope.bench import bench_mha, bench_sdpa
from attnscope.cli import app


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
