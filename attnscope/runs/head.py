"""`attnscope head` and `attnscope bert` between parsing and rendering: find the model, read head h's weights,
and with --text run layers 0..L on the sentence (attnscope's own forward for the families it reads,
transformers for the others), guard the memory, --save.

`bert` is this same run with a BERT default and the BERT-layout families only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.headstats import LayerHeads
    from attnscope.models.config import Config
    from attnscope.models.family import Family, HeadWeights, LayerRun
    from attnscope.models.tokenizer import Encoded

BERT_TYPES = ("bert", "roberta", "xlm-roberta")
MACHINE_MARGIN = 1.2  # headroom when the limit is what the machine has available


@dataclass
class HeadOptions:
    model: str
    layer: int = 0
    head: int = 0
    text: str | None = None
    save: str | None = None
    force: bool = False
    max_memory: int | None = None
    command: str = "head"  # "bert" takes BERT-layout checkpoints only
    all_heads: bool = False  # --all-heads: every head of the layer, with its statistics, shown


@dataclass
class ModelInfo:
    """What the checkpoint is, as the header and JSON's `model` show it."""

    architecture: str
    model_type: str
    path: Path
    layers: int
    heads: int
    kv_heads: int
    d_model: int
    d_head: int

    @classmethod
    def of(cls, model: Family) -> ModelInfo:
        return cls(model.architecture, model.model_type, model.folder, model.n_layer, model.n_head, model.n_kv_head,
                   model.d_model, model.d_head)


@dataclass
class HeadResult:
    options: HeadOptions
    info: ModelInfo
    weights: HeadWeights | None  # None for a family attnscope does not read (the transformers fallback)
    encoded: Encoded | None = None
    run: LayerRun | None = None  # the traced layer and head; None without --text or through transformers
    attention: torch.Tensor | None = None  # head h's [n_tokens, n_tokens] pattern
    all_heads: torch.Tensor | None = None  # every head's pattern in layer L, [n_head, n_tokens, n_tokens]
    notes: list[str] = field(default_factory=list)
    saved: Path | None = None
    _heads: LayerHeads | None = field(default=None, repr=False)

    @property
    def traced(self) -> bool:
        return self.run is not None

    @property
    def heads(self) -> LayerHeads | None:
        """Every head of layer L on the text, with its statistics and kind (None without a text)."""
        if self.all_heads is None or self.encoded is None:
            return None
        if self._heads is None:
            from attnscope.headstats import LayerHeads

            tokens = list(self.encoded.tokens)
            self._heads = LayerHeads.of(self.all_heads, f"layer {self.options.layer}", tokens, tokens)
        return self._heads

    def _repr_html_(self) -> str:
        """Jupyter shows the model and head, the layer's steps, this head's pattern on the text and every
        head of the layer with what it does: the explorer page where the frontend runs scripts, the static view
        of notebook.py where not (views/embed.py)."""
        from attnscope.views.embed import head_view

        return head_view(self)


Progress = Callable[[str], AbstractContextManager[Any]]


@contextmanager
def _quiet(message: str) -> Iterator[None]:
    yield


def model_head(model: str | Path, layer: int = 0, head: int = 0, *, text: str | None = None,
               max_memory: int | None = None) -> HeadResult:
    """The Python form of `attnscope head` (`attnscope.model_head`): head `head` of layer `layer` of a checkpoint
    (a folder, or a Hugging Face name in the local cache), and with `text` layers 0..layer run on it. The result
    shows itself in Jupyter (`_repr_html_`); `.attention` is the head's pattern, `.all_heads` every head's,
    `.heads` every head with its statistics and kind, `.run.layer` the layer's trace."""
    return run_head(HeadOptions(model=str(model), layer=layer, head=head, text=text, max_memory=max_memory))


def run_head(o: HeadOptions, progress: Progress = _quiet) -> HeadResult:
    from attnscope.models import family_of, hub, open_model, tokenizer
    from attnscope.models.config import read_config

    if o.save:
        from attnscope.tensors import check_writable

        check_writable(o.save, o.force)
    if o.text is not None:
        tokenizer.check_text(o.text)
    elif o.all_heads:
        raise UsageError("--all-heads shows what every head of the layer does on a sentence; add --text \"...\"")
    with progress(f"locating {o.model}"):
        folder = hub.locate(o.model, need_tokenizer=o.text is not None)
        config = read_config(folder)
    if o.command == "bert" and config.model_type not in BERT_TYPES:
        raise UsageError(f"--model {folder} is a {config.architecture} (model_type '{config.model_type}'); "
                         f"attnscope bert supports BERT-layout checkpoints (model_type {', '.join(BERT_TYPES)}: "
                         f"BertModel, BertFor..., MiniLM saved as BertModel); for this one use attnscope head")
    if family_of(config) is None and o.text is not None:
        return _through_transformers(o, folder, config, progress)
    model = open_model(folder, config, command=o.command)
    with model.checkpoint:
        return _traced(o, model, progress)


