"""The width a module's forward receives, where the layer read as its query projection is fed by another layer of
its own: multi-head latent attention's `q_b_proj(q_a_layernorm(q_a_proj(x)))` (DeepSeek-V2/V3) reads the query
latent, q_lora_rank wide, not x. A layer registered before the reader that writes what it reads, and does not read
what the reader writes (an output projection back to the input's width is no such feeder), is followed back to the
layer the input reaches first; what that one reads is the module's width."""

from __future__ import annotations

from typing import Any


def fed_width(module: Any, reader: str, read: int, wrote: int) -> int:
    """What the module's input is, where the layer named `reader` (a fused projection's rows: `qkv[0:32]`) reads
    `read` features and writes `wrote`: `read`, unless a layer registered before it writes `read` (then what that
    one is fed, in turn)."""
    from attnscope.usertrace.linearweights import linears

    layers = linears(module)
    names = [name for name, _ in layers]
    at = names.index(reader.split("[")[0]) if reader.split("[")[0] in names else len(layers)
    seen = {read}
    while True:
        feeder = next((i for i, (_, layer) in enumerate(layers[:at])
                       if layer.out_features == read and layer.in_features != wrote), None)
        if feeder is None or layers[feeder][1].in_features in seen:
            return read
        at, wrote, read = feeder, read, int(layers[feeder][1].in_features)
        seen.add(read)
