"""`head --check`'s reference: the same checkpoint run by transformers' own eager modeling code, sharing nothing with
attnscope's forward: `AutoModel.from_pretrained(..., attn_implementation="eager")` and `output_attentions=True` for
a text, `AutoModelForCausalLM.generate` with attnscope's decoding rule (`greedy_config`) for decoding (no code from the
model's folder runs: `trust_remote_code=False`). Layers past the last one compared are not built (truncated.py's
cut config). Everything float32 on the CPU, batch 1, no padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError
from attnscope.models.nopage.cache_names import cache_keyword, cache_of

if TYPE_CHECKING:
    from pathlib import Path

    import torch


def patterns(folder: Path, model_type: str, ids: list[int], last: int) -> dict[int, torch.Tensor]:
    """transformers' eager `output_attentions` of layers 0..`last` on `ids`: layer -> `[n_head, n, n]`, the layers
    with attention only (a hybrid's Mamba or convolution layers have none)."""
    import torch
    from transformers import AutoModel

    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    full, n_layer = truncated.full_config(folder, model_type, last, text=True)
    model = truncated.load(AutoModel, folder, truncated.cut(full, n_layer, last), model_type, traced=False)
    try:
        with torch.no_grad():
            # no cache: one of linear layers only (Qwen3-Next cut before its first full layer) fails in transformers
            out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"{{check}}: transformers could not run model_type '{model_type}' on the text "
                            f"({truncated.first_line(exc)})", "check") from None
    attentions = [a for a in (getattr(out, "attentions", None) or ()) if a is not None]
    layers = list(range(last + 1))
    if len(attentions) != len(layers):  # a hybrid: entries for its attention layers only
        layers = [i for i in truncated.attention_layers(truncated.layers_config(full), n_layer) if i <= last]
    return {layer: attention[0] for layer, attention in zip(layers, attentions, strict=True)}


@dataclass
class Decoded:
    """transformers' greedy decoding: the new ids, and each step's attention of every layer with attention
    (`rows[t][layer]`: the newest query's row, `[n_head, keys the cache holds]`)."""

    ids: list[int]
    rows: list[dict[int, torch.Tensor]]


def greedy_config(model: Any, n_new: int) -> Any:
    """attnscope's decoding rule as transformers' `GenerationConfig`, made the model's own: `n_new` tokens, each the
    argmax of the last logits, and nothing else (models/forward/stream.py's `generate` and
    models/forward/interface_stream.py's decode that way, and never stop at an end-of-text token). It replaces the
    folder's generation_config.json, whose processors (a repetition_penalty, as Qwen2.5-Instruct's 1.05;
    no_repeat_ngram_size, bad_words_ids, min_new_tokens, suppress_tokens, ...) `generate` would apply even with
    do_sample=False: `GenerationMixin._prepare_generation_config` fills every setting a passed config leaves unset
    from `model.generation_config`, so that is replaced too. No eos_token_id: no stop, and no
    MinNewTokensLengthLogitsProcessor hiding the end-of-text token from the argmax."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n_new, eos_token_id=None,
                              pad_token_id=None, bos_token_id=None, output_attentions=True,
                              return_dict_in_generate=True)
    model.generation_config = config
    return config


def decode(folder: Path, model_type: str, ids: list[int], n_new: int) -> Decoded:
    """`generate` by attnscope's rule (`greedy_config`): `n_new` argmax tokens, every layer's attention a step."""
    import torch

    from attnscope.models.nopage.truncated import first_line

    model, n_layer, layers = _causal_lm(folder, model_type)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), generation_config=greedy_config(model, n_new))
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"{{check}}: transformers could not decode with model_type '{model_type}' "
                            f"({first_line(exc)})", "check") from None
    rows = [_newest_rows(step, n_layer, layers) for step in out.attentions]
    return Decoded(out.sequences[0, len(ids):].tolist(), rows)


def decode_uncached(folder: Path, model_type: str, ids: list[int], n_new: int) -> Decoded:
    """attnscope's decoding rule with no cache, for a model whose cached `generate` is wrong (MiniMax with a
    sliding window: families/minimax.py's `cached_generate_note`): each step transformers' eager forward on every
    token so far (`use_cache=False`, `output_attentions=True`), the argmax of its last logits; each step's rows
    the last query's, over every key."""
    import torch

    from attnscope.models.nopage.truncated import first_line

    model, n_layer, layers = _causal_lm(folder, model_type)
    tokens, rows = list(ids), []
    try:
        with torch.no_grad():
            for _ in range(n_new):
                out = model(input_ids=torch.tensor([tokens]), use_cache=False, output_attentions=True)
                rows.append(_newest_rows(out.attentions, n_layer, layers))
                tokens.append(int(out.logits[0, -1].argmax()))
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"{{check}}: transformers could not run model_type '{model_type}' without a cache "
                            f"({first_line(exc)})", "check") from None
    return Decoded(tokens[len(ids):], rows)


