"""`attnscope head` and `attnscope bert` between parsing and rendering: find the model, read head h's weights,
and with --text run layers 0..L on the sentence (attnscope's own forward for the families it reads,
transformers for the others), guard the memory, --save.

`bert` is this same run with a BERT default and BERT's encoders only (the BERT layout, and ModernBERT).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.runs import memory

if TYPE_CHECKING:
    import torch

    from attnscope.models.config import Config
    from attnscope.models.family import Family
    from attnscope.models.long import LongHead
    from attnscope.models.run import LayerRun
    from attnscope.models.stream import DecodeStep
    from attnscope.models.tokenizer import Encoded
    from attnscope.models.weights import HeadWeights
    from attnscope.readings.headstats import LayerHeads
    from attnscope.spec import Latent

# BERT's family of encoders: BERT's own layout, and ModernBERT, a BERT in use whose head lives elsewhere
# (docs/bert.md says why it belongs)
BERT_TYPES = ("bert", "roberta", "xlm-roberta", "modernbert")


@dataclass
class HeadOptions:
    model: str
    layer: int = 0
    head: int = 0
    text: str | None = None
    save: str | None = None
    force: bool = False
    max_memory: int | None = None
    command: str = "head"  # "bert" takes BERT's encoders only (BERT_TYPES)
    all_heads: bool = False  # --all-heads: every head of the layer, with its statistics, shown
    all_layers: bool = False  # --all-layers: every head of every layer (runs/layers.py)
    generate: int = 0  # --generate N: greedy decoding of N new tokens
    text_file: str | None = None  # --text-file: the text read from a file
    rows: str | None = None  # --rows A:B: exact query rows of a long input's pooled pattern
    target: str | None = None  # an encoder-decoder's target text, what its decoder reads (runs/encdec.py)
    attention: str | None = None  # an encoder-decoder's attention: encoder (default), decoder or cross
    audio: str | None = None  # Whisper's source: a PCM .wav file


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
    latent: Latent | None = None  # multi-head latent attention's sizes (DeepSeek); d_head is then d_K
    stacks: tuple[int, int] | None = None  # an encoder-decoder's encoder and decoder layers

    @classmethod
    def of(cls, model: Family) -> ModelInfo:
        return cls(model.architecture, model.model_type, model.folder, model.n_layer, model.n_head, model.n_kv_head,
                   model.d_model, model.d_head, model.latent)


@dataclass
class HeadResult:
    options: HeadOptions
    info: ModelInfo
    weights: HeadWeights | None  # None for a family attnscope does not read (one traced through transformers)
    encoded: Encoded | None = None
    run: LayerRun | None = None  # the traced layer and head; None without --text or through transformers
    attention: torch.Tensor | None = None  # head h's [n_tokens, n_tokens] pattern
    all_heads: torch.Tensor | None = None  # every head's pattern in layer L, [n_head, n_tokens, n_tokens]
    notes: list[str] = field(default_factory=list)
    saved: Path | None = None
    all_layers: list[torch.Tensor] | None = None  # --all-layers: every layer's patterns, [n_head, n, n] each
    layers: list[LayerHeads] | None = None  # and every layer's heads with their statistics and kinds
    decode: list[DecodeStep] | None = None  # --generate: each new token, its row of layer L
    decode_pieces: list[tuple[str, str]] = field(default_factory=list)  # each new token as (token, text)
    long: LongHead | None = None  # a long input: the head's pattern pooled, computed in blocks
    _heads: LayerHeads | None = field(default=None, repr=False)
    target: Encoded | None = None  # an encoder-decoder's target tokens, as its decoder reads them
    kind: str | None = None  # an encoder-decoder's attention: encoder, decoder or cross
    tracer: str | None = None  # "attnscope" (the family's page) or "attention-interface" (transformers' code)
    about: str | None = None  # what an encoder-decoder's attention reads, under the header

    @property
    def layer_name(self) -> str:
        """`layer 3`, or for an encoder-decoder `cross layer 3`."""
        return f"{self.kind + ' ' if self.kind else ''}layer {self.options.layer}"

    def axes(self) -> tuple[list[str], list[str]]:
        """The pattern's row (query) and column (key) labels: the text's tokens; an encoder-decoder's decoder
        attends over the target's, and across, the target's queries over the source's keys."""
        source = list(self.encoded.tokens) if self.encoded is not None else []
        target = list(self.target.tokens) if self.target is not None else source
        return {"decoder": (target, target), "cross": (target, source)}.get(self.kind or "", (source, source))

    def tokens_text(self) -> str:
        """`on 9 tokens`, or across `on 5 target tokens over 9 source tokens`."""
        rows, cols = self.axes()
        if self.kind == "cross":
            return f"on {len(rows)} target tokens over {len(cols)} source {self.source_unit}"
        unit = "target tokens" if self.kind == "decoder" else f"{'source ' if self.kind else ''}{self.source_unit}"
        return f"on {len(rows)} {unit}"

    @property
    def source_unit(self) -> str:
        return "audio positions" if self.options.audio else "tokens"

    @property
    def traced(self) -> bool:
        return self.run is not None

    @property
    def heads(self) -> LayerHeads | None:
        """Every head of layer L on the text, with its statistics and kind (None without a text)."""
        if self.all_heads is None or self.encoded is None:
            return None
        if self._heads is None:
            from attnscope.readings.headstats import LayerHeads

            rows, cols = self.axes()
            self._heads = LayerHeads.of(self.all_heads, self.layer_name, rows, cols)
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
               max_memory: int | None = None, target: str | None = None, attention: str | None = None,
               audio: str | Path | None = None) -> HeadResult:
    """The Python form of `attnscope head` (`attnscope.model_head`): head `head` of layer `layer` of a checkpoint
    (a folder, or a Hugging Face name in the local cache), and with `text` layers 0..layer run on it. The result
    shows itself in Jupyter (`_repr_html_`); `.attention` is the head's pattern, `.all_heads` every head's,
    `.heads` every head with its statistics and kind, `.run.layer` the layer's trace. An encoder-decoder takes
    `attention` ("encoder", "decoder" or "cross"), the decoder's `target` text, and for Whisper `audio` (a .wav)
    in place of `text`."""
    return run_head(HeadOptions(model=str(model), layer=layer, head=head, text=text, max_memory=max_memory,
                                target=target, attention=attention, audio=None if audio is None else str(audio)))


