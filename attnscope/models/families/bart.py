"""Bart <- EncoderDecoder <- Family; Marian, MBart <- Bart

BART, Marian and mBART: encoder-decoders whose every attention is `BartAttention` (transformers'
modeling_bart.py; Marian's and mBART's are copies of it).

Checkpoint keys, under `model.` in `BartForConditionalGeneration`, `MarianMTModel`, `MBartForConditionalGeneration`
and bare in `BartModel`:

    shared.weight [vocab, d_model]  (encoder.embed_tokens, decoder.embed_tokens: tied to it, or their own)
    encoder.embed_positions.weight [max_position_embeddings + 2, d_model]   BART, mBART: learned, offset 2
    encoder.layernorm_embedding.{weight,bias}                               BART, mBART
    encoder.layers.L.self_attn.{q,k,v,out}_proj.{weight,bias}   Linear [d_model, d_model]: head h = rows h·d_head ...
    encoder.layers.L.self_attn_layer_norm, encoder.layers.L.{fc1,fc2}, encoder.layers.L.final_layer_norm
    decoder.layers.L.self_attn.*                    the decoder's causal self-attention
    decoder.layers.L.encoder_attn.{q,k,v,out}_proj  cross-attention: q from the decoder, k and v from memory
    decoder.layers.L.encoder_attn_layer_norm
    encoder.layer_norm, decoder.layer_norm           mBART's final norms

`BartAttention`: four Linear layers with biases, `q` scaled by `head_dim ** -0.5` (`self.scaling`), no mask in
the encoder or across, a causal one in the decoder. The families differ around it:
- BART: post-norm (`h = LayerNorm(h + attention(h))`), learned positions with an offset of 2
  (`BartLearnedPositionalEmbedding`: position p reads row p + 2, a legacy of fairseq's padding index), and
  `layernorm_embedding` after the embeddings; tokens scaled by sqrt(d_model) when `scale_embedding`.
- Marian: post-norm, no `layernorm_embedding`, and sinusoidal positions (`MarianSinusoidalPositionalEmbedding`:
  sines in the first half of each vector, cosines in the second; not stored in the checkpoint); tokens scaled
  by sqrt(d_model) (`scale_embedding`, true for every published Marian model).
- mBART: pre-norm (`h = h + attention(LayerNorm(h))`), BART's learned positions and `layernorm_embedding`, and a
  final `layer_norm` at the end of each stack; its decoder starts from the target language's code, which
  `shift_tokens_right` (modeling_mbart.py) moves from the end of the target's tokens to the front.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from attnscope.errors import UsageError
from attnscope.models import blocks
from attnscope.models.families.seq2seq import EncoderDecoder, Stack

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


def _attention(stack: str, module: str, norm: str) -> Stack:
    names = {"q": f"{module}.q_proj", "k": f"{module}.k_proj", "v": f"{module}.v_proj", "o": f"{module}.out_proj"}
    return Stack(f"{stack}.layers", names, norm)


STACKS = {"encoder": _attention("encoder", "self_attn", "self_attn_layer_norm"),
          "decoder": _attention("decoder", "self_attn", "self_attn_layer_norm"),
          "cross": _attention("decoder", "encoder_attn", "encoder_attn_layer_norm")}


class Bart(EncoderDecoder):
    model_types: ClassVar[tuple[str, ...]] = ("bart",)
    layers = "encoder.layers"
    query = "self_attn.q_proj.weight"
    prefixes = ("model.", "")
    stacks: ClassVar[dict[str, Stack]] = STACKS
    ffn_norms: ClassVar[dict[str, str]] = {"encoder": "final_layer_norm", "decoder": "final_layer_norm"}
    pre_norm = False
    position_offset: ClassVar[int | None] = 2  # learned positions, row p + 2; None: Marian's sinusoids
    embedding_norm = True  # layernorm_embedding after the embeddings
    final_norm = False  # a layer_norm at the end of each stack (mBART)

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.sizes = {side: (config.integer(f"{side}_layers", "num_hidden_layers"),
                             config.integer(f"{side}_attention_heads", "num_attention_heads"))
                      for side in ("encoder", "decoder")}
        self.d_model = config.integer("d_model", "hidden_size")
        for side, (_, n_head) in self.sizes.items():
            if self.d_model % n_head:
                raise UsageError(f"{config.path}: d_model {self.d_model} is not divisible by {side}_attention_heads "
                                 f"{n_head}; fix config.json")
        # each stack its own heads (BartAttention(embed_dim, encoder_attention_heads) in the encoder,
        # decoder_attention_heads in both of the decoder's attentions), each d_model // its heads wide
        self.d_heads = {side: self.d_model // n_head for side, (_, n_head) in self.sizes.items()}
        self.d_head = self.d_heads["encoder"]
        limit = self.config.integer("max_position_embeddings", default=1024)
        self.max_positions = {"encoder": limit, "decoder": limit}
        self.finish_sizes()

    # --- the sublayers ----------------------------------------------------------------------------------

    def norm(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self._layer_norm(self.key(layer, name), x)

    def _layer_norm(self, stem: str, x: torch.Tensor) -> torch.Tensor:
        """`nn.LayerNorm(d_model)` with its default eps, 1e-5."""
        return blocks.layer_norm(x, self.checkpoint.tensor(f"{stem}.weight"), self.checkpoint.tensor(f"{stem}.bias"),
                                 1e-5)

    def feed_forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`fc2(act(fc1(x)))` with `activation_function` (gelu for BART)."""
        act = blocks.activation(self.config.raw("activation_function", default="gelu"),
                                f"{self.config.path}: activation_function")
        return blocks.plain_mlp(x, self.weight(layer, "fc1.weight"), self.weight(layer, "fc1.bias"),
                                self.weight(layer, "fc2.weight"), self.weight(layer, "fc2.bias"), act)

    # --- embeddings and the stacks' ends ----------------------------------------------------------------

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """Tokens (times sqrt(d_model) with `scale_embedding`) plus positions, then `layernorm_embedding`."""
        stem = f"{self.prefix}{self.side}"
        own = f"{stem}.embed_tokens.weight"
        tokens = self.checkpoint.rows(own if own in self.checkpoint else f"{self.prefix}shared.weight", ids)
        if self.config.flag("scale_embedding"):
            tokens = tokens * math.sqrt(self.d_model)
        h = (tokens + self.positions(len(ids)))[None]  # [1, n_tokens, d_model]
        return self._layer_norm(f"{stem}.layernorm_embedding", h) if self.embedding_norm else h

    def positions(self, n: int) -> torch.Tensor:
        """`BartLearnedPositionalEmbedding`: rows 2 .. n + 1 of the table, `[n, d_model]`."""
        assert self.position_offset is not None
        offset = self.position_offset
        return self.checkpoint.rows(f"{self.prefix}{self.side}.embed_positions.weight", list(range(offset, n + offset)))

    def encoder_output(self, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        n = self.sizes["encoder"][0]
        if self.final_norm:
            return (self._layer_norm(f"{self.prefix}encoder.layer_norm", h),
                    f"encoder.layer_norm(h): the encoder's output after its {n} layers")
        return h, f"the encoder's output: the stream after its {n} layers (no final norm)"

    def decoder_start(self) -> int:
        start = self.config.optional_integer("decoder_start_token_id", minimum=0)
        if start is None:
            raise UsageError(f"{self.config.path} has no decoder_start_token_id, so the decoder has no first "
                             "token; give {target}", "target")
        return start

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`BartForConditionalGeneration.forward` (MarianMTModel's, MBart's; Whisper's `proj_out`) after the
        decoder's last layer: its final `layer_norm` where the stack has one (mBART, Whisper), the language-model
        head (tied to the token table where the checkpoint holds none), plus `final_logits_bias` where stored."""
        import torch.nn.functional as F

        if self.final_norm:
            h = self._layer_norm(f"{self.prefix}decoder.layer_norm", h)
        heads = ("lm_head.weight", "proj_out.weight", f"{self.prefix}decoder.embed_tokens.weight",
                 f"{self.prefix}shared.weight")
        head = next(key for key in heads if key in self.checkpoint)
        logits = F.linear(h, self.checkpoint.tensor(head))  # [1, n, vocab]
        if "final_logits_bias" in self.checkpoint:
            logits = logits + self.checkpoint.tensor("final_logits_bias")  # [1, vocab]
        return logits


class Marian(Bart):
    model_types = ("marian",)
    position_offset = None
    embedding_norm = False

    def positions(self, n: int) -> torch.Tensor:
        """`MarianSinusoidalPositionalEmbedding.create_weight`: position p, feature j's angle p / 10000^(2·(j//2)/d);
        sines of the even j in the first half, cosines of the odd j in the second (computed in float64 as NumPy
        does there, then float32)."""
        import numpy as np
        import torch

        d = self.d_model
        angle = np.array([[p / np.power(10000, 2 * (j // 2) / d) for j in range(d)] for p in range(n)])  # [n, d]
        half = d // 2 if d % 2 == 0 else d // 2 + 1
        table = torch.empty(n, d, dtype=torch.float32)
        table[:, :half] = torch.tensor(np.sin(angle[:, 0::2]), dtype=torch.float32)
        table[:, half:] = torch.tensor(np.cos(angle[:, 1::2]), dtype=torch.float32)
        return table


class MBart(Bart):
    model_types = ("mbart",)
    pre_norm = True
    final_norm = True

    def decoder_ids(self, target: list[int] | None) -> list[int]:
        """mBART's `shift_tokens_right`: the target's last token (its language code, after `</s>`) moves to the
        front; without a target, the decoder starts from `decoder_start_token_id`."""
        if not target:
            return [self.decoder_start()]
        return [target[-1], *target[:-1]]
