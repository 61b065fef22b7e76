"""A model attnscope has no page for, through transformers, with only layers 0..L built and loaded.

The config is read by `AutoConfig` (trust_remote_code off: no code from the model's folder runs) and cut to
L + 1 layers (`num_hidden_layers`, and every per-layer list, `layer_types` and the like), so `from_pretrained`
builds L + 1 layers and reads only their tensors from the checkpoint (the others are skipped as unexpected),
plus the embeddings and final norm. Then:

- a family whose modules call transformers' attention interface (`_supports_attention_backend`) runs with
  attnscope's implementation (models/nopage/interface.py), which records layer L's attention and stops the forward
  there: `traced`;
- any other family runs its eager attention with `output_attentions` through its L + 1 layers: the pattern
  only.

A hybrid's layer without attention (Jamba's Mamba layers, LFM2's convolutions, as `layer_types` names them, or
holding no module transformers records as `attentions`) is refused in one line naming the layers that have it.
The whole model, for `--all-layers` and `--generate`, is models/forward/interface_stream.py's.

Everything is float32 on the CPU, batch 1, no padding.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from attnscope.errors import ResourceError, UsageError
from attnscope.models.memory import Footprint
from attnscope.words import counted

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.nopage.interface import Recorded

_LAYER = re.compile(r"\.(\d+)\.")
# config.layer_types' kinds of layer with no attention (transformers' ALLOWED_ATTN_LAYER_TYPES, configuration_utils):
# Mamba and other recurrent layers ("linear_attention", legacy "mamba"), LFM2's convolutions, NemotronH's MoE
NO_ATTENTION = frozenset({"linear_attention", "mamba", "recurrent", "conv", "moe"})


@dataclass
class TransformersRun:
    """Layer L through transformers: the recorded steps (None where the family does not call the interface),
    every head's pattern `[n_head, n_tokens, n_tokens]`, and the model's sizes as its config says."""

    recorded: Recorded | None
    attention: torch.Tensor
    architecture: str
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_head: int
    module: str  # the attention module's class, `GPTNeoXAttention`
    fallback: str = ""  # interface_check.py's note where the trace did not reproduce the module's output: pattern only


def footprint(checkpoint: Checkpoint, layer: int) -> Footprint:
    """What the truncated load holds (models/memory.py): layers 0..L's tensors and every tensor outside the layers
    (embeddings, norms), in float32, once held and once being loaded; each token's activations and every head's
    scores, for up to 64 heads of 1,024 numbers a token."""
    numel = 0
    for key in checkpoint.keys:
        found = _LAYER.search(key)
        if found is None or int(found.group(1)) <= layer:
            numel += math.prod(checkpoint.shape(key))
    return Footprint(2 * 4 * numel, per_token=1024 * 64, cells=64)


def full_config(folder: Path, model_type: str, layer: int, *, text: bool = False) -> tuple[Any, int]:
    """transformers' config of the model (`AutoConfig`, no code from the folder), and its number of layers;
    `layer` checked against it. `text`: a multimodal model's layers are its text model's (`layers_config`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except config_errors() as exc:
        raise refused(folder, model_type, exc) from None
    _check_buildable(folder, layers_config(config))
    n_layer = getattr(layers_config(config) if text else config, "num_hidden_layers", None)
    if not isinstance(n_layer, int) or n_layer < 1:
        raise UsageError(f"{{model}} {folder}: config.json gives model_type '{model_type}' no num_hidden_layers; "
                         "attnscope cannot tell its layers apart", "model")
    if not 0 <= layer < n_layer:
        raise UsageError(f"{{layer}} {layer} is out of range: this model has {counted(n_layer, 'layer')}, "
                         f"0 to {n_layer - 1}", "layer")
    return config, n_layer


def _check_buildable(folder: Path, config: Any) -> None:
    """What AutoConfig accepts but building the model does not (found by tests/test_trust_models' fuzzing): a
    pad_token_id outside the embedding (nn.Embedding's padding_idx must lie in [-vocab_size, vocab_size))."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not -vocab <= pad < vocab:
        raise UsageError(f"{{model}} {folder}: config.json's pad_token_id {pad} is outside the {vocab} embeddings; "
                         "fix config.json or save the model again with save_pretrained", "model")


def config_errors() -> tuple[type[Exception], ...]:
    """What `AutoConfig.from_pretrained` raises on a config.json it refuses: its own checks, and the strict
    dataclass validation of transformers 5's config classes (`index_topk: null` where an int is declared), and the
    AttributeError of its getattr(torch, dtype) on a `dtype` torch has no name for, and the arithmetic of a config
    class's __post_init__ on a hostile value (Llama 4's `(i + 1) % no_rope_layer_interval` with an interval of 0)."""
    from huggingface_hub.errors import StrictDataclassError

    return (OSError, ValueError, LookupError, TypeError, ImportError, AttributeError, ArithmeticError,
            StrictDataclassError)


def refused(folder: Path, model_type: str, exc: BaseException) -> UsageError:
    """The one message for a config.json that `AutoConfig.from_pretrained` refused: the field, where it is a `dtype`
    torch has no name for (transformers' getattr(torch, dtype) says only "module 'torch' has no attribute"),
    else transformers' own first line."""
    bad = _bad_dtype(folder)
    if bad is not None:
        return UsageError(f"{{model}} {folder}: config.json's {bad[0]} {bad[1]!r} is not a torch dtype; give one "
                          "torch names (float32, bfloat16, float16) or 'auto'", "model")
    return UsageError(f"{{model}} {folder}: transformers cannot read model_type '{model_type}' ({first_line(exc)})",
                      "model")


def _bad_dtype(folder: Path) -> tuple[str, object] | None:
    """(`dtype` or `torch_dtype`, with the sub-config's name before it, and its value) where config.json names
    a dtype torch does not have; None where every one it names is torch's or 'auto'."""
    import json

    import torch

    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tables = [("", data)] + [(f"{k}.", v) for k, v in data.items() if k.endswith("_config") and isinstance(v, dict)]
    for prefix, table in tables if isinstance(data, dict) else []:
        for key in ("dtype", "torch_dtype"):
            value = table.get(key)
            if value is None or value == "auto":
                continue
            if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
                return f"{prefix}{key}", value
    return None


def layers_config(config: Any) -> Any:
    """The config that holds the layers: the model's own, or a multimodal model's `text_config` (Gemma 3's and
    Gemma 4's ...ForConditionalGeneration, LLaVA's, Llama 4's have no num_hidden_layers of their own)."""
    inner = getattr(config, "text_config", None)
    return inner if getattr(config, "num_hidden_layers", None) is None and inner is not None else config


def cut(config: Any, n_layer: int, layer: int) -> Any:
    """A copy of the config with layers 0..`layer` only (`num_hidden_layers`, and every per-layer list; a
    multimodal model's in its text_config)."""
    import copy

    config = copy.deepcopy(config)
    held = layers_config(config)
    for name, value in held.to_dict().items():  # layer_types, no_rope_layers, ...: one entry per layer
        if isinstance(value, list) and len(value) == n_layer and hasattr(held, name):
            setattr(held, name, value[: layer + 1])
    held.num_hidden_layers = layer + 1
    return config


def run(folder: Path, ids: list[int], model_type: str, layer: int) -> TransformersRun:
    import torch
    from transformers import AutoModel

    from attnscope.models.nopage import interface_check

    quiet_transformers()
    full, n_layer = full_config(folder, model_type, layer)
    check_attention_layer(full, n_layer, layer)
    config = cut(full, n_layer, layer)
    traced = routes_through_interface(config)
    model = load(AutoModel, folder, config, model_type, traced)
    recorded, fallback = None, ""
    inputs = torch.tensor([ids])
    try:
        with torch.no_grad():
            if traced:
                with interface_check.checked_recording(model, layer) as recorder:
                    model(input_ids=inputs)
                recorded, fallback = interface_check.outcome(recorder)
            if recorded is None:  # a layer that does not call the interface: its eager pattern
                # (a self-check's fallback was recorded there: ALBERT's one module serves layers its path never names)
                if not fallback and layer not in module_layers(model):
                    refuse_layer(full, n_layer, layer, attention_layers(full, n_layer))
                model.set_attn_implementation("eager")
                out = model(input_ids=inputs, output_attentions=True)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"transformers could not run model_type '{model_type}' on the text alone "
                            f"({first_line(exc)})") from None
    if recorded is not None:
        attention = recorded.layer["attention"][0]
    else:
        attentions = getattr(out, "attentions", None)
        if not attentions or attentions[-1] is None:
            raise ResourceError(f"model_type '{model_type}' gives no attention weights (output_attentions) in "
                                "transformers; attnscope cannot show its pattern")
        attention = attentions[-1][0]  # layer L, the last of layers 0..L, has attention: output_attentions' last
    found = sizes(model, recorded, attention, n_layer, layer)
    found.fallback = fallback
    return found


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load report (the layers left out are "unexpected") would bury the table
    hf_logging.disable_progress_bar()


