"""GGUF's tensor types: how many bytes a tensor takes (`GGML_QUANT_SIZES`: elements per block, bytes per
block), and its rows dequantized to float32 by the `gguf` package's own `gguf.quants.dequantize`, the same
function transformers' GGUF loader calls (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`).

A block never spans two rows (llama.cpp quantizes along the fastest dimension, a row of a `[rows, cols]`
matrix), so rows lo:hi of a quantized matrix are bytes `lo·row_bytes .. hi·row_bytes` of it, read alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np


@cache
def names() -> dict[int, str]:
    from gguf.constants import GGMLQuantizationType

    return {int(t): t.name for t in GGMLQuantizationType}


def supported() -> list[str]:
    """The types attnscope reads: F32, F16 and every type `gguf.quants` dequantizes (BF16, Q4_0 ... Q8_0, the
    K-quants, the I-quants)."""
    from gguf.quants import _type_traits

    return ["F32", "F16", *(t.name for t in _type_traits)]


def byte_count(path: Path, name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    """The bytes a tensor of this type and torch-order shape takes; an unknown type, or a row that is not a
    whole number of blocks, refused naming the tensor."""
    import math

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise UsageError(f"{{model}} {path}: tensor {name} has ggml type {ggml_type}, which GGUF does not define; "
                         f"attnscope reads {', '.join(supported())}", "model") from None
    block, size = GGML_QUANT_SIZES[kind]
    if shape[-1] % block:
        raise UsageError(f"{{model}} {path}: tensor {name} has rows of {shape[-1]} values, not a whole number of "
                         f"{kind.name} blocks of {block}; the header is damaged", "model")
    return math.prod(shape) // block * size


def row_bytes(ggml_type: int, cols: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return cols // block * size


CHUNK = 1 << 16  # values dequantized at a time: the temporaries (several times the output) stay small, in cache


def dequantize(raw: np.ndarray, ggml_type: int, rows: int, cols: int, where: str) -> np.ndarray:
    """`rows` rows of `cols` values from their bytes `raw` (uint8), as a fresh float32 array `[rows, cols]`,
    dequantized a few rows at a time into it: the common types by `_whole_blocks` (gguf.quants' own formulas,
    bit for bit, on many blocks at once), the rest by `gguf.quants.dequantize`."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(ggml_type)
    if kind.name not in supported():
        raise UsageError(f"{{model}} {where} is stored as {kind.name}, which attnscope cannot dequantize; it reads "
                         f"{', '.join(supported())}", "model")
    raw = raw.reshape(rows, -1)  # [rows, bytes per row]
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, CHUNK // max(cols, 1))
    fast = _whole_blocks(kind.name)
    for lo in range(0, rows, step):
        part = raw[lo : lo + step]  # [step, bytes per row]
        values = fast(part) if fast is not None else gguf_dequantize(part, kind)
        out[lo : lo + step] = values.reshape(-1, cols)  # [step, cols]
    return out


def _whole_blocks(name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """gguf.quants' `dequantize_blocks` of F32, F16, BF16, Q4_0, Q4_1 and Q8_0, the same NumPy operations in the
    same order (so the same float32 values), on every block of `raw` at once: gguf.quants walks a tensor in
    groups of rows through `np.array_split`, which is most of its time on a model's worth of small blocks."""
    import numpy as np

    def float16(blocks: np.ndarray) -> np.ndarray:  # [n_blocks, 2] bytes -> [n_blocks, 1] float32
        return blocks.view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [n_blocks, 16] bytes -> [n_blocks, 32]: low halves, then high
        shifted = qs.reshape(qs.shape[0], -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (shifted & np.uint8(0x0F)).reshape(qs.shape[0], -1)

    def q4_0(raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, 18)  # [n_blocks, 2 + 16]: d, then 32 four-bit values
        return float16(blocks[:, :2]) * (nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)

    def q4_1(raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, 20)  # [n_blocks, 2 + 2 + 16]: d, m, then 32 four-bit values
        return float16(blocks[:, :2]) * nibbles(blocks[:, 4:]).astype(np.float32) + float16(blocks[:, 2:4])

    def q8_0(raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, 34)  # [n_blocks, 2 + 32]: d, then 32 int8 values
        return blocks[:, 2:].copy().view(np.int8).astype(np.float32) * float16(blocks[:, :2])

    def bf16(raw: np.ndarray) -> np.ndarray:
        return (np.ascontiguousarray(raw).view(np.int16).astype(np.int32) << 16).view(np.float32)

    return {"F32": lambda raw: np.ascontiguousarray(raw).view(np.float32).copy(),
            "F16": lambda raw: np.ascontiguousarray(raw).view(np.float16).astype(np.float32),
            "BF16": bf16, "Q4_0": q4_0, "Q4_1": q4_1, "Q8_0": q8_0}.get(name)