def run_head(asked: HeadOptions, progress: Progress = _quiet) -> HeadResult:
    from attnscope.models import family_of, hub, open_model, tokenizer
    from attnscope.models.config import read_config
    from attnscope.runs import layers

    if asked.text_file is not None:
        if asked.text is not None:
            raise UsageError("--text and --text-file both give the text; keep one")
        asked.text = layers.read_text_file(asked.text_file)
    layers.check_options(asked)
    if asked.save:
        from attnscope.tensors import check_writable

        check_writable(asked.save, asked.force)
    if asked.text is not None:
        tokenizer.check_text(asked.text)
    elif asked.all_heads and not asked.audio:
        raise UsageError("--all-heads shows what every head of the layer does on a sentence; add --text \"...\"")
    with progress(f"locating {asked.model}"):
        folder = hub.locate(asked.model, need_tokenizer=any(x is not None for x in (asked.text, asked.target,
                                                                                         asked.audio)),
                            extra=("preprocessor_config.json",) if asked.audio else ())
        config = read_config(folder)
    if asked.command == "bert" and config.model_type not in BERT_TYPES:
        raise UsageError(f"--model {folder} is a {config.architecture} (model_type '{config.model_type}'); "
                         f"attnscope bert supports BERT-layout checkpoints and ModernBERT (model_type "
                         f"{', '.join(BERT_TYPES)}: BertModel, BertFor..., MiniLM saved as BertModel, ModernBertModel, "
                         "ModernBertFor...); for this one use attnscope head")
    from attnscope.runs.encdec import encoder_decoder, refuse_two_stack_options, run_encdec

    if encoder_decoder(config):
        layers.refuse_beyond_one_layer(asked, f"{config.architecture} is an encoder-decoder")
        return run_encdec(asked, folder, config, progress)
    refuse_two_stack_options(asked, config)
    if family_of(config) is None and asked.text is not None:
        layers.refuse_beyond_one_layer(asked, f"model_type '{config.model_type}' has no page (transformers runs it "
                                              "as far as --layer)")
        return _through_transformers(asked, folder, config, progress)
    model = open_model(folder, config, command=asked.command)
    with model.checkpoint:
        return _traced(asked, model, progress)


def _traced(asked: HeadOptions, model: Family, progress: Progress) -> HeadResult:
    from attnscope.models.weights import head_weights

    model.check_position(asked.layer, asked.head)
    with progress(f"reading layer {asked.layer}, head {asked.head}"):
        weights = head_weights(model, asked.layer, asked.head)
    result = HeadResult(asked, ModelInfo.of(model), weights, notes=list(weights.notes))
    if asked.text is not None:
        _on_text(asked, model, result, progress)
    _save(result)
    return result


