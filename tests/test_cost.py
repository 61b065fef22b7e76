"""FLOPs, memory estimates and the guard: the arithmetic must agree with what really runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_main import unwrapped

from attnscope import cost
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.spec import AttentionSpec


@pytest.mark.parametrize("causal", [None, "upper-left"])
@pytest.mark.parametrize(("batch", "nq", "nk", "dk", "dv"), [(3, 30, 50, 128, 256), (2, 7, 7, 4, 9), (1, 1, 5, 3, 2)])
def test_guard_estimate_for_sdpa_equals_the_traced_run(batch, nq, nk, dk, dv, causal):
    meta = run_sdpa(SdpaOptions(batch=batch, nq=nq, nk=nk, dk=dk, dv=dv, causal=causal, meta=True))
    real = run_sdpa(SdpaOptions(batch=batch, nq=nq, nk=nk, dk=dk, dv=dv, causal=causal))
    analytic = cost.sdpa_bytes(batch, nq, nk, dk, dv, AttentionSpec(causal=causal))
    assert meta.peak_bytes == real.peak_bytes == analytic


@pytest.mark.parametrize("causal", [None, "lower-right"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("batch", "nq", "nk", "d_feat", "heads"), [(4, 6, None, 16, 4), (2, 3, 9, 24, 3)])
def test_guard_estimate_for_mha_equals_the_traced_run(batch, nq, nk, d_feat, heads, bias, causal):
    options = {"batch": batch, "nq": nq, "nk": nk, "d_feat": d_feat, "heads": heads, "bias": bias, "causal": causal}
    meta = run_mha(MhaOptions(**options, meta=True))
    real = run_mha(MhaOptions(**options))
    n_K = nq if nk is None else nk
    analytic = cost.mha_bytes(batch, nq, n_K, d_feat, heads, AttentionSpec(causal=causal), bias=bias, cross=n_K != nq)
    assert meta.peak_bytes == real.peak_bytes == analytic


def test_fused_needs_everything_but_the_attention_matrices():
    result = run_sdpa(SdpaOptions(batch=2, nq=8, nk=16, dk=4, dv=4))
    matrices = 2 * (2 * 8 * 16 * 4)  # scores and attention, float32
    log_sum_exp = 2 * 8 * 4
    assert result.fused_bytes == result.peak_bytes - matrices + log_sum_exp


def test_mha_flops_per_step():
    trace = run_mha(MhaOptions(batch=2, nq=5, nk=7, d_feat=12, heads=3)).trace
    assert trace.step("Q_feat").flops == 2 * 5 * 12 * 12 * 2 + 2 * 5 * 12  # matmul + bias, per batch element
    assert trace.step("scores").flops == 2 * 3 * (2 * 5 * 4 * 7 + 5 * 7)
    assert trace.step("x_raw").flops == 2 * 3 * 2 * 5 * 7 * 4
    assert trace.step("Q_split").flops == 0 and not trace.step("Q_split").allocates


def test_meta_runs_any_size_without_allocating():
    result = run_mha(MhaOptions(d_feat=4096, heads=32, batch=8, nq=1_000_000, meta=True))
    assert result.trace.step("scores").shape == (8, 32, 1_000_000, 1_000_000)
    assert all(step.tensor.device.type == "meta" for step in result.trace.steps)
    assert result.peak_bytes > 10**15  # petabytes: a real run would be refused
    assert result.fused_bytes < result.peak_bytes / 1000


def test_meta_json_reports_bytes_and_flops(runner):
    from attnscope.cli import app

    payload = json.loads(runner.invoke(app, ["sdpa", "--nq", "100000", "--nk", "100000", "--meta", "--json"]).stdout)
    scores = {t["name"]: t for t in payload["tensors"]}["scores"]
    assert scores["bytes"] == 3 * 100000 * 100000 * 4
    assert scores["flops"] == 3 * (2 * 100000 * 128 * 100000 + 100000 * 100000)
    assert payload["totals"]["peak_bytes"] > payload["totals"]["fused_peak_bytes"]


def _run_attnscope(*args: str) -> subprocess.CompletedProcess[str]:
    code = ("import sys\nfrom attnscope.cli import main\nsys.argv = ['attnscope', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
            "print('EXIT', code, 'TORCH', 'torch' in sys.modules, 'TRANSFORMERS', 'transformers' in sys.modules,"
            " file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    result.stderr = unwrapped(result.stderr)  # each message on one line again (they wrap at 80 columns)
    return result


def test_guard_refuses_before_torch_is_imported():
    result = _run_attnscope("mha", "--d-feat", "4096", "--heads", "32", "--batch", "8", "--nq", "1000000")
    first, last = result.stderr.strip().splitlines()
    assert first.startswith("attnscope: error: this run needs about") and "--meta" in first
    assert last == "EXIT 1 TORCH False TRANSFORMERS False"


def test_max_memory_refuses_with_the_estimate():
    result = _run_attnscope("sdpa", "--max-memory", "100KB")
    assert "needs about 395.2 KiB, more than --max-memory 97.7 KiB" in result.stderr
    assert "EXIT 1 TORCH False" in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["sdpa", "--help"], ["mha", "--help"],
                                  ["bert", "--help"], ["bench", "--help"], ["bench", "sdpa", "--help"],
                                  ["bench", "mha", "--help"]])
def test_help_and_version_import_neither_torch_nor_transformers(args):
    result = _run_attnscope(*args)
    assert "EXIT 0 TORCH False TRANSFORMERS False" in result.stderr, result.stderr


def test_estimate_within_25_percent_of_the_measured_peak():
    """A real run of ~150 MiB in a fresh process: peak RSS beyond a tiny run's, against the estimate."""

    # Measured by a small intermediate process: a child forked straight from this (large) pytest process
    # would carry pytest's own resident set into its ru_maxrss.
    measurer = ("import os, subprocess, sys\n"
                "proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
                "out = proc.stdout.read()\n"
                "_, status, usage = os.wait4(proc.pid, 0)\n"
                "assert os.waitstatus_to_exitcode(status) == 0\n"
                "print(usage.ru_maxrss * 1024)\n"
                "sys.stdout.write(out.decode())\n")

    def peak(*args: str) -> tuple[int, dict]:
        result = subprocess.run([sys.executable, "-c", measurer, sys.executable, "-m", "attnscope", *args, "--json"],
                                capture_output=True, text=True, timeout=300, check=True)
        first, _, rest = result.stdout.partition("\n")
        return int(first), json.loads(rest)

    baseline, _ = peak("sdpa", "--batch", "1", "--nq", "1", "--nk", "1", "--dk", "1", "--dv", "1")
    measured, payload = peak("sdpa", "--batch", "16", "--nq", "1024", "--nk", "1024", "--dk", "64", "--dv", "64")
    estimate = payload["totals"]["peak_bytes"]
    assert 0.75 <= estimate / (measured - baseline) <= 1.25, (estimate, measured - baseline)


