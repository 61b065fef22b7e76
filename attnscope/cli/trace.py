"""`attnscope trace`: parse options, call attnscope.runs.trace, hand the result to render.

Exit 0 when every reference step has its equal in the user's code, 1 at a divergence or when the user's
code raised, 2 for bad input (no such file or name, a signature it cannot feed, a syntax error).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from attnscope.cli.common import Page, exporting, max_memory_bytes
from attnscope.cli.errors import reported
from attnscope.cli.options import (
    BARE_GIVEN,
    Alibi,
    AttentionCommand,
    Cache,
    CausalOpt,
    Debug,
    Force,
    HtmlPage,
    Json,
    KFile,
    Layout,
    MaskFile,
    MaxMemory,
    QFile,
    QkNormOpt,
    RopeBase,
    RopeOpt,
    RopePairing,
    Save,
    Seed,
    Softcap,
    Svg,
    TracePositionBias,
    VFile,
    Window,
    WindowSideOpt,
)

if TYPE_CHECKING:
    from rich.console import Console

TRACE_EXAMPLES = """Examples:

  attnscope trace docs/examples/my_attention.py:MultiHeadedAttention --init "d_feat=200, n_head=5"   # exit 1: a bug

  attnscope trace docs/examples/nanogpt.py:CausalSelfAttention --init "config=GPTConfig(n_embd=64, n_head=4)" --causal

  attnscope trace docs/examples/llama.py:Attention --init "dim=64, n_heads=4, n_kv_heads=2" --rope --causal"""

KvHeads = Annotated[int | None, typer.Option("--kv-heads", min=1, help="n_kv_head of the reference: a function's K and V get this many heads (with --heads); a module's is read from its projections' widths, which this must match.", rich_help_panel="Variants")]


def trace(
    target: Annotated[str, typer.Argument(metavar="FILE.py:NAME", help="An nn.Module class (or instance) or a function in a Python file. The file is imported: this runs its code.", show_default=False)],
    init: Annotated[str | None, typer.Option("--init", metavar="ARGS", help="Keyword arguments for the class, as Python literals, or calls of the file's own classes (and of a transformers config it imports) with such arguments: \"d_feat=200, n_head=5\", \"config=GPTConfig(n_embd=64, n_head=4)\" (read with ast, never eval).")] = None,
    forward: Annotated[str | None, typer.Option("--forward", metavar="ARGS", help="More keyword arguments for the forward, read as --init is: \"start_pos=0\", \"use_cache=False\"; trace still feeds the inputs and the mask.")] = None,
    train: Annotated[bool, typer.Option("--train", help="Run the module in training mode (dropout on, random); by default it runs in eval() mode.")] = False,
    batch: Annotated[int | None, typer.Option("--batch", min=0, help="n_batch; 0: 2-D inputs \\[n, d], one sequence.  \\[default: chosen so every dim differs; 2-D where your code fails on batched inputs]", show_default=False)] = None,
    nq: Annotated[int | None, typer.Option("--nq", min=1, help="n_Q: queries.  \\[default: chosen]", show_default=False)] = None,
    nk: Annotated[int | None, typer.Option("--nk", min=1, help="n_K: keys, for a callable taking query, key, value.  \\[default: chosen, ≠ n_Q]", show_default=False)] = None,
    d_feat: Annotated[int | None, typer.Option("--d-feat", min=1, help="d_feat, for a class whose constructor needs it and --init does not give it.", show_default=False)] = None,
    heads: Annotated[int | None, typer.Option("--heads", min=1, help="n_head, for a module whose head count cannot be read; for a function, 4-D inputs \\[n_batch, n_head, n, d].", show_default=False)] = None,
    dk: Annotated[int | None, typer.Option("--dk", min=1, help="d_K, for a function.  \\[default: chosen]", show_default=False)] = None,
    dv: Annotated[int | None, typer.Option("--dv", min=1, help="d_V, for a function.  \\[default: chosen]", show_default=False)] = None,
    seed: Seed = 0,
    q: QFile = None,
    k: KFile = None,
    v: VFile = None,
    causal: CausalOpt = None,
    window: Window = None,
    window_side: WindowSideOpt = None,
    mask: MaskFile = None,
    layout: Annotated[Layout, typer.Option("--layout", help="row: a function's inputs \\[.., n, d] (PyTorch); col: \\[.., d, n], one token a column, out = V softmax(Kᵀ Q), as sdpa --layout col.", rich_help_panel="Inputs")] = Layout.row,
    rope: RopeOpt = False,
    rope_base: RopeBase = None,
    rope_pairing: RopePairing = None,
    kv_heads: KvHeads = None,
    alibi: Alibi = False,
    position_bias: TracePositionBias = None,
    qk_norm: QkNormOpt = None,
    scale: Annotated[float | None, typer.Option("--scale", help="The scores' scale, for 1/sqrt(d_head) (T5: 1; Gemma 2's query_pre_attn_scalar q gives q ** -0.5).", rich_help_panel="Variants")] = None,
    softcap: Softcap = None,
    cache: Cache = 0,
    max_memory: MaxMemory = None,
    json: Json = False,
    save: Save = None,
    svg: Svg = None,
    html: HtmlPage = None,
    force: Force = False,
    debug: Debug = False,
    ctx: typer.Context = None,  # type: ignore[assignment]  # given by Typer: which options stood bare
) -> None:
    """Is my attention right? Run YOUR attention code (FILE.py:NAME is imported, which runs it), record every
    tensor op with its line, and line it up with attnscope's reference on the same inputs and weights; the
    first step that differs is explained. Exit 0 when all align, 1 at a divergence or an error in your code."""

    from attnscope.cli.collector import as_python

    as_python()  # the user's code runs here, many times: its cycles freed as in their own program
    page = Page()
    with reported(debug), exporting(svg, html, force=force, json=json, title="attnscope trace", page=page) as out:
        from attnscope.readings.headstats import describe
        from attnscope.runs.trace import TraceOptions, run_trace
        from attnscope.views.sources import from_trace_run

        bare = ctx.meta.get(BARE_GIVEN, set())  # a bare --causal: its alignment left to the default
        options = TraceOptions(target=target, init=init, forward=forward, train=train, batch=batch, nq=nq, nk=nk, d_feat=d_feat,
                               heads=heads, dk=dk, dv=dv, seed=seed, q=q, k=k, v=v, mask=mask, layout=layout.value,
                               causal=causal.value if causal else None, max_memory=max_memory_bytes(max_memory),
                               window=window, window_side=window_side.value if window_side else "left", rope=rope, rope_base=rope_base,
                               rope_pairing=rope_pairing.value if rope_pairing else None, kv_heads=kv_heads, cache=cache,
                               save=save, force=force, alibi=alibi, position_bias=position_bias,
                               qk_norm=qk_norm.value if qk_norm else None, scale=scale, softcap=softcap,
                               causal_asked=causal is not None and "--causal" not in bare)
        run = run_trace(options)
        page.of(run, lambda traced: from_trace_run(traced, describe))
        _show(out, run, json, exported=bool(svg or html))


def _show(out: Console, run: object, json: bool, exported: bool) -> None:
    from attnscope import render
    from attnscope.errors import UsageError
    from attnscope.render.usertrace import show_usertrace, usertrace_json
    from attnscope.runs.trace import TraceRun

    assert isinstance(run, TraceRun)
    if json:
        render.emit_json(usertrace_json(run))
    else:
        show_usertrace(out, run)
    if run.no_reference and run.failure is None:
        raise UsageError(run.no_reference)
    if run.failure is not None and not exported:  # shown above; and one line on stderr (with --svg/--html,
        # the line saying the file was written is the one line, and the failure is in the file)
        f = run.failure
        where = f"{run.params['file'].rsplit('/', 1)[-1]}:{f.line}" if f.line else run.params["file"]
        render.error(f"{where}: your code raised {f.message}")
    if run.failure is not None or run.diverged:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("trace", cls=AttentionCommand, epilog=TRACE_EXAMPLES)(trace)
