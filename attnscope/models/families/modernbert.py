"""ModernBert <- Family

ModernBERT (Answer.AI's, transformers' `ModernBertModel`): a BERT-like encoder with a fused query/key/value
projection, RoPE, pre-norm layers and alternating global and local (bidirectional sliding window) attention.

Checkpoint keys, under `model.` in `ModernBertForMaskedLM` (and the other task models), bare in `ModernBertModel`:

    embeddings.tok_embeddings.weight [vocab, d_model], embeddings.norm.weight        LayerNorm (no bias by default)
    layers.L.attn_norm.weight       LayerNorm before the attention (none in layer 0: `nn.Identity`)
    layers.L.attn.Wqkv.weight  [3·d_model, d_model]   Q rows 0..d_model-1, K rows d_model.., V rows 2·d_model..;
                                                      head h: rows h·d_head ... of each third
    layers.L.attn.Wo.weight  [d_model, d_model]       head h = columns h·d_head ...
    layers.L.mlp_norm.weight, layers.L.mlp.Wi.weight [2·d_ff, d_model], layers.L.mlp.Wo.weight [d_model, d_ff]
    final_norm.weight; (masked LM, outside `model.`) head.dense.weight, head.norm.weight, decoder.bias

`ModernBertAttention` views `Wqkv(x)` as `[.., 3, n_head, d_head]`, so the three thirds are Q, K and V and head h
is the h-th `d_head` rows of each. Biases (`attention_bias`, `mlp_bias`, `norm_bias`) are off by default.

Layers: `layer_types` (transformers 5), else every `global_attn_every_n_layers`-th layer (3) is global and the
others local, as 4.4x configs say it. A global layer sees every token; a local one sees the keys within
`local_attention // 2` positions either side (`window=local_attention, window_side="both"`: no causal mask).
RoPE has a base per kind: 160000 for global, 10000 for local (`rope_parameters` per layer type, or 4.4x
`global_rope_theta`/`local_rope_theta`), read by `Rope.from_config`.

A layer (`ModernBertEncoderLayer`): `h = h + attention(attn_norm(h))`, then `h = h + mlp(mlp_norm(h))`, the MLP
a GeGLU: `input, gate = Wi(x).chunk(2)`, `Wo(act(input) * gate)`. The embeddings are the token rows, normed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from attnscope.errors import UsageError
from attnscope.models import blocks
from attnscope.models.family import Family, Slice, check_sizes, encoder_sizes
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config

KINDS = ("full_attention", "sliding_attention")


class ModernBert(Family):
    model_types: ClassVar[tuple[str, ...]] = ("modernbert",)
    layers = "layers"
    query = "attn.Wqkv.weight"
    prefixes = ("model.", "")

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_layer, self.n_head, self.d_model, self.d_head = encoder_sizes(config)
        self.n_kv_head = self.n_head
        check_sizes(self)

    # --- where head h lives -------------------------------------------------------------------------------

    def biases(self) -> tuple[bool, bool]:
        on = self.config.flag("attention_bias")
        return on, on

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        d, D = self.d_head, self.d_model
        parts = [Slice(f"W_{name}", self.key(layer, "attn.Wqkv.weight"), "rows", third * D + head * d,
                       third * D + (head + 1) * d) for third, name in enumerate("QKV")]
        if self.biases()[0]:
            parts += [Slice(f"b_{name}", self.key(layer, "attn.Wqkv.bias"), "rows", third * D + head * d,
                            third * D + (head + 1) * d) for third, name in enumerate("QKV")]
        return [*parts, Slice("W_O", self.key(layer, "attn.Wo.weight"), "cols", head * d, (head + 1) * d)]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        d, D = self.d_head, self.d_model
        return [f"W_Q, W_K, W_V: the fused Wqkv holds Q, K and V as three {D}-row thirds; head {head} is rows "
                f"{head * d}:{(head + 1) * d} of each ({head * d}, {D + head * d} and {2 * D + head * d} onwards)"]

    # --- the attention's specifics ------------------------------------------------------------------------

    def layer_type(self, layer: int) -> str:
        """`layer_types[layer]`, or the 4.4x rule: global every `global_attn_every_n_layers`-th layer."""
        kinds = self.config.str_list("layer_types", self.n_layer)
        if kinds is not None:
            if kinds[layer] not in KINDS:
                raise UsageError(f"{self.config.path}: layer_types[{layer}] is {kinds[layer]!r}; ModernBERT's layers "
                                 f"are {' or '.join(KINDS)}")
            return kinds[layer]
        every = self.config.integer("global_attn_every_n_layers", default=3)
        return "sliding_attention" if layer % every else "full_attention"

    def attention_spec(self, layer: int) -> AttentionSpec:
        from attnscope.variants.rope import Rope

        kind = self.layer_type(layer)
        try:
            rope = Rope.from_config(self.config.data, kind, self.d_head)
        except UsageError as error:
            raise UsageError(f"{self.config.path}: {error}; fix config.json") from None
        if kind == "full_attention":
            return AttentionSpec(rope=rope)
        return AttentionSpec(rope=rope, window=self.config.integer("local_attention", default=128),
                             window_side="both")

    def projections(self, layer: int) -> dict[str, Any]:
        """Wqkv split into its three thirds, W_q, W_k, W_v; Wo as W_o."""
        q, k, v = self.weight(layer, "attn.Wqkv.weight").chunk(3)  # [3·d_model, d_model] -> 3 x [d_model, d_model]
        state = {"W_q.weight": q, "W_k.weight": k, "W_v.weight": v, "W_o.weight": self.weight(layer, "attn.Wo.weight")}
        if self.biases()[0]:
            q_bias, k_bias, v_bias = self.weight(layer, "attn.Wqkv.bias").chunk(3)
            state |= {"W_q.bias": q_bias, "W_k.bias": k_bias, "W_v.bias": v_bias,
                      "W_o.bias": self.weight(layer, "attn.Wo.bias")}
        return state

    # --- the prefix ---------------------------------------------------------------------------------------

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """`nn.LayerNorm(d_model, eps=norm_eps, bias=norm_bias)`."""
        bias = self.checkpoint.tensor(f"{name}.bias") if self.config.flag("norm_bias") else None
        eps = self.config.number("norm_eps", default=1e-5)
        return blocks.layer_norm(x, self.checkpoint.tensor(f"{name}.weight"), bias, eps)

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """`ModernBertEmbeddings`: the token rows, LayerNorm (no position table: RoPE places the tokens)."""
        stem = f"{self.prefix}embeddings"
        return self.norm(f"{stem}.norm", self.checkpoint.rows(f"{stem}.tok_embeddings.weight", ids))[None]

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        if layer == 0:
            return h, "the embeddings: layer 0 has no attn_norm (nn.Identity)"
        return (self.norm(self.key(layer, "attn_norm"), h),
                f"attn_norm(h): LayerNorm of the residual stream entering layer {layer}")

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`ModernBertMLP`: `input, gate = Wi(x).chunk(2)`, `Wo(act(input) * gate)`: a GeGLU."""
        act = blocks.activation(self.config.raw("hidden_activation", default="gelu"),
                                f"{self.config.path}: hidden_activation")
        first, second = self.weight(layer, "mlp.Wi.weight").chunk(2)  # `input` (activated) and `gate` rows
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None)
        if self.config.flag("mlp_bias"):
            first_bias, second_bias = self.weight(layer, "mlp.Wi.bias").chunk(2)
            biases = (first_bias, second_bias, self.weight(layer, "mlp.Wo.bias"))
        return blocks.gated_mlp(x, first, second, self.weight(layer, "mlp.Wo.weight"), act, biases)

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        h = h + attention(self.attention_input(layer, h)[0])["x"]
        return h + self.mlp(layer, self.norm(self.key(layer, "mlp_norm"), h))
