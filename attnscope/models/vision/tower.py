"""A vision tower (ViT, DeiT, DINOv2 with or without registers, CLIP's and SigLIP's image towers) on an image,
through transformers with attnscope's attention function (models/nopage/interface.py): the family's own embeddings and
layers run, and layer L's attention is recorded step by step from what transformers hands the attention
function (Q, K, V, no mask: every token sees every token), held against the family's own eager attention.

The tower is built from the folder's config (`AutoConfig`, no code from the folder; a whole CLIP or SigLIP's
`vision_config`), cut to layers 0..L for one layer (truncated.cut), whole for every layer. Its input is the
processor's `pixel_values`; the patch embedding (a Conv2d of kernel = stride = patch) is recorded too, so the
steps say where `n_patches` comes from: `pixel_values` `[n_batch, n_channel, height, width]` -> `patches`
`[n_batch, n_patches, d_model]`; the tokens are the `[CLS]` (and DeiT's `[DIST]`, DINOv2's registers) then the
patches row by row (patches.py).

The tower's attention modules have no `layer_idx`; the self-check (nopage/interface_check.py) knows each by its call's
order in the forward and runs the traced layer's module (every layer's, for every layer) again with eager
attention on the same inputs. A module that does more than its attention function is handed fails it, and the
tower runs again with transformers' eager attention and `output_attentions`: the pattern only, untraced, the
self-check's note saying which layer and step (`_eager`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError, UsageError
from attnscope.models.vision.patches import Grid, prefix_names
from attnscope.words import counted

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.nopage.truncated import TransformersRun
    from attnscope.models.vision.processor import Pixels
    from attnscope.trace import Trace


@dataclass(frozen=True)
class Tower:
    """How transformers builds one family's tower: its class, whether the folder's config holds it as
    `vision_config` (a whole CLIP or SigLIP), whether it reads any image size (DINOv2 interpolates its
    position embeddings), and its tokens before the patches."""

    model_class: str
    part: bool = False
    any_size: bool = False
    cls: int = 1
    distillation: bool = False
    registers: bool = False


TOWERS = {
    "vit": Tower("ViTModel"), "deit": Tower("DeiTModel", distillation=True),
    "dinov2": Tower("Dinov2Model", any_size=True),
    "dinov2_with_registers": Tower("Dinov2WithRegistersModel", any_size=True, registers=True),
    "clip_vision_model": Tower("CLIPVisionModel"), "clip": Tower("CLIPVisionModel", part=True),
    "siglip_vision_model": Tower("SiglipVisionModel", cls=0), "siglip": Tower("SiglipVisionModel", part=True, cls=0),
}
VISION_TYPES = ", ".join(TOWERS)


@dataclass
class VisionRun:
    """Layer L on the image (`run`: its recorded steps, the pixel and patch steps first; none, and its
    `fallback` note, where the self-check failed), the patch grid, and with every layer each layer's pattern
    `[n_head, n_tokens, n_tokens]`."""

    run: TransformersRun
    grid: Grid
    patterns: list[torch.Tensor] | None = None
    notes: list[str] | None = None
    W_O: torch.Tensor | None = None  # layer L's output projection's weight [d_model, n_head·d_head] (moved.py)
    layer_norms: list[torch.Tensor | None] | None = None  # with every layer, each one's value_norms [n_head, n]


def is_vision(model_type: str) -> bool:
    return model_type in TOWERS


def tower_config(folder: Path, model_type: str, layer: int) -> tuple[Any, int]:
    """The tower's config (`AutoConfig`, no code from the folder; a whole CLIP's or SigLIP's `vision_config`)
    and its number of layers, `layer` checked."""
    from transformers import AutoConfig

    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    try:
        full = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except truncated.config_errors() as exc:
        raise truncated.refused(folder, model_type, exc) from None
    config = full.vision_config if TOWERS[model_type].part else full
    n_layer = int(config.num_hidden_layers)
    if not 0 <= layer < n_layer:
        raise UsageError(f"{{layer}} {layer} is out of range: this vision tower has {counted(n_layer, 'layer')}, "
                         f"0 to {n_layer - 1}", "layer")
    return config, n_layer


def grid_of(config: Any, model_type: str, pixels: Pixels, image: str) -> Grid:
    """The patch grid over the processor's output, checked against the size the tower was made for."""
    tower = TOWERS[model_type]
    patch = int(config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0])
    size = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
    if not tower.any_size and (pixels.height, pixels.width) != tuple(size):
        raise UsageError(f"{{image}} {image}: the folder's {pixels.processor} makes {pixels.height} x {pixels.width} "
                         f"pixels but config.json's tower reads {size[0]} x {size[1]}; preprocessor_config.json "
                         "and config.json are of different models", "image")
    if pixels.height < patch or pixels.width < patch:
        raise UsageError(f"{{image}} {image}: the processor makes {pixels.height} x {pixels.width} pixels, smaller "
                         f"than one {patch}-pixel patch", "image")
    n_register = int(getattr(config, "num_register_tokens", 0) or 0) if tower.registers else 0
    return Grid.of(pixels.height, pixels.width, patch, prefix_names(tower.cls, n_register, tower.distillation))


