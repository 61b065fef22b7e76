"""What `sdpa` and `mha` share, written once: their common options and their output path.

A command writes its own options and takes `shared: Shared`; `attention_command` gives Typer one signature:
the command's options before `shared`, then the shared ones (seed, inputs, masks, output, variants), then the
command's options after `shared`, then the size options (--meta, --max-memory) and --debug. Typer draws each
help panel in that order, so each command's --help reads as when it listed every option itself.

The output path, `Shared.running` and `Shared.show`: errors reported (exit 2 or 1, a traceback with --debug),
--svg/--html checked before the run and written after it, the result shown as tables or JSON, exit 1 on FAIL.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, get_type_hints

from attnscope.cli.common import Page, exporting, max_memory_bytes, show_run
from attnscope.cli.errors import OOM_ADVICE, reported
from attnscope.cli.options import (
    Alibi,
    AttnScale,
    Cache,
    CausalOpt,
    Check,
    Chunk,
    Debug,
    FloorScale,
    Force,
    HeatmapBatch,
    HeatmapHead,
    HeatmapOpt,
    HtmlPage,
    Json,
    KFile,
    MaskFile,
    MaxMemory,
    Meta,
    Pad,
    PositionBias,
    QFile,
    QkNormOpt,
    RopeBase,
    RopeFraction,
    RopeOpt,
    RopePairing,
    Save,
    Seed,
    ShowMask,
    SinksOpt,
    Softcap,
    Stats,
    Svg,
    TemperatureOpt,
    Values,
    VFile,
    Window,
    WindowSideOpt,
    signed,
)

if TYPE_CHECKING:
    from rich.console import Console

    from attnscope.runs.outputs import RunResult


@dataclass(frozen=True)
class Shared:
    """The options sdpa and mha share, declared once: each field is an option (its type says how Typer reads
    it, its default is the option's), and a command is handed their values in one `Shared`
    (`attention_command`). The fields in LAST close each command's list of options."""

    seed: Seed = 0
    q: QFile = None
    k: KFile = None
    v: VFile = None
    causal: CausalOpt = None
    mask: MaskFile = None
    pad: Pad = 0
    show_mask: ShowMask = False
    check: Check = False
    json: Json = False
    save: Save = None
    svg: Svg = None
    html: HtmlPage = None
    force: Force = False
    values: Values = False
    stats: Stats = False
    heatmap: HeatmapOpt = False
    heatmap_batch: HeatmapBatch = 0
    heatmap_head: HeatmapHead = 0
    window: Window = None
    window_side: WindowSideOpt = None
    softcap: Softcap = None
    alibi: Alibi = False
    position_bias: PositionBias = None
    rope: RopeOpt = False
    rope_base: RopeBase = None
    rope_fraction: RopeFraction = None
    rope_pairing: RopePairing = None
    chunk: Chunk = None
    temperature_tuning: TemperatureOpt = False
    floor_scale: FloorScale = None
    attn_scale: AttnScale = None
    cache: Cache = 0
    sinks: SinksOpt = None
    qk_norm: QkNormOpt = None
    meta: Meta = False
    max_memory: MaxMemory = None
    debug: Debug = False

    def options(self) -> dict[str, Any]:
        """The keyword arguments of runs/options.py's `AttentionOptions` (and so of SdpaOptions, MhaOptions): the
        fields but the output's, choices as their strings, --window-side's default left, --max-memory in bytes
        (a UsageError naming it when unreadable)."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in OUTPUT_ONLY}
        choices = {name: value.value for name, value in given.items() if isinstance(value, Enum)}
        return given | choices | {"window_side": self.window_side.value if self.window_side else "left",
                                  "max_memory": max_memory_bytes(self.max_memory)}

    @contextmanager
    def running(self, command: str, page: Page) -> Iterator[Console]:
        """Around a run: its errors reported (with OOM advice), its --svg/--html checked first and written last;
        the block prints to the console it is given."""
        with reported(self.debug, oom_advice=OOM_ADVICE), exporting(
                self.svg, self.html, force=self.force, json=self.json, title=f"attnscope {command}", page=page) as out:
            yield out

    def show(self, out: Console, result: RunResult, page: Page) -> None:
        """The result as tables or JSON (--values, --stats), handed to --html's page; exit 1 on a FAIL."""
        show_run(out, result, json=self.json, values=self.values, stats=self.stats, page=page)


LAST = ("meta", "max_memory", "debug")  # the Size panel, and --debug
OUTPUT_ONLY = ("json", "svg", "html", "values", "stats", "debug")  # read by the output path, not by the run


def _options() -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    """Shared's fields as keyword parameters with their Typer types: those before LAST, and LAST's."""
    types = get_type_hints(Shared, include_extras=True)
    parameters = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
                  for f in fields(Shared)]
    return [p for p in parameters if p.name not in LAST], [p for p in parameters if p.name in LAST]


def attention_command(own: Callable[..., None]) -> Callable[..., None]:
    """`own(..., shared: Shared, ...)` as the function Typer reads: `shared` replaced by the shared options,
    the size options and --debug last (the module docstring's order). Called with every option by name, it
    gathers the shared ones into a `Shared` for `own`."""
    parameters = list(inspect.signature(own, eval_str=True).parameters.values())
    at = [p.name for p in parameters].index("shared")
    mine = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters if p.name != "shared"]
    shared_options, last = _options()
    merged = [*mine[:at], *shared_options, *mine[at:], *last]
    names = [f.name for f in fields(Shared)]
    return signed(own, merged, lambda given: {"shared": Shared(**{name: given.pop(name) for name in names})})
