"""Models: one module per family behind one protocol (family.py), the lazy checkpoint reader
(checkpoint.py), config.json read defensively (config.py), the model's own tokenizer (tokenizer.py), the
Hugging Face cache lookup (hub.py), and transformers as the fallback for other families (fallback.py).

| model_type | module | class |
|---|---|---|
| bert (also MiniLM saved as BertModel) | bert.py | Bert |
| roberta, xlm-roberta | bert.py | Roberta |
| gpt2 | gpt2.py | Gpt2 |
| llama, mistral, qwen2 | llama.py | Llama |
| gemma2 | gemma2.py | Gemma2 |
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.models.config import Config
    from attnscope.models.family import Family

# model_type -> (module, class): imported only for the family asked for.
FAMILIES = {"bert": ("bert", "Bert"), "roberta": ("bert", "Roberta"), "xlm-roberta": ("bert", "Roberta"),
            "gpt2": ("gpt2", "Gpt2"), "llama": ("llama", "Llama"), "mistral": ("llama", "Llama"),
            "qwen2": ("llama", "Llama"), "gemma2": ("gemma2", "Gemma2")}
SUPPORTED = "bert, roberta, gpt2, llama, mistral, qwen2, gemma2"


def family_of(config: Config) -> type[Family] | None:
    where = FAMILIES.get(config.model_type)
    if where is None:
        return None
    return getattr(import_module(f"attnscope.models.{where[0]}"), where[1])  # type: ignore[no-any-return]


def open_model(folder: Path, config: Config, *, command: str = "head") -> Family:
    """The checkpoint in `folder` as its family reads it; a family attnscope does not read is refused in one
    line that names what was found and what is supported."""
    from attnscope.models.checkpoint import Checkpoint

    family = family_of(config)
    if family is None:
        raise UsageError(f"{{model}} {folder} is a {config.architecture} (model_type '{config.model_type}'); "
                         f"attnscope {command} reads the heads of {SUPPORTED} ({{text}} still shows its attention "
                         "through transformers)", "model", "text")
    return family(folder, config, Checkpoint.open(folder))
