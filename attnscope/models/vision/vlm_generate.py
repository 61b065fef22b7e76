"""Greedy decoding with an image (`head --text ... --image F --generate N`): the prompt, the image's embeddings in
its places, prefilled once; then each new token a decode step over the KV cache; at each, layer L's row for the
query that chose the token, and the share of that row on the image's tokens.

- On a family page (Gemma 3, Llama 4, LLaVA's LLaMA or Mistral) the text model decodes with
  models/forward/stream.py's `generate`, as a text does: vlm_run.py's `ImageEmbedded` hands the prefill the
  VLM's `inputs_embeds` and each new token its token embedding; Gemma 3's image block applies to the prefill
  only (vlm_gemma3.py), as transformers drops `token_type_ids` after the first step.
- Through the attention interface (Qwen2.5-VL, Qwen3-VL, `through_interface` here) transformers' own forward and
  cache run: the prompt with `pixel_values` (its `get_rope_index` sets the model's `rope_deltas`), then one token a
  step with M-RoPE's decode positions `position + rope_deltas` on each of the three axes
  (`Qwen2_5_VLForConditionalGeneration._prepare_position_ids_for_generation`), layer L's row recorded each step.

`eager_decode` is --check's reference: transformers' `generate` on the eager VLM, the processor's inputs as they are,
decoding by attnscope's rule (models/nopage/eager.py's `greedy_config`), not by the folder's generation_config.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError
from attnscope.models.nopage.cache_names import cache_of
from attnscope.models.nopage.truncated import first_line

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import torch

    from attnscope.models.config import Config
    from attnscope.models.forward.stream import DecodeStep
    from attnscope.models.nopage.eager import Decoded
    from attnscope.models.nopage.truncated import TransformersRun
    from attnscope.models.vision.vlm import ImageTokens


def through_interface(folder: Path, config: Config, tokens: ImageTokens, layer: int, n_new: int,
                      every: bool = False) -> tuple[TransformersRun, list[torch.Tensor] | None, list[DecodeStep]]:
    """The whole VLM in transformers, layer L recorded through the attention interface on the prompt (with
    `every`, every layer's pattern too) and at each of `n_new` greedy steps, the self-check watching every call
    (models/nopage/interface_check.py); where a module's output is not reproduced, on the prompt or at a step, the whole
    decoding again with eager's `output_attentions` (`_eager`), untraced."""
    import torch

    from attnscope.models.forward.interface_stream import decode_step, greedy
    from attnscope.models.nopage import interface as recorder
    from attnscope.models.nopage import interface_check
    from attnscope.models.vision import vlm_run

    n = vlm_run.n_layer(folder, config)
    model = vlm_run.load(folder, config, layers=n, attention=recorder.IMPLEMENTATION)
    try:
        with torch.no_grad(), recorder.recording(layer, stop=False, every=every) as recording, \
                interface_check.watching(model, recording):
            out = model(**tokens.inputs, use_cache=True)  # the prompt: get_rope_index sets rope_deltas
            if recording.failure is None:
                run, patterns = vlm_run.recorded(model, config, recording, layer, n)
                recording.patterns = None

                def step(out: Any, position: int) -> DecodeStep:
                    assert recording.recorded is not None
                    recording.calls = 0  # the next forward's calls counted from its layer 0
                    token = int(out.logits[0, -1].argmax())
                    return decode_step(recording.recorded, token, position, cache_of(out))

                steps = greedy(model, out, tokens.ids, n_new, step, _positions(model, config))
        if recording.failure is not None:
            with torch.no_grad():
                return _eager(model, config, tokens, layer, n_new, n, every, recording.failure.note())
        if not recording.checked and run.recorded is not None:
            run.recorded.layer.notes.append(interface_check.UNCHECKED)
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise ResourceError(f"transformers could not decode with {config.architecture} on the text and image "
                            f"({first_line(exc)})") from None
    return run, patterns, steps


def _eager(model: Any, config: Config, tokens: ImageTokens, layer: int, n_new: int, n: int, every: bool,
           fallback: str) -> tuple[TransformersRun, list[torch.Tensor] | None, list[DecodeStep]]:
    """The prompt and `n_new` steps again with transformers' eager attention and `output_attentions`: layer L's
    pattern and each step's row (every layer's pattern with `every`), untraced, `fallback` (the self-check's note)
    saying why."""
    from attnscope.models.forward.interface_stream import eager_step, greedy
    from attnscope.models.nopage.truncated import sizes

    model.set_attn_implementation("eager")
    out = model(**tokens.inputs, use_cache=True, output_attentions=True)
    patterns = [a[0] for a in out.attentions]  # [n_head, n_tokens, n_tokens] each

    def step(out: Any, position: int) -> DecodeStep:
        return eager_step(out.attentions[layer], int(out.logits[0, -1].argmax()), position, cache_of(out))

    steps = greedy(model, out, tokens.ids, n_new, step, _positions(model, config), output_attentions=True)
    run = sizes(model.get_decoder(), None, patterns[layer], n, layer)
    run.architecture, run.fallback = config.architecture, fallback
    return run, patterns if every else None, steps


def _positions(model: Any, config: Config) -> Callable[[int], torch.Tensor]:
    """A new token's M-RoPE position ids by its position (`decode_positions` with the prompt's rope_deltas)."""
    deltas = _rope_deltas(model, config)
    return lambda position: decode_positions(position, deltas)


def decode_positions(position: int, deltas: torch.Tensor) -> torch.Tensor:
    """M-RoPE's position ids `[3, n_batch, n_new]` of a new text token at `position`: `position + rope_deltas` on
    each axis (time, row, column), the offset the prompt's `get_rope_index` left (an image's tokens take fewer
    positions than places)."""
    import torch

    return (torch.tensor([[[position]]]) + deltas).expand(3, 1, 1)  # [1, 1, 1] + [n_batch, 1] -> [3, 1, 1]


def _rope_deltas(model: Any, config: Config) -> torch.Tensor:
    """The model's `rope_deltas` `[n_batch, 1]`, set by the prompt's forward."""
    deltas = getattr(getattr(model, "model", None), "rope_deltas", None)
    if deltas is None:
        raise ResourceError(f"{config.architecture}'s forward on the prompt set no rope_deltas: its decode "
                            "positions are unknown")
    return deltas


def eager_decode(folder: Path, config: Config, tokens: ImageTokens, n_new: int) -> Decoded:
    """transformers' eager VLM, every layer: `generate(**inputs)` with attnscope's decoding rule
    (models/nopage/eager.py's `greedy_config`: `n_new` argmax tokens, no stop at the end-of-text token, none of the
    folder's generation_config.json processors, Qwen2.5-VL's repetition penalty of 1.05 among them); each step's
    row of every layer (`[n_head, keys the cache holds]`)."""
    import torch

    from attnscope.models.nopage.eager import Decoded, greedy_config
    from attnscope.models.nopage.upstream import reference_fixes
    from attnscope.models.vision import vlm_run

    model = vlm_run.load_eager(folder, config, vlm_run.n_layer(folder, config) - 1)
    try:
        with torch.no_grad(), reference_fixes():  # models/nopage/upstream.py: transformers 5.24's Llama 4 forward
            out = model.generate(**tokens.inputs, generation_config=greedy_config(model, n_new))
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"{{check}}: transformers could not decode with {config.architecture} "
                            f"({first_line(exc)})", "check") from None
    rows = [{layer: a[0, :, -1] for layer, a in enumerate(step) if a is not None} for step in out.attentions]
    return Decoded(out.sequences[0, len(tokens.ids):].tolist(), rows)


def step_shares(steps: list[DecodeStep], image: list[bool]) -> torch.Tensor:
    """Each step's weight on the image's tokens, per head: `[n_new, n_head]` (its row summed over the keys the
    image fills, all of them in the prompt)."""
    import torch

    from attnscope.models.vision.vlm import image_share

    if not steps:
        return torch.zeros(0, 0)
    return torch.stack([image_share(step.attention, image + [False] * (step.attention.shape[-1] - len(image)))
                        for step in steps])  # [n_new, n_head]
