"""GGUF's common block types expanded to float32 by torch, fast enough to do again at each use of a weight
(a decoding run that keeps only some of its weights float32: models/gguf/keep.py).

The formulas are gguf.quants' (and quants.py's): Q4_0 `d * (q - 8)`, Q4_1 `d * q + m`, Q8_0 `q * d`, with d and m
float16 made float32, and F32, F16, BF16 as stored. Each product of a 4- or 8-bit integer by a float16 scale is
exact in float32 (at most 19 significant bits), so the order of the operations changes no bit: the values are
gguf.quants.dequantize's, bit for bit (tests/test_gguf_expand.py, real weights and random bytes).

Where the time goes: the nibbles of Q4_0 and Q4_1 are unpacked four (Q4_1's 4-byte aligned blocks) or two
(Q4_0's 18-byte blocks) at a time, as int32 or int16 words masked with 0x0F0F...; the rest is one conversion, a
multiply and an add over the output. About 0.7 ns a value on one core of the shared machine, against 2.7 ns for
quants.py's NumPy and 0.13 ns for a matrix-vector product over the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")  # what `expand` takes; quants.py dequantizes the rest


def expand(raw: torch.Tensor, name: str, rows: int, cols: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """`rows` rows of `cols` values of type `name` (one of TYPES) from their bytes `raw` (uint8, contiguous), as a
    float32 tensor `[rows, cols]`: `into` (contiguous, that shape) where given, else a fresh one."""
    import numpy as np
    import torch

    into = torch.empty(rows, cols) if into is None else into
    if name == "F32":
        return into.copy_(raw.view(torch.float32).view(rows, cols))
    if name == "F16":  # NumPy's conversion, which keeps a signalling NaN's bits as gguf's does (torch's quiets it)
        into.numpy()[...] = raw.numpy().view(np.float16).reshape(rows, cols)
        return into
    if name == "BF16":
        return into.copy_(raw.view(torch.bfloat16).view(rows, cols))  # the 16 bits moved up: exact, as gguf's shift
    n_blocks = rows * cols // 32
    out = into.view(n_blocks, 32)  # [n_blocks, 32]
    if name == "Q8_0":
        blocks = raw.view(n_blocks, 34)  # [n_blocks, 2 + 32]: d, then 32 int8 values
        out.copy_(blocks[:, 2:].view(torch.int8))
        out.mul_(_scales(blocks, 1))
    elif name == "Q4_1":
        blocks = raw.view(n_blocks, 20)  # [n_blocks, 2 + 2 + 16]: d, m, then 32 four-bit values
        out.copy_(_nibbles(blocks[:, 4:], torch.int32, 0x0F0F0F0F))
        d_m = _scales(blocks, 2)  # [n_blocks, 2]
        out.mul_(d_m[:, :1])
        torch.add(d_m[:, 1:], out, out=out)  # m + d·q: NumPy's operand order, so even two NaNs give its bits
    elif name == "Q4_0":
        blocks = raw.view(n_blocks, 18)  # [n_blocks, 2 + 16]: d, then 32 four-bit values
        out.copy_(_nibbles(blocks[:, 2:], torch.int16, 0x0F0F))
        out.sub_(8).mul_(_scales(blocks, 1))
    else:
        raise ValueError(f"expand takes {', '.join(TYPES)}, not {name}")
    return into


def _scales(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` float16 numbers that open each block (d, or d and m), float32: `[n_blocks, n]`. Read as one word
    a block (int16 for d, int32 for d and m), a one-dimensional strided copy, then converted contiguous: the
    strided `[n_blocks, 2]` float16 view converted directly took 0.4 ns a value of Q4_1, 30% of the expansion."""
    import torch

    word = torch.int16 if n == 1 else torch.int32
    first = blocks.view(word)[:, 0].contiguous()  # [n_blocks]: each block's first word
    return first.view(torch.float16).view(-1, n).float()  # [n_blocks, n]


def _nibbles(qs: torch.Tensor, word: torch.dtype, mask: int) -> torch.Tensor:
    """A block's 16 bytes of four-bit values `[n_blocks, 16]` -> its 32 values `[n_blocks, 32]` (uint8): the low
    halves of the 16 bytes, then the high halves (gguf.quants' order), taken a word of `word` at a time."""
    import torch

    n_blocks = qs.shape[0]
    words = qs.view(word)  # [n_blocks, 16 / word size]; the words' blocks start on the word's alignment
    out = torch.empty(n_blocks, 2, words.shape[1], dtype=word)  # [n_blocks, low | high, words]
    torch.bitwise_and(words, mask, out=out[:, 0])
    torch.bitwise_right_shift(words, 4, out=out[:, 1])
    out[:, 1].bitwise_and_(mask)  # an arithmetic shift's sign bits land in the masked-out halves
    return out.view(torch.uint8).view(n_blocks, 32)  # little-endian words: the bytes in their order
