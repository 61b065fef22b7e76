"""An sdpa or mha run: header, steps, cost footer, check, heatmap, statistics, values; and its JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from attnscope.cost import format_bytes, format_flops
from attnscope.render.console import clean, numbers
from attnscope.render.heads import heads_json, show_heads
from attnscope.render.heatmap import heatmap_json, show_heatmap
from attnscope.render.mask import mask_json, show_grid
from attnscope.render.tables import (
    VALUES_LIMIT,
    check_json,
    check_table,
    show_trace,
    show_values,
    stats_table,
    step_json,
)

if TYPE_CHECKING:
    from attnscope.runs.outputs import RunResult


def cost_lines(result: RunResult) -> list[str]:
    return [
        f"total {format_flops(result.trace.total_flops)}   peak memory {format_bytes(result.peak_bytes)} traced "
        "(every step kept)",
        f"a fused kernel needs {format_bytes(result.fused_bytes)}: it never materializes scores or attention",
        f"KV cache of this layer: {format_bytes(result.kv_cache_bytes)} ({result.kv_cache_what} for n_K = "
        f"{result.params.get('nk')} positions)",
    ] + ([] if result.kv_cache_full_bytes is None else
         [f"as full heads (K_full and V_split of every head) it would be {format_bytes(result.kv_cache_full_bytes)}"])


def show_result(out: Console, result: RunResult, *, values: bool = False, stats: bool = False) -> None:
    if result.mask_view:
        show_grid(out, result.mask_view)
    show_trace(out, result.header, result.trace, footer=cost_lines(result))
    if result.comparisons:
        out.print(check_table(result.comparisons))
        for c in result.comparisons:
            if c.detail:
                out.print(Text(f"{c.name}: {c.detail}"))
    if result.heatmap:
        show_heatmap(out, result.heatmap)
    if result.heads:
        show_heads(out, result.heads)
    if stats:
        out.print(stats_table(result.trace))
    if values:
        show_values(out, result.trace)
    if result.saved:
        out.print(Text(f"saved {len(result.saved_names)} tensors to {result.saved}"))


def result_json(result: RunResult, *, values: bool = False, stats: bool = False) -> dict[str, Any]:
    from attnscope.tensors import tensor_stats

    tensors = []
    for step in result.trace.steps:
        entry = step_json(step)
        if stats:
            entry["stats"] = clean(tensor_stats(step.tensor))
        if values:
            small = step.tensor.device.type != "meta" and step.tensor.numel() <= VALUES_LIMIT
            entry["values"] = numbers(step.tensor) if small else None
        tensors.append(entry)
    payload: dict[str, Any] = {
        "command": result.command,
        "params": result.params,
        "tensors": tensors,
        "totals": {"flops": result.trace.total_flops, "peak_bytes": result.peak_bytes,
                   "fused_peak_bytes": result.fused_bytes, "kv_cache_bytes": result.kv_cache_bytes},
        "notes": list(result.trace.notes),
    }
    if result.kv_cache_full_bytes is not None:
        payload["totals"]["kv_cache_full_heads_bytes"] = result.kv_cache_full_bytes
    if result.comparisons:
        payload["check"] = [check_json(c) for c in result.comparisons]
        payload["check_passed"] = not result.check_failed
    if result.heatmap:
        payload["heatmap"] = heatmap_json(result.heatmap)
    if result.heads:
        payload["heads"] = heads_json(result.heads)
    if result.mask_view:
        payload["mask"] = mask_json(result.mask_view)
    if result.saved:
        payload["saved"] = str(result.saved)
    return payload