def _causal_lm(folder: Path, model_type: str) -> tuple[Any, int, list[int]]:
    """transformers' eager causal LM of the whole folder, its number of layers and the layers with attention."""
    from transformers import AutoModelForCausalLM

    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    full, n_layer = truncated.full_config(folder, model_type, 0, text=True)
    model = truncated.load(AutoModelForCausalLM, folder, full, model_type, traced=False)
    return model, n_layer, truncated.attention_layers(truncated.layers_config(full), n_layer)


def _newest_rows(attentions: Any, n_layer: int, layers: list[int]) -> dict[int, torch.Tensor]:
    """One forward's `output_attentions` as layer -> the newest query's row `[n_head, n_K]`: every layer's, or a
    hybrid's attention layers' where only those have an entry."""
    present = [a for a in attentions if a is not None]
    numbers = range(n_layer) if len(present) == n_layer else layers
    return {layer: a[0, :, -1] for layer, a in zip(numbers, present, strict=True)}


@dataclass
class Seq2Seq:
    """transformers' eager run of an encoder-decoder on attnscope's inputs: each attention's `output_attentions`
    (`kind` -> layer -> `[n_head, n_Q, n_K]`), and with decoding the new ids and each step's rows (`rows[t]`:
    kind ("decoder", "cross") -> layer -> the newest query's row `[n_head, n_K]`)."""

    attentions: dict[str, dict[int, torch.Tensor]]
    ids: list[int]
    rows: list[dict[str, dict[int, torch.Tensor]]]


SEQ2SEQ_OUTPUTS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}


def seq2seq(folder: Path, model_type: str, source: list[int] | torch.Tensor, decoder_ids: list[int],
            n_new: int = 0) -> Seq2Seq:
    """`AutoModelForSeq2SeqLM` (Whisper: `AutoModelForSpeechSeq2Seq`, on the same `input_features`) eager, its
    forward on the source and the decoder's ids with `output_attentions=True`; then, for `n_new` tokens, plain
    greedy decoding with the model's own cache (an `EncoderDecoderCache`, as `generate` builds one), a forward a
    step and the argmax of its last logits. generate() itself is not called: its logits processors from the
    checkpoint's generation config (BART's forced_eos_token_id, Whisper's suppressed and forced tokens) would
    change tokens that attnscope's plain greedy decoding chooses."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    audio = not isinstance(source, list)
    config, _ = truncated.full_config(folder, model_type, 0)
    model = truncated.load(AutoModelForSpeechSeq2Seq if audio else AutoModelForSeq2SeqLM, folder, config, model_type,
                           traced=False)
    inputs = {"input_features": source} if audio else {"input_ids": torch.tensor([source])}
    try:
        with torch.no_grad():
            out = model(**inputs, decoder_input_ids=torch.tensor([decoder_ids]), output_attentions=True,
                        use_cache=bool(n_new))
            attentions = {kind: dict(enumerate(a[0] for a in getattr(out, name)))
                          for kind, name in SEQ2SEQ_OUTPUTS.items()}
            ids, rows = _greedy(model, out, n_new)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"{{check}}: transformers could not run model_type '{model_type}' on the input "
                            f"({truncated.first_line(exc)})", "check") from None
    return Seq2Seq(attentions, ids, rows)


def _greedy(model: Any, out: Any, n_new: int) -> tuple[list[int], list[dict[str, dict[int, torch.Tensor]]]]:
    """Greedy decoding on from the first forward `out` (its logits, cache and encoder output), as
    `GenerationMixin._sample` does with do_sample=False and no logits processor."""
    import torch

    ids: list[int] = []
    rows = []
    name = cache_keyword(model)  # the forward's name for its cache, asked once a run
    for step in range(n_new):
        rows.append({kind: {layer: a[0, :, -1] for layer, a in enumerate(getattr(out, SEQ2SEQ_OUTPUTS[kind]))}
                     for kind in ("decoder", "cross")})
        ids.append(int(out.logits[0, -1].argmax()))
        if step + 1 < n_new:
            out = model(encoder_outputs=(out.encoder_last_hidden_state,), **{name: cache_of(out)},
                        decoder_input_ids=torch.tensor([[ids[-1]]]), output_attentions=True, use_cache=True)
    return ids, rows
