"""`attnscope head` and `attnscope bert` between parsing and rendering: find the model, read head h's weights,
and with --text run layers 0..L on the sentence (attnscope's own forward for the families it reads,
transformers for the others), guard the memory, --save.

`bert` is this same run with a BERT default and BERT's encoders only (the BERT layout, and ModernBERT).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from attnscope.errors import UsageError
from attnscope.runs.head_result import (
    BERT_TYPES,
    HeadOptions,
    HeadResult,
    ModelInfo,
    Progress,
    guard_memory,
    save_result,
)
from attnscope.words import counted

if TYPE_CHECKING:
    from attnscope.models.config import Config
    from attnscope.models.family import Family


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
    from attnscope.runs import beyond_layer as layers

    if asked.text_file is not None:
        if asked.text is not None:
            raise UsageError("--text and --text-file both give the text; keep one")
        from attnscope.runs.inputs import read_text_file

        asked.text = read_text_file(asked.text_file)
    if asked.save:
        from attnscope.tensors import check_writable

        check_writable(asked.save, asked.force)
    if asked.check and asked.text is None and asked.audio is None:
        raise UsageError("--check compares the attention on a text with transformers' eager run; add --text \"...\"")
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
    from attnscope.runs.encdec import encoder_decoder, refuse_one_stack_options, refuse_two_stack_options, run_encdec

    if encoder_decoder(config):  # before check_options, which would ask a Whisper for --text; checks its own run
        refuse_one_stack_options(asked, config)
        return run_encdec(asked, folder, config, progress)
    layers.check_options(asked)
    refuse_two_stack_options(asked, config)
    if family_of(config) is None and asked.text is not None:
        if asked.rows:  # --all-layers and --generate run through transformers too (runs/interface.py)
            raise UsageError(f"--rows picks exact rows of a long input computed in blocks, which the families "
                             f"attnscope has a page for do (docs/models.md); model_type '{config.model_type}' has no "
                             "page (transformers runs its whole pattern); drop --rows")
        result = _through_transformers(asked, folder, config, progress)
    else:
        model = open_model(folder, config, command=asked.command)
        with model.checkpoint:
            result = _traced(asked, model, progress)
    if asked.check:
        from attnscope.runs.check_model import check_head

        with progress("--check: running transformers' eager model on the same text"):
            result.comparisons = check_head(result, folder, config.model_type)
    return result


def _traced(asked: HeadOptions, model: Family, progress: Progress) -> HeadResult:
    from attnscope.models.weights import head_weights

    model.check_position(asked.layer, asked.head)
    with progress(f"reading layer {asked.layer}, head {asked.head}"):
        weights = head_weights(model, asked.layer, asked.head)
    result = HeadResult(asked, ModelInfo.of(model), weights, notes=list(weights.notes))
    if asked.text is not None:
        _on_text(asked, model, result, progress)
    save_result(result)
    return result


def _on_text(asked: HeadOptions, model: Family, result: HeadResult, progress: Progress) -> None:
    """The model on the text: layer L traced (with every layer, or decoding, where asked), or a long input's
    head in blocks."""
    from attnscope.models import tokenizer
    from attnscope.models.forward import stream
    from attnscope.runs import beyond_layer as layers

    encoded = result.encoded = tokenizer.encode(model.folder, asked.text or "")
    result.tracer = "attnscope"
    plan = layers.plan(asked, model, encoded)
    n = plan.n_tokens
    what = (f"running {'every layer' if asked.all_layers or asked.generate else f'layers 0..{asked.layer}'} of this "
            f"checkpoint on {n} tokens")
    guard_memory(layers.estimate_bytes(asked, model, plan), asked.max_memory, what)
    if plan.long:
        from attnscope.models.forward.long import long_head

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
        result.run, result.layer_patterns = every.run, every.patterns
        layers.layer_heads(result)
    else:
        from attnscope.models.forward.run import run_layer

        with progress(f"running layers 0 to {asked.layer} on {n} tokens"):
            result.run = run_layer(model, encoded.ids, encoded.type_ids, asked.layer, asked.head)
    result.attention = result.run.head["attention"]
    result.all_heads = result.run.layer["attention"][0]
    result.notes.extend(result.run.layer.notes)
    if asked.generate:
        with progress(f"decoding {counted(asked.generate, 'token')}"):
            result.decode = stream.generate(model, encoded.ids, asked.generate, asked.layer)
        result.decode_pieces = tokenizer.pieces(model.folder, [step.token_id for step in result.decode])


def _through_transformers(asked: HeadOptions, folder: Path, config: Config, progress: Progress) -> HeadResult:
    """A family with no page: transformers runs layers 0..L, its attention traced through the attention
    interface where the family calls it (runs/interface.py)."""
    from attnscope.runs.interface import run_transformers

    return run_transformers(asked, folder, config, progress)