def load(auto: Any, folder: Path, config: Any, model_type: str, traced: bool, **more: Any) -> Any:
    """`auto.from_pretrained` (AutoModel, AutoModelForCausalLM) in float32 with attnscope's attention function
    where the family calls the interface, eager's otherwise; one line if transformers cannot."""
    import torch

    from attnscope.models.nopage import interface

    if traced:
        interface.register()
    try:
        loaded = auto.from_pretrained(str(folder), config=config, dtype=torch.float32, trust_remote_code=False,
                                      attn_implementation=interface.IMPLEMENTATION if traced else "eager", **more)
    except (OSError, ValueError, LookupError, TypeError, ImportError, RuntimeError, ArithmeticError) as exc:
        raise UsageError(f"{{model}} {folder}: transformers cannot load model_type '{model_type}' either "
                         f"({first_line(exc)})", "model") from None
    (loaded[0] if isinstance(loaded, tuple) else loaded).eval()
    return loaded


def declared_attention_layers(config: Any, n_layer: int) -> list[int] | None:
    """The layers with attention as config.layer_types names each layer's kind (Jamba's "linear_attention" Mamba
    layers and LFM2's "conv" layers have none), or None where the config does not say."""
    kinds = getattr(config, "layer_types", None)
    if not isinstance(kinds, list) or len(kinds) != n_layer:
        return None
    return [i for i, kind in enumerate(kinds) if kind not in NO_ATTENTION]


