"""A vision-language model's text with an image (`head --text ... --image F`): the image's tokens placed as the
model's own processor places them, each labelled by its place in the image, `img(r,c)`, and the share of each
text query's weight that lands on them.

The processor is the folder's own (`AutoProcessor`: its tokenizer and image processor, and the placement its
`__call__` does: Gemma 3's `\\n\\n<start_of_image>` + 256 `<image_soft_token>` + `<end_of_image>\\n\\n`, LLaVA's
`<image>` repeated per patch, Llama 4's `<|image_start|>` ... `<|patch|>` ... `<|image_end|>`, Qwen's
`<|vision_start|>` + `<|image_pad|>` per merged patch + `<|vision_end|>`). Where transformers cannot build the
processor for want of torchvision: Llama 4's image processor exists only as a torchvision class, so
Llama4Processor is built over attnscope's copy of its steps (llama4_tiles.py, equal to it bit for bit); Qwen's
needs torchvision for its video half, so the folder's tokenizer and image processor are used apart and the image's
tokens placed by the processor's own rule (`Qwen2_5_VLProcessor.__call__`'s, written once in `_qwen_placement`).
The prompt: the text as given where it holds the processor's image placeholder, else the
chat template where the processor has one (a user turn: the image, then the text), else the placeholder before
the text.

Which positions the image fills is the model's own rule: the tokens equal to `config.image_token_id` (the
`get_placeholder_mask` of every family). A run of them is one image (or one tile or crop of it); its grid is the
processor's `image_grid_thw` (Qwen: rows and columns of merged patches) or, where tokens come in a square, the
square's side (Gemma 3's `mm_tokens_per_image`, LLaVA's patches, Llama 4's pixel-shuffled patches per tile).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models.nopage.truncated import first_line
from attnscope.words import counted

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from attnscope.models.config import Config

# model_type -> how its text model is read: the family page's model_type, or None for transformers' attention
# interface (Qwen's M-RoPE turns three position ids per token, which no page computes).
VLM_TYPES: dict[str, str | None] = {"gemma3": "gemma3", "llama4": "llama4", "llava": "text_config",
                                    "qwen2_5_vl": None, "qwen3_vl": None}
TEXT_TYPES = ("llama", "mistral")  # LLaVA's language models attnscope has a page for


@dataclass
class ImageTokens:
    """The prompt as the model reads it: ids, a label per token (text pieces; `img(r,c)` for the image's), which
    positions an image fills, each run's grid, and the processor's tensors for the model."""

    ids: list[int]
    labels: list[str]
    image: list[bool]
    grids: list[tuple[int, int]]  # each run of image tokens: (rows, cols)
    inputs: dict[str, Any]  # input_ids, attention_mask, pixel_values, image_grid_thw, token_type_ids, ...
    prompt: str
    processor: str  # what made it: `Gemma3Processor`, or `Qwen2TokenizerFast + Qwen2VLImageProcessorPil`
    notes: list[str] = field(default_factory=list)
    whole: int = 0  # the run that shows the whole image (Llama 4's global view comes after its tiles)

    @property
    def n_image(self) -> int:
        return sum(self.image)

    def run_start(self, k: int) -> int:
        """The position where run `k` of image tokens starts."""
        return [i for i, on in enumerate(self.image) if on and (i == 0 or not self.image[i - 1])][k]

    def blocks(self) -> list[int]:
        """Each position's image run (0, 1, ...), -1 for text: transformers' `get_block_sequence_ids_for_mask`."""
        out, run = [], -1
        for i, on in enumerate(self.image):
            if on and (i == 0 or not self.image[i - 1]):
                run += 1
            out.append(run if on else -1)
        return out


def check_vlm(config: Config) -> None:
    """A model_type attnscope places image tokens for, with a text model it can run; else one line."""
    if config.model_type not in VLM_TYPES:
        from attnscope.models.vision.tower import TOWERS

        supported = (f"{{image}} is read by vision towers ({', '.join(TOWERS)}) alone and by vision-language "
                     f"models ({', '.join(VLM_TYPES)}) with {{text}}")
        what = f"{{model}} is a {config.architecture} (model_type '{config.model_type}')"
        if reads_images(config):
            raise UsageError(f"{what}, a model that reads images, but attnscope does not support its family; "
                             f"{supported}", "image", "text", "model")
        raise UsageError(f"{supported}; {what}, which reads no image: drop {{image}}", "image", "text", "model")
    if VLM_TYPES[config.model_type] == "text_config":
        text = config.mapping("text_config") or {}
        kind = text.get("model_type", "llama")
        if kind not in TEXT_TYPES:
            raise UsageError(f"{{model}}: this LLaVA's language model is a '{kind}'; attnscope places its image "
                             f"tokens over {' or '.join(TEXT_TYPES)} language models", "model")


def reads_images(config: Config) -> bool:
    """Whether the model's family reads images: transformers knows an image processor for its model_type
    (`IMAGE_PROCESSOR_MAPPING_NAMES`: SigLIP2, BLIP, Idefics, ...), it is a `..._vision_model`, or its config holds
    a `vision_config`."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    return (config.model_type in IMAGE_PROCESSOR_MAPPING_NAMES or config.model_type.endswith("_vision_model")
            or isinstance(config.raw("vision_config"), dict))


