"""Mpt <- Family: MosaicML's MPT (transformers' `MptForCausalLM`): a decoder with ALiBi (BLOOM's slopes, bloom.py),
LayerNorms without biases, and no bias anywhere.

Checkpoint keys, under `transformer.` in `MptForCausalLM` and bare in `MptModel`:

    wte.weight [vocab, d_model], norm_f.weight                       LayerNorm without bias (as every norm here)
    blocks.L.norm_1.weight, blocks.L.norm_2.weight
    blocks.L.attn.Wqkv.weight  [3·d_model, d_model]                  Q, K, V stacked by rows (`mixed_qkv.chunk(3)`):
        head h = rows h·d_head ... of each third
    blocks.L.attn.out_proj.weight  [d_model, d_model]                head h = columns h·d_head ...
    blocks.L.ffn.up_proj.weight, blocks.L.ffn.down_proj.weight       exact GELU between

A block (`MptBlock.forward`): `a = h + attention(norm_1(h))`, `h' = a + ffn(norm_2(a))`. The attention
(`MptAttention.forward`) is causal, scaled by `attn_config.softmax_scale` (default 1/sqrt(d_head)), with the
ALiBi bias `m_h · (j - n_K + 1)` (`build_mpt_alibi_tensor`): its slopes, `1 / 2^(8 k / 2^ceil(log2 n_head))`
with the odd k first where n_head is not a power of two, are BLOOM's `_get_alibi_slopes` reordered into the same
order, and the bias differs from the paper's `-m_h · (i - j)` (alibi.py) by one constant per query row, so
every pattern agrees. transformers reads neither `attn_config.alibi` nor `alibi_bias_max` (`MptModel.forward`
builds the bias with the default 8), nor `qk_ln`, `attn_type` or `no_bias`; this page follows it. The bias table
ends at `max_seq_len`, so a longer text has no position to take.

`attn_config.clip_qkv` (a clamp of the fused projection before the split) is not a step attnscope computes: such
a checkpoint runs through transformers (`reads` says no), its pattern exact, its steps untraced.
"""

from __future__ import annotations

from collections.abc import Mapping
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

QKV, OUT = "attn.Wqkv.weight", "attn.out_proj.weight"


def _attn_config(config: Config) -> Mapping[str, Any]:
    value = config.mapping("attn_config")
    return value if value is not None else {}


class Mpt(Family):
    model_types = ("mpt",)
    layers = "blocks"
    query = QKV
    prefixes = ("transformer.", "")
    embedding = "wte.weight"  # the token embedding, [vocab, d_model] (models/shapes.py)

    @staticmethod
    def reads(config: Config) -> bool:
        """Whether this page computes the checkpoint: not with clip_qkv (see the module's docstring)."""
        return _attn_config(config).get("clip_qkv") is None

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_layer = config.integer("n_layers", "num_hidden_layers")
        self.n_head = self.n_kv_head = config.integer("n_heads", "num_attention_heads")
        self.d_model = config.integer("d_model", "hidden_size")
        if self.d_model % self.n_head:
            raise UsageError(f"{config.path}: d_model {self.d_model} is not divisible by n_heads {self.n_head}; "
                             "fix config.json")
        self.d_head = self.d_model // self.n_head
        self.max_tokens = config.integer("max_seq_len", default=2048)
        check_sizes(self)

    # --- where head h lives ---------------------------------------------------------------------------------

    def biases(self) -> tuple[bool, bool]:
        return False, False  # MptAttention's Wqkv and out_proj have none

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        d, D = self.d_head, self.d_model
        lo, fused = head * d, self.key(layer, QKV)
        return [Slice("W_Q", fused, "rows", lo, lo + d), Slice("W_K", fused, "rows", D + lo, D + lo + d),
                Slice("W_V", fused, "rows", 2 * D + lo, 2 * D + lo + d),
                Slice("W_O", self.key(layer, OUT), "cols", lo, lo + d)]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        D, lo = self.d_model, head * self.d_head
        return [f"Wqkv stacks Q, K and V ({D} rows each): head {head} has rows {lo}:{lo + self.d_head} of each"]

    # --- the attention's specifics --------------------------------------------------------------------------

    def attention_spec(self, layer: int) -> AttentionSpec:
        scale = _attn_config(self.config).get("softmax_scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise UsageError(f"{self.config.path}: attn_config.softmax_scale is {scale!r}; it must be a number")
        return AttentionSpec(causal=True, alibi=True, scale=None if scale is None else float(scale))

    def projections(self, layer: int) -> dict[str, Any]:
        fused = self.weight(layer, QKV)  # [3·d_model, d_model]
        D = self.d_model
        return {"W_q.weight": fused[:D], "W_k.weight": fused[D : 2 * D], "W_v.weight": fused[2 * D :],
                "W_o.weight": self.weight(layer, OUT)}

    # --- the prefix -----------------------------------------------------------------------------------------

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """MPT's LayerNorm `name` (a full key without `.weight`), without bias."""
        eps = self.config.number("layer_norm_epsilon", default=1e-5)
        return blocks.layer_norm(x, self.checkpoint.tensor(f"{name}.weight"), None, eps)

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        return self.embed_at(ids, 0)

    def embed_at(self, ids: list[int], start: int) -> torch.Tensor:
        """`MptModel.forward`: the token embeddings alone; ALiBi's table ends at max_seq_len."""
        check_length(self.max_tokens, start + len(ids))
        return self.checkpoint.rows(f"{self.prefix}wte.weight", ids)[None]  # [1, n, d_model]

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        return (self.norm(self.key(layer, "norm_1"), h),
                f"norm_1(h): LayerNorm of the residual stream entering layer {layer}")

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        """`MptBlock.forward`, its MLP `MptMLP`: up_proj, exact GELU, down_proj."""
        import torch.nn.functional as F

        h = h + attention(self.attention_input(layer, h)[0])["x"]
        x = self.norm(self.key(layer, "norm_2"), h)
        up, down = self.weight(layer, "ffn.up_proj.weight"), self.weight(layer, "ffn.down_proj.weight")
        return h + F.linear(F.gelu(F.linear(x, up)), down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`MptForCausalLM`: norm_f, then lm_head, tied to wte by default."""
        return self.norm(f"{self.prefix}norm_f", h) @ lm_head.weight(self, "wte.weight", True).T  # [1, n, vocab]
