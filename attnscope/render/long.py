"""A long input's head (models/forward/long.py): the layer's steps as shapes, the pooled pattern, the head's statistics
over every row, and the exact rows asked for (`--rows A:B`) as their strongest keys; and its JSON
(`attention_pooled`, `pool`, `rows`, `head_stats`; docs/json.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from attnscope.render.console import clean, numbers, shown_token
from attnscope.render.fit import FittedText
from attnscope.render.heatmap import show_heatmap
from attnscope.render.tables import step_json, steps_table

if TYPE_CHECKING:
    from attnscope.runs.head_result import HeadResult

TOP_KEYS = 5  # keys listed for each exact row
TERMINAL_ROWS = 48  # query rows of the pooled pattern drawn in the terminal (the JSON has all of them)


def show_long(out: Console, result: HeadResult) -> None:
    from attnscope.runs.outputs import Heatmap

    long, o, encoded = result.long, result.options, result.encoded
    assert long is not None and encoded is not None
    queries, keys = result.axes()  # an encoder-decoder's decoder and cross-attention: the target's rows
    n, n_K = len(queries), len(keys)
    on = result.tokens_text() if result.kind else f"on {n:,} tokens"
    out.print(Text(f"{result.layer_name}'s attention {on}, as shapes (computed in blocks, never held): "
                   f"{long.spec.describe(result.info.d_head)}", style="bold"))
    out.print(steps_table(long.layer.steps))
    for note in result.notes:
        out.print(Text(f"note: {note}", style="yellow"))
    matrix, r, c = terminal_view(long.pooled, long.pool, n)
    rows = [_span(i, r, n, "q") for i in range(matrix.shape[0])]
    cols = [_span(j, c, n_K, "k") for j in range(matrix.shape[1])]
    show_heatmap(out, Heatmap(f"layer {o.layer}, head {o.head}: attention pooled {r} x {c} (each cell: the mean over "
                              f"{r} queries of the weight on {c} keys)", matrix.tolist(), rows, cols))
    s = long.stats
    out.print(FittedText(f"head {o.head} over all {n:,} queries: entropy {s.entropy:.2f} bits, first token "
                         f"{s.first:.2f}, previous {s.previous:.2f}, self {s.self:.2f}, distance {s.distance:.1f}"
                         + (f", induction {s.induction:.2f}" if s.induction is not None else "")))
    if long.rows is not None and long.exact_rows is not None:
        tokens, key_tokens = [shown_token(t) for t in queries], [shown_token(t) for t in keys]
        out.print(Text(f"exact rows {long.rows[0]} to {long.rows[1] - 1}: the {TOP_KEYS} strongest keys of each",
                       style="bold"))
        for i, row in enumerate(long.exact_rows):
            top = row.topk(min(TOP_KEYS, row.numel()))
            strongest = ", ".join(f"{key_tokens[j]}@{j} {w:.3f}" for w, j in zip(top.values.tolist(),
                                                                                  top.indices.tolist(), strict=True))
            q = long.rows[0] + i
            out.print(FittedText(f"q{q} {tokens[q]}: {strongest}"))


def terminal_view(pooled: Any, pool: tuple[int, int], n: int) -> tuple[Any, int, int]:
    """The pooled pattern with its query rows pooled again to at most TERMINAL_ROWS (exact means: each pooled row
    weighs as many queries as it holds), and the query rows and key columns per cell."""
    import torch

    from attnscope.views.pooling import group_size

    r, c = pool
    g = group_size(pooled.shape[0], TERMINAL_ROWS)
    if g == 1:
        return pooled, r, c
    counts = torch.bincount(torch.arange(n) // r, minlength=pooled.shape[0]).to(pooled.dtype)  # queries per row
    groups = torch.arange(pooled.shape[0]) // g
    sums = torch.zeros(int(groups[-1]) + 1, pooled.shape[1], dtype=pooled.dtype).index_add_(
        0, groups, pooled * counts[:, None])
    return sums / torch.zeros(sums.shape[0], dtype=pooled.dtype).index_add_(0, groups, counts)[:, None], r * g, c


def _span(i: int, size: int, n: int, prefix: str) -> str:
    first, last = i * size, min(n, (i + 1) * size) - 1
    return f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"


def long_json(result: HeadResult) -> dict[str, Any]:
    long, encoded = result.long, result.encoded
    assert long is not None and encoded is not None
    payload: dict[str, Any] = {
        "tokens": encoded.tokens, **({"token_text": encoded.text} if encoded.text is not None else {}),
        "token_ids": encoded.ids, "tokenizer": encoded.via, "traced": True,
        "tracer": result.tracer,
        "steps": [], "layer_steps": [step_json(step) for step in long.layer.steps],
        "attention_pooled": numbers(long.pooled), "pool": list(long.pool),
        "head_stats": clean(long.stats.as_dict()),
    }
    if long.rows is not None and long.exact_rows is not None:
        payload["rows"] = {"first": long.rows[0], "attention": numbers(long.exact_rows)}
    return payload
