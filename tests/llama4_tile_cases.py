"""The pictures and settings Llama 4's image processor is held to (tests/test_llama4_tiles.py), shared with
scripts/llama4_tiles_reference.py, which records transformers' `Llama4ImageProcessor` (torchvision) on them into
tests/references/llama4_tiles.safetensors on a machine that has torchvision.

Each picture is drawn from arithmetic alone (no random numbers), so both sides make the same pixels; their sizes
reach every branch of the canvas choice: one tile, wide and tall tilings, upscaling a small picture, downscaling a
large one, a side left over after the aspect-preserving resize (padding), and RGBA and grayscale inputs.
"""

from __future__ import annotations

from typing import Any

SETTINGS: dict[str, dict[str, Any]] = {
    "bilinear_28x4": {"size": {"height": 28, "width": 28}, "max_patches": 4},
    "bilinear_32x6_max_canvas": {"size": {"height": 32, "width": 32}, "max_patches": 6, "resize_to_max_canvas": True},
    "bicubic_28x5": {"size": {"height": 28, "width": 28}, "max_patches": 5, "resample": 3},
    "nearest_32x3": {"size": {"height": 32, "width": 32}, "max_patches": 3, "resample": 0},
    "one_tile_28": {"size": {"height": 28, "width": 28}, "max_patches": 1, "image_mean": [0.48, 0.46, 0.41],
                    "image_std": [0.27, 0.26, 0.28]},
}
SIZES = {"square": (40, 40), "wide": (130, 50), "tall": (45, 120), "small": (10, 7), "large": (300, 200),
         "primes": (97, 61)}


def picture(name: str) -> Any:
    """The test picture `name`: a gradient with a disc (RGB), or the RGBA and grayscale variants."""
    from PIL import Image, ImageDraw

    if name in ("rgba", "gray"):
        base = picture("primes")
        if name == "gray":
            return base.convert("L")
        rgba = base.convert("RGBA")
        rgba.putalpha(Image.new("L", base.size, 0).point(lambda _: 0))
        ImageDraw.Draw(rgba).rectangle((5, 5, 60, 40), fill=(30, 200, 90, 160))
        return rgba
    width, height = SIZES[name]
    image = Image.new("RGB", (width, height))
    image.putdata([((7 * x + 3 * y) % 256, (5 * y + 40) % 256, (x * y) % 256) for y in range(height)
                   for x in range(width)])
    ImageDraw.Draw(image).ellipse((width // 4, height // 5, 3 * width // 4, 3 * height // 4), fill=(220, 30, 30))
    return image


def cases() -> list[tuple[str, str, str]]:
    """(key, picture, settings) for every picture under every setting."""
    names = [*SIZES, "rgba", "gray"]
    return [(f"{image}/{setting}", image, setting) for setting in SETTINGS for image in names]


# through torchvision's float32 resize (a CPU without AVX2): the bilinear setting on every picture
FLOAT_PATH = [(f"float32_path/{image}/bilinear_28x4", image, "bilinear_28x4") for image in [*SIZES, "rgba", "gray"]]