def _traced(o: HeadOptions, model: Family, progress: Progress) -> HeadResult:
    from attnscope.models.family import head_weights, run_layer

    model.check_position(o.layer, o.head)
    with progress(f"reading layer {o.layer}, head {o.head}"):
        weights = head_weights(model, o.layer, o.head)
    result = HeadResult(o, ModelInfo.of(model), weights, notes=list(weights.notes))
    if o.text is not None:
        from attnscope.models import tokenizer

        encoded = tokenizer.encode(model.folder, o.text)
        what = f"running layers 0..{o.layer} of this checkpoint on {len(encoded.ids)} tokens"
        guard_memory(model.estimate_bytes(o.layer, len(encoded.ids)), o.max_memory, what)
        with progress(f"running layers 0 to {o.layer} on {len(encoded.ids)} tokens"):
            result.run = run_layer(model, encoded.ids, encoded.type_ids, o.layer, o.head)
        result.encoded = encoded
        result.attention = result.run.head["attention"]
        result.all_heads = result.run.layer["attention"][0]
        result.notes.extend(result.run.layer.notes)
    _save(result)
    return result


def _through_transformers(o: HeadOptions, folder: Path, config: Config, progress: Progress) -> HeadResult:
    from attnscope.models import SUPPORTED, fallback, tokenizer
    from attnscope.models.checkpoint import Checkpoint

    encoded = tokenizer.encode(folder, o.text or "")
    with Checkpoint.open(folder) as checkpoint:
        needed = fallback.estimate_bytes(checkpoint)
    guard_memory(needed, o.max_memory, "loading this whole model through transformers")
    with progress(f"running {config.architecture} through transformers"):
        run = fallback.run(folder, encoded.ids, config.model_type)
    n_layer, n_head, n = len(run.attentions), run.attentions[0].shape[1], len(encoded.ids)
    info = ModelInfo(config.architecture, config.model_type, folder, n_layer, n_head, n_head,
                     config.integer("hidden_size", "n_embd", "d_model", default=0, minimum=0), 0)
    _check_range(o, n_layer, n_head)
    result = HeadResult(o, info, None, encoded)
    result.all_heads = run.attentions[o.layer][0]  # [n_head, n_tokens, n_tokens]
    result.attention = result.all_heads[o.head]
    result.notes.append(f"model_type '{config.model_type}' is not one attnscope traces ({SUPPORTED}): this pattern "
                        f"is transformers' eager output_attentions[{o.layer}][0, {o.head}] on {n} tokens; the steps "
                        "that made it are not shown")
    _save(result)
    return result


def _check_range(o: HeadOptions, n_layer: int, n_head: int) -> None:
    if not 0 <= o.layer < n_layer:
        raise UsageError(f"--layer {o.layer} is out of range: this model has {n_layer} layers, 0 to {n_layer - 1}")
    if not 0 <= o.head < n_head:
        raise UsageError(f"--head {o.head} is out of range: this model has {n_head} heads, 0 to {n_head - 1}")


def guard_memory(needed: int, max_memory: int | None, what: str) -> None:
    """Refuse, with the estimate, a run that would not fit: one line now rather than a process killed later."""
    if max_memory is not None and needed > max_memory:
        raise ResourceError(f"{what} needs about {cost.format_bytes(needed)}, more than --max-memory "
                            f"{cost.format_bytes(max_memory)}; pick an earlier --layer, a shorter --text, or raise "
                            "--max-memory")
    available = cost.available_memory()
    if max_memory is None and available is not None and needed * MACHINE_MARGIN > available:
        raise ResourceError(f"{what} needs about {cost.format_bytes(needed)} but this machine has "
                            f"{cost.format_bytes(available)} available; pick an earlier --layer or a shorter --text")


def saved_tensors(result: HeadResult) -> dict[str, Any]:
    """What --save writes: the head's weights, the head's steps under their names (X, Q, K, V, ..., attention,
    out), and the layer's steps under `layer.` (layer.Q_feat, ..., layer.attention: every head)."""
    tensors: dict[str, Any] = dict(result.weights.as_torch()) if result.weights else {}
    if result.run is not None:
        tensors.update({step.name: step.tensor for step in result.run.head.steps})
        tensors.update({f"layer.{step.name}": step.tensor for step in result.run.layer.steps})
    elif result.attention is not None:
        tensors["attention"] = result.attention
        tensors["layer.attention"] = result.all_heads
    return tensors


def _save(result: HeadResult) -> None:
    o = result.options
    if not o.save:
        return
    from attnscope.tensors import save_tensors

    meta: dict[str, Any] = {"model": str(result.info.path), "layer": o.layer, "head": o.head,
                            "sources": result.weights.sources if result.weights else {},
                            "tokens": result.encoded.tokens if result.encoded else None,
                            "token_ids": result.encoded.ids if result.encoded else None}
    if result.run is not None:
        steps = {**{s.name: s for s in result.run.head.steps},
                 **{f"layer.{s.name}": s for s in result.run.layer.steps}}
        meta["steps"] = {name: {"dims": list(s.dims), "op": s.op} for name, s in steps.items()}
    result.saved = save_tensors(saved_tensors(result), o.save, force=o.force, metadata=meta, option="--save")