def _on_text(asked: HeadOptions, model: Family, result: HeadResult, progress: Progress) -> None:
    """The model on the text: layer L traced (with every layer, or decoding, where asked), or a long input's
    head in blocks."""
    from attnscope.models import stream, tokenizer
    from attnscope.runs import layers

    encoded = result.encoded = tokenizer.encode(model.folder, asked.text or "")
    result.tracer = "attnscope"
    plan = layers.plan(asked, model, encoded)
    n = plan.n_tokens
    what = (f"running {'every layer' if asked.all_layers or asked.generate else f'layers 0..{asked.layer}'} of this "
            f"checkpoint on {n} tokens")
    guard_memory(layers.estimate_bytes(asked, model, plan), asked.max_memory, what)
    if plan.long:
        from attnscope.models.long import long_head

        with progress(f"running layers 0 to {asked.layer} on {n} tokens, head {asked.head} in blocks"):
            result.long = long_head(model, encoded.ids, encoded.type_ids, asked.layer, asked.head,
                                    layers.parse_rows(asked.rows))
        result.notes.append(f"{n:,} tokens: head {asked.head}'s pattern is computed in blocks of query rows, each "
                            "exact, and pooled; the layer's steps are shown as shapes (no [n_head, n_tokens, "
                            "n_tokens] step is held)")
        return
    if asked.all_layers:
        with progress(f"running all {model.n_layer} layers on {n} tokens"):
            every = stream.every_layer(model, encoded.ids, encoded.type_ids, asked.layer, asked.head)
        result.run, result.all_layers = every.run, every.patterns
        layers.layer_heads(result)
    else:
        from attnscope.models.run import run_layer

        with progress(f"running layers 0 to {asked.layer} on {n} tokens"):
            result.run = run_layer(model, encoded.ids, encoded.type_ids, asked.layer, asked.head)
    result.attention = result.run.head["attention"]
    result.all_heads = result.run.layer["attention"][0]
    result.notes.extend(result.run.layer.notes)
    if asked.generate:
        with progress(f"decoding {asked.generate} tokens"):
            result.decode = stream.generate(model, encoded.ids, asked.generate, asked.layer)
        result.decode_pieces = tokenizer.pieces(model.folder, [step.token_id for step in result.decode])


def _through_transformers(asked: HeadOptions, folder: Path, config: Config, progress: Progress) -> HeadResult:
    """A family with no page: transformers runs layers 0..L, its attention traced through the attention
    interface where the family calls it (runs/interface.py)."""
    from attnscope.runs.interface import run_transformers

    return run_transformers(asked, folder, config, progress)


def guard_memory(needed: int, max_memory: int | None, what: str) -> None:
    """The memory guard, with what a model run can do instead: an earlier layer, a shorter text."""
    memory.guard_memory(needed, max_memory, f"{what} needs", "pick an earlier --layer, a shorter --text, or raise "
                        "--max-memory", machine_advice="pick an earlier --layer or a shorter --text")


def saved_tensors(result: HeadResult) -> dict[str, Any]:
    """What --save writes: the head's weights, the head's steps under their names (X, Q, K, V, ..., attention,
    out), and the layer's steps under `layer.` (layer.Q_feat, ..., layer.attention: every head); with
    --all-layers every layer's pattern (`layers.L.attention`), with --generate each new token's row
    (`decode.I.attention`), for a long input the pooled pattern and the exact rows."""
    tensors: dict[str, Any] = dict(result.weights.as_torch()) if result.weights else {}
    if result.run is not None:
        tensors.update({step.name: step.tensor for step in result.run.head.steps})
        tensors.update({f"layer.{step.name}": step.tensor for step in result.run.layer.steps})
    elif result.attention is not None:
        tensors["attention"] = result.attention
        tensors["layer.attention"] = result.all_heads
    for i, pattern in enumerate(result.all_layers or []):
        tensors[f"layers.{i}.attention"] = pattern
    for i, step in enumerate(result.decode or []):
        tensors[f"decode.{i}.attention"] = step.attention
    if result.long is not None:
        tensors["attention_pooled"] = result.long.pooled
        if result.long.exact_rows is not None:
            tensors["attention_rows"] = result.long.exact_rows
    return tensors


def _save(result: HeadResult) -> None:
    asked = result.options
    if not asked.save:
        return
    from attnscope.tensors import save_tensors

    meta: dict[str, Any] = {"model": str(result.info.path), "layer": asked.layer, "head": asked.head,
                            "sources": result.weights.sources if result.weights else {},
                            "tokens": result.encoded.tokens if result.encoded else None,
                            "token_ids": result.encoded.ids if result.encoded else None}
    if result.run is not None:
        steps = {**{s.name: s for s in result.run.head.steps},
                 **{f"layer.{s.name}": s for s in result.run.layer.steps}}
        meta["steps"] = {name: {"dims": list(s.dims), "op": s.op} for name, s in steps.items()}
    result.saved = save_tensors(saved_tensors(result), asked.save, force=asked.force, metadata=meta,
                                option="--save")
