"""`--image FILE`: an image read with Pillow, checked before it is decoded.

`read_image(path)` opens the file lazily (`Image.open` reads the header only), checks what the header says
(a format attnscope reads, dimensions that are not zero and within Pillow's decompression-bomb limit,
`Image.MAX_IMAGE_PIXELS`, kept on), then decodes it (`Image.load`, with truncated files refused:
`ImageFile.LOAD_TRUNCATED_IMAGES` stays off) and hands back the picture in its own mode, transparency kept: the
conversion to RGB is the processor's own (processor.py's `as_processor_reads`; transformers' `convert_to_rgb`
composites a transparent image on white, where dropping the alpha channel would show what lies under it).

Samples of 16 bits (a 16-bit grayscale PNG or TIFF: Pillow's modes I;16, I;16B, ...) become 8 bits by their high
byte, `v >> 8`, as Pillow itself reads a 16-bit colour PNG (its `RGB;16B` unpacker): the picture a viewer shows.
Pillow's own `convert` would clip every value over 255 to white. A tRNS transparent grey stays transparent.
Samples of 32 bits (Pillow's I and F, a TIFF's integer or float samples) hold no one scale to read them by and are
refused, as are modes that cannot become RGB. Each failure is one `UsageError` naming `{image}`: no such file,
not an image, a format attnscope does not read, too many pixels, truncated or corrupt, a mode it cannot read.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from PIL import Image

# Pillow's names for the formats read: PNG and JPEG, and the other still-image formats a photo arrives in.
FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")
PILLOW_LIMIT = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS (1024 * 1024 * 1024 // 4 // 3)


@dataclass(frozen=True)
class Header:
    """What an image's header says, before any pixel is decoded."""

    format: str  # Pillow's name: PNG, JPEG, ...
    width: int
    height: int
    mode: str  # Pillow's mode: RGB, RGBA, L, P, CMYK, ...

    def describe(self) -> str:
        return f"a {self.width} x {self.height} {self.format} ({self.mode})"