def run(folder: Path, model_type: str, config: Any, n_layer: int, grid: Grid, pixels: Pixels, layer: int,
        every: bool) -> VisionRun:
    """Layer `layer` traced on the image (`config`, `grid`: tower_config's and grid_of's); with `every` the whole
    tower run and every layer's pattern kept."""
    import torch
    import transformers

    from attnscope.models.nopage import interface_check, truncated

    model = truncated.load(getattr(transformers, TOWERS[model_type].model_class), folder,
                           config if every else truncated.cut(config, n_layer, layer), model_type, traced=True)
    captured: dict[str, torch.Tensor] = {}
    hooks = [_patch_conv(model).register_forward_hook(lambda _m, _i, out: captured.setdefault("patches", out))]
    values: dict[int, torch.Tensor] = {}  # with every layer: each layer's V as its value projection made it
    if every:
        hooks += [module.register_forward_hook(lambda _m, _i, out, i=i: values.setdefault(i, out[0].detach()))
                  for i, module in _projections(model, VALUE_PROJECTIONS).items()]
    try:
        with torch.no_grad(), interface_check.checked_recording(model, layer, stop=not every, every=every) as recorder:
            model(pixel_values=pixels.values)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise _could_not_run(model_type, exc) from None
    finally:
        for hook in hooks:
            hook.remove()
    recorded, fallback = interface_check.outcome(recorder)
    if fallback:  # interface_check.py: a module does more than its attention function is handed: eager's patterns
        return _eager(model, model_type, grid, pixels, n_layer, layer, every, fallback)
    if recorded is None or "patches" not in captured:
        raise ResourceError(f"{type(model).__name__} did not call transformers' attention interface at layer "
                            f"{layer}; attnscope cannot trace it")
    _check_tokens(model, int(recorded.layer["Q"].shape[2]), grid)
    recorded = replace(recorded, layer=_with_pixels(recorded.layer, pixels, captured["patches"], grid))
    patterns = [recorder.patterns[i] for i in sorted(recorder.patterns)] if recorder.patterns else None
    found = truncated.sizes(model, recorded, recorded.layer["attention"][0], n_layer, layer)
    norms = _layer_norms(model, values, n_layer, found.n_head) if every else None
    return VisionRun(found, grid, patterns, list(recorder.notes), output_weight(model, layer), norms)


# Where each tower keeps its attention's output and value projections in a layer: ViT's, DeiT's and DINOv2's
# `attention.o_proj` and `attention.v_proj` (transformers 5.23; ViTSelfOutput's `attention.output.dense` and
# `attention.attention.value` before), CLIP's and SigLIP's `self_attn.out_proj` and `self_attn.v_proj`.
OUTPUT_PROJECTIONS = ("attention.o_proj", "attention.output.dense", "self_attn.out_proj", "self_attn.o_proj")
VALUE_PROJECTIONS = ("attention.v_proj", "attention.attention.value", "self_attn.v_proj")


def output_weight(model: Any, layer: int) -> torch.Tensor | None:
    """Layer `layer`'s attention output projection's weight `[d_model, n_head·d_head]` (a Linear's), which
    carries each head's values into the residual stream (readings/moved.py's W_O); None where the tower keeps it
    elsewhere."""
    found = _projections(model, OUTPUT_PROJECTIONS).get(layer)
    return None if found is None else found.weight.detach()


