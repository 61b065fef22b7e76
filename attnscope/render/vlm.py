"""A vision-language model's text with an image (`head --text ... --image F`, runs/vlm.py): each text query's
share of weight on the image's tokens, for the head asked and over every head of the layer; and its JSON keys
`image_tokens`, `image_grids`, `image_share` (docs/json.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnscope.render.console import numbers

if TYPE_CHECKING:
    from attnscope.runs.head_result import HeadResult


def show_image_share(out: Console, result: HeadResult) -> None:
    """A row per text query: its weight on the image's tokens in head h, and the mean and largest over the layer's
    heads (with the head that has it)."""
    share, tokens = result.image_share, result.image_tokens
    if share is None or tokens is None or result.encoded is None:
        return
    image = tokens.image
    h = result.options.head
    n_image = sum(image)
    out.print(Text(f"{result.layer_name}: each text query's weight on the image's {n_image} tokens (its row's sum "
                   "over them)", style="bold"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name, justify in (("query", "left"), (f"head {h}", "right"), ("mean of heads", "right"),
                          ("largest", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    seen = False
    for q, token in enumerate(result.encoded.tokens):
        if image[q]:
            continue
        seen = seen or q > image.index(True)
        if not seen:
            continue  # the text before the image sees none of it (a causal model)
        column = share[:, q]  # [n_head]
        top = int(column.argmax())
        table.add_row(Text(token), f"{float(share[h, q]):.3f}", f"{float(column.mean()):.3f}",
                      f"{float(column[top]):.3f} (head {top})")
    out.print(table)


def image_tokens_json(result: HeadResult) -> dict[str, Any]:
    """`image_tokens`: the positions the image fills; `image_grids`: each run's [rows, cols]; `image_share`: each
    head's weight on them per query, `[n_head][n_tokens]`."""
    tokens = result.image_tokens
    if result.image_share is None or tokens is None:
        return {}
    return {"image_tokens": [i for i, on in enumerate(tokens.image) if on],
            "image_grids": [list(grid) for grid in tokens.grids], "image_share": numbers(result.image_share)}
