"""A vision-language model's text model run on a prompt with an image (vlm.py places the image's tokens).

The vision tower and projector run in transformers, untraced: the image's features are an input of the language
model. What enters the language model, `inputs_embeds` `[1, n_tokens, d_model]` (the token embeddings with the
projected image features scattered over the image's positions: each family's `masked_scatter`), is taken from
transformers' own forward, stopped there (`_Entered`), with the text model cut to one layer so nothing more is
loaded than the tower, the projector and the embeddings.

Then the text model's layers 0..L run:
- on attnscope's family page where there is one (`page`): Gemma 3 (with the image's bidirectional mask:
  vlm_gemma3.py), Llama 4, LLaVA's LLaMA or Mistral, from those embeddings, layer L traced;
- through transformers' attention interface otherwise (`interface`): Qwen2.5-VL and Qwen3-VL turn M-RoPE, three
  position ids per token (temporal, row, column; `get_rope_index`), which no page computes, so the whole model
  runs in transformers (its text layers cut to L + 1, its vision tower eager) and layer L's attention is
  recorded from the Q, K, V and mask transformers hands it (models/interface.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError, UsageError
from attnscope.models.truncated import first_line

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.config import Config
    from attnscope.models.family import Family
    from attnscope.models.run import LayerRun
    from attnscope.models.truncated import TransformersRun
    from attnscope.models.vision.vlm import ImageTokens


class _Entered(Exception):
    """The language model's inputs are taken: the rest of the model need not run."""

    def __init__(self, embeds: torch.Tensor) -> None:
        self.embeds = embeds


def text_family(folder: Path, config: Config, tokens: ImageTokens) -> Family:
    """The page that reads this VLM's language model: Gemma 3's with the image mask, Llama 4's, or for LLaVA the
    page of its text_config's model_type."""
    from attnscope.models import family_of
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config as Settings
    from attnscope.models.shapes import check_weights

    checkpoint = Checkpoint.open(folder)
    model: Family
    if config.model_type == "gemma3":
        from attnscope.models.vision.vlm_gemma3 import Gemma3Image

        model = Gemma3Image(folder, config, checkpoint).with_image(tokens.blocks())
    elif config.model_type == "llava":
        # transformers' text config, its class defaults filled in: LLaVA 1.5's config.json names a few settings
        text = Settings(config.path, {**text_settings(folder, config),
                                      "architectures": config.data.get("architectures")})
        family = family_of(text)
        assert family is not None  # vlm.check_vlm kept LLaMA and Mistral
        model = family(folder, text, checkpoint)
        model.architecture = config.architecture
    else:
        family = family_of(config)
        assert family is not None
        model = family(folder, config, checkpoint)
    check_weights(model)
    return model


def embeddings(folder: Path, config: Config, tokens: ImageTokens) -> torch.Tensor:
    """`inputs_embeds` as the model hands them to its language model, `[1, n_tokens, d_model]`: the tower and
    projector run by transformers, the features scattered over the image's positions."""
    import torch

    model = _load(folder, config, layers=1, attention="eager")
    decoder = model.get_decoder()

    def entered(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        raise _Entered(kwargs["inputs_embeds"])

    hook = decoder.register_forward_pre_hook(entered, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**tokens.inputs)
    except _Entered as entered_with:
        return entered_with.embeds.float()
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise ResourceError(f"transformers could not run {config.architecture}'s vision tower on the image "
                            f"({first_line(exc)})") from None
    finally:
        hook.remove()
    raise ResourceError(f"{config.architecture} never called its language model with inputs_embeds")


def page(model: Family, h0: torch.Tensor, layer: int, head: int) -> LayerRun:
    """`models/run.py`'s `run_layer`, from the embeddings the model made: layers 0..L-1 whole, layer L traced."""
    import torch

    from attnscope.models.run import layer_run

    with torch.no_grad():
        h = h0  # [1, n_tokens, d_model]
        for earlier in range(layer):
            h = model.block(earlier, h, model.attention(earlier, record=False))
        X, made = model.attention_input(layer, h)  # [1, n_tokens, d_model]
        traced = model.attention(layer, record=True)(X)
    made = f"{made}; layer 0's input: the token embeddings with the projected image features in the image's places"
    return layer_run(model, layer, head, traced, X, made)


def interface(folder: Path, config: Config, tokens: ImageTokens, layer: int) -> TransformersRun:
    """The whole VLM in transformers, its text layers cut to L + 1, layer L's attention recorded through the
    attention interface (the vision tower's own attention stays eager, unrecorded)."""
    import torch

    from attnscope.models import interface as recorder
    from attnscope.models.truncated import sizes

    model = _load(folder, config, layers=layer + 1, attention=recorder.IMPLEMENTATION)
    try:
        with torch.no_grad(), recorder.recording(layer) as recording:
            try:
                model(**tokens.inputs)
            except recorder.Reached:
                pass
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise ResourceError(f"transformers could not run {config.architecture} on the text and image "
                            f"({first_line(exc)})") from None
    recorded = recording.recorded
    if recorded is None:
        raise ResourceError(f"{config.architecture}'s layer {layer} never called the attention interface")
    text_model = model.get_decoder()
    run = sizes(text_model, recorded, recorded.layer["attention"][0], _n_layer(folder, config), layer)
    run.architecture = config.architecture
    return run


def load_eager(folder: Path, config: Config, layer: int) -> Any:
    """transformers' eager VLM, text layers 0..`layer`: --check's reference."""
    return _load(folder, config, layers=layer + 1, attention="eager")


def text_settings(folder: Path, config: Config) -> dict[str, Any]:
    """The language model's settings as transformers reads them (`AutoConfig`, no code from the folder): its
    `text_config` with the class defaults a config.json leaves out (LLaVA 1.5's names a few), or built from the
    top level where an older config keeps them there (Qwen2.5-VL's)."""
    from transformers import AutoConfig

    from attnscope.models.truncated import quiet_transformers

    quiet_transformers()
    try:
        settings = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise UsageError(f"{{model}} {folder}: transformers cannot read model_type '{config.model_type}' "
                         f"({first_line(exc)})", "model") from None
    return dict(settings.get_text_config().to_dict())


def _n_layer(folder: Path, config: Config) -> int:
    n = text_settings(folder, config).get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise UsageError(f"{config.path}: the language model has no num_hidden_layers; fix config.json")
    return n


def check_layer(folder: Path, config: Config, layer: int) -> None:
    from attnscope.models.family import check_position

    check_position(_n_layer(folder, config), 1 << 30, layer, 0)


def _load(folder: Path, config: Config, *, layers: int, attention: str) -> Any:
    """The VLM through transformers (AutoModelForImageTextToText, no code from the folder), float32, its text
    model cut to `layers` layers; the vision tower eager, the text model's attention `attention`."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from attnscope.models import interface as recorder
    from attnscope.models.truncated import cut, quiet_transformers

    quiet_transformers()
    try:
        settings = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        settings.text_config = cut(settings.text_config, _n_layer(folder, config), layers - 1)
        if attention == recorder.IMPLEMENTATION:
            recorder.register()
        implementation = {"": "eager", "text_config": attention, "vision_config": "eager"}
        return AutoModelForImageTextToText.from_pretrained(str(folder), config=settings, dtype=torch.float32,
                                                           trust_remote_code=False,
                                                           attn_implementation=implementation).eval()
    except (OSError, ValueError, KeyError, TypeError, ImportError, RuntimeError) as exc:
        raise UsageError(f"{{model}} {folder}: transformers cannot load model_type '{config.model_type}' "
                         f"({first_line(exc)})", "model") from None
