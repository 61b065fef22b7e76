"""A vision tower's tokens over the image: the tokens before the patches (`[CLS]`, DeiT's `[DIST]`, DINOv2's
registers `reg0`, `reg1`, ...), then the patches row by row, each named by its row and column, `p(3,7)`.

ViT, DeiT, DINOv2, CLIP's and SigLIP's vision towers all cut the image the same way: a Conv2d with
kernel = stride = patch size (`ViTPatchEmbeddings`, `CLIPVisionEmbeddings`), flattened row-major
(`.flatten(2).transpose(1, 2)`), so token `n_prefix + r * cols + c` is the patch at row r, column c, and
`n_patches = (H / patch) * (W / patch)`. A VLM places its image tokens by the same geometry (`img(r,c)`,
`patch_labels(..., name="img")`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLS = "[CLS]"
DIST = "[DIST]"


def prefix_names(n_cls: int = 1, n_register: int = 0, distillation: bool = False) -> list[str]:
    """The tokens before the patches, in the order the embeddings concatenate them: `[CLS]`, DeiT's `[DIST]`,
    then the registers `reg0..` (Dinov2WithRegistersEmbeddings: cls, registers, patches)."""
    return [CLS] * n_cls + ([DIST] if distillation else []) + [f"reg{i}" for i in range(n_register)]


def patch_labels(rows: int, cols: int, n_prefix: int = 0, prefix_names: list[str] | None = None,
                 name: str = "p") -> list[str]:
    """Every token's label: the `n_prefix` tokens before the patches (`prefix_names`, else `t0`, `t1`, ...),
    then `p(r,c)` for each patch, row by row."""
    names = list(prefix_names) if prefix_names is not None else [f"t{i}" for i in range(n_prefix)]
    if len(names) != n_prefix:
        raise ValueError(f"{len(names)} prefix names for {n_prefix} tokens before the patches")
    return names + [f"{name}({r},{c})" for r in range(rows) for c in range(cols)]


@dataclass(frozen=True)
class Grid:
    """Where the patches sit: `rows` x `cols` patches of `patch` pixels over the `height` x `width` image the
    model read, after the `prefix` tokens."""

    rows: int
    cols: int
    patch: int
    prefix: tuple[str, ...] = ()

    @classmethod
    def of(cls, height: int, width: int, patch: int, prefix: list[str] | tuple[str, ...] = ()) -> Grid:
        """The grid a Conv2d of kernel = stride = `patch` makes of a `height` x `width` image (the floor, as
        the convolution drops a partial patch at the edge)."""
        if patch < 1:
            raise ValueError(f"patch size {patch}: must be at least 1")
        return cls(height // patch, width // patch, patch, tuple(prefix))

    @property
    def n_patches(self) -> int:
        return self.rows * self.cols

    @property
    def n_prefix(self) -> int:
        return len(self.prefix)

    @property
    def n_tokens(self) -> int:
        return self.n_prefix + self.n_patches

    @property
    def height(self) -> int:
        """The pixels the patches cover (the image the model read, less a partial patch at the edge)."""
        return self.rows * self.patch

    @property
    def width(self) -> int:
        return self.cols * self.patch

    def labels(self, name: str = "p") -> list[str]:
        return patch_labels(self.rows, self.cols, self.n_prefix, list(self.prefix), name)

    def cell(self, token: int) -> tuple[int, int] | None:
        """Token `token`'s (row, column), or None for a token before the patches."""
        if not 0 <= token < self.n_tokens:
            raise IndexError(f"token {token} of {self.n_tokens}")
        index = token - self.n_prefix
        return None if index < 0 else divmod(index, self.cols)

    def token(self, row: int, col: int) -> int:
        """The token of the patch at (`row`, `col`)."""
        if not (0 <= row < self.rows and 0 <= col < self.cols):
            raise IndexError(f"patch ({row},{col}) of a {self.rows} x {self.cols} grid")
        return self.n_prefix + row * self.cols + col

    def patches_formula(self, height: int, width: int) -> str:
        """`(224/16) * (224/16)`, or `floor(36/8) * floor(54/8)` where a partial patch is dropped at the edge."""
        def side(n: int) -> str:
            return f"({n}/{self.patch})" if n % self.patch == 0 else f"floor({n}/{self.patch})"

        return f"{side(height)} * {side(width)}"

    def dims_note(self, height: int, width: int) -> str:
        """`n_tokens = 1 + n_patches, n_patches = (224/16) * (224/16) = 14 * 14 = 196`, as the notes say it."""
        before = f"{self.n_prefix} + " if self.n_prefix else ""
        return (f"n_tokens = {before}n_patches, n_patches = {self.patches_formula(height, width)} = "
                f"{self.rows} * {self.cols} = {self.n_patches}")


@dataclass
class Picture:
    """An image as the model read it, for drawing weights over it: `image` (a PIL image of the processor's
    output, `grid.height` x `grid.width` pixels or more), the patch grid, and the token where the patches start
    in the sequence (`start`: after the `[CLS]` and registers of a vision tower; a VLM's first image token)."""

    image: Any  # PIL.Image.Image
    grid: Grid
    path: str
    processor: str
    start: int | None = None
    query: int | None = None  # the token whose row is drawn (--query); None: [CLS]'s, else the mean

    @property
    def first(self) -> int:
        return self.grid.n_prefix if self.start is None else self.start

    def patch_of(self, token: int) -> tuple[int, int] | None:
        """Token `token`'s (row, column) in the grid, or None where it is no patch."""
        index = token - self.first
        return divmod(index, self.grid.cols) if 0 <= index < self.grid.n_patches else None

    def png(self) -> bytes:
        """The image as PNG bytes (what --svg and the page embed as a data: URI)."""
        import io

        buffer = io.BytesIO()
        self.image.save(buffer, format="PNG", optimize=True)
        return buffer.getvalue()

    def data_uri(self) -> str:
        import base64

        return "data:image/png;base64," + base64.b64encode(self.png()).decode("ascii")


def token_index(query: str, labels: list[str]) -> int:
    """The token `query` names: its label (`p(3,7)`, `[CLS]`, `reg0`; spaces ignored) or its index."""
    wanted = query.replace(" ", "")
    if wanted in labels:
        return labels.index(wanted)
    if wanted.isdigit() and int(wanted) < len(labels):
        return int(wanted)
    from attnscope.errors import UsageError

    last = labels[-1] if labels else "none"
    raise UsageError(f"{{query}} {query!r} names no token of this image: give a label ({', '.join(labels[:3])}, ..., "
                     f"{last}) or an index from 0 to {len(labels) - 1}", "query")
