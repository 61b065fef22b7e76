"""`attnscope diff A B`: parse options, call attnscope.runs.diff, hand the result to render.

Exit 0 when every step both runs hold agrees within its tolerance, 1 at the first that does not, 2 for a
file that is no saved run (or two runs with no step in common).
"""

from __future__ import annotations

from typing import Annotated

import typer

from attnscope.cli.options import Export, grouped

DIFF_EXAMPLES = """Examples:

  attnscope diff eager.safetensors fused.safetensors   # two trace --save runs: nanoGPT eager, and fused

  attnscope diff fixed.safetensors buggy.safetensors   # exit 1: scores, divided by √d_feat

  attnscope diff eager.safetensors fused.safetensors --atol 1e-6 --rtol 0 --json"""



def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="A run saved with --save (.safetensors, .pt, .npz): the reference.", show_default=False)],
    b: Annotated[str, typer.Argument(metavar="B", help="The run to compare with it, step by step.", show_default=False)],
    atol: Annotated[float | None, typer.Option("--atol", metavar="X", help="Absolute tolerance.  \\[default: by dtype, as --check]", show_default=False)] = None,
    rtol: Annotated[float | None, typer.Option("--rtol", metavar="X", help="Relative tolerance, of max |A|.  \\[default: by dtype, as --check]", show_default=False)] = None,
    export: Export = Export(),
) -> None:
    """Compare two saved runs (--save of any command, trace --save) step by step: shape, dtype and max |diff| of
    every step both hold, NaN-aware, each within its dtype's tolerance. Exit 0 when all agree, 1 at the first
    that does not (named, and where trace's diagnoses apply, why)."""

    with export.around("diff") as out:
        from attnscope import render
        from attnscope.render.diff import diff_json, show_diff
        from attnscope.runs.diff import DiffOptions, run_diff

        run = run_diff(DiffOptions(a=a, b=b, atol=atol, rtol=rtol))
        if export.json:
            render.emit_json(diff_json(run))
        else:
            show_diff(out, run)
        if run.diverged:
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("diff", epilog=DIFF_EXAMPLES)(grouped(diff))
