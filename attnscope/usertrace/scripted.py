"""TorchScript helpers run as the Python they were compiled from. `@torch.jit.script` turns a function into a
ScriptFunction whose ops run inside TorchScript's interpreter, where trace's recorder (a TorchFunctionMode) sees none
of them: Sockeye's `@pt.jit.script` helpers that split the heads and make the scores would leave trace only their
results, and a line-up with its middle steps missing. torch keeps each compiled function's Python original
(`_torchdynamo_inline`, set by torch.jit.script for torch.compile's sake), which computes the same numbers; the
user's file's names for its ScriptFunctions are pointed at those originals once it is imported, and a note says so."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def unscripted(module: ModuleType) -> list[str]:
    """The names of the file's TorchScript functions, each now its Python original in the file's namespace (so that
    the file's own calls to it, looked up there, run the Python); none where it holds none or torch kept no
    original."""
    import torch

    script_function = getattr(torch.jit, "ScriptFunction", None)
    if script_function is None:
        return []
    names = []
    for name, value in list(vars(module).items()):
        original: Any = getattr(value, "_torchdynamo_inline", None) if isinstance(value, script_function) else None
        if callable(original):
            setattr(module, name, original)
            names.append(name)
    return names


def note(names: list[str]) -> str:
    """The note that says which functions ran as Python."""
    listed = ", ".join(names)
    them = "them" if len(names) > 1 else "it"
    return (f"{listed}: compiled with @torch.jit.script, whose ops trace cannot see; run as the Python "
            f"{'they were' if len(names) > 1 else 'it was'} compiled from (the same numbers), so that trace sees "
            f"{them} op by op")
