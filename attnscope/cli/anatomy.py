"""`attnscope anatomy`: every layer's attention from a model's config.json alone (no weights, no torch), with its
KV cache and attention FLOPs at a number of tokens."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.options import Export, grouped

ANATOMY_EXAMPLES = """Examples:

  attnscope anatomy Qwen/Qwen3-0.6B

  attnscope anatomy google/gemma-3-1b-it --tokens 8192 --dtype float8_e4m3fn

  attnscope anatomy ./DeepSeek-V3 --tokens 4096 --json"""


def anatomy(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A folder with config.json (or the config.json itself), or a Hugging Face model name found in the local cache. Only config.json is read. A GGUF file (or ollama:NAME[:TAG]): its metadata.")],
    tokens: Annotated[int | None, typer.Option("--tokens", min=1, metavar="N", help="Count the KV cache and FLOPs at N tokens.  \\[default: the config's context, max_position_embeddings or the like]")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", metavar="DTYPE", help="Count the KV cache in this dtype (float32, bfloat16, float16, float8_e4m3fn, ...).  \\[default: the config's torch_dtype]")] = None,
    export: Export = Export(),
) -> None:
    """Every layer's attention from config.json alone: full, sliding, chunked, NoPE, MLA, sinks, qk-norm; heads,
    KV heads, head size, RoPE; the KV cache and attention FLOPs at --tokens. Identical layers share a row."""
    with export.around("anatomy", names={"model": "MODEL"}) as out:
        from attnscope import render
        from attnscope.anatomy.read import read_anatomy

        found = read_anatomy(model, tokens=tokens, dtype=dtype)
        if export.json:
            render.emit_json(render.anatomy_json(found))
        else:
            render.show_anatomy(out, found)


def register(app: typer.Typer) -> None:
    app.command("anatomy", epilog=ANATOMY_EXAMPLES)(grouped(anatomy))