def _projections(model: Any, names: tuple[str, ...]) -> dict[int, Any]:
    """Each layer's Linear named `<layers>.<i>.<one of names>`, by layer index i."""
    import torch

    found: dict[int, Any] = {}
    for full, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for name in names:
            index = full[:-len(name) - 1].rpartition(".")[2] if full.endswith("." + name) else ""
            if index.isdigit():  # `encoder.layers.3.self_attn.v_proj` -> 3
                found.setdefault(int(index), module)
    return found


def _layer_norms(model: Any, values: dict[int, torch.Tensor], n_layer: int,
                 n_head: int) -> list[torch.Tensor | None] | None:
    """Every layer's value_norms `[n_head, n]` (readings/moved.py) from its value projection's output `[n,
    n_head·d_head]` (bias in: f(x) = (x W_V + b_V) W_O) and its output projection; None where a layer's is
    missing."""
    from attnscope.readings.moved import value_norms

    norms: list[torch.Tensor | None] = []
    for i in range(n_layer):
        W_O = output_weight(model, i)
        if i not in values or W_O is None or values[i].shape[-1] % n_head:
            return None
        n, width = values[i].shape
        V = values[i].view(n, n_head, width // n_head).transpose(0, 1)  # [n_head, n, d_head]
        norms.append(value_norms(V, W_O))
    return norms


def _eager(model: Any, model_type: str, grid: Grid, pixels: Pixels, n_layer: int, layer: int, every: bool,
           fallback: str) -> VisionRun:
    """The same tower run again with transformers' eager attention and `output_attentions`: layer `layer`'s
    pattern (every layer's with `every`), untraced, `fallback` (the self-check's note) saying why."""
    import torch

    from attnscope.models.nopage.truncated import sizes

    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(pixel_values=pixels.values, output_attentions=True).attentions
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise _could_not_run(model_type, exc) from None
    if not attentions or len(attentions) <= layer:
        raise ResourceError(f"{type(model).__name__} gives no attention weights (output_attentions) for layer "
                            f"{layer}; attnscope cannot show its pattern")
    attention = attentions[layer][0]  # [n_head, n_tokens, n_tokens]
    _check_tokens(model, int(attention.shape[-1]), grid)
    found = replace(sizes(model, None, attention, n_layer, layer), fallback=fallback)
    return VisionRun(found, grid, [a[0] for a in attentions] if every else None, [])


def _could_not_run(model_type: str, exc: BaseException) -> ResourceError:
    from attnscope.models.nopage.truncated import first_line

    return ResourceError(f"transformers could not run model_type '{model_type}' on the image ({first_line(exc)})")


def _check_tokens(model: Any, n_tokens: int, grid: Grid) -> None:
    if n_tokens != grid.n_tokens:
        raise ResourceError(f"{type(model).__name__} made {n_tokens} tokens of the image, not the {grid.n_tokens} "
                            f"its grid implies ({grid.n_prefix} + {grid.rows} x {grid.cols} patches)")


def _patch_conv(model: Any) -> Any:
    """The patch embedding's Conv2d (`patch_embeddings.projection`, CLIP's and SigLIP's `patch_embedding`)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d) and "embed" in name:
            return module
    raise ResourceError(f"{type(model).__name__} has no patch embedding (a Conv2d under its embeddings)")


def _with_pixels(layer: Trace, pixels: Pixels, conv_out: torch.Tensor, grid: Grid) -> Trace:
    """The layer's steps with the input image and its patches first."""
    from attnscope import cost
    from attnscope.trace import Trace

    trace = Trace(notes=list(layer.notes))
    trace.add("pixel_values", pixels.values, ("n_batch", "n_channel", "height", "width"),
              f"{pixels.processor}(image): resized, rescaled, normalized")
    n_channel = int(pixels.values.shape[1])
    flat = conv_out.flatten(2).transpose(1, 2)  # [n_batch, d_model, rows, cols] -> [n_batch, n_patches, d_model]
    trace.add("patches", flat, ("n_batch", "n_patches", "d_model"),
              f"Conv2d(kernel = stride = {grid.patch}) over pixel_values, flattened row by row: "
              f"n_patches = {grid.patches_formula(pixels.height, pixels.width)} = {grid.n_patches}",
              cost.matmul_flops(flat.shape, n_channel * grid.patch**2))
    for step in layer.steps:
        trace.add_step(step)
    return trace
