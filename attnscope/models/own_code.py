"""A model folder's own code never runs.

Every transformers call passes `trust_remote_code=False` (so transformers never asks "Do you wish to run the
custom code?" and never reads stdin), and a folder whose config.json names a model_type transformers does not
know and an `auto_map` to its own code is refused in one line before anything is loaded (`refuse_own_code`);
tokenizer.py refuses a tokenizer_config.json's `auto_map` the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path


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
