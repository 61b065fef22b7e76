"""models/gguf/expand.py's torch expansion of F32, F16, BF16, Q4_0, Q4_1 and Q8_0 against the `gguf` package's own
`gguf.quants.dequantize` (the same float32 bits, on real quantized weights and random bytes); the checkpoint's
weights expanded at each use (into reused buffers) and its LM-head product in row chunks against the NumPy
dequantization it kept before; and a decoding run that keeps nothing choosing the same tokens from the same rows
as one that keeps everything (issue 44, goal 2)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tiny_gguf
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from attnscope.models.gguf import checkpoint
from attnscope.models.gguf.buffers import Buffers
from attnscope.models.gguf.checkpoint import GgufCheckpoint
from attnscope.models.gguf.expand import TYPES, expand
from attnscope.models.gguf.header import read_header
from attnscope.runs.head import run_head
from attnscope.runs.head_result import HeadOptions

TEXT = "the cat sat on the mat and the dog sat on the log"


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", TYPES)
def test_expand_is_gguf_bit_for_bit(name):
    kind = GGMLQuantizationType[name]
    rng = np.random.default_rng(11)
    rows, cols = 90, 128
    weights = (rng.standard_normal((rows, cols)) * 0.3 + 0.01).astype(np.float32)
    raw = np.asarray(quantize(weights, kind)).view(np.uint8).reshape(rows, -1)
    noise = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)  # NaN, infinite and subnormal scales
    for data in (raw, noise):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = np.asarray(dequantize(data, kind), dtype=np.float32).reshape(rows, cols)
        fresh = expand(torch.from_numpy(data.copy().reshape(-1)), name, rows, cols)
        into = torch.full((rows, cols), 7.0)
        reused = expand(torch.from_numpy(data.copy().reshape(-1)), name, rows, cols, into)
        assert reused.data_ptr() == into.data_ptr() and fresh.dtype == torch.float32
        for got in (fresh, reused):
            np.testing.assert_array_equal(_bits(got.numpy()), _bits(want))


def test_a_buffer_is_handed_out_again_only_when_no_tensor_holds_it():
    buffers = Buffers()
    first = buffers.take(4, 8)
    held = torch.nn.Parameter(first, requires_grad=False).T  # an alias the caller made: the array stays held
    del first
    second = buffers.take(4, 8)
    assert second.data_ptr() != held.data_ptr()
    ptr = held.data_ptr()
    del held
    assert buffers.take(4, 8).data_ptr() == ptr  # free again: reused
    assert buffers.take(8, 4).shape == (8, 4)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def gguf(request, tmp_path_factory):
    return tiny_gguf.write("llama", tmp_path_factory.mktemp(f"expand_{request.param}"), request.param)


def test_expanded_weights_and_the_chunked_head_are_the_numpy_dequantization(gguf, monkeypatch):
    monkeypatch.setattr(checkpoint, "PRODUCT_ROWS", 48)  # several chunks, the last one partial
    with GgufCheckpoint(read_header(gguf)) as opened:
        opened.reads_again()
        opened.keep_bytes = 0  # nothing kept: every read expanded again, into reused buffers
        for key in opened.keys:  # Q and K rows reordered, the rest as stored, norms F32
            want = opened._rows(opened._info(key), 0, opened.shape(key)[0])
            got = opened.tensor(key)
            np.testing.assert_array_equal(_bits(got.numpy()), _bits(want))
        embedding = "model.embed_tokens.weight"
        whole = torch.from_numpy(opened._rows(opened._info(embedding), 0, opened.shape(embedding)[0]))
        h = torch.randn(1, 3, whole.shape[1], generator=torch.Generator().manual_seed(0))
        assert torch.equal(opened.product(embedding, h), h @ whole.T)  # each output one row's dot product
        opened.keep_bytes = 1 << 30
        kept = opened.tensor(embedding)
        assert opened.tensor(embedding) is kept and torch.equal(opened.product(embedding, h), h @ whole.T)


def test_the_bound_keeps_a_sixteenth_of_the_float32_weights_or_the_floor(gguf, monkeypatch):
    monkeypatch.setattr(checkpoint, "_keep_bound", lambda: 1 << 40)
    with GgufCheckpoint(read_header(gguf)) as opened:
        assert opened.keep_bytes == checkpoint.KEEP_FLOOR  # a tiny model: kept whole
    monkeypatch.setattr(checkpoint, "KEEP_FLOOR", 0)
    with GgufCheckpoint(read_header(gguf)) as opened:
        float32 = 4 * sum(int(np.prod(opened.shape(key))) for key in opened.keys)
        assert opened.keep_bytes == float32 // checkpoint.KEEP_FRACTION
    monkeypatch.setattr(checkpoint, "_keep_bound", lambda: 1000)  # the memory available bounds it first
    with GgufCheckpoint(read_header(gguf)) as opened:
        assert opened.keep_bytes == 1000


def test_decoding_that_keeps_nothing_is_decoding_that_keeps_everything(gguf, monkeypatch):
    kept = run_head(HeadOptions(model=str(gguf), layer=1, head=0, text=TEXT, generate=4)).decode
    monkeypatch.setattr(checkpoint, "_keep_bound", lambda: 0)
    again = run_head(HeadOptions(model=str(gguf), layer=1, head=0, text=TEXT, generate=4)).decode
    assert kept is not None and again is not None
    assert [step.token_id for step in kept] == [step.token_id for step in again]
    for one, other in zip(kept, again, strict=True):
        assert torch.equal(one.attention, other.attention)