@pytest.mark.parametrize(("text", "size"), [("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5g", 1_500_000_000),
                                            ("1000000", 10**6), ("100 kb", 100_000)])
def test_parse_size(text, size):
    assert cost.parse_size(text) == size


@pytest.mark.parametrize("shapes", [[(3, 1), (1, 4)], [(2, 1, 5), (4, 1)], [(), (3,)], [(7,), (7,)]])
def test_broadcast_shapes_agrees_with_torch(shapes):
    assert cost.broadcast_shapes(*shapes) == tuple(torch.broadcast_shapes(*shapes))


def test_broadcast_shapes_refuses_what_torch_refuses():
    with pytest.raises(ValueError):
        cost.broadcast_shapes((3, 2), (4, 2))
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes((3, 2), (4, 2))



GRID = [{"pad": pad, "causal": causal, "window": window, "alibi": alibi, "cache": cache}
        for pad in (0, 2) for causal in (None, "upper-left", "lower-right") for window in (None, 2)
        for alibi in (False, True) for cache in (0, 3) if not (cache and causal == "upper-left")]


def _estimated_and_traced(monkeypatch, module, run, asked) -> tuple[int, int]:
    """What the run's guard was asked about (its estimate from the sizes alone, before anything is
    allocated) and what the traced run then holds (its steps, inputs, weights and masks, summed)."""
    asked_about: list[int] = []
    monkeypatch.setattr(module, "guard_memory", lambda needed, *args, **kwargs: asked_about.append(needed))
    result = run(asked)
    assert len(asked_about) == 1
    return asked_about[0], result.peak_bytes