def pixel_limit() -> int:
    """Pillow's decompression-bomb limit, or its default where a caller has switched it off (None)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    return int(limit) if limit else PILLOW_LIMIT


def read_header(path: str | Path, param: str = "image") -> Header:
    """The header of the image at `path`, read without decoding its pixels, and checked: a file, an image, a
    format in FORMATS, dimensions above zero and at most `pixel_limit()` pixels."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        where = "a folder, not an image file" if path.is_dir() else "no such file"
        raise UsageError(f"{{{param}}} {path}: {where}; give a PNG or JPEG file", param)
    fix = "give a PNG or JPEG file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:  # the header only: nothing decoded yet
                header = Header(str(image.format), int(image.width), int(image.height), str(image.mode))
    except UnidentifiedImageError:
        looks = _looks_like(path)
        if looks:
            raise UsageError(f"{{{param}}} {path} starts as a {looks} but Pillow cannot read its header: the file is "
                             "truncated or damaged; give the whole file", param) from None
        raise UsageError(f"{{{param}}} {path} is not an image Pillow can read (its first bytes are "
                         f"{_first_bytes(path)}); {fix}", param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UsageError(f"{{{param}}} {path} declares more than {pixel_limit():,} pixels (Pillow's decompression-"
                         f"bomb limit); shrink it first, e.g. to 1024 px on its longer side", param) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        if "truncat" in str(exc).lower() or isinstance(exc, EOFError):
            raise UsageError(f"{{{param}}} {path} is truncated: the file ends inside its header ({_why(exc)}); give "
                             "the whole file", param) from None
        raise UsageError(f"{{{param}}} {path}: its header cannot be read ({_why(exc)}); {fix}", param) from None
    if header.format not in FORMATS:
        raise UsageError(f"{{{param}}} {path} is an image in {header.format} format; attnscope reads "
                         f"{', '.join(FORMATS)}: convert it to PNG first", param)
    if header.width < 1 or header.height < 1:
        raise UsageError(f"{{{param}}} {path} is {header.width} x {header.height} pixels: it holds no pixels; "
                         f"{fix}", param)
    if header.width * header.height > pixel_limit():
        raise UsageError(f"{{{param}}} {path} is {header.width:,} x {header.height:,} = "
                         f"{header.width * header.height:,} pixels, over Pillow's decompression-bomb limit of "
                         f"{pixel_limit():,}; shrink it first, e.g. to 1024 px on its longer side", param)
    return header


def read_image(path: str | Path, param: str = "image") -> Image.Image:
    """The image at `path`, decoded, in 8-bit samples and its own mode (RGB, RGBA, L, LA, P, CMYK, ...: the
    processor converts it, processor.as_processor_reads), after `read_header`'s checks; a truncated or corrupt
    file, or samples of 32 bits, refused in one message."""
    from PIL import Image

    header = read_header(path, param)
    if header.mode in WIDE_MODES or header.mode.startswith("I;16S"):  # before decoding: no scale to read them by
        raise _wide(path, header.mode, param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()  # decodes; a truncated file raises (LOAD_TRUNCATED_IMAGES stays off)
                picture = eight_bits(image) if image.mode.startswith("I;16") else image.copy()  # info kept
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombWarning) as exc:
        what = "is truncated" if "truncated" in str(exc) or isinstance(exc, EOFError) else "is corrupt"
        raise UsageError(f"{{{param}}} {path} {what}: Pillow cannot decode its pixels ({_why(exc)}); give the "
                         f"whole file, or re-save it as PNG", param) from None
    if picture.mode in WIDE_MODES:  # a decoder that widened while decoding
        raise _wide(path, picture.mode, param)
    if picture.mode not in MODES:
        raise UsageError(f"{{{param}}} {path} is a picture in Pillow's mode {picture.mode}, which does not convert "
                         "to RGB; re-save it as an RGB or RGBA PNG", param)
    return picture


# Pillow's modes of 8-bit samples that transformers' convert_to_rgb (and Pillow's convert) turn into RGB
MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
WIDE_MODES = ("I", "F")  # 32-bit integer and float samples


def eight_bits(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale picture (`I;16`, `I;16B`, ...) in 8 bits, `v >> 8` (the high byte, as Pillow reads a
    16-bit colour PNG); a tRNS transparent grey (PNG `info["transparency"]`, a 16-bit value) becomes an alpha
    channel, so the processor's conversion composites it as it would the 8-bit picture's."""
    import numpy as np
    from PIL import Image

    values = np.asarray(image).astype(np.uint16)  # [height, width], the file's byte order undone
    grey = Image.fromarray((values >> 8).astype(np.uint8), "L")
    key = image.info.get("transparency")
    if isinstance(key, int) and not isinstance(key, bool):
        alpha = Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8), "L")
        return Image.merge("LA", (grey, alpha))
    return grey


def _wide(path: str | Path, mode: str, param: str) -> UsageError:
    kind = "32-bit floating-point" if mode == "F" else "signed 16-bit" if mode.startswith("I;16S") else "32-bit integer"
    return UsageError(f"{{{param}}} {path} holds {kind} samples (Pillow's mode {mode}), which have no one "
                      "scale to show them by; attnscope reads 8- and 16-bit images: save it as an 8- or 16-bit PNG "
                      "with the range you want shown", param)


# the first bytes of each format read (its signature) -> its name
SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
              (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def _looks_like(path: Path) -> str | None:
    """The format whose signature the file starts with (WebP: RIFF....WEBP), else None."""
    with open(path, "rb") as f:
        head = f.read(12)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return next((name for signature, name in SIGNATURES if head.startswith(signature)), None)


def _first_bytes(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(8)
    return repr(head) if head else "none: the file is empty"


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:100] if text else type(exc).__name__
