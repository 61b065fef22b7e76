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
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from attnscope.trace import Trace

    Array = np.ndarray | torch.Tensor

# safetensors dtypes NumPy can hold; the rest (BF16, F8_*) are read through torch.
NUMPY_DTYPES = frozenset({"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"})

DEFAULT_MODEL = "bert-base-uncased"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
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


def locate(model: str, *, need_tokenizer: bool = False) -> Path:
    """A local folder as it is, or a Hugging Face model name through the local cache (downloading when
    the network allows and HF_HUB_OFFLINE is not set)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UsageError(f"--model {model} is a file; give the folder that holds config.json and the weights")
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep in model.replace("/", "", 1):
        raise UsageError(f"--model {model}: no such folder")
    return _from_hub(model, need_tokenizer)


def _from_hub(name: str, need_tokenizer: bool) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError

    try:
        config = _cached_or_download(name, "config.json", hf_hub_download)
        folder = Path(config).parent
        for weights in WEIGHT_FILES:
            try:
                _cached_or_download(name, weights, hf_hub_download)
                break
            except FileNotFoundError:
                continue
        if need_tokenizer:
            for extra in TOKENIZER_FILES:
                try:
                    _cached_or_download(name, extra, hf_hub_download)
                except FileNotFoundError:
                    pass
        return folder
    except HFValidationError:
        raise UsageError(f"--model {name}: neither a folder nor a valid Hugging Face model name") from None


def _cached_or_download(name: str, filename: str, download: Any) -> str:
    try:
        return str(download(name, filename, local_files_only=True))
    except Exception as cached_miss:  # noqa: BLE001 - any miss means: go to the network, if we may
        if _offline():
            if filename == "config.json":
                raise ResourceError(_not_cached(name, "HF_HUB_OFFLINE=1 forbids downloading")) from None
            raise FileNotFoundError(filename) from cached_miss
    if not _hub_reachable():
        if filename == "config.json":
            raise ResourceError(_not_cached(name, "the Hugging Face Hub cannot be reached from here")) from None
        raise FileNotFoundError(filename)
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    try:
        return str(download(name, filename))
    except RepositoryNotFoundError:
        raise ResourceError(f"--model {name}: no such model on the Hugging Face Hub (or it is private)") from None
    except EntryNotFoundError:
        if filename == "config.json":
            raise ResourceError(f"--model {name}: the model has no config.json") from None
        raise FileNotFoundError(filename) from None
    except OSError as exc:
        if filename == "config.json":
            raise ResourceError(_not_cached(name, f"downloading failed ({type(exc).__name__})")) from None
        raise FileNotFoundError(filename) from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_reachable() -> bool:
    """A name lookup for the Hub, so a machine with no network learns it now, not after a minute of retries."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def _not_cached(name: str, why: str) -> str:
    return (f"--model {name} is not in the Hugging Face cache and {why}; download it where the network is "
            f"reachable (hf download {name}), or point --model at a folder with config.json and model.safetensors")


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
    keys = _keys(weights)
    query = next((k for k in keys if k.endswith("encoder.layer.0.attention.self.query.weight")), None)
    if query is None:
        raise UsageError(f"{weights}: no encoder.layer.0.attention.self.query.weight; "
                         f"this checkpoint is not laid out as BERT's, and attnscope bert supports {SUPPORTED}")
    return BertInfo(folder, weights, architecture, int(config["num_hidden_layers"]), n_head, d_model,
                    query.removesuffix("encoder.layer.0.attention.self.query.weight"),
                    int(config.get("max_position_embeddings", 512)))


def _keys(weights: Path) -> list[str]:
    if weights.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(weights), framework="numpy") as handle:  # reads the header only
                return list(handle.keys())
        except SafetensorError as exc:
            raise UsageError(f"{weights}: not a valid safetensors file ({exc})") from None
    return list(_load_bin(weights))


def _load_bin(weights: Path) -> dict[str, torch.Tensor]:
    """pytorch_model.bin, memory-mapped (only the slices read are paged in) and never unpickling code."""
    import pickle

    import torch

    try:
        return torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise UsageError(f"{weights}: refused: it would run code when unpickled (torch.load with "
                         "weights_only=True rejected it); convert the checkpoint to model.safetensors") from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise UsageError(f"{weights}: not a readable checkpoint ({str(exc).splitlines()[0][:120]})") from None


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
    with _reader(info.weights) as read:
        for name, (key, axis) in wanted.items():
            tensor, text = read(key, axis, lo, hi)
            result.tensors[name] = tensor
            result.sources[name] = f"{key}{text}"
    return result


class _reader:
    """A context giving `read(key, axis, lo, hi) -> (array, slice text)` over either weight format."""

    def __init__(self, weights: Path) -> None:
        self.weights = weights
        self._handles: dict[str, Any] = {}
        self._state: dict[str, torch.Tensor] | None = None

    def __enter__(self) -> Any:
        if self.weights.suffix != ".safetensors":
            self._state = _load_bin(self.weights)
        return self.read

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.values():
            handle.__exit__(*exc)
        self._state = None

    def _handle(self, framework: str) -> Any:
        if framework not in self._handles:
            from safetensors import safe_open

            handle = safe_open(str(self.weights), framework=framework)
            handle.__enter__()
            self._handles[framework] = handle
        return self._handles[framework]

    def read(self, key: str, axis: str, lo: int, hi: int) -> tuple[Array, str]:
        try:
            if self._state is None:
                whole = self._handle("numpy").get_slice(key)
                if whole.get_dtype() not in NUMPY_DTYPES:
                    whole = self._handle("pt").get_slice(key)
                rank = len(whole.get_shape())
                tensor = whole[lo:hi] if axis == "rows" or rank == 1 else whole[:, lo:hi]
            else:
                state = self._state[key]
                rank = state.dim()
                tensor = (state[lo:hi] if axis == "rows" or rank == 1 else state[:, lo:hi]).clone()
        except KeyError:
            raise UsageError(f"{self.weights}: no tensor {key}; the checkpoint is incomplete") from None
        text = f"[{lo}:{hi}]" if rank == 1 else (f"[{lo}:{hi}, :]" if axis == "rows" else f"[:, {lo}:{hi}]")
        return tensor, text


def as_float64(tensor: Array) -> np.ndarray:
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float64)
    return tensor.detach().double().numpy()


def weight_stats(tensor: Array) -> dict[str, float]:
    """mean, std (unbiased, as torch.std) and Frobenius norm, computed in float64."""
    import numpy as np

    values = as_float64(tensor)
    std = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return {"mean": float(values.mean()), "std": std, "norm": float(np.linalg.norm(values))}


def describe(tensor: Array) -> tuple[list[int], str, int]:
    """shape, dtype name and bytes, the same for a NumPy array and a torch tensor."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return list(tensor.shape), str(tensor.dtype), int(tensor.nbytes)
    return list(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()


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
