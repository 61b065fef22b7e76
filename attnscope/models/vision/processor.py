"""The model's own image processor, from its folder's preprocessor_config.json: transformers'
`AutoImageProcessor` with the PIL backend (`backend="pil"`: ViTImageProcessorPil, CLIPImageProcessorPil,
SiglipImageProcessorPil, BitImageProcessorPil for DINOv2, ...; no torchvision), `trust_remote_code` off. It turns
the image into `pixel_values` `[n_batch, n_channel, height, width]` exactly as the model's users do; the picture
shows that input (`shown`), the pixels the patches cut, not the file before resizing and cropping.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models.config import load_json

if TYPE_CHECKING:
    import torch
    from PIL import Image

PROCESSOR_CONFIG = "preprocessor_config.json"


@dataclass
class Pixels:
    """What the model reads, `pixel_values` `[1, n_channel, height, width]`, and who made it."""

    values: torch.Tensor
    processor: str  # the class: `ViTImageProcessorPil`
    mean: tuple[float, ...] | None  # the processor's normalization, undone for the picture
    std: tuple[float, ...] | None
    rescale: float | None  # its rescale_factor (1/255) where it rescales

    @property
    def height(self) -> int:
        return int(self.values.shape[-2])

    @property
    def width(self) -> int:
        return int(self.values.shape[-1])


def load_processor(folder: Path) -> Any:
    """The folder's image processor (PIL backend), or one line saying why there is none."""
    path = folder / PROCESSOR_CONFIG
    if not path.is_file():
        raise UsageError(f"{{model}} {folder} has no {PROCESSOR_CONFIG}: how this model resizes and normalizes an "
                         "image is unknown, so {image} cannot be read; save its image processor beside the weights "
                         "with AutoImageProcessor.save_pretrained(folder)", "model", "image")
    settings = load_json(path)
    if not isinstance(settings, dict):
        raise UsageError(f"{path} holds a JSON {type(settings).__name__}, not an image processor's settings")
    if "auto_map" in settings:
        raise UsageError(f"{path} names its own image processor code (auto_map); attnscope never runs code from a "
                         "model's folder: save a transformers image processor's settings there instead")
    from transformers import AutoImageProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoImageProcessor.from_pretrained(str(folder), backend="pil", trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError) as exc:
        raise UsageError(f"{path}: transformers cannot build its image processor ({_first_line(exc)})") from None


def pixel_values(folder: Path, image: Image.Image) -> Pixels:
    """`image` as the folder's image processor makes it for the model."""
    processor = load_processor(folder)
    try:
        made = processor(images=image, return_tensors="pt")
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        raise UsageError(f"{{image}}: {type(processor).__name__} cannot process it ({_first_line(exc)})",
                         "image") from None
    values = made["pixel_values"].float()  # [1, n_channel, height, width]
    normalize = getattr(processor, "do_normalize", False)
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    rescale = getattr(processor, "rescale_factor", None) if getattr(processor, "do_rescale", False) else None
    return Pixels(values, type(processor).__name__, _floats(mean) if normalize else None,
                  _floats(std) if normalize else None, float(rescale) if rescale else None)


def shown(pixels: Pixels) -> Image.Image:
    """The model's input as a picture: the processor's normalization and rescaling undone, RGB, 8 bits."""
    import numpy as np
    from PIL import Image

    values = pixels.values[0].double()  # [n_channel, height, width]
    if pixels.std is not None and pixels.mean is not None:
        std = values.new_tensor(_per_channel(pixels.std, values.shape[0]))[:, None, None]
        mean = values.new_tensor(_per_channel(pixels.mean, values.shape[0]))[:, None, None]
        values = values * std + mean
    scale = 255.0 if pixels.rescale is not None else 1.0  # rescaled to [0, 1] by the processor, else 0..255
    array = (values * scale).clamp(0, 255).round().to(dtype=values.dtype).numpy().astype(np.uint8)
    if array.shape[0] == 1:
        return Image.fromarray(array[0], "L").convert("RGB")
    # [3, height, width] -> [height, width, 3]
    return Image.fromarray(np.ascontiguousarray(array[:3].transpose(1, 2, 0)), "RGB")


def _floats(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    return tuple(float(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _per_channel(values: tuple[float, ...], n: int) -> list[float]:
    return list(values) * n if len(values) == 1 else list(values[:n])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__
