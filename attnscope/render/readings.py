"""What heads move and where they park their weight, in the terminal and in JSON (docs/heads.md, docs/json.md):
value-weighted attention (readings/moved.py), sink accounting (readings/sinkshare.py), rollout
(readings/rollout.py).

The terminal: with `--all-heads` a table of layer L's heads (moved, the weight and the value-weighted share on
the first token, a learned sink's weight, the top keys' share); with `--all-layers` the "sinks" view, a layer x
head grid of the weight parked on the first token (and a learned sink) beside the value-weighted share that
arrives from there, and the input tokens the rollout says the last query draws from. A vision tower's tokens
are no text: there the words name the token at position 0 by its label, `[CLS]` (SigLIP's, which has none, the patch
`p(0,0)`), in place of "the first token" (`first_words`); nor are Whisper's encoder positions, audio labelled by
the time each starts at (`0.00s`): there key 0 is "the audio's first 20 ms (position 0)", in the encoder and across,
and the rollout's last query the audio at its time (`audio_words`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from attnscope.render.console import clean, numbers, shown_token
from attnscope.render.fit import Column, FittedTable, FittedText, cell, whole

if TYPE_CHECKING:
    from attnscope.readings.headstats import LayerHeads
    from attnscope.runs.head_result import HeadResult

LABEL = 9  # "layer 23 " and the like, as render/beyond_layer.py's grid
CELL = 4  # " 100"
ROLLOUT_TOKENS = 5  # the input tokens named for the last query


def head_readings(heads: LayerHeads) -> list[dict[str, Any]]:
    """Each head's `value_norms` [n_K], `weighted` [n_Q, n_K] and `moved` (where the values are known) and its
    `sinks_share`: the keys a `heads` entry gains."""
    shares = heads.sinks_share()
    weights = heads.weighted()
    moved = heads.moved()
    out: list[dict[str, Any]] = []
    for h, share in enumerate(shares):
        entry: dict[str, Any] = {}
        if weights is not None and heads.value_norms is not None and moved is not None:
            entry = {"value_norms": numbers(heads.value_norms[h]), "weighted": numbers(weights[h]),
                     "moved": clean(moved[h])}
        out.append(entry | {"sinks_share": clean(share)})
    return out


def layer_readings(layer: LayerHeads) -> dict[str, Any]:
    """An `all_layers` entry's readings: `value_norms` [n_head, n_K] and `moved` [n_head] where known, and
    `sinks_share` (a head each)."""
    entry: dict[str, Any] = {}
    moved = layer.moved()
    if layer.value_norms is not None and moved is not None:
        entry = {"value_norms": numbers(layer.value_norms), "moved": clean(moved)}
    return entry | {"sinks_share": clean(layer.sinks_share())}


def sinks_grid(layers: list[LayerHeads], numbers_of: list[int]) -> dict[str, Any]:
    """JSON `sinks_share`: the layer x head grid (readings/sinkshare.py's `grid`)."""
    from attnscope.readings.sinkshare import grid

    return grid([layer.sinks_share() for layer in layers], numbers_of)


def readings_json(result: HeadResult) -> dict[str, Any]:
    """The run's top-level readings: `sinks_share` (layer L's row, every layer's with --all-layers), and with
    --all-layers `rollout`, `rollout_weighted` and `rollout_layers`."""
    payload: dict[str, Any] = {}
    if result.layer_heads:
        layer_numbers = result.layer_numbers or list(range(len(result.layer_heads)))
        payload["sinks_share"] = sinks_grid(result.layer_heads, layer_numbers)
    elif result.heads is not None:
        payload["sinks_share"] = sinks_grid([result.heads], [result.options.layer])
    if result.rollout is not None:
        payload["rollout"] = numbers(result.rollout)
        payload["rollout_layers"] = list(result.layer_numbers or [])
        if result.rollout_weighted is not None:
            payload["rollout_weighted"] = numbers(result.rollout_weighted)
        if result.rollout_without_first is not None:
            payload["rollout_without_first"] = numbers(result.rollout_without_first)
    return payload


def _percent(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else str(round(100 * value))


def first_words(heads: LayerHeads) -> tuple[str, str]:
    """How the tables name key 0, the sink's usual place, short and in a sentence: `first`, `the first token` on a
    text; on a vision tower's tokens, which are no text, the token there by its label (the heads' column labels):
    `[CLS]`, `[CLS] (token 0)`, or SigLIP's first patch `p(0,0)`, `p(0,0) (token 0)`; on Whisper's encoder
    positions (its keys in the encoder and across), audio, by their time: `0.00s`, `the audio's first 20 ms
    (position 0)`."""
    audio = audio_words(heads.col_labels)
    if audio is not None:
        return heads.col_labels[0], audio
    if heads.grid is None or not heads.grid.tower or not heads.col_labels:
        return "first", "the first token"
    label = heads.col_labels[0]
    return label, f"{label} (token 0)"


def audio_words(labels: list[str], position: int = 0) -> str | None:
    """Audio position `position` in a sentence, where `labels` are Whisper's encoder positions by the time each
    starts at (models/audio.py's `position_labels`: `0.00s`, `0.02s`, ...): `the audio's first 20 ms (position
    0)`, `the audio at 0.98s (position 49)`; None for any other labels (a text's tokens, an image's)."""
    from attnscope.readings.headstats import audio_times

    times = audio_times(labels)
    if times is None:
        return None
    if len(times) == 1:
        return "the audio at 0.00s (position 0)"
    span = f"{1000 * times[-1] / (len(times) - 1):.3g} ms"  # each position's, conv2's stride of two mel frames
    if position == 0:
        return f"the audio's first {span} (position 0)"
    return f"the audio at {labels[position]} (position {position})"


def show_moved(out: Console, heads: LayerHeads) -> None:
    """`--all-heads`: what each head of the layer moves, and where its weight goes."""
    shares, moved = heads.sinks_share(), heads.moved()
    sinks = "sink" in shares[0] if shares else False
    first, the_first = first_words(heads)
    columns = [Column("head", "right", style="bold cyan"), Column("moved", "right"), Column(f"{first} %", "right"),
               Column(f"value-wtd {first} %", "right"), Column("top-3 %", "right"),
               Column("value-wtd top-3 %", "right")]
    if sinks:
        columns.insert(2, Column("sink %", "right"))
    rows = []
    for h, share in enumerate(shares):
        row = [whole(str(h)), whole("-" if moved is None else f"{moved[h]:.2f}")]
        if sinks:
            row.append(whole(_percent(share.get("sink"))))
        row += [whole(_percent(share["first"])), whole(_percent(share.get("weighted_first"))),
                whole(_percent(share["top"])), whole(_percent(share.get("weighted_top")))]
        rows.append([cell(r) for r in row])
    out.print()
    out.print(Text(f"{heads.title}: what each head moves (value-weighted attention) and where its weight goes",
                   style="bold"))
    out.print(FittedTable(columns, rows))
    out.print(FittedText("moved: mean over queries of Σ_j a_ij·||f(x_j)||, an upper bound on the norm of what the "
                         "head adds to the residual stream (its output's norm is at most this);  "
                         f"{first} %: its weight on {the_first}, value-wtd: the share of what it moves "
                         "that comes from there;  top-3: the three keys with the most weight" +
                         (";  sink %: the learned sink's weight, which moves nothing" if sinks else "") +
                         " (docs/heads.md)"))
    if moved is None:
        out.print(FittedText("moved and value-wtd are '-': this run holds no traced values V and output projection "
                             "W_o of the layer to weigh the weights by (the pattern alone)"))


def show_sinks(out: Console, layers: list[LayerHeads]) -> None:
    """`--all-layers`: the sinks view, a layer x head grid of the weight parked on the first token (and a learned
    sink) and, beside it, the value-weighted share that comes from the first token."""
    if not layers:
        return
    shares = [layer.sinks_share() for layer in layers]
    sinks = any("sink" in head for layer in shares for head in layer)
    weighted = all("weighted_first" in head for layer in shares for head in layer)
    the_first = first_words(layers[0])[1]
    parked = f"{the_first} + learned sink" if sinks else the_first
    grids = [(f"weight on {parked}, % (mean over queries)",
              lambda head: head["first"] + head.get("sink", 0.0))]
    if weighted:
        grids.append((f"value-weighted share from {the_first}, % (what moves from there)",
                      lambda head: head["weighted_first"]))
    n_head = max(len(share) for share in shares)  # a hybrid's linear layers may have more heads than its others
    per_line = max(1, (out.width - LABEL) // CELL)
    out.print()
    out.print(Text(f"sinks: where each head parks its weight  [{len(layers)} layers x {n_head} heads]", style="bold"))
    for title, value in grids:
        out.print(FittedText(title))
        for start in range(0, n_head, per_line):
            heads = range(start, min(start + per_line, n_head))
            out.print(Text(" " * LABEL + "".join(f"{h:>{CELL}}" for h in heads), style="dim"))
            for layer, share in zip(layers, shares, strict=True):
                out.print(Text(layer.title.ljust(LABEL) + "".join(
                    f"{_percent(value(share[h])) if h < len(share) else '':>{CELL}}" for h in heads)))
    out.print(FittedText(f"a head that parks its weight on {the_first} but moves little from there is resting "
                         "(Kobayashi et al. 2020; docs/heads.md)"))


SINK_DOMINATES = 0.5  # the first token's share of the last row above which the rollout ranks little else


def show_rollout(out: Console, result: HeadResult) -> None:
    """The input tokens the last query draws from, by attention rollout (and value-weighted rollout)."""
    if result.rollout is None or result.encoded is None:
        return
    tokens = result.axes()[1]
    picture = result.picture
    who = "the last token"
    if picture is not None and result.options.text is None:  # a vision tower: its last token is a patch
        who = "[CLS]" if "[CLS]" in picture.grid.prefix else "the mean query"
    audio = audio_words(tokens, len(tokens) - 1)  # Whisper's encoder: its last position is audio (or padding)
    for name, matrix in (("rollout", result.rollout), ("value-weighted rollout", result.rollout_weighted)):
        if matrix is None or matrix.shape[0] == 0:
            continue
        # a tower's [CLS] row, or with no [CLS] every query's mean, as the overlay draws it (render/overlay.py)
        row = matrix[-1] if who == "the last token" else matrix[0] if who == "[CLS]" else matrix.double().mean(0)
        top = row.argsort(descending=True, stable=True)[:ROLLOUT_TOKENS].tolist()
        named = ",  ".join(f"{j} {_token(tokens[j] if j < len(tokens) else str(j))} {row[j]:.2f}" for j in top)
        out.print(FittedText(f"{name}, {audio or who} draws from: {named}"))
    rest = result.rollout_without_first
    if who == "the last token" and rest is not None and float(result.rollout[-1, 0]) >= SINK_DOMINATES:
        share = float(result.rollout[-1, 0])
        row = rest[-1]
        top = [j for j in row.argsort(descending=True, stable=True).tolist() if j > 0][:ROLLOUT_TOKENS]
        named = ",  ".join(f"{j} {_token(tokens[j] if j < len(tokens) else str(j))} {row[j]:.2f}" for j in top)
        out.print(FittedText(f"the first token holds {share:.2f} of the rollout: the heads park their weight there "
                             "(a sink), so the other tokens' shares are near 0 and their order is noise"))
        out.print(FittedText(f"rollout without the first token, the last token draws from: {named}"))
    out.print(FittedText("rollout: the product over layers of 0.5·mean_heads(A) + 0.5·I; the residual taken as "
                         "identity, heads averaged, MLPs ignored: a ranking, not an attribution (docs/heads.md)"))


def _token(token: str) -> str:
    return shown_token(token)