def image_token_id(config: Config) -> int:
    """`config.image_token_id` (`image_token_index` in older configs): the id whose positions the image fills."""
    value = config.raw("image_token_id", "image_token_index")
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{config.path}: no image_token_id (or image_token_index); a vision-language model's "
                         "config names the token its image fills; fix config.json")
    return value


def place(folder: Path, config: Config, text: str, picture: Image.Image, path: str = "") -> ImageTokens:
    """The folder's processor on the text and the picture (image.read_image's, `path`), and the image's tokens
    found and labelled. The size the image processor would resize the picture to is checked first, and the
    picture converted to RGB as the image processor converts (processor.check_size, as_processor_reads)."""
    from attnscope.models.vision.processor import as_processor_reads, check_size

    processor, made_by, notes = _processor(folder, config)
    images = getattr(processor, "image_processor", None)
    if images is not None:
        check_size(images, picture.width, picture.height, path)
        picture = as_processor_reads(images, picture)
    prompt, templated = _prompt(processor, text, config)
    try:
        if made_by == "AutoProcessor":
            # ProcessorMixin.apply_chat_template(tokenize=True): a chat template's prompt that starts with the BOS
            # gets no second one
            bos = getattr(processor.tokenizer, "bos_token", None)
            special = not (templated and bos and prompt.startswith(bos))
            inputs = dict(processor(text=prompt, images=[picture], return_tensors="pt", add_special_tokens=special))
            made_by = type(processor).__name__
        else:
            inputs = _qwen_placement(processor, prompt, picture)
    except (ValueError, TypeError, KeyError, RuntimeError, IndexError) as exc:
        raise UsageError(f"{{image}}: the model's processor cannot read the text with the image "
                         f"({first_line(exc)})", "image") from None
    # the model runs in float32; Llama4ImageProcessor's pixels are bfloat16 (each exact in float32): moved to the
    # model's dtype as its users do (`BatchFeature.to(model.dtype)`, which casts floating tensors only)
    inputs = {k: v.float() if hasattr(v, "is_floating_point") and v.is_floating_point() else v
              for k, v in inputs.items()}
    return found(config, inputs, processor.tokenizer, prompt, made_by, notes)


def found(config: Config, inputs: dict[str, Any], tokenizer: Any, prompt: str, made_by: str,
          notes: list[str] | None = None) -> ImageTokens:
    """The processor's output read: the image's positions (`config.image_token_id`'s), its runs, their grids and
    every token's label."""
    notes = list(notes or [])
    ids = [int(i) for i in inputs["input_ids"][0]]
    wanted = image_token_id(config)
    image = [i == wanted for i in ids]
    if not any(image):
        raise UsageError(f"{{image}}: the processor placed no image token (id {wanted}) in the prompt; the model's "
                         "config and processor disagree", "image")
    runs = _runs(image)
    grids = _grids(runs, inputs.get("image_grid_thw"), config)
    labels = _labels(tokenizer, ids, runs, grids)
    if len(runs) > 1:
        notes.append(f"the image fills {counted(len(runs), 'run')} of tokens (tiles, crops or a global view, as "
                     f"the processor cut it): the first labelled img(r,c), the next img2(r,c), ...; the picture "
                     "shows the run that holds the whole image")
    whole = len(runs) - 1 if config.model_type == "llama4" else 0  # Llama4Processor: tiles, then the global view
    return ImageTokens(ids, labels, image, grids, inputs, prompt, made_by, notes, whole)


