"""A vision-language model's text with an image (`head --text ... --image F`, runs/vlm.py): each text query's
share of weight on the image's tokens, for the head asked and over every head of the layer (with --generate, each
new token's); and its JSON keys `image_tokens`, `image_grids`, `image_share`, `decode_image_share`
(docs/json.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnscope.models.tokenizer import token_label
from attnscope.render.console import numbers

if TYPE_CHECKING:
    import torch

    from attnscope.runs.head_result import HeadResult


def show_image_share(out: Console, result: HeadResult) -> None:
    """A row per text query: its weight on the image's tokens in head h, and the mean and largest over the layer's
    heads (with the head that has it); with --generate, a row per new token for the row that chose it."""
    share, tokens = result.image_share, result.image_tokens
    if share is None or tokens is None or result.encoded is None:
        return
    image = tokens.image
    n_image = sum(image)
    out.print(Text(f"{result.layer_name}: each text query's weight on the image's {n_image} tokens (its row's sum "
                   "over them)", style="bold"))
    rows = []
    seen = False
    for q, token in enumerate(result.encoded.labels):  # as decoded (tokenizer.token_label)
        if image[q]:
            continue
        seen = seen or q > image.index(True)
        if seen:  # the text before the image sees none of it (a causal model)
            rows.append((token, share[:, q]))  # [n_head]
    out.print(_share_table("query", rows, result.options.head))
    if result.decode:
        from attnscope.models.vision.vlm_generate import step_shares

        out.print(Text(f"{result.layer_name}: each new token's weight on the image (the row of the query that "
                       "chose it)", style="bold"))
        by_step = step_shares(result.decode, image)  # [n_new, n_head]
        pieces = [token_label(token, text) for token, text in result.decode_pieces]  # as the timeline shows them
        out.print(_share_table("new token", list(zip(pieces, by_step, strict=False)), result.options.head))


def _share_table(first: str, rows: list[tuple[str, torch.Tensor]], h: int) -> Table:
    """Each row's share in head h, the mean of the heads, and the largest (its head)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name, justify in ((first, "left"), (f"head {h}", "right"), ("mean of heads", "right"),
                          ("largest", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for token, column in rows:  # column: [n_head]
        top = int(column.argmax())
        table.add_row(Text(token), f"{float(column[h]):.3f}", f"{float(column.mean()):.3f}",
                      f"{float(column[top]):.3f} (head {top})")
    return table


def image_tokens_json(result: HeadResult) -> dict[str, Any]:
    """`image_tokens`: the positions the image fills; `image_grids`: each run's [rows, cols]; `image_share`: each
    head's weight on them per query, `[n_head][n_tokens]` (a long prompt's pattern is pooled: `rows_image_share`
    instead, head h's exact rows' `[n_rows]`); with --generate `decode_image_share`, each new token's (the row that
    chose it, as `decode_steps`' `attention`), `[n_new][n_head]`."""
    tokens = result.image_tokens
    if tokens is None:
        return {}
    found: dict[str, Any] = {"image_tokens": [i for i, on in enumerate(tokens.image) if on],
                             "image_grids": [list(grid) for grid in tokens.grids]}
    if result.image_share is not None:
        found["image_share"] = numbers(result.image_share)
    long = result.long
    if long is not None and long.exact_rows is not None:
        from attnscope.models.vision.vlm_long import row_shares

        found["rows_image_share"] = numbers(row_shares(long.exact_rows, tokens.image))
    if result.decode:
        from attnscope.models.vision.vlm_generate import step_shares

        found["decode_image_share"] = numbers(step_shares(result.decode, tokens.image))
    return found
