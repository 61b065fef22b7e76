"""The language-model head a page's `logits` ends in: its weight `[vocab, d_model]` (`weight`), the product
`h @ weight.T` (`product`) and the key of its tensor (`key`). `tied` is the token embedding's key under the
model's prefix, used where the config ties them (`tie_word_embeddings`, default as the family's config class
has it, `ties_by_default`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.models.family import Family


def weight(model: Family, tied: str, ties_by_default: bool = False) -> torch.Tensor:
    """The head's weight `[vocab, d_model]`: the token embedding `tied` where the config ties them, else
    `lm_head.weight`, beside the model's keys (`language_model.lm_head.weight` where they lie under
    `language_model.model.`: Llama 4's multimodal checkpoints) or at the top (Gemma 3's)."""
    return model.checkpoint.tensor(key(model, tied, ties_by_default))


def product(model: Family, h: torch.Tensor, tied: str, ties_by_default: bool = False) -> torch.Tensor:
    """`h @ weight(...).T`, `[1, n, vocab]`; through the checkpoint's own `product` where it has one (a GGUF
    file's: the head's rows expanded a few thousand at a time, its float32 matrix never whole)."""
    name = key(model, tied, ties_by_default)
    own = getattr(model.checkpoint, "product", None)
    return own(name, h) if own is not None else h @ model.checkpoint.tensor(name).T  # [1, n, vocab]


def key(model: Family, tied: str, ties_by_default: bool = False) -> str:
    """The key of `weight`'s tensor."""
    if model.config.flag("tie_word_embeddings", default=ties_by_default):
        return f"{model.prefix}{tied}"
    beside = model.prefix[: -len("model.")] if model.prefix.endswith(".model.") else ""
    for name in dict.fromkeys((f"{beside}lm_head.weight", "lm_head.weight")):
        if name in model.checkpoint:
            return name
    raise UsageError(f"{{generate}}: {model.checkpoint.source.name} holds no lm_head.weight (a base model "
                     "without its language-model head); give a ...ForCausalLM checkpoint", "generate")
