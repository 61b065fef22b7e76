"""Shared by the model benchmarks: write a large random checkpoint shard by shard, so that no more than one
shard is ever in memory (the model is built on the meta device: shapes only).

Run inside the builder subprocesses (bench_model_text.py, bench_qwen3_text.py), never in the measuring process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_random_shards(folder: Path, model_class: type, config: object, layers_per_shard: int,
                        dtype: torch.dtype = torch.float32) -> int:
    """Random weights (std 0.02; norm weights 1) for `model_class(config)`, saved in `dtype` as sharded safetensors
    with their index, `layers_per_shard` decoder layers a shard; tied weights (`lm_head` with tied embeddings) left
    out as save_pretrained does. Returns the number of parameters written."""
    with torch.device("meta"):
        model = model_class(config)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    groups: dict[int, list[str]] = {}
    for key in shapes:
        part = key.split(".")
        layer = int(part[2]) // layers_per_shard if part[1] == "layers" else (-1 if "embed" in key else 1 << 30)
        groups.setdefault(layer, []).append(key)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, (_, keys) in enumerate(sorted(groups.items())):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.ones(shapes[k]) if k.endswith("norm.weight") else
                       torch.randn(shapes[k], generator=generator) * 0.02).to(dtype) for k in keys}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    return sum(torch.Size(s).numel() for s in shapes.values())
