"""How a checkpoint lays out a family's weights, read and checked once when a page opens it: the key prefix
a task model puts before the base model's keys (`find_prefix`), an encoder's sizes (`encoder_sizes`), and the
sizes a page read held against its heads and its layers' keys (`check_sizes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from attnscope.errors import UsageError
from attnscope.models.config import fix_advice

if TYPE_CHECKING:
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


class Sized(Protocol):
    """What `check_sizes` reads of a page (models/family.py's Family)."""

    n_layer: int
    n_head: int
    n_kv_head: int
    config: Config
    checkpoint: Checkpoint

    @property
    def query(self) -> str: ...  # layer 0's query weight under the layers' key

    def key(self, layer: int, name: str) -> str: ...


def find_prefix(checkpoint: Checkpoint, wanted: str, prefixes: tuple[str, ...], model_type: str) -> str:
    """Where layer 0's query weight `wanted` lies: "" for a base model, "model." / "bert." / "transformer." for
    task models that wrap it (the page's `prefixes` first, then any key that ends in it)."""
    for prefix in prefixes:
        if f"{prefix}{wanted}" in checkpoint:
            return prefix
    found = next((k for k in checkpoint.keys if k.endswith(wanted)), None)
    if found is None:
        raise UsageError(f"{checkpoint.source}: no {wanted}; this checkpoint is not laid out as "
                         f"{model_type}'s (model_type in config.json: '{model_type}')")
    return found.removesuffix(wanted)


def encoder_sizes(config: Config) -> tuple[int, int, int, int]:
    """An encoder's (n_layer, n_head, d_model, d_head): `num_hidden_layers`, `num_attention_heads` (each head its
    own keys and values) and `hidden_size`, whose quotient d_head must be whole."""
    n_layer = config.integer("num_hidden_layers")
    n_head = config.integer("num_attention_heads")
    d_model = config.integer("hidden_size")
    if d_model % n_head:
        raise UsageError(f"{config.path}: hidden_size {d_model} is not divisible by num_attention_heads "
                         f"{n_head}; {fix_advice(config.path)}")
    return n_layer, n_head, d_model, d_model // n_head


def check_sizes(model: Sized) -> None:
    """After a page read its sizes: heads that divide, and every layer in the checkpoint."""
    path, checkpoint = model.config.path, model.checkpoint
    if model.n_head % model.n_kv_head:
        raise UsageError(f"{path}: {model.n_head} attention heads are not a multiple of "
                         f"{model.n_kv_head} key/value heads; {fix_advice(path)}")
    last = model.key(model.n_layer - 1, model.query)
    if last not in checkpoint:
        present = sum(1 for layer in range(model.n_layer) if model.key(layer, model.query) in checkpoint)
        raise UsageError(f"{path} says {model.n_layer} layers but {checkpoint.source.name} holds "
                         f"{present} ({last} is missing); config.json does not describe these weights")
