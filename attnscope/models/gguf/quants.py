"""GGUF's tensor types: how many bytes a tensor takes (`GGML_QUANT_SIZES`: elements per block, bytes per
block), and its rows dequantized to float32 by the `gguf` package's own `gguf.quants.dequantize`, the same
function transformers' GGUF loader calls (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`).

A block never spans two rows (llama.cpp quantizes along the fastest dimension, a row of a `[rows, cols]`
matrix), so rows lo:hi of a quantized matrix are bytes `lo·row_bytes .. hi·row_bytes` of it, read alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np


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


CHUNK = 1 << 16  # values dequantized at a time: gguf.quants' temporaries (several times the output) stay small


def dequantize(raw: np.ndarray, ggml_type: int, rows: int, cols: int, where: str) -> np.ndarray:
    """`rows` rows of `cols` values from their bytes `raw` (uint8), as a fresh float32 array `[rows, cols]`,
    dequantized a few rows at a time into it."""
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
    for lo in range(0, rows, step):
        out[lo : lo + step] = gguf_dequantize(raw[lo : lo + step], kind).reshape(-1, cols)  # [step, cols]
    return out
