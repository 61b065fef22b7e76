"""GptOss <- Llama <- Family

GPT-OSS (OpenAI's open-weight mixture of experts, transformers' `GptOssForCausalLM`): LLaMA's layout and forward
(llama.py), with attention sinks, biases, alternating sliding and full layers, yarn RoPE and an MoE MLP.

Checkpoint keys, under `model.` (`lm_head.weight` outside it):

    embed_tokens.weight [vocab, d_model], norm.weight
    layers.L.input_layernorm.weight, layers.L.post_attention_layernorm.weight       RMSNorm
    layers.L.self_attn.q_proj.{weight,bias}  [n_head·d_head, d_model]             head h = rows h·d_head ...
    layers.L.self_attn.{k,v}_proj.{weight,bias}  [n_kv_head·d_head, d_model]      KV head g = h // n_group
    layers.L.self_attn.o_proj.{weight,bias}  [d_model, n_head·d_head]             head h = columns h·d_head ...
    layers.L.self_attn.sinks  [n_head]                                            head h = sinks[h]
    layers.L.mlp.router.{weight,bias}  [n_expert, d_model]                        the top-k router
    layers.L.mlp.experts.gate_up_proj  [n_expert, d_model, 2·d_ff]                x @ W; gate ::2, up 1::2
    layers.L.mlp.experts.gate_up_proj_bias [n_expert, 2·d_ff], down_proj [n_expert, d_ff, d_model],
    layers.L.mlp.experts.down_proj_bias [n_expert, d_model]
    (OpenAI's release stores the experts in MXFP4: `gate_up_proj_blocks`/`_scales`, `down_proj_blocks`/`_scales`,
    read here as transformers' `convert_moe_packed_tensors` reads them.)

What GPT-OSS changes (transformers' `GptOssAttention`, `GptOssMLP`):
- attention sinks: `sinks[h]` joins every softmax row of head h and is dropped after (steps `sinks`, `sink_weight`;
  sinks.py), so a row's attention sums to less than 1;
- biases on q, k, v and o (`attention_bias`, true by default);
- `layer_types` alternate "sliding_attention" (a causal window of `sliding_window`, 128) and "full_attention"
  (default: even layers sliding);
- RoPE is yarn (factor 32 over 4096 positions, base 150000), read by `Rope.from_config`; transformers computes its
  half-split rotation with `torch.chunk` halves, which is LLaMA's `rotate_half`;
- the MLP is a mixture of experts: the router's top-k logits, softmaxed over those k, weigh the k experts each
  token goes to; an expert is a clamped SwiGLU, `(clamp(up, -limit, limit) + 1) · g · sigmoid(alpha · g)` with
  `g = clamp(gate, max=limit)`, between two biased projections (alpha and limit: config.json's `swiglu_alpha` and
  `swiglu_limit` where the installed transformers reads them, as 5.24 does; 1.702 and 7.0 where it does not).
A layer (`GptOssDecoderLayer`): `h = h + attention(RMSNorm(h))`, `h = h + moe(RMSNorm(h))`. The experts of the
layers before L run exactly (their output feeds layer L), each read alone when a token is routed to it; they are
not traced.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models.families.llama import NAMES, Llama
from attnscope.models.family import Slice, linear_projections, linear_slices
from attnscope.models.memory import Experts
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Array, Checkpoint
    from attnscope.models.config import Config

EXPERTS = "mlp.experts."
EXPERT_WEIGHTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
# MXFP4's E2M1 values, indexed by a 4-bit code (transformers' integrations/mxfp4.py FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ALPHA, LIMIT = 1.702, 7.0  # GptOssExperts' constants before transformers read them from the config


@cache
def _experts_read_swiglu() -> bool:
    """Whether the installed transformers' `GptOssExperts` takes `swiglu_alpha` and `swiglu_limit` from the config
    (5.24 does) or keeps its own 1.702 and 7.0 whatever config.json says (5.17 and 4.x do): read from a one-expert
    module made with other values, so that the run is the one the user's transformers runs. Asked only where a
    config's values differ from the constants."""
    try:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return True
    try:
        probe = GptOssConfig(num_local_experts=1, hidden_size=2, intermediate_size=2, num_attention_heads=1,
                             num_key_value_heads=1, head_dim=2, swiglu_alpha=0.625, swiglu_limit=3.25)
        experts = GptOssExperts(probe)
    except (TypeError, ValueError, AttributeError):
        return True  # a release this probe does not fit: the config's values, as the current release reads them
    return (getattr(experts, "alpha", None), getattr(experts, "limit", None)) == (0.625, 3.25)

