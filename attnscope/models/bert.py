"""One head of a BERT model: find the checkpoint, slice the head's weights, run it on a sentence.

Head h of layer l is rows `h*d_head:(h+1)*d_head` of the query/key/value Linear weights (Hugging Face
stores a Linear weight as `[out, in]`) and the same columns of `attention.output.dense.weight`.

Dumping a head reads only those slices from a lazily opened safetensors file, as NumPy arrays: it
imports neither torch nor transformers (both take seconds to import), so it answers in a fraction of
the time a model load takes. torch comes in only where it is needed: `--text`, `--save`, a dtype NumPy
cannot hold (bfloat16) and `pytorch_model.bin` files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models import checkpoint
from attnscope.models.hub import WEIGHT_FILES

if TYPE_CHECKING:
    import numpy as np
    import torch

    from attnscope.trace import Trace

    Array = np.ndarray | torch.Tensor

DEFAULT_MODEL = "bert-base-uncased"
SUPPORTED = ("BERT-family checkpoints laid out as BERT's (model_type 'bert': BertModel, BertFor..., "
             "MiniLM saved as BertModel)")


@dataclass(frozen=True)
class BertInfo:
    """What a checkpoint is, read from its config.json and its weight file's key names."""

    folder: Path
    weights: Path
    architecture: str
    n_layer: int
    n_head: int
    d_model: int
    prefix: str  # "" for BertModel, "bert." for BertForMaskedLM and friends
    max_tokens: int

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    def key(self, layer: int, part: str) -> str:
        return f"{self.prefix}encoder.layer.{layer}.attention.{part}"


@dataclass
class HeadWeights:
    """W_Q, W_K, W_V `[d_head, d_model]`, b_Q, b_K, b_V `[d_head]` and W_O `[d_model, d_head]`, with where
    each came from (`encoder.layer.0.attention.self.query.weight[0:32, :]`)."""

    info: BertInfo
    layer: int
    head: int
    tensors: dict[str, Array] = field(default_factory=dict)  # NumPy arrays where it could, else torch
    sources: dict[str, str] = field(default_factory=dict)

    def as_torch(self) -> dict[str, torch.Tensor]:
        import torch

        return {name: t if isinstance(t, torch.Tensor) else torch.from_numpy(t.copy())
                for name, t in self.tensors.items()}


# --- finding the model ---------------------------------------------------------------------------------


def inspect(folder: Path) -> BertInfo:
    """Read config.json and the weight file's key names; refuse what is not laid out as BERT."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--model {folder}: no config.json in that folder; give a folder saved by save_pretrained")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{config_path}: not readable JSON ({exc})") from None
    model_type = config.get("model_type", "?")
    architecture = (config.get("architectures") or [f"model_type {model_type}"])[0]
    if model_type != "bert":
        raise UsageError(f"--model {folder} is a {architecture} (model_type '{model_type}'); "
                         f"attnscope bert supports {SUPPORTED}")
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if weights is None:
        raise UsageError(f"--model {folder}: no checkpoint there (looked for {' and '.join(WEIGHT_FILES)})")
    d_model, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    if d_model % n_head:
        raise UsageError(f"{config_path}: hidden_size {d_model} is not divisible by num_attention_heads {n_head}")
    names = checkpoint.keys(weights)
    query = next((k for k in names if k.endswith("encoder.layer.0.attention.self.query.weight")), None)
    if query is None:
        raise UsageError(f"{weights}: no encoder.layer.0.attention.self.query.weight; "
                         f"this checkpoint is not laid out as BERT's, and attnscope bert supports {SUPPORTED}")
    return BertInfo(folder, weights, architecture, int(config["num_hidden_layers"]), n_head, d_model,
                    query.removesuffix("encoder.layer.0.attention.self.query.weight"),
                    int(config.get("max_position_embeddings", 512)))


# --- one head's weights ----------------------------------------------------------------------------------


def check_position(info: BertInfo, layer: int, head: int) -> None:
    if not 0 <= layer < info.n_layer:
        raise UsageError(f"--layer {layer} is out of range: this model has {info.n_layer} layers, "
                         f"0 to {info.n_layer - 1}")
    if not 0 <= head < info.n_head:
        raise UsageError(f"--head {head} is out of range: this model has {info.n_head} heads, 0 to {info.n_head - 1}")


def head_weights(info: BertInfo, layer: int, head: int) -> HeadWeights:
    """Read this head's slices only: from safetensors lazily, from a .bin through a memory map."""
    check_position(info, layer, head)
    lo, hi = head * info.d_head, (head + 1) * info.d_head
    wanted = {  # name: (checkpoint key, rows or columns, slice text)
        "W_Q": (info.key(layer, "self.query.weight"), "rows"),
        "W_K": (info.key(layer, "self.key.weight"), "rows"),
        "W_V": (info.key(layer, "self.value.weight"), "rows"),
        "b_Q": (info.key(layer, "self.query.bias"), "rows"),
        "b_K": (info.key(layer, "self.key.bias"), "rows"),
        "b_V": (info.key(layer, "self.value.bias"), "rows"),
        "W_O": (info.key(layer, "output.dense.weight"), "cols"),
    }
    result = HeadWeights(info, layer, head)
    with checkpoint.Reader(info.weights) as read:
        for name, (key, axis) in wanted.items():
            tensor, text = read(key, axis, lo, hi)
            result.tensors[name] = tensor
            result.sources[name] = f"{key}{text}"
    return result


