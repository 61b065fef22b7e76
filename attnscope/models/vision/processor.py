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
from attnscope.models.jsonfile import load_json

if TYPE_CHECKING:
    import numpy as np
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


# The most pixels attnscope lets a processor resize an image to (4096 x 4096: Qwen2-VL's largest default,
# 3584 x 3584, fits): its uint8 and float32 copies stay under 1 GiB. A thin image (2,000,000 x 1) that a
# shortest-edge resize would scale up to 448,000,000 x 224 is refused before any pixel is resized.
MAX_RESIZED = 4096 * 4096


def planned_size(processor: Any, height: int, width: int) -> tuple[int, int, str] | None:
    """The (height, width) the image processor's resize makes of a `height` x `width` image, and how, computed
    as its resize computes it and without resizing: transformers' `PilBackend.resize` (a size dict's
    shortest_edge, shortest and longest edge, max_height and max_width, or height and width, through
    transformers' own get_resize_output_image_size, get_size_with_aspect_ratio,
    get_image_size_for_max_height_width) or Qwen's `smart_resize` (its size's shortest and longest edge are
    pixel counts, the factor patch_size * merge_size); None where the processor resizes another way. Qwen's
    smart_resize refuses an aspect ratio over 200 with a ValueError, raised here as there."""
    import sys

    import numpy as np

    if not getattr(processor, "do_resize", True):
        return height, width, "it does not resize"
    size = getattr(processor, "size", None)
    if size is None or not hasattr(size, "shortest_edge"):
        return None
    smart = getattr(sys.modules.get(type(processor).__module__), "smart_resize", None)
    if smart is not None and hasattr(processor, "merge_size") and size.shortest_edge and size.longest_edge:
        factor = int(processor.patch_size) * int(processor.merge_size)
        h, w = smart(height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
        return int(h), int(w), f"smart_resize, to between {size.shortest_edge:,} and {size.longest_edge:,} pixels"
    from transformers.image_processing_backends import PilBackend

    if getattr(type(processor), "resize", None) is not PilBackend.resize:
        return None
    from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio
    from transformers.image_utils import ChannelDimension, get_image_size_for_max_height_width

    if size.shortest_edge and size.longest_edge:
        h, w = get_size_with_aspect_ratio((height, width), size.shortest_edge, size.longest_edge)
        how = f"its shorter side resized to {size.shortest_edge}, its longer at most {size.longest_edge}"
    elif size.shortest_edge:
        shape = np.broadcast_to(np.zeros((1, 1, 1), np.uint8), (3, height, width))  # a shape, no pixels
        h, w = get_resize_output_image_size(shape, size=size.shortest_edge, default_to_square=False,
                                            input_data_format=ChannelDimension.FIRST)
        how = f"its shorter side resized to {size.shortest_edge}, the aspect ratio kept"
    elif size.max_height and size.max_width:
        h, w = get_image_size_for_max_height_width((height, width), size.max_height, size.max_width)
        how = f"resized to fit {size.max_height} x {size.max_width}"
    elif size.height and size.width:
        h, w, how = size.height, size.width, "resized to its size"
    else:
        return None
    return int(h), int(w), how


def check_size(processor: Any, width: int, height: int, image: str = "") -> None:
    """Refuse, in one message naming the image and the size, an image the processor would resize to more than
    MAX_RESIZED pixels, or to nothing (a side of 0), before it resizes anything."""
    name = type(processor).__name__
    where = f"{{image}} {image}".rstrip()
    try:
        planned = planned_size(processor, height, width)
    except (ValueError, TypeError, ArithmeticError) as exc:
        if "aspect ratio" in str(exc):  # Qwen's smart_resize: an aspect ratio over 200
            raise UsageError(f"{where} is {width:,} x {height:,} pixels, which {name} cannot resize "
                             f"({_first_line(exc)}); crop it to a less elongated shape", "image") from None
        raise UsageError(f"{where}: {name} cannot work out the size it resizes a {width:,} x {height:,} image to "
                         f"({_first_line(exc)}); fix the size in {PROCESSOR_CONFIG}", "image") from None
    if planned is None or _fits(planned):
        return
    h, w, how = planned
    made = f"{_count(w)} x {_count(h)} = {_count(w * h)} pixels, over the {MAX_RESIZED:,} attnscope lets it make" \
        if min(h, w) >= 1 else f"{_count(w)} x {_count(h)} pixels, an empty image"
    side = min(width, height)
    try:
        thin = _fits(planned_size(processor, side, side))  # a square picture would do: the shape is to blame
    except (ValueError, TypeError, ArithmeticError):
        thin = False
    fix = "crop it to a less elongated shape first" if thin else f"fix the size in {PROCESSOR_CONFIG}"
    raise UsageError(f"{where} is {width:,} x {height:,} pixels, and {name} would make it {made} ({how}); {fix}",
                     "image")


def _fits(planned: tuple[int, int, str] | None) -> bool:
    return planned is None or (min(planned[0], planned[1]) >= 1 and planned[0] * planned[1] <= MAX_RESIZED)


def _count(n: int) -> str:
    """`2,048,000,000`; a number too long to read, `about 10^300`."""
    return f"{n:,}" if abs(n) < 10**15 else f"about 10^{int(abs(n).bit_length() * 0.30103)}"


def pixel_values(folder: Path, image: Image.Image, path: str = "") -> Pixels:
    """`image` (image.read_image's: its own mode) as the folder's image processor makes it for the model: its
    size checked first (check_size), converted to RGB as the processor converts (as_processor_reads)."""
    processor = load_processor(folder)
    check_size(processor, image.width, image.height, path)
    try:
        made = processor(images=as_processor_reads(processor, image), return_tensors="pt")
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        raise UsageError(f"{{image}}: {type(processor).__name__} cannot process it ({_first_line(exc)})",
                         "image") from None
    values = made["pixel_values"].float()  # [1, n_channel, height, width]
    normalize = getattr(processor, "do_normalize", False)
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    rescale = getattr(processor, "rescale_factor", None) if getattr(processor, "do_rescale", False) else None
    return Pixels(values, type(processor).__name__, _floats(mean) if normalize else None,
                  _floats(std) if normalize else None, float(rescale) if rescale else None)


def as_processor_reads(processor: Any, image: Image.Image) -> Image.Image:
    """`image` as the processor is to be handed it: as it is where the processor converts to RGB itself
    (`do_convert_rgb`: CLIP's, SigLIP's, DINOv2's BitImageProcessor, the VLMs'; its own `convert_to_rgb`, which in
    transformers composites a transparent image on white), else RGB by transformers' `convert_to_rgb`, the same rule
    (ViT's and DeiT's processors convert nothing and read three channels only: an L, RGBA or CMYK picture made
    their normalize fail)."""
    return image if getattr(processor, "do_convert_rgb", False) else to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB by transformers' `convert_to_rgb` (image_transforms.py): a picture with transparency (an
    alpha band, a palette's or a grey's tRNS) composited on white, any other converted by Pillow."""
    if image.mode == "RGB":
        return image
    from PIL import Image as PILImage

    return PILImage.fromarray(rgb_array(image), "RGB")


def rgb_array(image: Image.Image) -> np.ndarray:
    """transformers' `convert_to_rgb(image)` as a `[height, width, 3]` uint8 array, in the installed transformers'
    own words: newer ones take `return_numpy=True` (a PIL result is deprecated there), older ones (5.17 and before)
    have no such argument and hand back a PIL image."""
    import inspect

    import numpy as np
    from transformers.image_transforms import convert_to_rgb

    if "return_numpy" in inspect.signature(convert_to_rgb).parameters:
        return np.asarray(convert_to_rgb(image, return_numpy=True))
    return np.array(convert_to_rgb(image))  # a copy: an array over a PIL image is read-only


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
