"""Qwen3.5 (`qwen3_5_text`, and the text model of the multimodal `qwen3_5`): Qwen3-Next's layers (qwen3_next.py:
Gated DeltaNet linear layers, gated full attention with partial RoPE, (1 + w) norms) with the linear layers'
projections unfused and a dense SwiGLU MLP in every layer. transformers' `Qwen3_5DecoderLayer`
(models/qwen3_5/modeling_qwen3_5.py) is the reference.

Checkpoint keys, under `model.` (`Qwen3_5ForCausalLM`) or `model.language_model.` (`Qwen3_5ForConditionalGeneration`,
its settings under `text_config`); a linear layer's:

    layers.L.linear_attn.in_proj_qkv.weight  [2·n_k_head·d_K + n_head·d_V, d_model]  every q, every k, every v
    layers.L.linear_attn.in_proj_z.weight    [n_head·d_V, d_model]                   the output gates
    layers.L.linear_attn.in_proj_b.weight, in_proj_a.weight   [n_head, d_model]
    layers.L.linear_attn.conv1d.weight, A_log, dt_bias, norm.weight, out_proj.weight  as Qwen3-Next's

Its RoPE is multimodal (`mrope_section`: time, height and width interleaved); on text the three positions are the
token's, so it turns as Qwen3-Next's partial RoPE does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from attnscope.models.config import Config
from attnscope.models.families.qwen3_next import LINEAR, Qwen3Next

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.family import Slice


class Qwen3_5(Qwen3Next):  # noqa: N801 (transformers' name)
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_text", "qwen3_5")
    prefixes: ClassVar[tuple[str, ...]] = ("model.", "", "model.language_model.", "language_model.model.")
    default_head_dim = 256  # Qwen3_5TextConfig's
    qkv_op = "in_proj_qkv(X): every query, key and value"

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        self.model_type = config.model_type  # the checkpoint's own, not its text_config's (Family keeps it)
        if config.model_type == "qwen3_5":  # Qwen3_5ForConditionalGeneration: the text model's settings
            text = {**(config.mapping("text_config") or {}),
                    "tie_word_embeddings": config.data.get("tie_word_embeddings", False)}
            config = Config(config.path, {**text, "model_type": "qwen3_5_text"})
        super().__init__(folder, config, checkpoint)

    def sparse(self, layer: int) -> bool:
        """`Qwen3_5DecoderLayer`: a dense MLP in every layer."""
        return False

    def linear_projections(self, layer: int) -> dict[str, torch.Tensor]:
        import torch

        s = self.delta
        qkv = self.weight(layer, f"{LINEAR}.in_proj_qkv.weight")
        q, k, v = torch.split(qkv, [s.n_k_head * s.d_K, s.n_k_head * s.d_K, s.n_head * s.d_V])
        return {"q": q, "k": k, "v": v, **{n: self.weight(layer, f"{LINEAR}.in_proj_{n}.weight") for n in "zba"}}

    def linear_slices(self, layer: int, head: int) -> list[Slice]:
        from attnscope.models.family import Slice

        s = self.delta
        g = head // (s.n_head // s.n_k_head)
        key = lambda name: self.key(layer, f"{LINEAR}.{name}")  # noqa: E731
        qkv, width = key("in_proj_qkv.weight"), s.n_k_head * s.d_K
        return [Slice("W_Q", qkv, "rows", g * s.d_K, (g + 1) * s.d_K, dims=("d_K", "d_model")),
                Slice("W_K", qkv, "rows", width + g * s.d_K, width + (g + 1) * s.d_K, dims=("d_K", "d_model")),
                Slice("W_V", qkv, "rows", 2 * width + head * s.d_V, 2 * width + (head + 1) * s.d_V,
                      dims=("d_V", "d_model")),
                Slice("W_Z", key("in_proj_z.weight"), "rows", head * s.d_V, (head + 1) * s.d_V,
                      dims=("d_V", "d_model")),
                Slice("W_b", key("in_proj_b.weight"), "rows", head, head + 1, dims=("1", "d_model")),
                Slice("W_a", key("in_proj_a.weight"), "rows", head, head + 1, dims=("1", "d_model")),
                *self._shared_linear_slices(layer, head)]
