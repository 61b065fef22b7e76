"""Phi3 <- Llama <- Family

Phi-3 and Phi-4 (model_type "phi3": Phi-3 mini/medium, Phi-3.5 mini, Phi-4, Phi-4 mini): LLaMA's forward
(llama.py) with the projections fused, no biases, and RoPE that may turn only part of each head.

Checkpoint keys, under `model.` in `Phi3ForCausalLM`:

    layers.L.self_attn.qkv_proj.weight  [(n_head + 2·n_kv_head)·d_head, d_model]   Q, K, V stacked by rows:
        query head h      rows  h·d_head ...                                 (the first n_head·d_head rows)
        key of KV head g  rows  n_head·d_head + g·d_head ...                 (the next n_kv_head·d_head)
        value of KV head  rows  (n_head + n_kv_head)·d_head + g·d_head ...   (the last n_kv_head·d_head)
        with g = h // n_group, as `Phi3Attention.forward` slices `qkv[..., :query_pos]` and on
    layers.L.self_attn.o_proj.weight    [d_model, n_head·d_head]                   head h = columns h·d_head ...
    layers.L.mlp.gate_up_proj.weight    [2·d_ff, d_model]   gate rows first, then up: `down(up · act(gate))`
    layers.L.mlp.down_proj.weight, layers.L.{input,post_attention}_layernorm.weight

RoPE (`Phi3RotaryEmbedding`): `partial_rotary_factor` of each head turns (Phi-4 mini: 0.75), half-split, the
rest passes; `rope_scaling`/`rope_parameters` may be longrope (Phi-3 "128k", Phi-4 mini: short factors up to
`original_max_position_embeddings`, long ones past it; older configs say "su" or "yarn"), all read by
`Rope.from_config`. A `sliding_window` in the config applies to every layer (Phi-3 mini 4k: 2047).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.models import blocks
from attnscope.models.families.llama import Llama
from attnscope.models.family import Slice

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config

QKV, OUT = "self_attn.qkv_proj", "self_attn.o_proj"


class Phi3(Llama):
    model_types = ("phi3",)
    query = f"{QKV}.weight"
    whole_head_default = False  # Phi3RotaryEmbedding's default honours partial_rotary_factor

    # --- where head h lives ---------------------------------------------------------------------------------

    def biases(self) -> tuple[bool, bool]:
        return False, False  # Phi3Attention's qkv_proj and o_proj have none

    def mlp_biased(self) -> bool:
        return False

    def rows(self, head: int) -> dict[str, tuple[int, int]]:
        """Where head h's query rows and its KV head's key and value rows sit in qkv_proj."""
        d, g = self.d_head, head // self.n_group  # its KV head (transformers' repeat_kv order)
        keys = self.n_head * d
        values = keys + self.n_kv_head * d
        return {"W_Q": (head * d, (head + 1) * d), "W_K": (keys + g * d, keys + (g + 1) * d),
                "W_V": (values + g * d, values + (g + 1) * d)}

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        fused = self.key(layer, f"{QKV}.weight")
        parts = [Slice(name, fused, "rows", lo, hi) for name, (lo, hi) in self.rows(head).items()]
        lo = head * self.d_head
        return [*parts, Slice("W_O", self.key(layer, f"{OUT}.weight"), "cols", lo, lo + self.d_head)]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        rows = self.rows(head)
        placed = ", ".join(f"{name} rows {lo}:{hi}" for name, (lo, hi) in rows.items())
        return [f"qkv_proj stacks Q ({self.n_head}·{self.d_head} rows), K and V ({self.n_kv_head}·{self.d_head} "
                f"each): head {head} has {placed}", *super().notes(layer, head)]

    # --- the attention's specifics --------------------------------------------------------------------------

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        """`Phi3ForCausalLM.prepare_inputs_for_generation`: when the text first grows past
        `original_max_position_embeddings`, longrope turns to its long factors and the cache, rotated with the
        short ones, is dropped: that step runs the whole text again (`regenerate_past`)."""
        super().__init__(folder, config, checkpoint)
        self.regenerate_past = self._original_max()

    def _original_max(self) -> int | None:
        """transformers checks the config's own attribute (Phi3Config sets it from rope_parameters)."""
        parameters = self.config.mapping("rope_parameters") or self.config.mapping("rope_scaling") or {}
        value = self.config.raw("original_max_position_embeddings",
                                default=parameters.get("original_max_position_embeddings"))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def window(self, layer: int) -> int | None:
        return self.config.optional_integer("sliding_window")

    def projections(self, layer: int) -> dict[str, Any]:
        """W_q, W_k, W_v as row blocks of qkv_proj (views: nothing is copied), W_o as o_proj."""
        fused = self.weight(layer, f"{QKV}.weight")  # [(n_head + 2·n_kv_head)·d_head, d_model]
        q, kv = self.n_head * self.d_head, self.n_kv_head * self.d_head
        return {"W_q.weight": fused[:q], "W_k.weight": fused[q : q + kv], "W_v.weight": fused[q + kv :],
                "W_o.weight": self.weight(layer, f"{OUT}.weight")}

    # --- the prefix -----------------------------------------------------------------------------------------

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`Phi3MLP`: `gate, up = gate_up_proj(x).chunk(2)`, `down_proj(up · act(gate))`."""
        act = blocks.activation(self.config.raw("hidden_act", default="silu"), f"{self.config.path}: hidden_act")
        gate_up = self.weight(layer, "mlp.gate_up_proj.weight")  # [2·d_ff, d_model]
        gate, up = gate_up.chunk(2, dim=0)
        return blocks.gated_mlp(x, gate, up, self.weight(layer, "mlp.down_proj.weight"), act)
