"""Llama 4's image processor without torchvision. transformers' `Llama4ImageProcessor`
(models/llama4/image_processing_llama4.py) exists only with the torchvision backend, so on a machine without
torchvision (a CPU-only PyTorch beside which PyPI's torchvision does not import) `AutoProcessor` cannot build
Llama 4's processor. `Llama4Tiles` makes the same `pixel_values` and `aspect_ratios` step for step in plain torch,
and `Llama4Processor` itself (its tokenizer, chat template and image-token placement) runs with it:

1. the PIL image to RGB (`image_transforms.convert_to_rgb`, as `TorchvisionBackend.process_image`), `uint8`
   `[n_channel, height, width]`;
2. the canvas: `find_supported_resolutions(max_patches, size)` and `get_best_fit` pick `(rows, cols)` tiles of
   `size`; the image is resized to fit it without distortion, upscaled no further than one tile's side
   (`resize_to_max_canvas` off), as `Llama4ImageProcessor._preprocess` does;
3. the resize is torchvision's `resize_image` on a tensor: `torch.nn.functional.interpolate` with
   `antialias=True`, on the `uint8` image itself where torchvision does so on a CPU (bilinear on AVX2/AVX512 or
   ARM, bicubic always), else in float32 and rounded back;
4. zero padding right and bottom to the canvas (`pad_to_best_fit`), then rescale and normalize in bfloat16
   (`Llama4ImageProcessor.rescale_and_normalize`, then torchvision's `normalize_image`: `(x - mean) / std`);
5. `image_transforms.split_to_tiles` into `rows * cols` tiles, and where there is more than one, the whole image
   resized to one tile (the global view) after them.

The outputs are held equal to `Llama4ImageProcessor`'s, bit for bit, in tests/test_llama4_tiles.py (its
reference recorded by scripts/llama4_tiles_reference.py on a machine with torchvision).
"""

from __future__ import annotations

import math
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Llama4Tiles' base, a written class's: this module is imported only inside vision/vlm.py's processor, which runs
# transformers' Llama4Processor
from transformers.image_processing_utils import ImageProcessingMixin

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch
    from PIL import Image

# Llama4ImageProcessor's class defaults
DEFAULTS: dict[str, Any] = {"size": {"height": 336, "width": 336}, "max_patches": 16, "resize_to_max_canvas": False,
                            "resample": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                            "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                            "do_convert_rgb": True}
# PILImageResampling -> torchvision's InterpolationMode (image_utils.pil_torch_interpolation_mapping) as
# interpolate's mode: NEAREST -> NEAREST_EXACT, BILINEAR, BICUBIC
MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}
RESAVE = "save the processor beside the weights again with AutoProcessor.save_pretrained(folder)"
MAX_TILES = 256  # 16 times what Llama 4 cuts: find_supported_resolutions factors every count up to it, and each
# tile of 336 px is 677 KiB of bfloat16 before the text model reads its 144 tokens


def make(settings: dict[str, Any]) -> Any:
    """A `Llama4Tiles` with the folder's image processor settings (`processor_config.json`'s `image_processor`,
    or `preprocessor_config.json`), checked: one line for a setting it cannot follow."""
    values = {**DEFAULTS, **{k: v for k, v in settings.items() if k in DEFAULTS}}
    size = values["size"]
    if not (isinstance(size, dict) and isinstance(size.get("height"), int) and size.get("height") == size.get("width")
            and size["height"] > 0):
        raise UsageError(f"Llama 4's image processor settings: size {size!r} is not a square "
                         "{'height': N, 'width': N} (find_supported_resolutions needs one)")
    if values["resample"] not in MODES:
        raise UsageError(f"Llama 4's image processor settings: resample {values['resample']!r} is not one attnscope "
                         "follows without torchvision (0 nearest, 2 bilinear, 3 bicubic); install torchvision")
    if not values["do_resize"]:
        raise UsageError("Llama 4's image processor settings: do_resize is false, which Llama4ImageProcessor refuses "
                         "(its tiles must have one size)")
    if not (isinstance(values["max_patches"], int) and 1 <= values["max_patches"] <= MAX_TILES):
        raise UsageError(f"Llama 4's image processor settings: max_patches {values['max_patches']!r} is not a "
                         f"whole number of tiles from 1 to {MAX_TILES:,} (Llama 4's checkpoints cut at most 16)")
    _check_numbers(values)
    return Llama4Tiles(values)


