"""`attnscope sdpa`: parse options, call attnscope.runs.sdpa, hand the result to render."""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.common import Page
from attnscope.cli.options import AttentionCommand, Batch, Dk, Dv, Layout, NkOrCache, Nq
from attnscope.cli.shared_run import Shared, attention_command

SDPA_EXAMPLES = """Examples:

  attnscope sdpa --nq 30 --nk 50 --dk 128 --dv 256

  attnscope sdpa --q q.npy --k k.npy --v v.npy --causal --check

  attnscope sdpa --batch 1 --nq 2 --cache 6 --dk 8 --dv 8 --rope --window 4 --show-mask"""


def sdpa(
    batch: Batch = 3,
    nq: Nq = 30,
    nk: NkOrCache = None,
    dk: Dk = 128,
    dv: Dv = 256,
    *,
    shared: Shared,
    x: Annotated[str | None, typer.Option("--x", metavar="FILE", help="X \\[n, p] for Q = X W_Q, K = X W_K, V = X W_V.", rich_help_panel="Inputs")] = None,
    wq: Annotated[str | None, typer.Option("--wq", metavar="FILE", help="W_Q \\[p, d_K].", rich_help_panel="Inputs")] = None,
    wk: Annotated[str | None, typer.Option("--wk", metavar="FILE", help="W_K \\[p, d_K].", rich_help_panel="Inputs")] = None,
    wv: Annotated[str | None, typer.Option("--wv", metavar="FILE", help="W_V \\[p, d_V].", rich_help_panel="Inputs")] = None,
    layout: Annotated[Layout, typer.Option("--layout", help="row: inputs \\[n, d] (PyTorch); col: inputs \\[d, n], out = V softmax(Kᵀ Q).", rich_help_panel="Inputs")] = Layout.row,
    scale: Annotated[float | None, typer.Option("--scale", help="Replace 1/sqrt(d_K), as F.scaled_dot_product_attention(scale=...).", rich_help_panel="Masks")] = None,
) -> None:
    """Scaled dot-product attention: softmax(Q Kᵀ / √d_K) V, every step shown."""

    page = Page()
    with shared.running("sdpa", page) as out:
        from attnscope.runs.sdpa import SdpaOptions, run_sdpa

        options = SdpaOptions(batch=batch, nq=nq, nk=nk, dk=dk, dv=dv, x=x, wq=wq, wk=wk, wv=wv, layout=layout.value,
                              scale=scale, **shared.options())
        shared.show(out, run_sdpa(options), page)


def register(app: typer.Typer) -> None:
    app.command("sdpa", cls=AttentionCommand, epilog=SDPA_EXAMPLES)(attention_command(sdpa))