def image_share(patterns: torch.Tensor, image: list[bool]) -> torch.Tensor:
    """Each head's weight on the image tokens, per query: `patterns [..., n_Q, n_K]` summed over the keys an image
    fills -> `[..., n_Q]` (a text query's share of its softmax row that lands on the image)."""
    import torch

    keys = torch.tensor(image, dtype=torch.bool)
    return patterns[..., keys].sum(dim=-1)  # [..., n_Q, n_image] -> [..., n_Q]


# --- the processor ----------------------------------------------------------------------------------------


def _processor(folder: Path, config: Config) -> tuple[Any, str, list[str]]:
    """The folder's AutoProcessor; without torchvision, Llama 4's Llama4Processor over llama4_tiles, and Qwen's
    tokenizer and image processor apart (its video half needs torchvision), placed by the rule written here."""
    from transformers import AutoProcessor

    from attnscope.models.nopage.truncated import quiet_transformers

    quiet_transformers()
    try:
        return AutoProcessor.from_pretrained(str(folder), trust_remote_code=False), "AutoProcessor", []
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError, RuntimeError) as exc:
        # RuntimeError: a torchvision that does not match the installed torch fails to import ("operator
        # torchvision::nms does not exist")
        torchvision = "torchvision" in str(exc).lower() or importlib.util.find_spec("torchvision") is None
        why = "it needs torchvision, not installed" if "torchvision" in str(exc).lower() else first_line(exc)
    if config.model_type == "llama4" and torchvision:
        from attnscope.models.vision import llama4_tiles

        try:
            made = llama4_tiles.processor(folder)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise UsageError(f"{{model}} {folder}: Llama4Processor cannot be built from this folder "
                             f"({first_line(exc)})", "model") from None
        note = ("Llama 4's image processor needs torchvision, not usable here: its tiles were cut by attnscope's "
                "copy of Llama4ImageProcessor's steps (models/vision/llama4_tiles.py, equal to it bit for bit in "
                "the tests) and placed by Llama4Processor itself")
        return made, "AutoProcessor", [note]
    if not config.model_type.startswith("qwen"):
        fix = "pip install torchvision" if "torchvision" in why else "save it beside the weights with " \
            "AutoProcessor.save_pretrained(folder)"
        raise UsageError(f"{{model}} {folder}: transformers cannot build this model's processor ({why}); {fix}",
                         "model")
    from transformers import AutoTokenizer

    from attnscope.models.vision.processor import load_processor

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError) as exc:
        raise UsageError(f"{{model}} {folder}: its tokenizer cannot be read ({first_line(exc)})", "model") from None
    images = load_processor(folder)
    name = f"{type(tokenizer).__name__} + {type(images).__name__}"
    note = (f"transformers cannot build this folder's processor here ({why}); its tokenizer and image processor "
            f"ran apart ({name}) and the image's tokens were placed by Qwen2_5_VLProcessor's rule: "
            "<|image_pad|> times the merged patches")
    return _Parts(tokenizer, images), name, [note]


@dataclass
class _Parts:
    tokenizer: Any
    image_processor: Any
    image_token: str = "<|image_pad|>"


