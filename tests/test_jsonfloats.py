"""A float32 tensor's values written by numpy at once (render/jsonfloats.py) read back bit for bit, in the nested
lists json.dumps would write, laid out as Python's repr lays out a float."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from attnscope.render.console import emit_json, numbers
from attnscope.render.jsonfloats import CHUNK, float_text


def _read_back(values: np.ndarray) -> np.ndarray:
    """The text of float32 `values`, parsed as json.loads parses it and rounded to float32."""
    return np.array(json.loads(float_text(values.astype(np.float64))), dtype=np.float64).astype(np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a.view(np.uint32) == b.view(np.uint32)).all())


EDGES = np.array([0.0, -0.0, 1.0, -1.0, 0.1, 0.3, 0.5, 1e-4, 9.999999e-5, 1e-5, 1.5e-5, 123456789.0, 1e9, 1e16, 3.4e38,
                  -3.4028235e38, 1.4e-45, -2.8e-45, 1.17549435e-38, 1e-38, 65504.0, 999999.94, 9.9999999e8,
                  0.00012345678, 7.0e-45], dtype=np.float32)


def test_edge_values_read_back_bit_for_bit_and_read_as_repr_writes_them():
    assert _same_bits(_read_back(EDGES), EDGES)
    assert float_text(np.array([0.5, 0.25, 1.0, 0.0, -0.0, 100.0, 0.1, 1e-4, 1e-5, 1.5e-5])) == \
        "[0.5, 0.25, 1.0, 0.0, -0.0, 100.0, 0.1, 0.0001, 1e-05, 1.5e-05]"
    assert float_text(np.array([[1.0, -2.5], [3.0, 4.0]])) == json.dumps([[1.0, -2.5], [3.0, 4.0]])
    assert float_text(np.array([float(np.float32(1.5e9)), float(np.float32(-3.5e20))])) == "[1.5e+09, -3.5e+20]"


def test_every_float32_near_each_power_of_ten_reads_back():
    """Where log10's guess of the exponent is off by one, and where rounding carries into the next power."""
    base = np.array([10.0 ** k for k in range(-44, 39)], dtype=np.float32)
    near = np.concatenate([np.nextafter(base, np.float32(0)), base, np.nextafter(base, np.float32(np.inf)),
                           np.nextafter(np.nextafter(base, np.float32(0)), np.float32(0))])
    near = near[np.isfinite(near)]
    assert _same_bits(_read_back(near), near)


def test_many_values_across_chunks_keep_their_nesting():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((3, CHUNK // 7 + 5, 9)) * 10.0 ** rng.integers(-30, 30, (3, 1, 9))).astype(np.float32)
    assert _same_bits(_read_back(values), values)


@fuzz_settings(60)
@given(arrays(np.float32, array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6),
              elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_any_finite_float32_array_reads_back_bit_for_bit(values):
    assert _same_bits(_read_back(values), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_emit_json_writes_a_tensors_values_as_its_own(dtype):
    torch.manual_seed(0)
    tensor = (torch.randn(2, 3, 5) * 100).to(dtype)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        emit_json({"attention": numbers(tensor), "ids": numbers(torch.arange(3)), "double": numbers(tensor.double())})
    got = json.loads(out.getvalue())
    assert torch.equal(torch.tensor(got["attention"], dtype=torch.float64).to(dtype), tensor)
    assert got["ids"] == [0, 1, 2]
    assert torch.equal(torch.tensor(got["double"], dtype=torch.float64), tensor.double())
