"""Any other architecture transformers can load: its attention on a sentence through transformers itself.

`AutoModel.from_pretrained(folder, attn_implementation="eager")` in float32 and `output_attentions=True`:
the pattern of every head of every layer, but not the steps that made it (attnscope traces only the
families it has a forward for). The whole model is loaded, so the memory guard counts it first.
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


def run(folder: Path, ids: list[int], model_type: str) -> FallbackRun:
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load report and progress bar would bury the table
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise UsageError(f"{{model}} {folder}: transformers cannot load model_type '{model_type}' either "
                         f"({_first_line(exc)})", "model") from None
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
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
