"""Any other architecture transformers can load: its attention on a sentence through transformers itself.

`AutoModel.from_pretrained(folder, attn_implementation="eager")` in float32 and `output_attentions=True`:
the pattern of every head of every layer, but not the steps that made it (attnscope traces only the
families it has a forward for). The whole model is loaded, so the memory guard counts it first.

A model folder's own code never runs: every transformers call passes `trust_remote_code=False` (so
transformers never asks "Do you wish to run the custom code?" and never reads stdin), and a folder whose
config.json names a model_type transformers does not know and an `auto_map` to its own code is refused in
one line before anything is loaded (`refuse_own_code`). Whatever else transformers raises while loading
the user's folder is one line too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint


@dataclass
class FallbackRun:
    attentions: tuple[torch.Tensor, ...]  # one [1, n_head, n_tokens, n_tokens] per layer
    architecture: str


def estimate_bytes(checkpoint: Checkpoint) -> int:
    """What from_pretrained needs in float32: the parameters, and as much again while it loads them."""
    numel = sum(math.prod(checkpoint.shape(key)) for key in checkpoint.keys)
    return 2 * 4 * numel


def own_code(folder: Path, file: str, auto_map: object) -> UsageError:
    """The one line for a folder that asks for its own Python code (`auto_map`)."""
    targets = sorted({str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])})
    named = f" ({', '.join(targets)[:120]})" if targets else ""
    return UsageError(f"{{model}} {folder}: its {file} asks for the folder's own Python code through auto_map{named}, "
                      "and attnscope never runs code from a model folder (transformers' trust_remote_code stays "
                      "off); use a model whose classes transformers ships", "model")


def refuse_own_code(folder: Path, model_type: str, auto_map: object) -> None:
    """A model_type transformers does not know, with an `auto_map` to the folder's own code: transformers could
    only load it by running that code. (A known model_type with an auto_map loads transformers' own classes.)"""
    if not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise own_code(folder, "config.json", auto_map)


def run(folder: Path, ids: list[int], model_type: str) -> FallbackRun:
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load report and progress bar would bury the table
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32,
                                          trust_remote_code=False).eval()
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's folder through a third-party loader: any failure is theirs
        raise UsageError(f"{{model}} {folder}: transformers cannot load model_type '{model_type}' either "
                         f"({_first_line(exc)})", "model") from None
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the same: transformers running the user's checkpoint
        raise ResourceError(f"transformers could not run model_type '{model_type}' on the text alone "
                            f"({_first_line(exc)})") from None
    attentions = getattr(out, "attentions", None)
    if not attentions:
        raise ResourceError(f"model_type '{model_type}' gives no attention weights (output_attentions) in "
                            "transformers; attnscope cannot show its pattern")
    return FallbackRun(tuple(attentions), type(model).__name__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__