# --- a sentence through the model ------------------------------------------------------------------------


@dataclass
class SentenceRun:
    tokens: list[str]
    trace: Trace  # X, Q, K, V, scores, attention, out: this head's computation on the sentence


def run_text(head: HeadWeights, text: str) -> SentenceRun:
    """Tokenize with the model's own tokenizer, run the model up to this layer (eager attention), and
    compute this head's attention from the layer's input with attnscope's own sdpa."""
    if not text.strip():
        raise UsageError("--text is empty; give a sentence, e.g. --text \"The cat sat on the mat.\"")
    info = head.info
    import torch

    from attnscope.attention import Names, sdpa

    tokenizer = load_tokenizer(info.folder)
    encoded = tokenizer(text, return_tensors="pt")
    n_tokens = int(encoded["input_ids"].shape[-1])
    if n_tokens > info.max_tokens:
        raise UsageError(f"--text is {n_tokens} tokens, more than this model's {info.max_tokens}; shorten it")
    model = load_model(info.folder)
    with torch.no_grad():
        hidden = model(**encoded, output_hidden_states=True).hidden_states[head.layer][0]  # [n_tokens, d_model]
    W = {name: t.to(hidden.dtype) for name, t in head.as_torch().items()}
    Q = hidden @ W["W_Q"].T + W["b_Q"]  # [n_tokens, d_model] @ [d_model, d_head] -> [n_tokens, d_head]
    K = hidden @ W["W_K"].T + W["b_K"]
    V = hidden @ W["W_V"].T + W["b_V"]
    trace = sdpa(Q, K, V, names=Names(d_K="d_head", d_V="d_head"))
    layer_input = f"hidden_states[{head.layer}]: the input of layer {head.layer}"
    result = _head_trace(trace, hidden, layer_input)
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist())
    return SentenceRun(tokens, result)


def _head_trace(inner: Trace, hidden: torch.Tensor, layer_input: str) -> Trace:
    """The head's steps with BERT's axis names: a sentence has n_tokens queries and keys."""
    from attnscope import cost
    from attnscope.trace import Trace

    rename = {"n_Q": "n_tokens", "n_K": "n_tokens"}
    trace = Trace(notes=list(inner.notes))
    trace.add("X", hidden, ("n_tokens", "d_model"), layer_input)
    ops = {"Q": "X @ W_Q.T + b_Q", "K": "X @ W_K.T + b_K", "V": "X @ W_V.T + b_V"}
    for step in inner.steps:
        dims = tuple(rename.get(d, d) for d in step.dims)
        flops = cost.linear_flops(step.shape, hidden.shape[-1], True) if step.name in ops else step.flops
        trace.add(step.name, step.tensor, dims, ops.get(step.name, step.op), flops)
    return trace


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise UsageError(f"--model {folder}: no usable tokenizer there for --text ({first})") from None


def load_model(folder: Path) -> Any:
    """The whole model, with eager attention (the implementation whose output_attentions we agree with)."""
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load report and progress bar would bury the table
    hf_logging.disable_progress_bar()
    model = BertModel.from_pretrained(str(folder), attn_implementation="eager")
    return model.eval()
