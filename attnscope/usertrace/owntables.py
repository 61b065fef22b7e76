"""RoPE's angles read from the cos and sin tables the code builds itself, where its rotated queries are no rotation
(ropefreqs.angles_from reads none): timm's EVA-02 (`RotaryEmbeddingCat`: sin and cos of a 2-D grid, each angle
`repeat_interleave(2)`, split from one tensor and multiplied into q and k) rotated with transformers' `rotate_half`
turns each coordinate by an angle of another pair, which the catalog's rope.pairing names once the reference turns
by the tables' own angles, in the pairing their layout says.

Two of the code's tensors of n_t rows of d_head (its other axes 1: `[n_t, d]`, `[1, 1, n_t, d]`, `[n_t, 1, d]`),
each multiplied into what the scores' queries are made from, the one (cos) into the heads as they are and the other
(sin) into their turned copy, are read as the tables where `cos² + sin² = 1` in every cell and each angle is laid
out as one pairing lays it: twice in a row (repeat_interleave: the interleaved pairing, 2i with 2i + 1) or once in
each half (cat((θ, θ)): half-split, i with i + d_head/2). Tables of fewer tokens than the queries turn the last n_t
of them, the ones before them (a cls token, registers, kept aside as EVA-02 keeps them) by no angle; tables that
move every pair evenly from token to token are a 1-D RoPE, left to the readings by base."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.usertrace.ropefreqs import Angles

TOL = 1e-5  # cos² + sin² within this of 1, and an angle's copies alike to it


def angles_from_tables(records: list[Any], n: int, d: int) -> tuple[Angles, int] | None:
    """The angle table `[n, d/2]` of the code's own cos and sin tables (as the module docstring says) and the line
    they are applied on; None where the code multiplies no such pair into what its queries are made from."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import operands
    from attnscope.usertrace.ropefreqs import STILL, Angles, one_position

    handed = operands(records)
    if handed is None or d % 2 or n < 2:
        return None
    above = ancestors(records[handed[0]], records)
    # (table, what it multiplies) for each product above the queries with a table-shaped operand
    applied = [(records[t], records[o]) for r in records if r.index in above and r.func in PRODUCTS
               for t, o in _operand_pairs(r) if _table_shaped(records[t].tensor, n, d)]
    for cos, x in applied:
        for sin, turned in applied:
            # cos multiplies the heads as they are, sin their turned copy, made from them (rotate_half, rot)
            if sin.index == cos.index or sin.tensor.numel() != cos.tensor.numel() \
                    or x.index not in ancestors(turned, records):
                continue  # a per-head gain [n_head, d_head] beside the tables is no table of theirs
            read = _angles(cos.tensor.detach().double().reshape(-1, d), sin.tensor.detach().double().reshape(-1, d))
            if read is None:
                continue
            table, pairing = read
            whole = torch.cat((torch.zeros(n - table.shape[0], d // 2, dtype=torch.float64), table))
            if float(whole.abs().max()) < STILL or one_position(whole):
                continue
            return Angles(whole, pairing), cos.line
    return None


PRODUCTS = ("mul", "__mul__", "__rmul__", "multiply")


def _operand_pairs(record: Any) -> list[tuple[int, int]]:
    """(one operand, the other) of a product of two recorded tensors, each way round."""
    held = [value for kind, value in record.args if kind == "rec"]
    return [(held[0], held[1]), (held[1], held[0])] if len(held) == 2 else []


def _table_shaped(tensor: Any, n: int, d: int) -> bool:
    """A float tensor of n_t rows of `d`, 2 <= n_t <= n, its other axes all 1 (`[n_t, d]`, `[1, 1, n_t, d]`, or
    `[n_t, 1, d]` for heads laid after the tokens, as Qwen2-VL's and GLM-4V's vision rotary unsqueeze it): one row
    a token, shared by every batch and head."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() < 2 \
            or tensor.shape[-1] != d:
        return False
    wide = [size for size in tensor.shape[:-1] if size != 1]
    return len(wide) == 1 and 2 <= wide[0] <= n


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """The angles `[n_t, d/2]` and the pairing their layout says, where `cos` and `sin` are RoPE's tables."""
    if not bool(((cos * cos + sin * sin - 1).abs() <= TOL).all()):
        return None
    d = cos.shape[-1]
    for pairing, (a, b) in (("interleaved", (slice(0, d, 2), slice(1, d, 2))),
                            ("half-split", (slice(0, d // 2), slice(d // 2, d)))):
        if all(bool(((t[:, a] - t[:, b]).abs() <= TOL).all()) for t in (cos, sin)):
            return torch.atan2(sin[:, a], cos[:, a]), pairing
    return None


SAID = "RoPE's angles read from your code's own cos and sin tables"  # how words() starts (conventions.note)


def words(line: int) -> str:
    """What the reading says of the code."""
    return (f"{SAID} (line {line}), each token's pairs turned by angles of its own (a 2-D or axial RoPE), in the "
            "pairing the tables are laid out for")