def attention_layers(config: Any, n_layer: int) -> list[int]:
    """The layers with attention: as config.layer_types says, else the layers holding the module transformers
    records as `attentions`, in the model built on the meta device (nothing allocated, nothing read)."""
    declared = declared_attention_layers(config, n_layer)
    if declared is not None:
        return declared
    import torch
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    except (ValueError, TypeError, RuntimeError, ImportError, AttributeError):
        return list(range(n_layer))
    return module_layers(model)


def check_attention_layer(config: Any, n_layer: int, layer: int) -> None:
    """Layer `layer` has attention by config.layer_types (where it says), else one line naming those that do."""
    declared = declared_attention_layers(config, n_layer)
    if declared is not None and layer not in declared:
        refuse_layer(config, n_layer, layer, declared)


def refuse_layer(config: Any, n_layer: int, layer: int, layers: list[int]) -> NoReturn:
    kinds = getattr(config, "layer_types", None)
    kind = f" (a '{kinds[layer]}' layer)" if isinstance(kinds, list) and len(kinds) == n_layer else ""
    named = ", ".join(map(str, layers)) if layers else "none"
    raise UsageError(f"{{layer}} {layer} of this {type(config).__name__.removesuffix('Config')} model has no "
                     f"attention{kind}; the layers with attention are {named}", "layer")


def module_layers(model: Any) -> list[int]:
    """The layers holding an attention module: one of the classes transformers records as `attentions`
    (`_can_record_outputs`, the entries of output_attentions), else one whose class name ends in Attention."""
    recorded = getattr(model, "_can_record_outputs", None) or {}
    target = recorded.get("attentions")
    targets = target if isinstance(target, (list, tuple)) else [target] if target is not None else []
    kinds = [getattr(t, "target_class", t) for t in targets]
    classes: tuple[type, ...] = tuple(k for k in kinds if isinstance(k, type))
    found = set()
    for name, module in model.named_modules():
        hit = isinstance(module, classes) if classes else type(module).__name__.endswith("Attention")
        number = _LAYER.search(f"{name}.")
        if hit and number:
            found.add(int(number.group(1)))
    return sorted(found)


def routes_through_interface(config: Any) -> bool:
    """Whether the model class transformers builds for this config calls the attention interface: it says so
    (`_supports_attention_backend`), or its modeling file looks its attention up in `ALL_ATTENTION_FUNCTIONS`
    (Jamba, Bamba, ... do without saying)."""
    import sys

    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        cls = MODEL_MAPPING[type(config)]
    except KeyError:
        return False
    return bool(getattr(cls, "_supports_attention_backend", False)) or \
        "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules.get(cls.__module__, sys))


def sizes(model: Any, recorded: Recorded | None, attention: torch.Tensor, n_layer: int,
           layer: int) -> TransformersRun:
    config = model.config
    n_head = int(attention.shape[0])
    d_model = int(getattr(config, "hidden_size", 0) or 0)
    if recorded is not None:
        d_head, n_kv_head = int(recorded.layer["Q"].shape[-1]), recorded.n_kv_head
    else:
        d_head = int(getattr(config, "head_dim", 0) or (d_model // n_head if n_head else 0))
        n_kv_head = int(getattr(config, "num_key_value_heads", n_head) or n_head)
    module = _attention_module(model, layer)
    return TransformersRun(recorded, attention, type(model).__name__, n_layer, n_head, n_kv_head, d_model, d_head,
                           module)


def _attention_module(model: Any, layer: int) -> str:
    """The class name of layer `layer`'s attention module (`GPTNeoXAttention`), or "" if none is found."""
    for name, module in model.named_modules():
        found = _LAYER.search(f"{name}.")
        if found and int(found.group(1)) == layer and type(module).__name__.endswith("Attention"):
            return type(module).__name__
    return ""


def first_line(exc: BaseException) -> str:
    text = [line.strip() for line in str(exc).strip().splitlines()]
    if len(text) > 1 and text[0].endswith(":"):  # a heading, then what it heads (a dataclass validation error)
        text = [f"{text[0]} {text[1]}"]
    return text[0][:160] if text else type(exc).__name__
