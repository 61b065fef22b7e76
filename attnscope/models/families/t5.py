"""T5 <- EncoderDecoder <- Family; Umt5 <- T5

T5 (and mT5, UMT5): an encoder-decoder with a learned relative position bias instead of position embeddings.

Checkpoint keys (`T5ForConditionalGeneration`, `T5Model`; bare, no prefix):

    shared.weight [vocab, d_model]  (encoder.embed_tokens, decoder.embed_tokens: the same table, tied)
    encoder.block.L.layer.0.SelfAttention.{q,k,v,o}.weight     q, k, v [n_head·d_kv, d_model]: head h = rows h·d_kv ...
    encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight  [num_buckets, n_head]: layer 0's only
    encoder.block.L.layer.0.layer_norm.weight, encoder.block.L.layer.1.{layer_norm, DenseReluDense.wi, .wo}
    decoder.block.L.layer.0.SelfAttention.*          the decoder's causal self-attention (its own bias table)
    decoder.block.L.layer.1.EncDecAttention.{q,k,v,o}.weight   cross-attention: q from the decoder, k, v from memory
    decoder.block.L.layer.{1,2}.layer_norm, decoder.block.L.layer.2.DenseReluDense.*
    encoder.final_layer_norm.weight, decoder.final_layer_norm.weight

What T5 does differently (transformers' modeling_t5.py):
- No position embeddings: layer 0's self-attention of each stack holds a table of `relative_attention_num_buckets`
  numbers per head; the distance j - i of key j from query i falls in a bucket (exact for small distances, then
  logarithmic up to `relative_attention_max_distance`; the encoder's buckets tell left from right, the decoder's
  see only the past), and the table's number for that bucket is added to the score (`T5Attention.compute_bias`,
  `_relative_position_bucket`). The bias is computed in layer 0 and shared by every layer of the stack. UMT5
  gives every layer its own table. Cross-attention has no bias.
- No 1/sqrt(d_head) on the scores (`T5Attention.scaling = 1.0`): Mesh TensorFlow folds it into the query
  weights' initialisation (std `(d_model·d_kv)^-½` for W_q against `d_model^-½` for W_k and W_v).
- `T5LayerNorm`: RMS normalisation, no mean subtracted and no bias, pre-norm before every sublayer.
- `d_kv` (d_head) is its own setting; no biases anywhere; the feed-forward is `wo(relu(wi(x)))`, or gated
  (`feed_forward_proj = "gated-gelu"`, T5 v1.1, mT5: `wo(gelu_new(wi_0(x)) · wi_1(x))`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from attnscope.errors import UsageError
from attnscope.models import blocks
from attnscope.models.families.seq2seq import BiasSteps, EncoderDecoder, Stack

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


def _attention(stack: str, sublayer: str, module: str) -> Stack:
    names = {x: f"{sublayer}.{module}.{x}" for x in "qkvo"}
    return Stack(f"{stack}.block", names, f"{sublayer}.layer_norm")


class T5(EncoderDecoder):
    model_types: ClassVar[tuple[str, ...]] = ("t5", "mt5")
    layers = "encoder.block"
    query = "layer.0.SelfAttention.q.weight"
    prefixes = ("",)
    stacks: ClassVar[dict[str, Stack]] = {"encoder": _attention("encoder", "layer.0", "SelfAttention"),
                                          "decoder": _attention("decoder", "layer.0", "SelfAttention"),
                                          "cross": _attention("decoder", "layer.1", "EncDecAttention")}
    ffn_norms: ClassVar[dict[str, str]] = {"encoder": "layer.1.layer_norm", "decoder": "layer.2.layer_norm"}
    pre_norm = True
    bias_in_every_layer = False  # UMT5: each layer its own table

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        encoder = config.integer("num_layers")
        n_head = config.integer("num_heads")
        self.sizes = {"encoder": (encoder, n_head),
                      "decoder": (config.integer("num_decoder_layers", default=encoder), n_head)}
        self.d_model = config.integer("d_model")
        self.d_head = config.integer("d_kv", default=self.d_model // n_head)
        self.finish_sizes()

    def biases(self) -> tuple[bool, bool]:
        return False, False

    def scale(self) -> float | None:
        return 1.0

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is not None:
            return super().notes(layer, head)
        return ["T5 does not scale the scores by 1/√d_head (T5Attention.scaling = 1.0): Mesh TensorFlow folds it "
                "into W_q's initialisation, std (d_model·d_kv)^-½ against d_model^-½ for W_k and W_v"]

    # --- the relative position bias ---------------------------------------------------------------------

    def bias_key(self, layer: int) -> str:
        return self.key(layer if self.bias_in_every_layer else 0,
                        f"{self.stack.names['q'].rsplit('.', 1)[0]}.relative_attention_bias.weight")

    def position_bias(self, layer: int, n_Q: int, n_K: int, first: int = 0) -> BiasSteps | None:
        """`T5Attention.compute_bias(query_length, key_length, past_seen_tokens=first)`: the table's row for each
        (query, key) distance's bucket, per head; the queries at positions first..first + n_Q - 1 (a block of rows of a
        long input, models/forward/seq2seq_long.py), the keys at 0..n_K - 1."""
        if self.kind == "cross":
            return None
        buckets_n = self.config.integer("relative_attention_num_buckets", default=32)
        distance = self.config.integer("relative_attention_max_distance", default=128)
        bidirectional = self.kind == "encoder"
        buckets = relative_buckets(n_Q, n_K, bidirectional, buckets_n, distance, first)  # [n_Q, n_K]
        key = self.bias_key(layer)
        table = self.checkpoint.tensor(key)  # [num_buckets, n_head]
        if list(table.shape) != [buckets_n, self.n_head]:
            raise UsageError(f"{key} is {list(table.shape)} but config.json says {buckets_n} buckets and "
                             f"{self.n_head} heads; config.json does not describe these weights")
        bias = table[buckets].permute(2, 0, 1)[None]  # [n_Q, n_K, n_head] -> [1, n_head, n_Q, n_K]
        which = f"layer {layer}'s own" if self.bias_in_every_layer else "layer 0's, shared by every layer"
        side = "left from right" if bidirectional else "the past only"
        module = key.removesuffix(".relative_attention_bias.weight")
        return BiasSteps(bias, f"relative_attention_bias.weight[position_buckets] ({module}), as [1, n_head, n_Q, "
                               f"n_K]: {which}", buckets,
                         f"_relative_position_bucket(j - i): {buckets_n} buckets ({side}), exact below "
                         f"{buckets_n // (4 if bidirectional else 2)}, logarithmic to {distance}")

    # --- the rest of the layers -------------------------------------------------------------------------

    def norm(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """`T5LayerNorm`: `x / sqrt(mean(x²) + eps) · w`, no mean subtracted, no bias."""
        eps = self.config.number("layer_norm_epsilon", default=1e-6)
        return blocks.rms_norm(x, self.weight(layer, f"{name}.weight"), eps)

    def feed_forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`T5DenseActDense` or, for `gated-ACT`, `T5DenseGatedActDense`."""
        import torch.nn.functional as F

        kind = self.config.string("feed_forward_proj", default="relu")
        parts = kind.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise UsageError(f"{self.config.path}: feed_forward_proj {kind!r} is not 'ACT' or 'gated-ACT'")
        name = "gelu_new" if kind == "gated-gelu" else parts[-1]  # T5Config's backward compatibility
        act = blocks.activation(name, f"{self.config.path}: feed_forward_proj")
        stem = self.ffn_norms[self.side].replace("layer_norm", "DenseReluDense")  # layer.1 / layer.2
        down = self.weight(layer, f"{stem}.wo.weight")
        if len(parts) == 2:
            gate, up = (self.weight(layer, f"{stem}.wi_{i}.weight") for i in (0, 1))
            return blocks.gated_mlp(x, gate, up, down, act)
        return F.linear(act(F.linear(x, self.weight(layer, f"{stem}.wi.weight"))), down)  # [.., d_model]

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """The shared token table (T5 has no position embeddings and no scale)."""
        own = f"{self.prefix}{self.side}.embed_tokens.weight"
        key = own if own in self.checkpoint else f"{self.prefix}shared.weight"
        return self.checkpoint.rows(key, ids)[None]  # [1, n_tokens, d_model]

    def encoder_output(self, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        key = f"{self.prefix}encoder.final_layer_norm.weight"
        eps = self.config.number("layer_norm_epsilon", default=1e-6)
        n = self.sizes["encoder"][0]
        return (blocks.rms_norm(h, self.checkpoint.tensor(key), eps),
                f"encoder.final_layer_norm(h): the encoder's output after its {n} layers (T5Stack)")

    def decoder_start(self) -> int:
        return self.config.integer("decoder_start_token_id", "pad_token_id", default=0, minimum=0)

    scales_output: ClassVar[bool | None] = None  # UMT5: always (UMT5Config forces tie_word_embeddings)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`T5ForConditionalGeneration.forward` after the decoder's last layer: `decoder.final_layer_norm`, times
        d_model^-½ where T5Config's `scale_decoder_outputs` (config.json's tie_word_embeddings not false; UMT5's
        forward scales always), then `lm_head` (the shared table where the checkpoint holds no lm_head)."""
        import torch.nn.functional as F

        eps = self.config.number("layer_norm_epsilon", default=1e-6)
        h = blocks.rms_norm(h, self.checkpoint.tensor(f"{self.prefix}decoder.final_layer_norm.weight"), eps)
        scales = self.scales_output
        if scales is None:
            scales = self.config.raw("tie_word_embeddings", default=True) is not False
        if scales:
            h = h * self.d_model**-0.5
        head = "lm_head.weight" if "lm_head.weight" in self.checkpoint else f"{self.prefix}shared.weight"
        return F.linear(h, self.checkpoint.tensor(head))  # [1, n, vocab]


class Umt5(T5):
    """UMT5: T5's layout, each layer with its own relative position bias table (`UMT5Attention`)."""

    model_types = ("umt5",)
    bias_in_every_layer = True
    scales_output = True


def relative_buckets(n_Q: int, n_K: int, bidirectional: bool, num_buckets: int, max_distance: int,
                     first: int = 0) -> torch.Tensor:
    """`T5Attention._relative_position_bucket` of `j - i` for query i (at first..first + n_Q - 1, compute_bias's
    `past_seen_tokens`) and key j, `[n_Q, n_K]` int64. Half the
    buckets (bidirectional: half of each side's) hold distances one by one; the rest grow logarithmically up to
    `max_distance`, beyond which every distance shares the last bucket."""
    import torch

    relative = torch.arange(n_K)[None, :] - torch.arange(first, first + n_Q)[:, None]  # [n_Q, n_K]: j - i
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets  # keys after the query take the upper half
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)  # the decoder sees only the past: distance i - j >= 0
    exact = num_buckets // 2
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(relative < exact, relative, large)