def _prompt(processor: Any, text: str, config: Config) -> tuple[str, bool]:
    """The text with the image placeholder: as given where it holds one, else the chat template's user turn
    (image, then text), else the placeholder before the text; and whether the chat template made it."""
    placeholder = _placeholder(processor)
    if placeholder in text:
        return text, False
    template = getattr(processor, "chat_template", None)
    if template and hasattr(processor, "apply_chat_template"):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return str(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)), True
    if config.model_type.startswith("qwen"):
        return f"<|vision_start|>{placeholder}<|vision_end|>{text}", False  # the template's image, without its turn
    return f"{placeholder}{text}", False


def _placeholder(processor: Any) -> str:
    """What marks the image in a prompt: Gemma 3's `<start_of_image>` (its `boi_token`), else `image_token`
    (`<image>`, `<|image|>`, `<|image_pad|>`)."""
    return str(getattr(processor, "boi_token", None) or getattr(processor, "fake_image_token", None)
               or processor.image_token)


def _qwen_placement(parts: _Parts, prompt: str, picture: Image.Image) -> dict[str, Any]:
    """`Qwen2_5_VLProcessor.__call__` (and Qwen3VLProcessor's): the image processor's pixel_values and
    image_grid_thw, then each `<|image_pad|>` repeated `grid_thw.prod() // merge_size**2` times, tokenized, with
    the processor's `mm_token_type_ids` (M-RoPE's get_rope_index reads them)."""
    made = parts.image_processor(images=[picture], return_tensors="pt")
    merge = int(getattr(parts.image_processor, "merge_size", 2))
    pieces = prompt.split(parts.image_token)
    if len(pieces) != 2:
        raise ValueError(f"the prompt holds {prompt.count(parts.image_token)} {parts.image_token}, not one")
    n = int(made["image_grid_thw"][0].prod()) // merge ** 2
    text = pieces[0] + parts.image_token * n + pieces[1]
    encoded = dict(parts.tokenizer(text, return_tensors="pt"))
    image_id = parts.tokenizer.convert_tokens_to_ids(parts.image_token)
    types = (encoded["input_ids"] == image_id).long()  # create_mm_token_type_ids: 1 on the image's tokens
    return {**encoded, "mm_token_type_ids": types, "pixel_values": made["pixel_values"],
            "image_grid_thw": made["image_grid_thw"]}


# --- the image's tokens -------------------------------------------------------------------------------------


def _runs(image: list[bool]) -> list[tuple[int, int]]:
    """Each run of consecutive image tokens as (start, stop)."""
    runs: list[tuple[int, int]] = []
    for i, on in enumerate(image):
        if on and (i == 0 or not image[i - 1]):
            runs.append((i, i + 1))
        elif on:
            runs[-1] = (runs[-1][0], i + 1)
    return runs


def _grids(runs: list[tuple[int, int]], grid_thw: Any, config: Config) -> list[tuple[int, int]]:
    """Each run's rows and columns: Qwen's image_grid_thw (merged: h // merge, w // merge; one run per image), else
    the square the run's tokens make (Gemma 3, LLaVA, Llama 4), else one row."""
    if grid_thw is not None and len(grid_thw) == len(runs):
        vision = config.mapping("vision_config") or {}
        merge = int(vision.get("spatial_merge_size", 2))
        grids = [(int(g[1]) // merge, int(g[2]) // merge) for g in grid_thw]  # [t, h, w] in patches
        sizes = [int(g.prod()) // merge ** 2 for g in grid_thw]  # tokens per image: t * h * w // merge²
        if sizes == [stop - start for start, stop in runs]:
            return grids
    out = []
    for start, stop in runs:
        side = math.isqrt(stop - start)
        out.append((side, side) if side * side == stop - start else (1, stop - start))
    return out


def _labels(tokenizer: Any, ids: list[int], runs: list[tuple[int, int]], grids: list[tuple[int, int]]) -> list[str]:
    """The tokenizer's pieces, and `img(r,c)` (`img2(r,c)` for a second run) at the image's positions."""
    labels = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    for k, ((start, stop), (rows, cols)) in enumerate(zip(runs, grids, strict=True)):
        name = "img" if k == 0 else f"img{k + 1}"
        for j in range(stop - start):
            r, c = divmod(j % (rows * cols), cols)
            labels[start + j] = f"{name}({r},{c})"
    return labels
