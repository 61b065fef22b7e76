"""What a run computes on: tensors from the user's files (or only their headers under --meta), a model's text
from --text-file, random inputs drawn from one seeded generator, and the mask made of the mask file and the
padding."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.spec import AttentionSpec


TEXT_FILE_BYTES = 8 * 2**20  # a text file larger than this is not a prompt (32k tokens are about 150 KB)


def read_text_file(path: str) -> str:
    """--text-file: the text of a UTF-8 file, refused in one line when it is missing, binary, huge or empty. A
    pipe or device (`/dev/stdin`) is read too, at most TEXT_FILE_BYTES of it, so `/dev/zero` ends."""
    file = Path(path).expanduser()
    if not file.exists():
        raise UsageError(f"--text-file {path}: no such file")
    if file.is_dir():
        raise UsageError(f"--text-file {path} is a folder; give a text file")
    size = file.stat().st_size
    if size > TEXT_FILE_BYTES:
        raise UsageError(_too_long(path, size))
    try:
        with file.open("rb") as stream:
            raw = stream.read(TEXT_FILE_BYTES + 1)  # a device (/dev/zero) reports size 0 and never ends
    except OSError as exc:
        raise UsageError(f"--text-file {path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > TEXT_FILE_BYTES:
        raise UsageError(_too_long(path, None))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--text-file {path} is not UTF-8 text (a stray byte at {exc.start}); give a text "
                         "file") from None
    if not text.strip():
        held = "is empty (0 bytes)" if not raw else f"holds only {len(raw):,} bytes of blank space"
        raise UsageError(f"--text-file {path} {held}; give a file with the text to run the model on")
    return text


def _too_long(path: str, size: int | None) -> str:
    held = f"is {size:,} bytes," if size is not None else "is not a regular file, and gives"
    return (f"--text-file {path} {held} more than the {TEXT_FILE_BYTES:,} bytes a text to run a model on needs; "
            "give a shorter file")


def load(spec: str | None, meta: bool = False) -> torch.Tensor | None:
    """A tensor from a file; with --meta only its shape and dtype, from the file's header (no data is read)."""
    from attnscope.tensors import load_tensor

    return load_tensor(spec, meta=meta) if spec else None


def bias_numel(spec: str | None) -> int:
    """The elements of a --position-bias file, from its header alone (0 without one): what the estimate counts."""
    if not spec:
        return 0
    import math

    bias = load(spec, meta=True)
    return math.prod(bias.shape) if bias is not None else 0


def random_inputs(shapes: Mapping[str, tuple[int, ...]], seed: int, device: str) -> dict[str, torch.Tensor]:
    """One generator for all, drawn in order, so a seed gives the same inputs every time."""
    import torch

    if device == "meta":
        return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def input_op(spec: str | None, random_op: str) -> str:
    return f"loaded from {spec}" if spec else random_op


def build_mask(spec: AttentionSpec, pad: int, user_mask: torch.Tensor | None, n_Q: int, n_K: int, device: Any,
               columns: bool = False, scores_shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """The mask file and padding, combined (both must allow a key); causal and window masks are sdpa's own
    (`spec`). The file's mask is checked against the scores' shape and put under the dtype rule first. In the
    column layout the scores are [n_K, n_Q]: padding is transposed, and causal is added here."""
    from attnscope import masks

    built = None
    if user_mask is not None:
        # Checked before it meets the padding mask, which would broadcast it first; without the scores' shape,
        # against its own batch dims and [n_Q, n_K].
        trailing = (n_K, n_Q) if columns else (n_Q, n_K)
        masks.check_broadcast(user_mask, scores_shape or (*user_mask.shape[:-2], *trailing))
        built = masks.normalize(user_mask.to(device))
    if pad:
        padding = masks.key_padding_mask(n_K, pad, device)  # [n_K]
        built = masks.combine(built, padding.unsqueeze(-1) if columns else padding)
    if columns and spec.align:
        # [n_Q, n_K] -> [n_K, n_Q]: the column layout
        built = masks.combine(built, masks.causal_mask(n_Q, n_K, spec.align, device).transpose(0, 1))
    # [n_K] (key padding, or a 1-D mask; [n_Q] in the column layout) as [1, n_K]: the same for every query,
    # in the [.., n_Q, n_K] form every consumer takes (PyTorch's CPU attention refuses a 1-D attn_mask).
    return built.reshape(1, -1) if built is not None and built.dim() < 2 else built


def sink_values(text: str | None, n_head: int, seed: int, device: str) -> torch.Tensor | None:
    """--sinks: `random` draws one logit per head N(0, 1) from its own generator (seeded seed + 1, so the inputs
    drawn from the seed stay the same), or the numbers given (one for every head, or one per head)."""
    if text is None:
        return None
    import torch

    from attnscope.runs.options import parse_sinks

    given = parse_sinks(text)
    if given is not None:
        return torch.tensor(given, dtype=torch.float32, device=device)
    if device == "meta":
        return torch.empty(n_head, device="meta")
    return torch.randn(n_head, generator=torch.Generator().manual_seed(seed + 1))


def sink_op(text: str | None) -> str:
    """How the sinks were made, for their step's op."""
    if text is not None and text.strip().lower() != "random":
        return f"input: --sinks {text}, one logit per head"
    return "input: torch.randn(n_head) from --seed + 1, one logit per head"
