"""Running an encoder-decoder as far as the attention asked for, and tracing that attention.

- `encoder`, layer L: the encoder's layers 0..L-1 whole, then layer L's self-attention traced.
- `decoder`, layer L: the whole encoder (its output is `memory`), the decoder's layers 0..L-1 whole (each
  attending over `memory`), then layer L's causal self-attention traced.
- `cross`, layer L: the same, then layer L's self-attention sublayer, then its cross-attention traced: queries
  from the decoder's stream, keys and values projected from `memory`.

Nothing after the traced attention runs. The layer's steps keep the model's names (`X`, `d_model`); in self-
attention n_Q = n_K = n_tokens (the source's in the encoder, the target's in the decoder), across they stay
apart: n_Q target tokens, n_K source tokens, and `memory` `[n_batch, n_K, d_model]` is a step of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.models.head_steps import head_trace
from attnscope.models.run import LayerRun

if TYPE_CHECKING:
    import torch

    from attnscope.models.seq2seq import BiasSteps, EncoderDecoder
    from attnscope.trace import Trace


def run_attention(model: EncoderDecoder, source: list[int] | torch.Tensor, target: list[int], kind: str,
                  layer: int, head: int) -> LayerRun:
    """`source`: the source tokens' ids (Whisper: its audio features); `target`: the ids the decoder reads."""
    import torch

    view = model.for_kind(kind)
    encoder = model.for_kind("encoder")
    memory: torch.Tensor | None = None
    memory_op = ""
    with torch.no_grad():
        h = model.embed_source(source)  # [1, n_source, d_model]
        for earlier in range(layer if kind == "encoder" else encoder.n_layer):
            h = encoder.block(earlier, h, encoder.attention(earlier, record=False))
        if kind != "encoder":
            memory, memory_op = encoder.encoder_output(h)  # [1, n_source, d_model]
            decoder = model.for_kind("decoder")
            h = decoder.embed(target, [0] * len(target))  # [1, n_target, d_model]
            for earlier in range(layer):
                h = model.decoder_block(earlier, h, memory)
            if kind == "cross":
                h = decoder.attend(layer, h)
        X, made = view.attention_input(layer, h)  # [1, n_Q, d_model]
        keys = memory if kind == "cross" else X
        assert keys is not None
        bias = view.position_bias(layer, X.shape[1], keys.shape[1])
        traced = view.attention(layer, record=True)(X, keys, keys, position_bias=bias.bias if bias else None)
    cross = kind == "cross"
    layer_trace = _layer_trace(traced, X, made, memory if cross else None, memory_op, bias)
    layer_trace.notes.extend(view.layer_notes(layer))
    return LayerRun(layer_trace, _head(view, layer_trace, head), view.attention_spec(layer))


SELF_DIMS = {"n_Q": "n_tokens", "n_K": "n_tokens", "d_feat": "d_model"}
CROSS_DIMS = {"d_feat": "d_model"}


def _layer_trace(inner: Trace, X: torch.Tensor, made: str, memory: torch.Tensor | None, memory_op: str,
                 bias: BiasSteps | None) -> Trace:
    """X (and across, memory) first, then MultiHeadAttention's steps with the model's axis names, X (or
    memory) as the projections' input, and T5's buckets before the bias they index."""
    from attnscope.trace import Trace

    names = SELF_DIMS if memory is None else CROSS_DIMS
    trace = Trace(notes=list(inner.notes))
    trace.add("X", X, ("n_batch", names.get("n_Q", "n_Q"), "d_model"), made)
    keys = "X"
    if memory is not None:
        trace.add("memory", memory, ("n_batch", "n_K", "d_model"), memory_op)
        keys = "memory"
    inputs = {"Q_feat": "W_q(X)", "K_feat": f"W_k({keys})", "V_feat": f"W_v({keys})"}
    for step in inner.steps:
        dims = tuple(names.get(d, d) for d in step.dims)
        op = inputs.get(step.name, step.op.replace("d_feat", "d_model"))
        if step.name == "position_bias" and bias is not None:
            if bias.buckets is not None:
                trace.add("position_buckets", bias.buckets, dims[-2:], bias.buckets_op)
            op = bias.op
        trace.add(step.name, step.tensor, dims, op, step.flops, step.allocates)
    return trace


def _head(model: EncoderDecoder, layer: Trace, head: int) -> Trace:
    """Head h's own steps (head_steps.py's), with `memory` after X across (K and V are projected from it) and the
    head's slice of the position bias after its scores."""
    from attnscope.trace import Trace

    base = head_trace(layer, head, model.kv_head(head), model.biases()[0])
    trace = Trace()
    for step in base.steps:
        op = step.op.replace("= X @ W_K", "= memory @ W_K").replace("= X @ W_V", "= memory @ W_V")
        trace.add(step.name, step.tensor, step.dims, op if "memory" in layer else step.op, 0, allocates=False)
        if step.name == "X" and "memory" in layer:
            memory = layer.step("memory")
            trace.add("memory", memory.tensor[0], memory.dims[1:], f"{memory.op} (n_batch 0)", allocates=False)
        if step.name == "scores" and "position_bias" in layer:
            for name in ("position_bias", "biased_scores"):
                whole = layer.step(name)
                trace.add(name, whole.tensor[0, head], whole.dims[2:], f"{name}[0, {head}]", allocates=False)
    return trace