def _check_numbers(values: dict[str, Any]) -> None:
    """rescale_factor a number; image_mean and image_std a number or one per channel (torchvision's
    normalize_image), the std never 0 (it refuses: "std evaluated to zero")."""
    def numbers(value: Any) -> list[Any]:
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def real(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not real(values["rescale_factor"]):
        raise UsageError(f"Llama 4's image processor settings: rescale_factor {values['rescale_factor']!r} is not a "
                         "number (1/255 rescales 8-bit pixels to [0, 1])")
    for key in ("image_mean", "image_std"):
        given = numbers(values[key])
        if len(given) not in (1, 3) or not all(real(v) for v in given):
            raise UsageError(f"Llama 4's image processor settings: {key} {values[key]!r} is not a number or one "
                             "number per channel (3)")
    if any(v == 0 for v in numbers(values["image_std"])):
        raise UsageError(f"Llama 4's image processor settings: image_std {values['image_std']!r} holds a 0, which "
                         "would divide the pixels by zero (torchvision's normalize refuses it too)")


class Llama4Tiles(ImageProcessingMixin):
    """An image processor as Llama4Processor checks for (an ImageProcessingMixin), with the folder's settings
    (`make` checks them): its call is `Llama4ImageProcessor.__call__`."""

    model_input_names = ["pixel_values"]

    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__()
        self.settings = settings

    def __call__(self, images: Any = None, return_tensors: Any = None, **_ignored: Any) -> Any:
        """Every image's tiles, `pixel_values [n_tiles, 3, side, side]` for all the images together, and each
        image's `aspect_ratios (rows, cols)`."""
        import torch
        from transformers.feature_extraction_utils import BatchFeature

        listed = images if isinstance(images, (list, tuple)) else [images]
        made = [tiles(picture, self.settings) for picture in listed]
        values = torch.cat([pixels for pixels, _ in made], dim=0)  # [n_tiles, n_channel, side, side]
        ratios = torch.tensor([ratio for _, ratio in made])  # [n_images, 2]
        return BatchFeature(data={"pixel_values": values, "aspect_ratios": ratios}, tensor_type=return_tensors)


def tiles(picture: Image.Image, settings: dict[str, Any]) -> tuple[torch.Tensor, tuple[int, int]]:
    """One image's tiles `[n_tiles, n_channel, side, side]` (bfloat16 where it is rescaled and normalized) and its
    (rows, cols): `Llama4ImageProcessor._preprocess` for one image."""
    import torch
    from transformers.image_transforms import split_to_tiles

    image = _as_tensor(picture, bool(settings["do_convert_rgb"]))[None]  # [1, n_channel, height, width]
    side = int(settings["size"]["height"])
    height, width = int(image.shape[-2]), int(image.shape[-1])
    # the canvas stays a tensor as in transformers, and so does every side taken from it: its divisions below are
    # then float32's (a 120 x 45 image on a 168 x 112 canvas is resized to 168 x 63 there, 62 in float64)
    canvas = best_fit((height, width), supported_resolutions(int(settings["max_patches"]), side),
                      bool(settings["resize_to_max_canvas"]))
    bound: tuple[Any, Any] = (canvas[0], canvas[1])
    if not settings["resize_to_max_canvas"]:  # upscaling limited to one tile's side
        bound = (min(max(height, side), canvas[0]), min(max(width, side), canvas[1]))
    fitted = max_res_without_distortion((height, width), bound)
    canvas_h, canvas_w = int(canvas[0]), int(canvas[1])
    mode = MODES[int(settings["resample"])]
    resized = resize(image, (max(int(fitted[0]), 1), max(int(fitted[1]), 1)), mode)
    # [1, n_channel, h, w] -> [1, n_channel, canvas_h, canvas_w]
    padded = torch.nn.functional.pad(resized, [0, canvas_w - resized.shape[-1], 0, canvas_h - resized.shape[-2]])
    rows, cols = canvas_h // side, canvas_w // side
    cut = split_to_tiles(_rescale_and_normalize(padded, settings), rows, cols)  # [1, rows * cols, n_channel, s, s]
    if rows * cols > 1:
        whole = _rescale_and_normalize(resize(image, (side, side), mode), settings)  # [1, n_channel, side, side]
        cut = torch.cat([cut, whole[:, None]], dim=1)  # the global view after the tiles
    return cut[0], (rows, cols)


# --- the canvas: image_processing_llama4's functions -------------------------------------------------------------


def supported_resolutions(max_chunks: int, side: int) -> list[tuple[int, int]]:
    """`find_supported_resolutions`: every (rows * side, cols * side) with rows * cols <= max_chunks, grouped by
    aspect ratio in the order the function builds its dict."""
    ratios: dict[float, list[tuple[int, int]]] = {}
    for chunks in range(max_chunks, 0, -1):
        factors = sorted({f for i in range(1, math.isqrt(chunks) + 1) if chunks % i == 0 for f in (i, chunks // i)})
        for rows in factors:
            ratios.setdefault(rows / (chunks // rows), []).append((rows, chunks // rows))
    return [(rows * side, cols * side) for pairs in ratios.values() for rows, cols in pairs]


def best_fit(size: tuple[int, int], resolutions: list[tuple[int, int]], to_max: bool) -> torch.Tensor:
    """`get_best_fit`: the canvas `[height, width]` (an int64 tensor, as transformers returns it) with the
    smallest upscale >= 1 (the largest with `to_max`), else the least downscale; of equal scales the smallest
    area. In float32 on torch tensors as transformers computes it, so that ties break the same way."""
    import torch

    possible = torch.tensor(resolutions)  # [n_resolutions, 2] int64
    scale_w = possible[:, 1] / size[1]
    scale_h = possible[:, 0] / size[0]
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    chosen = (torch.max(up) if to_max else torch.min(up)) if len(up) else torch.max(scales[scales < 1])
    canvas = possible[scales == chosen]
    if len(canvas) > 1:
        return canvas[torch.argmin(canvas[:, 0] * canvas[:, 1])]
    return canvas[0]


def max_res_without_distortion(size: tuple[int, int], target: tuple[Any, Any]) -> tuple[Any, Any]:
    """`get_max_res_without_distortion`: the largest (height, width) inside `target` with the image's aspect; a
    side of `target` that is a 0-d tensor makes its scale float32, as in transformers."""
    height, width = size
    scale_w, scale_h = target[1] / width, target[0] / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target[0]), target[1]
    return target[0], min(math.floor(width * scale_h), target[1])


# --- the pixels -------------------------------------------------------------------------------------------------


def _as_tensor(picture: Image.Image, to_rgb: bool) -> torch.Tensor:
    """`TorchvisionBackend.process_image` for a PIL image: RGB by transformers' `convert_to_rgb` (a transparent
    image over white), `[n_channel, height, width]` uint8."""
    import numpy as np
    import torch

    from attnscope.models.vision.processor import rgb_array

    array = rgb_array(picture) if to_rgb else np.array(picture)
    image = torch.from_numpy(np.asarray(array))  # [height, width, n_channel] or [height, width]
    image = image[None] if image.ndim == 2 else image.permute(2, 0, 1)  # [n_channel, height, width]
    return image.contiguous()


def resize(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """torchvision's `resize_image` on a tensor (transforms/v2/functional/_geometry.py): `interpolate` with
    antialias for bilinear and bicubic, on uint8 itself where torchvision uses the native CPU kernel, else in
    float32, clamped (bicubic) and rounded back to uint8. `image [n, n_channel, h, w]` -> `[n, n_channel, *size]`."""
    import torch

    if tuple(image.shape[-2:]) == size:
        return image
    native = mode == "nearest-exact" or mode == "bicubic" or (
        mode == "bilinear" and (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                                or platform.machine() in ("aarch64", "arm64")))
    cast = image.dtype == torch.uint8 and not native
    values = image.to(torch.float32) if cast else image
    smooth = mode != "nearest-exact"
    values = torch.nn.functional.interpolate(values, size=list(size), mode=mode,
                                             align_corners=False if smooth else None, antialias=smooth)
    if cast:
        values = (values.clamp_(0, 255) if mode == "bicubic" else values).round_().to(torch.uint8)
    return values


def _rescale_and_normalize(image: torch.Tensor, settings: dict[str, Any]) -> torch.Tensor:
    """`Llama4ImageProcessor.rescale_and_normalize`: rescaled in bfloat16 when it also normalizes, then
    torchvision's `normalize_image`, `(x - mean) / std` in the image's dtype."""
    import torch

    rescale, normalize = bool(settings["do_rescale"]), bool(settings["do_normalize"])
    if rescale and normalize:
        image = image.to(dtype=torch.bfloat16) * float(settings["rescale_factor"])
    elif rescale:
        image = image * float(settings["rescale_factor"])
    if normalize:
        if not image.is_floating_point():
            raise UsageError("Llama 4's image processor settings: do_normalize without do_rescale on 8-bit pixels, "
                             "which torchvision's normalize refuses")
        mean = torch.as_tensor(settings["image_mean"], dtype=image.dtype).view(-1, 1, 1)  # [n_channel, 1, 1]
        std = torch.as_tensor(settings["image_std"], dtype=image.dtype).view(-1, 1, 1)
        image = image.sub(mean).div_(std)
    return image


# --- the processor ----------------------------------------------------------------------------------------------


def processor(folder: Path) -> Any:
    """`Llama4Processor` as `AutoProcessor.from_pretrained(folder)` builds it, with `Llama4Tiles` for its image
    processor: the folder's tokenizer, its chat template (chat_template.jinja or chat_template.json, else the
    processor's own), processor_config.json's arguments, and the image processor's settings from its
    `image_processor` entry (transformers 5 saves them there) or from preprocessor_config.json."""
    import inspect

    from transformers import AutoTokenizer, Llama4Processor

    from attnscope.models.jsonfile import settings_file

    arguments = settings_file(folder / "processor_config.json", RESAVE)
    images = arguments.pop("image_processor", None)
    if not isinstance(images, dict):
        images = settings_file(folder / "preprocessor_config.json", RESAVE)
    if not images:
        raise UsageError(f"{{model}} {folder} has no image processor settings (processor_config.json's "
                         "image_processor or preprocessor_config.json): how Llama 4 cuts this model's tiles is "
                         "unknown; save its processor beside the weights with AutoProcessor.save_pretrained(folder)",
                         "model")
    accepted = set(inspect.signature(Llama4Processor.__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                             "chat_template", "kwargs"}
    kwargs = {k: v for k, v in arguments.items() if k in accepted}
    if (folder / "chat_template.jinja").is_file():
        kwargs["chat_template"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(template := settings_file(folder / "chat_template.json", RESAVE).get("chat_template"), str):
        kwargs["chat_template"] = template
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    return Llama4Processor(image_processor=make(images), tokenizer=tokenizer, **kwargs)