@pytest.mark.parametrize("options", GRID, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items() if v) or "plain")
def test_the_guards_estimate_equals_the_traced_bytes(monkeypatch, options):
    """Key padding is a [1, n_K] boolean, held beside the causal or window mask: the estimate once counted
    one [n_Q, n_K] mask for both, n_K bytes short with padding and a causal mask, n_Q·n_K − n_K over with
    padding alone."""
    from attnscope.runs import latent, mha, sdpa

    nk = None if options["cache"] else 6
    runs = [(sdpa, run_sdpa, SdpaOptions(batch=2, nq=4, nk=nk, dk=4, dv=6, **options)),
            (mha, run_mha, MhaOptions(batch=2, nq=4, d_feat=8, heads=2, **options)),
            (mha, run_mha, MhaOptions(batch=2, nq=4, d_feat=8, heads=2, kv_heads=1, rope=True, **options)),
            (latent, latent.run_latent, MhaOptions(batch=2, nq=4, d_feat=8, heads=2, kv_lora_rank=3, **options))]
    for module, run, asked in runs:
        estimated, traced = _estimated_and_traced(monkeypatch, module, run, asked)
        assert estimated == traced, (asked, estimated - traced)


@pytest.mark.parametrize(("command", "nq", "nk"), [("sdpa", 5, 2), ("mha", 6, 1), ("latent", 3, 1)])
def test_the_rope_tables_hold_the_positions_before_key_0(monkeypatch, command, nq, nk):
    """Lower-right with more queries than keys: cos and sin run from position nk − nq (negative) to nq − 1."""
    from attnscope.runs import latent, mha, sdpa

    base = {"batch": 1, "nq": nq, "nk": nk, "causal": "lower-right", "rope": True, "pad": 1 if nk > 1 else 0}
    module, run, asked = {"sdpa": (sdpa, run_sdpa, SdpaOptions(dk=4, dv=4, **base)),
                          "mha": (mha, run_mha, MhaOptions(d_feat=8, heads=2, **base)),
                          "latent": (latent, latent.run_latent, MhaOptions(d_feat=8, heads=2, kv_lora_rank=3,
                                                                           **base))}[command]
    estimated, traced = _estimated_and_traced(monkeypatch, module, run, asked)
    assert estimated == traced


HALF = [{"causal": causal, "alibi": alibi, "softcap": softcap, "rope": rope, "sinks": sinks, "pad": pad}
        for causal in (None, "lower-right") for alibi in (False, True) for softcap in (None, 5.0)
        for rope, sinks, pad in ((False, None, 0), (True, "random", 2))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("options", HALF, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items() if v) or "plain")
def test_half_precision_estimates_count_the_float32_scores(tmp_path, dtype, options):
    """A half-precision run holds its scores, masked scores, attention and sink weights in float32 (as PyTorch's
    math path upcasts); the estimate `bench --dtype bfloat16` prints counted them at 2 bytes, half of what CUDA
    measured. Each estimate against the traced run's own bytes, on inputs of that dtype."""
    from attnscope.runs import latent, mha, sdpa

    files = {}
    for name, shape in (("q", (2, 4, 8)), ("k", (2, 6, 8)), ("v", (2, 6, 5)), ("x", (2, 4, 16))):
        files[name] = str(tmp_path / f"{name}.pt")
        torch.save(torch.randn(*shape, generator=torch.Generator().manual_seed(len(name)), dtype=dtype), files[name])
    flags = {"causal": options["causal"], "alibi": options["alibi"], "softcap": options["softcap"],
             "rope": options["rope"], "pad": options["pad"], "sinks": options["sinks"]}
    pad = bool(options["pad"])
    asked = SdpaOptions(q=files["q"], k=files["k"], v=files["v"], **flags)
    ran = run_sdpa(asked)
    assert ran.trace["attention"].dtype == torch.float32
    assert cost.sdpa_bytes(2, 4, 6, 8, 5, sdpa.prepare(asked), itemsize=2, pad=pad) == ran.peak_bytes
    asked = MhaOptions(q=files["x"], d_feat=16, heads=4, **flags)
    ran = run_mha(asked)
    assert cost.mha_bytes(2, 4, 4, 16, 4, mha.prepare(asked), itemsize=2, pad=pad) == ran.peak_bytes
    if options["sinks"] is None:  # latent attention takes no sinks
        asked = MhaOptions(q=files["x"], d_feat=16, heads=2, kv_lora_rank=3, **flags)
        ran = latent.run_latent(asked)
        assert ran.trace["attention"].dtype == torch.float32
        assert cost.mla_bytes(2, 4, 4, 16, 2, latent.prepare(asked)[1], itemsize=2, pad=pad,
                              bias=asked.bias) == ran.peak_bytes