class GptOss(Llama):
    model_types = ("gpt_oss",)

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_expert = config.integer("num_local_experts")
        self.top_k = config.integer("num_experts_per_tok", "experts_per_token")
        if self.top_k > self.n_expert:
            raise UsageError(f"{config.path}: num_experts_per_tok {self.top_k} is more than num_local_experts "
                             f"{self.n_expert}; fix config.json")
        self.d_ff = config.integer("intermediate_size")
        # the experts are read one at a time: one expert in float32, twice over (dequantized and multiplied)
        self.expert_reads = Experts(one=3 * self.d_model * self.d_ff + 2 * self.d_ff + self.d_model)
        self.alpha = config.number("swiglu_alpha", default=ALPHA)
        self.limit = config.number("swiglu_limit", default=LIMIT)
        if (self.alpha, self.limit) != (ALPHA, LIMIT) and not _experts_read_swiglu():
            self.alpha, self.limit = ALPHA, LIMIT  # the installed release runs its constants, whatever config says

    # --- where head h lives -------------------------------------------------------------------------------

    def biases(self) -> tuple[bool, bool]:
        on = self.config.flag("attention_bias", default=True)  # GptOssConfig's default
        return on, on

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        sink = Slice("sink", self.key(layer, "self_attn.sinks"), "rows", head, head + 1)
        return [*linear_slices(self, layer, head, NAMES, self.biases()), sink]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        return [*super().notes(layer, head), f"sink: sinks[{head}], the logit head {head} adds to every softmax row "
                "as one more column, dropped after: the row's attention sums to less than 1"]

    # --- the attention's specifics ------------------------------------------------------------------------

    def window(self, layer: int) -> int | None:
        """`layer_types[layer]`, else GptOssConfig's default: even layers slide."""
        kinds = self.config.str_list("layer_types", self.n_layer)
        sliding = kinds[layer] == "sliding_attention" if kinds is not None else layer % 2 == 0
        # a sliding layer needs its window: GptOssAttention passes config.sliding_window to
        # create_sliding_window_causal_mask, which refuses None (masking_utils)
        return self.config.integer("sliding_window") if sliding else None

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(causal=True, rope=self.rope(), window=self.window(layer), sinks=True)

    def projections(self, layer: int) -> dict[str, Any]:
        return linear_projections(self, layer, NAMES) | {"sinks": self.weight(layer, "self_attn.sinks")}

    # --- the MoE MLP --------------------------------------------------------------------------------------

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`GptOssMLP`: each token's top-k experts, weighted by the softmax of their router logits."""
        import torch
        import torch.nn.functional as F

        flat = x.reshape(-1, x.shape[-1])  # [n_tokens, d_model]
        logits = F.linear(flat, self.weight(layer, "mlp.router.weight"), self.weight(layer, "mlp.router.bias"))
        top, chosen = torch.topk(logits, self.top_k, dim=-1)  # [n_tokens, top_k]
        share = torch.softmax(top, dim=-1)  # [n_tokens, top_k]: GptOssTopKRouter's router_scores
        out = torch.zeros_like(flat)
        for expert in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == expert)
            gate_up, gate_up_bias, down, down_bias = self.expert(layer, expert)
            hidden = self.clamped_swiglu(flat[tokens] @ gate_up + gate_up_bias)  # [n, d_ff]
            out.index_add_(0, tokens, (hidden @ down + down_bias) * share[tokens, slot, None])  # [n, d_model]
        return out.reshape(x.shape)  # [n_tokens, d_model] -> x's [.., n_tokens, d_model]

    def clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`GptOssExperts._apply_gate`: gate and up interleaved, each clamped, `(up + 1) · gate · σ(alpha · gate)`."""
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * (gate * self.alpha).sigmoid())

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """Expert `expert`'s gate_up_proj `[d_model, 2·d_ff]`, its bias, down_proj `[d_ff, d_model]` and its bias,
        float32, read alone (row `expert` of each tensor), MXFP4 blocks dequantized."""
        quantized = self.key(layer, EXPERTS + "gate_up_proj") not in self.checkpoint
        weights = []
        wanted = ([self.d_model, 2 * self.d_ff], [2 * self.d_ff], [self.d_ff, self.d_model], [self.d_model])
        for name, shape in zip(EXPERT_WEIGHTS, wanted, strict=True):
            if quantized and not name.endswith("_bias"):
                blocks, scales = (self._row(layer, f"{name}_{part}", expert) for part in ("blocks", "scales"))
                if blocks.dim() != 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
                    raise UsageError(f"{self.key(layer, EXPERTS + name)}_blocks is {list(blocks.shape)} with scales "
                                     f"{list(scales.shape)} per expert; MXFP4 packs [out, G, 16] bytes with [out, G] "
                                     "scales")
                weights.append(dequantize_mxfp4(blocks, scales))
            else:
                weights.append(self._row(layer, name, expert).float())
            if list(weights[-1].shape) != shape:
                raise UsageError(f"{self.key(layer, EXPERTS + name)} holds {list(weights[-1].shape)} per expert, but "
                                 f"config.json's hidden_size {self.d_model} and intermediate_size {self.d_ff} make it "
                                 f"{shape}; config.json does not describe these weights")
        return tuple(weights)

    def _row(self, layer: int, name: str, expert: int) -> torch.Tensor:
        tensor, _ = self.checkpoint.slice(self.key(layer, EXPERTS + name), "rows", expert, expert + 1)
        return _as_torch(tensor)[0]



def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's MXFP4 weight `[out, G, 16]` bytes and `[out, G]` scales -> float32 `[G·32, out]` (`[in, out]`,
    as `x @ W` takes it): each byte holds two E2M1 codes, the low nibble first; each block of 32 values is scaled
    by 2^(scale - 127). transformers' `_convert_moe_packed_tensors`, for one expert."""
    import torch

    codes = blocks.to(torch.uint8)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)  # [out, G, 16, 2]
    values = torch.ldexp(pairs.reshape(*codes.shape[:-1], -1), scales.to(torch.int32)[..., None] - 127)  # [out, G, 32]
    return values.reshape(codes.shape[0], -1).T  # [G·32, out]


def _as_torch(tensor: Array) -> torch.Tensor:
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(tensor)) if isinstance(tensor, np.ndarray) else tensor
