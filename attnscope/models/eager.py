"""`head --check`'s reference: the same checkpoint run by transformers' own eager modeling code, sharing nothing with
attnscope's forward: `AutoModel.from_pretrained(..., attn_implementation="eager")` and `output_attentions=True` for
a text, `AutoModelForCausalLM.generate(do_sample=False, output_attentions=True)` for decoding (no code from the
model's folder runs: `trust_remote_code=False`). Layers past the last one compared are not built (truncated.py's
cut config). Everything float32 on the CPU, batch 1, no padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnscope.errors import ResourceError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

def patterns(folder: Path, model_type: str, ids: list[int], last: int) -> dict[int, torch.Tensor]:
    """transformers' eager `output_attentions` of layers 0..`last` on `ids`: layer -> `[n_head, n, n]`, the layers
    with attention only (a hybrid's Mamba or convolution layers have none)."""
    import torch
    from transformers import AutoModel

    from attnscope.models import truncated

    truncated.quiet_transformers()
    full, n_layer = truncated.full_config(folder, model_type, last)
    model = truncated.load(AutoModel, folder, truncated.cut(full, n_layer, last), model_type, traced=False)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"--check: transformers could not run model_type '{model_type}' on the text "
                            f"({truncated.first_line(exc)})") from None
    attentions = [a for a in (getattr(out, "attentions", None) or ()) if a is not None]
    layers = list(range(last + 1))
    if len(attentions) != len(layers):  # a hybrid: entries for its attention layers only
        layers = [i for i in truncated.attention_layers(full, n_layer) if i <= last]
    return {layer: attention[0] for layer, attention in zip(layers, attentions, strict=True)}


@dataclass
class Decoded:
    """transformers' greedy decoding: the new ids, and each step's attention of every layer with attention
    (`rows[t][layer]`: the newest query's row, `[n_head, keys the cache holds]`)."""

    ids: list[int]
    rows: list[dict[int, torch.Tensor]]


def decode(folder: Path, model_type: str, ids: list[int], n_new: int) -> Decoded:
    """`generate(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, output_attentions=True)`."""
    import torch
    from transformers import AutoModelForCausalLM

    from attnscope.models import truncated

    truncated.quiet_transformers()
    full, n_layer = truncated.full_config(folder, model_type, 0)
    model = truncated.load(AutoModelForCausalLM, folder, full, model_type, traced=False)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 output_attentions=True, return_dict_in_generate=True)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"--check: transformers could not decode with model_type '{model_type}' "
                            f"({truncated.first_line(exc)})") from None
    layers = truncated.attention_layers(full, n_layer)
    rows = []
    for step in out.attentions:
        present = [a for a in step if a is not None]
        numbers = range(n_layer) if len(present) == n_layer else layers
        rows.append({layer: a[0, :, -1] for layer, a in zip(numbers, present, strict=True)})
    return Decoded(out.sequences[0, len(ids):].tolist(), rows)
