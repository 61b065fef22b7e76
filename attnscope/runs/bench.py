"""`attnscope bench sdpa|mha` between parsing and rendering: check the sizes, guard memory (every contender's
inputs and one traced run's worth more), then set up the race (race.py) that the command times under its
progress bar. torch is imported only once the options and the memory are known to be fine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnscope import cost

if TYPE_CHECKING:
    from attnscope.runs.race import Race
    from attnscope.spec import AttentionSpec

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


def prepare(asked: BenchOptions) -> Race:
    """The race for these asked, once they make sense and it fits in memory."""
    from attnscope.runs.memory import guard_memory

    guard_memory(2 * needed_bytes(asked), None, advice=SHRINK)
    from attnscope.runs import race

    n_K = asked.nq if asked.nk is None else asked.nk
    if asked.command == "sdpa":
        return race.sdpa_race(asked.batch, asked.nq, n_K, asked.dk, asked.dv, causal=asked.causal,
                              device=asked.device, dtype=asked.dtype)
    return race.mha_race(asked.batch, asked.nq, n_K, asked.d_feat, asked.heads, bias=asked.bias, causal=asked.causal,
                         device=asked.device,
                         dtype=asked.dtype, kv_heads=asked.kv_heads)


def needed_bytes(asked: BenchOptions) -> int:
    """The traced run's estimate (cost.sdpa_bytes / cost.mha_bytes), after the head counts are checked."""
    n_K = asked.nq if asked.nk is None else asked.nk
    if asked.command == "sdpa":
        return cost.sdpa_bytes(asked.batch, asked.nq, n_K, asked.dk, asked.dv, spec(asked))
    from attnscope.runs.options import check_heads
    from attnscope.spec import check_kv_heads

    check_heads(asked.d_feat, asked.heads, from_file=False, has_d_head=False)
    if asked.kv_heads is not None:
        check_kv_heads(asked.heads, asked.kv_heads)
    return cost.mha_bytes(asked.batch, asked.nq, n_K, asked.d_feat, asked.heads, spec(asked), bias=asked.bias,
                          cross=n_K != asked.nq)


def spec(asked: BenchOptions) -> AttentionSpec:
    """The attention every contender computes: causal as asked, grouped key/value heads for mha."""
    from attnscope.spec import AttentionSpec

    return AttentionSpec(causal=asked.causal, n_kv_head=asked.kv_heads if asked.command == "mha" else None)
