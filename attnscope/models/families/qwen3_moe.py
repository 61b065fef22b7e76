"""Qwen3Moe <- Qwen3 <- Qwen2 <- Llama <- Family

Qwen3-MoE: Qwen3's attention (qwen3.py: qk-norm per head, traced), and a mixture of experts in place of the
MLP on most layers, run exactly as transformers' `Qwen3MoeSparseMoeBlock` does but not traced: its output only
feeds the layers after it.

Checkpoint keys per MoE layer (as `save_pretrained` writes them, and as the Hub's checkpoints hold them):

    layers.L.mlp.gate.weight                        [n_experts, d_model]   the router
    layers.L.mlp.experts.E.{gate,up}_proj.weight    [d_expert, d_model]    expert E's SwiGLU
    layers.L.mlp.experts.E.down_proj.weight         [d_model, d_expert]

or, fused as transformers 5 holds them in memory, `mlp.experts.gate_up_proj` `[n_experts, 2·d_expert, d_model]`
(the gate's rows first) and `mlp.experts.down_proj` `[n_experts, d_model, d_expert]`; both are read.

Which layers are MoE (`Qwen3MoeDecoderLayer`): layer l unless it is in `mlp_only_layers`, when
`num_experts > 0` and `(l + 1) % decoder_sparse_step == 0`; the others have a dense SwiGLU of
`intermediate_size` (`mlp.{gate,up,down}_proj`). The router (`Qwen3MoeTopKRouter`): softmax of `gate(x)` in
float32 over the experts, the top `num_experts_per_tok`, renormalised to sum to 1 when `norm_topk_prob`; each
token's output is the routing-weighted sum of its experts' SwiGLUs. Only the experts some token picked are read.
A sliding window, where `use_sliding_window` is on, covers every layer (`Qwen3MoeAttention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError
from attnscope.models import blocks
from attnscope.models.families.qwen3 import Qwen3
from attnscope.models.memory import Experts

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


class Qwen3Moe(Qwen3):
    model_types = ("qwen3_moe",)
    default_head_dim = None  # Qwen3MoeConfig has no head_dim of its own: hidden_size / num_attention_heads

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_experts = config.integer("num_experts", "num_local_experts", default=128, minimum=0)
        self.top_k = config.integer("num_experts_per_tok", default=8)
        self.sparse_step = config.integer("decoder_sparse_step", default=1)
        only = config.raw("mlp_only_layers", default=[])
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise UsageError(f"{config.path}: mlp_only_layers is {only!r}; it must be a list of layer numbers; "
                             "fix config.json")
        self.mlp_only = frozenset(only)
        if self.n_experts and self.top_k > self.n_experts:
            raise UsageError(f"{config.path}: num_experts_per_tok {self.top_k} is more than the {self.n_experts} "
                             "experts; fix config.json")
        # `experts` holds one expert's weights in float32 at a time (gate, up, down), twice over, and reads rows
        # of the stored tensors
        one = 3 * config.integer("moe_intermediate_size", default=768) * self.d_model
        self.expert_reads = Experts(one=one, stored=True)

    # --- the attention's specifics --------------------------------------------------------------------------

    def window(self, layer: int) -> int | None:
        """Every layer: `Qwen3MoeAttention` takes `config.sliding_window`, None unless `use_sliding_window`."""
        return self.config.optional_integer("sliding_window") if self.config.flag("use_sliding_window") else None

    # --- the prefix -----------------------------------------------------------------------------------------

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` routes through experts (`Qwen3MoeDecoderLayer.__init__`)."""
        return layer not in self.mlp_only and self.n_experts > 0 and (layer + 1) % self.sparse_step == 0

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts(layer, x) if self.sparse(layer) else super().mlp(layer, x)

    def experts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`Qwen3MoeSparseMoeBlock.forward`: route each token to its top-k experts, weight and sum their outputs."""
        import torch

        act = blocks.activation(self.config.raw("hidden_act", default="silu"), f"{self.config.path}: hidden_act")
        flat = x.reshape(-1, x.shape[-1])  # [n_tokens, d_model]
        logits = torch.nn.functional.linear(flat, self.weight(layer, "mlp.gate.weight"))  # [n_tokens, n_experts]
        if logits.shape[-1] != self.n_experts:
            raise UsageError(f"{self.key(layer, 'mlp.gate.weight')} routes to {logits.shape[-1]} experts but "
                             f"config.json says {self.n_experts}; fix config.json")
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)  # [n_tokens, top_k]
        if self.config.flag("norm_topk_prob"):
            top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for expert in sorted(set(chosen.flatten().tolist())):
            tokens, slot = torch.where(chosen == expert)
            gate, up, down = self.expert_weights(layer, expert)
            hidden = blocks.gated_mlp(flat[tokens], gate, up, down, act)  # [n_routed, d_model]
            out.index_add_(0, tokens, hidden * top[tokens, slot, None])
        return out.view_as(x)

    def expert_weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert `expert`'s gate, up and down projections, from per-expert keys or the fused tensors."""
        fused = self.key(layer, "mlp.experts.gate_up_proj")
        if fused in self.checkpoint:
            gate_up = self.checkpoint.rows(fused, [expert])[0]  # [2·d_expert, d_model]
            down = self.checkpoint.rows(self.key(layer, "mlp.experts.down_proj"), [expert])[0]
            half = gate_up.shape[0] // 2
            return gate_up[:half], gate_up[half:], down
        stem = f"mlp.experts.{expert}"
        return (self.weight(layer, f"{stem}.gate_proj.weight"), self.weight(layer, f"{stem}.up_proj.weight"),
                self.weight(layer, f"{stem}.down_proj.weight"))
