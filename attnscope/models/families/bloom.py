"""Bloom <- Family: BigScience's BLOOM (transformers' `BloomForCausalLM`), a decoder with ALiBi in place of
position embeddings, a LayerNorm on the token embeddings, and query/key/value fused per head. Falcon (falcon.py)
keeps its names and layout and says what differs.

Checkpoint keys, under `transformer.` in `BloomForCausalLM` and bare in `BloomModel`:

    word_embeddings.weight [vocab, d_model], word_embeddings_layernorm.{weight,bias}, ln_f.{weight,bias}
    h.L.input_layernorm, h.L.post_attention_layernorm                                 LayerNorm
    h.L.self_attention.query_key_value.{weight,bias}  [3·d_model, d_model]            fused per head:
        query head h  rows  3·h·d_head ...,  its key  rows  (3·h + 1)·d_head ...,  its value  (3·h + 2)·d_head ...
        (`BloomAttention._reshape` views the output as [n_tokens, n_head, 3, d_head])
    h.L.self_attention.dense.{weight,bias}  [d_model, d_model]                         head h = columns h·d_head ...
    h.L.mlp.dense_h_to_4h, h.L.mlp.dense_4h_to_h                                      biased, BLOOM's tanh GELU

A block (`BloomBlock`): `x = LN(h)`, `a = attention(x) + h`, `y = LN(a)`, `h' = mlp(y) + a`; with
`apply_residual_connection_post_layernorm` the residuals are the normed `x` and `y` instead of `h` and `a`.
The attention (`BloomAttention.forward`) is causal, scaled by 1/sqrt(d_head), with ALiBi added by
`alibi.baddbmm(Q, Kᵀ, beta=1, alpha=1/sqrt(d_head))`: the bias `m_h · j` (`build_alibi_tensor`, slopes
`_get_alibi_slopes`), unscaled. attnscope's `alibi_bias` is the paper's `-m_h · (i - j)` with the same slopes
(alibi.py): the two differ by `m_h · i`, one constant per query row, so the softmax, and every pattern, agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models import blocks, lm_head
from attnscope.models.family import Family, Slice, check_sizes
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config

QKV, OUT = "self_attention.query_key_value", "self_attention.dense"


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """`bloom_gelu_forward`: GELU's tanh approximation with BLOOM's constant 0.79788456."""
    import torch

    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class Bloom(Family):
    model_types = ("bloom",)
    layers = "h"
    query = f"{QKV}.weight"
    prefixes = ("transformer.", "")
    embedding = "word_embeddings.weight"  # the token embedding, [vocab, d_model] (models/shapes.py)

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_layer = config.integer("n_layer", "num_hidden_layers")
        self.n_head = config.integer("n_head", "num_attention_heads")
        self.n_kv_head = self.kv_heads()
        self.d_model = config.integer("hidden_size", "n_embed")
        if self.d_model % self.n_head:
            raise UsageError(f"{config.path}: hidden_size {self.d_model} is not divisible by the {self.n_head} "
                             "attention heads; fix config.json")
        self.d_head = self.d_model // self.n_head
        check_sizes(self)

    def kv_heads(self) -> int:
        """BLOOM's heads each have their own key and value."""
        return self.n_head

    # --- where head h lives ---------------------------------------------------------------------------------

    def qkv_rows(self, head: int) -> dict[str, int]:
        """Where head h's query rows and its key and value rows start in query_key_value: [n_head, 3, d_head]."""
        d = self.d_head
        return {"Q": 3 * head * d, "K": (3 * head + 1) * d, "V": (3 * head + 2) * d}

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        d, rows = self.d_head, self.qkv_rows(head)
        fused, bias = self.key(layer, f"{QKV}.weight"), self.key(layer, f"{QKV}.bias")
        parts = [Slice(f"W_{n}", fused, "rows", rows[n], rows[n] + d) for n in ("Q", "K", "V")]
        if self.biases()[0]:
            parts += [Slice(f"b_{n}", bias, "rows", rows[n], rows[n] + d) for n in ("Q", "K", "V")]
        return [*parts, Slice("W_O", self.key(layer, f"{OUT}.weight"), "cols", head * d, (head + 1) * d)]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        placed = ", ".join(f"W_{n} rows {lo}:{lo + self.d_head}" for n, lo in self.qkv_rows(head).items())
        return [f"query_key_value is fused per head ([n_head, 3, d_head] rows): head {head} has {placed}",
                *super().notes(layer, head)]

    # --- the attention's specifics ----------------------------------------------------------------------

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(causal=True, alibi=True)

    def projections(self, layer: int) -> dict[str, Any]:
        """W_q, W_k, W_v: every head's rows of its third of query_key_value; W_o: dense."""
        state = {}
        for ours, which in (("W_q", 0), ("W_k", 1), ("W_v", 2)):
            for part in ("weight", "bias"):
                fused = self.weight(layer, f"{QKV}.{part}")  # [3·d_model(, d_model)]
                # [n_head, 3, d_head(, d_model)]
                per_head = fused.reshape(self.n_head, 3, self.d_head, *fused.shape[1:])
                # [n_head·d_head(, d_model)]
                state[f"{ours}.{part}"] = per_head[:, which].reshape(self.n_head * self.d_head, *fused.shape[1:])
        return state | {f"W_o.{part}": self.weight(layer, f"{OUT}.{part}") for part in ("weight", "bias")}

    # --- the prefix -----------------------------------------------------------------------------------------

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm `name` (a full key without `.weight`) with its bias."""
        eps = self.config.number("layer_norm_epsilon", default=1e-5)
        return blocks.layer_norm(x, self.checkpoint.tensor(f"{name}.weight"), self.checkpoint.tensor(f"{name}.bias"),
                                 eps)

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """`BloomModel.forward`: the token embeddings, then word_embeddings_layernorm."""
        h = self.checkpoint.rows(f"{self.prefix}word_embeddings.weight", ids)[None]  # [1, n_tokens, d_model]
        return self.norm(f"{self.prefix}word_embeddings_layernorm", h)

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        return (self.norm(self.key(layer, "input_layernorm"), h),
                f"input_layernorm(h): LayerNorm of the residual stream entering layer {layer}")

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`BloomMLP`: dense_h_to_4h, BLOOM's GELU, dense_4h_to_h."""
        up, down = (f"mlp.{n}" for n in ("dense_h_to_4h", "dense_4h_to_h"))
        return blocks.plain_mlp(x, self.weight(layer, f"{up}.weight"), self.weight(layer, f"{up}.bias"),
                                self.weight(layer, f"{down}.weight"), self.weight(layer, f"{down}.bias"), bloom_gelu)

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        """`BloomBlock.forward`."""
        post = self.config.flag("apply_residual_connection_post_layernorm")
        x = self.attention_input(layer, h)[0]
        a = attention(x)["x"] + (x if post else h)
        y = self.norm(self.key(layer, "post_attention_layernorm"), a)
        return self.mlp(layer, y) + (y if post else a)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`BloomForCausalLM`: ln_f, then lm_head, tied to word_embeddings."""
        head = lm_head.weight(self, "word_embeddings.weight", True)  # [vocab, d_model]
        return self.norm(f"{self.prefix}ln_f", h) @ head.T  # [1, n, vocab]
