"""Gpt2 <- Family

GPT-2: a decoder with learned positions, pre-norm, and fused query/key/value weights.

Checkpoint keys, under `transformer.` in `GPT2LMHeadModel` and bare in `GPT2Model`:

    wte.weight [vocab, d_model], wpe.weight [n_positions, d_model], ln_f
    h.L.ln_1, h.L.attn.c_attn.{weight,bias}, h.L.attn.c_proj.{weight,bias}, h.L.ln_2, h.L.mlp.c_fc, h.L.mlp.c_proj

`c_attn` and `c_proj` are `Conv1D` layers, which store their weight `[in, out]`, the transpose of a Linear's:
`c_attn.weight` is `[d_model, 3·d_model]`, and its columns are Q's, then K's, then V's. Head h is columns
`h·d_head ... (h+1)·d_head - 1` of each third, and rows `h·d_head ...` of `c_proj.weight`. attnscope shows them
transposed, `[d_head, d_model]` and `[d_model, d_head]`, as every other family's.

A block (`GPT2Block`): `h = h + attn(ln_1(h))`, `h = h + mlp(ln_2(h))`; the attention is causal, scaled by
`1/sqrt(d_head)` when `scale_attn_weights` (the default), and by a further `1/(L + 1)` with
`scale_attn_by_inverse_layer_idx`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models import blocks, lm_head
from attnscope.models.family import Family, Slice, check_length, check_sizes
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


class Gpt2(Family):
    model_types = ("gpt2",)
    layers = "h"
    query = "attn.c_attn.weight"
    prefixes = ("", "transformer.")
    embedding = "wte.weight"  # the token embedding, [vocab, d_model] (models/shapes.py)

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_layer = config.integer("n_layer", "num_hidden_layers")
        self.n_head = self.n_kv_head = config.integer("n_head", "num_attention_heads")
        self.d_model = config.integer("n_embd", "hidden_size")
        if self.d_model % self.n_head:
            raise UsageError(f"{config.path}: n_embd {self.d_model} is not divisible by n_head {self.n_head}; "
                             "fix config.json")
        self.d_head = self.d_model // self.n_head
        self.max_tokens = config.integer("n_positions", "max_position_embeddings", default=1024)
        check_sizes(self)

    # --- where head h lives ---------------------------------------------------------------------------------

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        d, D = self.d_head, self.d_model
        lo = head * d
        fused, bias, out = self.key(layer, "attn.c_attn.weight"), self.key(layer, "attn.c_attn.bias"), \
            self.key(layer, "attn.c_proj.weight")
        return [Slice("W_Q", fused, "cols", lo, lo + d, transpose=True),
                Slice("W_K", fused, "cols", D + lo, D + lo + d, transpose=True),
                Slice("W_V", fused, "cols", 2 * D + lo, 2 * D + lo + d, transpose=True),
                Slice("b_Q", bias, "rows", lo, lo + d), Slice("b_K", bias, "rows", D + lo, D + lo + d),
                Slice("b_V", bias, "rows", 2 * D + lo, 2 * D + lo + d),
                Slice("W_O", out, "rows", lo, lo + d, transpose=True)]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        D = self.d_model
        return [f"GPT-2's c_attn is a Conv1D stored [in, out] = [{D}, {3 * D}]: columns 0-{D - 1} make Q, "
                f"{D}-{2 * D - 1} K, {2 * D}-{3 * D - 1} V; head {head}'s are a slice of each third, shown "
                "transposed (.T) to [d_head, d_model] like a Linear's rows; c_proj [in, out] likewise"]

    # --- the attention's specifics --------------------------------------------------------------------------

    def attention_spec(self, layer: int) -> AttentionSpec:
        scale = self.d_head ** -0.5 if self.config.flag("scale_attn_weights", default=True) else 1.0
        if self.config.flag("scale_attn_by_inverse_layer_idx"):
            scale /= float(layer + 1)
        return AttentionSpec(causal=True, scale=None if scale == self.d_head ** -0.5 else scale)

    def projections(self, layer: int) -> dict[str, Any]:
        D = self.d_model
        fused = self.weight(layer, "attn.c_attn.weight").T  # [d_model, 3·d_model] -> [3·d_model, d_model]: a Linear's
        bias = self.weight(layer, "attn.c_attn.bias")
        return {"W_q.weight": fused[:D], "W_k.weight": fused[D : 2 * D], "W_v.weight": fused[2 * D :],
                "W_q.bias": bias[:D], "W_k.bias": bias[D : 2 * D], "W_v.bias": bias[2 * D :],
                # [d_model, d_model], Conv1D's [in, out] as [out, in]
                "W_o.weight": self.weight(layer, "attn.c_proj.weight").T,
                "W_o.bias": self.weight(layer, "attn.c_proj.bias")}

    # --- the prefix -----------------------------------------------------------------------------------------

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        eps = self.config.number("layer_norm_epsilon", default=1e-5)
        weight, bias = self.checkpoint.tensor(f"{name}.weight"), self.checkpoint.tensor(f"{name}.bias")
        return blocks.layer_norm(x, weight, bias, eps)

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """`GPT2Model.forward`: token embedding + learned position embedding."""
        return self.embed_at(ids, 0)  # [1, n_tokens, d_model]

    def embed_at(self, ids: list[int], start: int) -> torch.Tensor:
        """Tokens at positions start, start + 1, ...: their embeddings and those positions' (a decode step)."""
        check_length(self.max_tokens, start + len(ids))
        h = (self.checkpoint.rows(f"{self.prefix}wte.weight", ids)
             + self.checkpoint.rows(f"{self.prefix}wpe.weight", list(range(start, start + len(ids)))))
        return h[None]  # [1, n, d_model]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`GPT2LMHeadModel`: the final LayerNorm ln_f, then the head, tied to wte."""
        # [.., n_tokens, d_model] @ [d_model, n_vocab]
        return self._norm(f"{self.prefix}ln_f", h) @ lm_head.weight(self, "wte.weight", ties_by_default=True).T

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        return (self._norm(self.key(layer, "ln_1"), h),
                f"ln_1(h): LayerNorm of the residual stream entering layer {layer}")

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        act = blocks.activation(self.config.raw("activation_function", default="gelu_new"),
                                f"{self.config.path}: activation_function")
        h = h + attention(self.attention_input(layer, h)[0])["x"]
        x = self._norm(self.key(layer, "ln_2"), h)
        fc = self.weight(layer, "mlp.c_fc.weight").T  # Conv1D [in, out] -> Linear [out, in]
        proj = self.weight(layer, "mlp.c_proj.weight").T  # Conv1D [in, out] -> Linear [out, in]
        return h + blocks.plain_mlp(x, fc, self.weight(layer, "mlp.c_fc.bias"), proj,
                                    self.weight(layer, "mlp.c_proj.bias"), act)
