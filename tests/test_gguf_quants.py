"""models/gguf/quants.py's own dequantization of F32, F16, BF16, Q4_0, Q4_1 and Q8_0 against the `gguf` package's
`gguf.quants.dequantize` (what transformers' GGUF loader calls): the same float32 bits, on real quantized weights
and on random bytes (scales that are NaN, infinite or subnormal)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from attnscope.models.gguf import quants


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"])
def test_fast_types_are_gguf_bit_for_bit(name, monkeypatch):
    monkeypatch.setattr(quants, "CHUNK", 1000)  # several chunks, one of them partial
    kind = GGMLQuantizationType[name]
    rng = np.random.default_rng(7)
    rows, cols = 70, 96
    weights = (rng.standard_normal((rows, cols)) * 0.3 + 0.01).astype(np.float32)
    raw = np.asarray(quantize(weights, kind)).view(np.uint8).reshape(rows, -1)
    noise = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)
    for data in (raw, noise):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NaN scales in the random bytes, both sides
            got = quants.dequantize(data.copy(), int(kind), rows, cols, "test")
            want = np.asarray(dequantize(data, kind), dtype=np.float32).reshape(rows, cols)
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
