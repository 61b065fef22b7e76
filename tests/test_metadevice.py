"""metadevice.shapes_only: every rule against PyTorch's own meta kernels, whole --meta runs against real runs,
and ordinary runs that never import torch's compiler nor write $TMPDIR/torchinductor_* (issue 18)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope.tensors.metadevice import shapes_only

META = "meta"


def _same(make) -> None:
    """`make()` on meta tensors gives the same shape and dtype (or the same error type) with the mode as without."""
    try:
        expected = make()
    except (RuntimeError, OverflowError) as error:  # OverflowError: -inf filled into an integer tensor
        with shapes_only(), pytest.raises(RuntimeError if isinstance(error, RuntimeError) else OverflowError):
            make()
        return
    with shapes_only():
        got = make()
    assert got.device.type == META
    assert (tuple(got.shape), got.dtype) == (tuple(expected.shape), expected.dtype), make


def _t(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device=META)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool]
shapes = st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=4)


@fuzz_settings(60)
@given(a=shapes, b=shapes, da=st.sampled_from(DTYPES), db=st.sampled_from(DTYPES),
       op=st.sampled_from(["add", "mul", "sub", "div", "lt", "le", "where", "and", "masked_fill", "tanh", "neg",
                           "cos", "not", "mul_", "masked_fill_", "scalar_mul", "clone"]))
def test_pointwise_ops_as_pytorch_gives_them(a, b, da, db, op):
    x, y = _t(a, da), _t(b, db)
    makers = {
        "add": lambda: x + y, "mul": lambda: x * y, "sub": lambda: x - y, "div": lambda: x / y,
        "lt": lambda: x < y, "le": lambda: x <= y, "where": lambda: torch.where(y.bool(), x, 0.5),
        "and": lambda: x.bool() & y.bool(), "masked_fill": lambda: x.masked_fill(y.bool(), float("-inf")),
        "tanh": lambda: torch.tanh(x), "neg": lambda: -x, "cos": lambda: torch.cos(x), "not": lambda: ~x.bool(),
        "mul_": lambda: x.mul_(y), "masked_fill_": lambda: x.masked_fill_(y.bool(), 0), "scalar_mul": lambda: x * 0.5,
        "clone": lambda: x.clone(),
    }
    _same(makers[op])


@pytest.mark.parametrize(("make"), [
    lambda: _t((3, 4)) @ _t((4, 5)),
    lambda: _t((2, 3, 4)) @ _t((2, 4, 5)),
    lambda: _t((2, 2, 3, 4)) @ _t((2, 2, 4, 5)),
    lambda: _t((2, 3, 4)) @ _t((4, 5)),
    lambda: _t((3, 4)) @ _t((5, 5)),  # does not fit: PyTorch's error
    lambda: _t((3, 4)) @ _t((4, 5), torch.float64),  # mixed dtypes: PyTorch's error
    lambda: F.linear(_t((2, 3, 8)), _t((6, 8)), _t(6)),
    lambda: F.linear(_t((3, 8)), _t((6, 8)), _t(6)),
    lambda: F.linear(_t((2, 3, 8)), _t((6, 8))),
    lambda: F.linear(_t((2, 3, 8)), _t((6, 8)), _t(5)),
    lambda: torch.addmm(_t((1, 5)), _t((3, 4)), _t((4, 5))),
    lambda: torch.baddbmm(_t((2, 3, 5)), _t((2, 3, 4)), _t((2, 4, 5))),
    lambda: torch.softmax(_t((2, 3, 5)), dim=-1),
    lambda: torch.softmax(_t((2, 3, 5), torch.float16), dim=-1, dtype=torch.float32),
    lambda: torch.log_softmax(_t((2, 3, 5)), dim=1),
    lambda: _t((2, 3, 5)).any(dim=-1),
    lambda: _t((2, 3, 5), torch.bool).any(dim=1, keepdim=True),
    lambda: _t((2, 3, 5)).amax(dim=(-2, -1)),
    lambda: _t((2, 3, 5), torch.bool).sum(dim=-1),
    lambda: _t((2, 3, 5)).mean(dim=0, keepdim=True),
    lambda: _t((2, 3, 5)).sum(),
    lambda: torch.cat([_t((2, 3)), _t((2, 4))], dim=-1),
    lambda: torch.cat([_t((2, 3)), _t((2, 4), torch.float64)], dim=1),
    lambda: torch.cat([_t((2, 3)), _t((3, 4))], dim=1),
    lambda: torch.arange(7, device=META),
    lambda: torch.arange(2, 11, 3, device=META),
    lambda: torch.arange(0.0, 1.0, 0.3, device=META),
    lambda: torch.arange(5, 0, -2, device=META, dtype=torch.float64),
])
def test_products_reductions_cat_arange_as_pytorch_gives_them(make):
    _same(make)


# --- whole runs: --meta gives the real run's steps --------------------------------------------------------------


RUNS = [
    ("sdpa", {"nq": 4, "nk": 6, "dk": 8, "dv": 4, "batch": 2}),
    ("sdpa", {"nq": 4, "nk": 6, "dk": 8, "dv": 4, "batch": 2, "causal": "lower-right", "window": 2, "softcap": 5.0,
              "alibi": True, "rope": True, "pad": 1, "show_mask": True}),
    ("sdpa", {"nq": 3, "dk": 4, "dv": 4, "batch": 1, "cache": 2}),
    ("sdpa", {"nq": 4, "nk": 6, "dk": 8, "dv": 4, "batch": 2, "layout": "col", "causal": "upper-left"}),
    ("mha", {"d_feat": 16, "heads": 4, "nq": 5, "batch": 2}),
    ("mha", {"d_feat": 16, "heads": 4, "nq": 5, "batch": 2, "kv_heads": 2, "rope": True, "causal": "lower-right",
             "window": 3, "softcap": 4.0, "alibi": True, "pad": 2, "cache": 3, "show_mask": True}),
    ("mha", {"d_feat": 16, "heads": 4, "nq": 5, "nk": 7, "batch": 1, "d_head": 3, "scale": 0.3, "bias": False}),
]


@pytest.mark.parametrize(("command", "options"), RUNS)
def test_meta_runs_have_the_real_runs_steps(command, options):
    from attnscope.runs.mha import MhaOptions, run_mha
    from attnscope.runs.sdpa import SdpaOptions, run_sdpa

    run, make = (run_sdpa, SdpaOptions) if command == "sdpa" else (run_mha, MhaOptions)
    real, meta = run(make(**options)), run(make(**options, meta=True))
    assert [s.name for s in meta.trace.steps] == [s.name for s in real.trace.steps]
    for ours, theirs in zip(meta.trace.steps, real.trace.steps, strict=True):
        assert ours.tensor.device.type == META
        assert (ours.shape, ours.tensor.dtype, ours.dims, ours.flops) == \
            (theirs.shape, theirs.tensor.dtype, theirs.dims, theirs.flops), ours.name
    assert meta.peak_bytes == real.peak_bytes


# --- no compiler: nothing imported, nothing written to $TMPDIR ----------------------------------------------------


PROBE = """
import sys
from attnscope.cli import main
for argv in {runs!r}:
    sys.argv = ["attnscope", *argv]
    try:
        main()
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
print("compiler imported:", sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules))
"""


def test_ordinary_runs_import_no_compiler_and_write_nothing_to_tmpdir(tmp_path):
    """Today --meta, a file input's shadow run, a long text's shapes (all on the meta device) and --check with a
    lower-right mask (torch.nn.attention.bias) import torch._dynamo, which makes $TMPDIR/torchinductor_<user>."""
    from tiny_models import build

    np.save(tmp_path / "q.npy", np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32))
    build("llama", tmp_path / "llama")
    q = str(tmp_path / "q.npy")
    runs = [["sdpa", "--nq", "4", "--nk", "6", "--causal", "lower-right", "--check"],
            ["sdpa", "--q", q, "--check", "--show-mask", "--causal", "lower-right"],
            ["sdpa", "--q", q, "--meta", "--window", "2", "--softcap", "3", "--alibi", "--rope"],
            ["mha", "--d-feat", "64", "--heads", "4", "--meta"],
            ["mha", "--q", q, "--heads", "2", "--check", "--pad", "1"],
            ["mha", "--d-feat", "16", "--heads", "4", "--kv-heads", "2", "--rope", "--window", "2", "--cache", "2",
             "--meta", "--show-mask"],
            ["mask", "--nq", "5", "--nk", "8", "--causal", "lower-right", "--pad", "2"],
            ["head", "--model", str(tmp_path / "llama"), "--layer", "1", "--text", "The cat sat on the mat"],
            ["head", "--model", str(tmp_path / "llama"), "--layer", "1", "--text-file", str(tmp_path / "long.txt")]]
    (tmp_path / "long.txt").write_text("the cat sat on the mat and the dog ran " * 300)  # past LONG_TOKENS: blocks
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    result = subprocess.run([sys.executable, "-c", PROBE.format(runs=runs)], capture_output=True, text=True, env=env,
                            timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "compiler imported: []" in result.stdout, result.stdout[-500:]
    assert list(tmpdir.iterdir()) == []
