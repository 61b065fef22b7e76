"""The one small protocol every model family follows, and what families share around it.

A family module (bert.py, gpt2.py, llama.py, gemma2.py) says, for a checkpoint laid out its way:
- what its checkpoint calls each weight and where head h lives in them (`head_slices`);
- the attention's specifics in layer l (`attention_spec`: causal, RoPE, window, softcap, scale; `biases`)
  and its four projections as Linear weights (`projections`);
- how to run the prefix: `embed` the tokens, run a whole `block`, and give the `attention_input` X of a
  layer (after its input norm).
Everything else lives here once: finding the key prefix, range checks, reading a head's slices, building the
traced `MultiHeadAttention` of a layer with its weights loaded, running layers 0..L, and the head's own
steps sliced out of the layer's trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.models.checkpoint import Array, Checkpoint
    from attnscope.models.config import Config
    from attnscope.multihead import MultiHeadAttention
    from attnscope.spec import AttentionSpec
    from attnscope.trace import Trace

HEAD_DIMS = {"W_Q": ("d_head", "d_model"), "W_K": ("d_head", "d_model"), "W_V": ("d_head", "d_model"),
             "b_Q": ("d_head",), "b_K": ("d_head",), "b_V": ("d_head",), "W_O": ("d_model", "d_head")}


@dataclass(frozen=True)
class Slice:
    """Where one of head h's weights lives: rows (`axis="rows"`) or columns lo:hi of a checkpoint tensor.
    `transpose`: the checkpoint stores it [in, out] (GPT-2's Conv1D), shown as [out, in] like a Linear."""

    name: str  # W_Q, W_K, W_V, b_Q, b_K, b_V, W_O
    key: str
    axis: str
    lo: int
    hi: int
    transpose: bool = False


class Family:
    """A checkpoint of one family: its sizes from config.json, and the protocol's methods.

    Subclasses set `model_types`, `layers` (the layers' key, e.g. `encoder.layer`), `query` (layer 0's
    query weight under it, used to find the key prefix), the sizes in `__init__`, and the methods below.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    layers: ClassVar[str] = ""
    query: ClassVar[str] = ""
    prefixes: ClassVar[tuple[str, ...]] = ("",)  # where task models put the base model's keys

    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_head: int
    max_tokens: int | None = None  # learned position tables end; RoPE models have no hard limit

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        self.folder, self.config, self.checkpoint = folder, config, checkpoint
        self.architecture = config.architecture
        self.prefix = self._find_prefix()

    # --- the protocol: each family writes these --------------------------------------------------------

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        raise NotImplementedError

    def attention_spec(self, layer: int) -> AttentionSpec:
        """What layer `layer`'s attention computes: causal, RoPE, window, softcap, scale (attnscope.spec)."""
        raise NotImplementedError

    def biases(self) -> tuple[bool, bool]:
        """Whether the query/key/value projections, and the output projection, have biases."""
        return True, True

    def projections(self, layer: int) -> dict[str, torch.Tensor]:
        """`W_q.weight`, `W_q.bias`, ... `W_o.weight` as Linear weights `[out, in]`, float32."""
        raise NotImplementedError

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """The residual stream entering layer 0, `[1, n_tokens, d_model]`."""
        raise NotImplementedError

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        """X, what layer `layer`'s attention reads, and how it was made."""
        raise NotImplementedError

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        """A whole layer: the residual stream entering layer + 1."""
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------------------------

    @property
    def n_group(self) -> int:
        return self.n_head // self.n_kv_head

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def key(self, layer: int, name: str) -> str:
        return f"{self.prefix}{self.layers}.{layer}.{name}"

    def weight(self, layer: int, name: str) -> torch.Tensor:
        return self.checkpoint.tensor(self.key(layer, name))

    def check_sizes(self) -> None:
        """After a subclass read its sizes: heads that divide, every layer in the checkpoint, and the weights of the
        shapes the config implies (models/shapes.py)."""
        if self.n_head % self.n_kv_head:
            raise UsageError(f"{self.config.path}: {self.n_head} attention heads are not a multiple of "
                             f"{self.n_kv_head} key/value heads; fix config.json")
        last = self.key(self.n_layer - 1, self.query)
        if last not in self.checkpoint:
            present = sum(1 for layer in range(self.n_layer) if self.key(layer, self.query) in self.checkpoint)
            raise UsageError(f"{self.config.path} says {self.n_layer} layers but {self.checkpoint.source.name} holds "
                             f"{present} ({last} is missing); config.json does not describe these weights")
        from attnscope.models.shapes import check_weights

        check_weights(self)  # every attention weight's shape against the config, from the headers

    def check_position(self, layer: int, head: int) -> None:
        check_position(self.n_layer, self.n_head, layer, head)

    def check_length(self, n_tokens: int) -> None:
        """Learned position tables end: a longer text has no position to take."""
        if self.max_tokens is not None and n_tokens > self.max_tokens:
            raise UsageError(f"{{text}} is {n_tokens} tokens, more than this model's {self.max_tokens} positions; "
                             "shorten it", "text")

    def kv_head(self, head: int) -> int:
        """The key/value head that serves query head `head` (transformers' `repeat_kv` order)."""
        return head // self.n_group

    def head_notes(self, head: int) -> list[str]:
        if self.n_group == 1:
            return []
        g = self.kv_head(head)
        shared = ", ".join(str(h) for h in range(g * self.n_group, (g + 1) * self.n_group))
        return [f"W_K, W_V: KV head {g} of {self.n_kv_head} (= {head} // n_group {self.n_group}) serves query "
                f"heads {shared}"]

    def attention(self, layer: int, record: bool) -> MultiHeadAttention:
        """Layer `layer`'s attention as a MultiHeadAttention with the family's specifics and its weights."""
        from attnscope.multihead import MultiHeadAttention

        spec = replace(self.attention_spec(layer), n_kv_head=self.n_kv_head)
        qkv, out = self.biases()
        module = MultiHeadAttention(self.d_model, self.n_head, bias=qkv, record=record, device="meta",
                                    d_head=self.d_head, out_bias=out, spec=spec)
        module.load_state_dict(self.projections(layer), assign=True)
        return module.eval()

    def estimate_bytes(self, layer: int, n_tokens: int) -> int:
        """Memory of a run up to `layer`: its layers' weights as stored (the pages read) and as float32, plus the
        activations and the traced attention (scores, masked, capped and attention of every head)."""
        stem = f"{self.prefix}{self.layers}."
        needed = [k for k in self.checkpoint.keys if k.startswith(stem) and _layer_of(k[len(stem):]) <= layer]
        stored = sum(self.checkpoint.nbytes(k) for k in needed)
        numel = sum(self._numel(k) for k in needed)
        activations = 4 * n_tokens * (40 * self.d_model + 4 * self.n_head * n_tokens)
        return stored + 4 * numel + activations

    def _numel(self, key: str) -> int:
        import math

        return math.prod(self.checkpoint.shape(key))

    def _find_prefix(self) -> str:
        """"" for a base model, "model." / "bert." / "transformer." for task models that wrap it."""
        wanted = f"{self.layers}.0.{self.query}"
        for prefix in self.prefixes:
            if f"{prefix}{wanted}" in self.checkpoint:
                return prefix
        found = next((k for k in self.checkpoint.keys if k.endswith(wanted)), None)
        if found is None:
            raise UsageError(f"{self.checkpoint.source}: no {wanted}; this checkpoint is not laid out as "
                             f"{self.model_type}'s (model_type in config.json: '{self.model_type}')")
        return found.removesuffix(wanted)


def check_position(n_layer: int, n_head: int, layer: int, head: int) -> None:
    """Layer `layer` and head `head` exist in a model of `n_layer` layers of `n_head` heads."""
    if not 0 <= layer < n_layer:
        raise UsageError(f"{{layer}} {layer} is out of range: this model has {n_layer} layers, 0 to {n_layer - 1}",
                             "layer")
    if not 0 <= head < n_head:
        raise UsageError(f"{{head}} {head} is out of range: this model has {n_head} heads, 0 to {n_head - 1}",
                             "head")


def _layer_of(rest: str) -> int:
    """The layer number at the start of a key's rest (`3.self_attn.q_proj.weight` -> 3); huge when none."""
    number = rest.split(".", 1)[0]
    return int(number) if number.isdigit() else 1 << 62


# --- one head's weights -----------------------------------------------------------------------------------


@dataclass
class HeadWeights:
    """W_Q, W_K, W_V `[d_head, d_model]`, their biases `[d_head]` where the family has them, and W_O
    `[d_model, d_head]`, each with where it came from (`model.layers.0.self_attn.q_proj.weight[0:64, :]`)."""

    model: Family
    layer: int
    head: int
    tensors: dict[str, Array] = field(default_factory=dict)  # NumPy arrays where it could, else torch
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_torch(self) -> dict[str, torch.Tensor]:
        import torch

        return {name: t if isinstance(t, torch.Tensor) else torch.from_numpy(t.copy())
                for name, t in self.tensors.items()}


def head_weights(model: Family, layer: int, head: int) -> HeadWeights:
    """Read this head's slices only (from safetensors lazily, from a .bin through a memory map)."""
    model.check_position(layer, head)
    result = HeadWeights(model, layer, head, notes=model.head_notes(head))
    for part in model.head_slices(layer, head):
        tensor, text = model.checkpoint.slice(part.key, part.axis, part.lo, part.hi)
        if part.transpose and len(tensor.shape) == 2:
            tensor, text = tensor.T, f"{text}.T"
        result.tensors[part.name] = tensor
        result.sources[part.name] = f"{part.key}{text}"
    return result


def linear_slices(model: Family, layer: int, head: int, names: dict[str, str],
                  biases: tuple[bool, bool]) -> list[Slice]:
    """Head h in Linear weights stored `[out, in]`: rows of query/key/value (key/value rows of the KV head
    that serves h), columns of the output projection. `names` maps q, k, v, o to the layer's module names;
    `biases` says whether q/k/v and o have biases (the output bias is not per head, so it is not shown)."""
    d = model.d_head
    q, kv = head * d, model.kv_head(head) * d
    parts = [Slice("W_Q", model.key(layer, f"{names['q']}.weight"), "rows", q, q + d),
             Slice("W_K", model.key(layer, f"{names['k']}.weight"), "rows", kv, kv + d),
             Slice("W_V", model.key(layer, f"{names['v']}.weight"), "rows", kv, kv + d)]
    if biases[0]:
        parts += [Slice("b_Q", model.key(layer, f"{names['q']}.bias"), "rows", q, q + d),
                  Slice("b_K", model.key(layer, f"{names['k']}.bias"), "rows", kv, kv + d),
                  Slice("b_V", model.key(layer, f"{names['v']}.bias"), "rows", kv, kv + d)]
    parts.append(Slice("W_O", model.key(layer, f"{names['o']}.weight"), "cols", q, q + d))
    return parts


def linear_projections(model: Family, layer: int, names: dict[str, str]) -> dict[str, Any]:
    """MultiHeadAttention's W_q, W_k, W_v, W_o from four Linear layers of the checkpoint."""
    state = {}
    qkv, out = model.biases()
    for ours, theirs in (("W_q", names["q"]), ("W_k", names["k"]), ("W_v", names["v"]), ("W_o", names["o"])):
        state[f"{ours}.weight"] = model.weight(layer, f"{theirs}.weight")
        if out if ours == "W_o" else qkv:
            state[f"{ours}.bias"] = model.weight(layer, f"{theirs}.bias")
    return state


# --- running the prefix ----------------------------------------------------------------------------------


@dataclass
class LayerRun:
    """Layer L's attention on a sentence: every step of the layer (`layer`: X, Q_feat, ..., x, all heads)
    and head h's own slice of it (`head`: X, Q, K, V, ..., attention, out)."""

    layer: Trace
    head: Trace
    spec: AttentionSpec


def run_layer(model: Family, ids: list[int], type_ids: list[int], layer: int, head: int) -> LayerRun:
    """Embed, run layers 0..layer-1 whole, and layer `layer`'s attention traced (nothing after it)."""
    import torch

    with torch.no_grad():
        h = model.embed(ids, type_ids)  # [1, n_tokens, d_model]
        for earlier in range(layer):
            h = model.block(earlier, h, model.attention(earlier, record=False))
        X, made = model.attention_input(layer, h)  # [1, n_tokens, d_model]
        traced = model.attention(layer, record=True)(X)
    layer_trace = _layer_trace(traced, X, made)
    return LayerRun(layer_trace, _head_trace(model, layer_trace, head, model.biases()[0]), model.attention_spec(layer))


MODEL_DIMS = {"n_Q": "n_tokens", "n_K": "n_tokens", "d_feat": "d_model"}


def _layer_trace(inner: Trace, X: torch.Tensor, made: str) -> Trace:
    """X first, then MultiHeadAttention's steps with a model's axis names (a sentence has n_tokens queries and
    keys; the model's width is d_model) and X as the input of all three projections."""
    from attnscope.trace import Trace

    trace = Trace(notes=list(inner.notes))
    trace.add("X", X, ("n_batch", "n_tokens", "d_model"), made)
    inputs = {"Q_feat": "W_q(X)", "K_feat": "W_k(X)", "V_feat": "W_v(X)"}
    for step in inner.steps:
        dims = tuple(MODEL_DIMS.get(d, d) for d in step.dims)
        op = inputs.get(step.name, step.op.replace("d_feat", "d_model"))
        trace.add(step.name, step.tensor, dims, op, step.flops, step.allocates)
    return trace


# Head h's steps: (its name, the layer step it is a slice of, which head index: query head or KV head).
HEAD_STEPS = (("Q", "Q_split", "q"), ("K", "K_split", "kv"), ("V", "V_split", "kv"), ("Q_rot", "Q_rot", "q"),
              ("K_rot", "K_rot", "kv"), ("scores", "scores", "q"), ("capped_scores", "capped_scores", "q"),
              ("masked_scores", "masked_scores", "q"), ("attention", "attention", "q"), ("out", "x_raw", "q"))


def _head_trace(model: Family, layer: Trace, head: int, bias: bool) -> Trace:
    """Head h's own computation, as views into the layer's steps: its query rows, the keys and values of the
    KV head that serves it, its scores, pattern and output. Names as sdpa's (X, Q, K, V, ..., out)."""
    from attnscope.trace import Trace

    trace = Trace()
    X = layer.step("X")
    trace.add("X", X.tensor[0], X.dims[1:], f"{X.op} (n_batch 0)", allocates=False)
    index = {"q": head, "kv": model.kv_head(head)}
    formulas = {name: f" = X @ W_{name}.T" + (f" + b_{name}" if bias else "") for name in ("Q", "K", "V")}
    formulas["out"] = f" = attention @ {'V_rep' if 'V_rep' in layer else 'V_split'}[0, {head}]"
    for name, source, which in HEAD_STEPS:
        if source not in layer:
            continue
        step = layer.step(source)
        i = index[which]
        op = f"{source}[0, {i}]{formulas.get(name, '')}"
        trace.add(name, step.tensor[0, i], step.dims[2:], op, 0, allocates=False)
    return trace
