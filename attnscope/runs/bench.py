"""`attnscope bench sdpa|mha` between parsing and rendering: check the sizes, guard memory (every contender's
inputs and one traced run's worth more), then set up the race (race.py) that the command times under its
progress bar. torch is imported only once the options and the memory are known to be fine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnscope import cost

if TYPE_CHECKING:
    from attnscope.runs.race import Race

SHRINK = "shrink --batch, --nq or --nk"  # what a bench too large for memory can do instead (it has no --meta)


@dataclass
class BenchOptions:
    command: str  # "sdpa" or "mha"
    batch: int
    nq: int
    nk: int | None = None  # mha: default --nq
    causal: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    dk: int = 64  # sdpa
    dv: int = 64
    d_feat: int = 512  # mha
    heads: int = 8
    kv_heads: int | None = None
    bias: bool = True


def prepare(o: BenchOptions) -> Race:
    """The race for these options, once they make sense and it fits in memory."""
    from attnscope.runs.common import guard_memory

    guard_memory(2 * needed_bytes(o), None, advice=SHRINK)
    from attnscope.runs import race

    n_K = o.nq if o.nk is None else o.nk
    if o.command == "sdpa":
        return race.sdpa_race(o.batch, o.nq, n_K, o.dk, o.dv, causal=o.causal, device=o.device, dtype=o.dtype)
    return race.mha_race(o.batch, o.nq, n_K, o.d_feat, o.heads, bias=o.bias, causal=o.causal, device=o.device,
                         dtype=o.dtype, kv_heads=o.kv_heads)


def needed_bytes(o: BenchOptions) -> int:
    """The traced run's estimate (cost.sdpa_bytes / cost.mha_bytes), after the head counts are checked."""
    n_K = o.nq if o.nk is None else o.nk
    masked = o.causal is not None
    if o.command == "sdpa":
        return cost.sdpa_bytes(o.batch, o.nq, n_K, o.dk, o.dv, masked=masked)
    from attnscope.runs.common import check_heads, check_kv_heads

    check_heads(o.d_feat, o.heads, from_file=False, has_d_head=False)
    check_kv_heads(o.heads, o.kv_heads)
    return cost.mha_bytes(o.batch, o.nq, n_K, o.d_feat, o.heads, bias=o.bias, cross=n_K != o.nq, masked=masked,
                          n_kv_head=o.kv_heads)
