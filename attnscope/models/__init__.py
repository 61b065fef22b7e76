"""Models: one module per family behind one protocol (family.py, an abstract base class), where a head lives
and reading it (weights.py), running layers 0..L with layer L traced (run.py), the lazy checkpoint reader
(checkpoint.py), config.json read defensively (config.py), the model's own tokenizer (tokenizer.py), the
Hugging Face cache lookup (hub.py), and transformers as the fallback for other families (fallback.py).

| model_type | module | class |
|---|---|---|
| bert (also MiniLM saved as BertModel) | bert.py | Bert |
| roberta, xlm-roberta | bert.py | Roberta |
| gpt2 | gpt2.py | Gpt2 |
| llama | llama.py | Llama |
| mistral | mistral.py | Mistral (LLaMA's, with a window) |
| qwen2 | qwen2.py | Qwen2 (LLaMA's, with q/k/v biases and windowed layers) |
| gemma2 | gemma2.py | Gemma2 (LLaMA's, with softcap, scalar, sandwich norms) |
| deepseek_v3, deepseek_v2 | deepseek.py | DeepseekV3, DeepseekV2 (latent attention, mixture of experts) |
| smollm3 | smollm3.py | SmolLM3 (LLaMA's, with NoPE layers: nope.py) |
| phi3 (Phi-3, Phi-4) | phi3.py | Phi3 (LLaMA's, with fused qkv_proj and gate_up_proj, partial rotary) |
| llama4, llama4_text | llama4.py | Llama4 (chunked and NoPE layers, temperature tuning, L2 qk-norm, MoE) |

Following a family's forward across files, step by step (`attnscope head --text`):

| step | made in |
|---|---|
| X, the attention's input (the residual stream after the layer's input norm) | the family's `attention_input`; |
|   the layers before it by its `block` | bert.py, gpt2.py, llama.py, ... |
| Q_feat, K_feat, V_feat, Q_split, K_split, V_split | multihead.py `_heads` (weights: the family's `projections`) |
| cos, sin, Q_rot, K_rot | attention.py `rotate` with rope.py (the family's `attention_spec().rope`; none on NoPE |
|   layers) | |
| Q_normed, K_normed (Llama 4: an L2 norm after RoPE) | llama4_qk_norm.py `Llama4Attention` |
| attn_scales, Q_tuned (Llama 4's NoPE layers) | attention.py `tune` with temperature.py |
| K_rep, V_rep, scores, capped_scores, masked_scores, attention | attention.py `sdpa` (masks.py for the mask: |
|   causal, window, chunk) | |
| x_raw, x_rsh1, x_rsh2, x | multihead.py `forward` |
| the head's own X, Q, K, V, ..., out (views of the layer's steps) | run.py `head_trace` |
| where head h lives (W_Q, b_Q, ..., W_O) | the family's `head_slices`, read by weights.py |
| MLA's Q_latent, ..., KV_latent, K_pe, Q_pe_rot, K_pe_rot, Q_full, KV_up, K_nope, K_full | latent.py (deepseek.py) |
| MLA: the head's own Q_nope, ..., K_full, out | deepseek.py `head_trace` |
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.models.config import Config
    from attnscope.models.family import Family

# model_type -> (module, class): imported only for the family asked for.
FAMILIES = {"bert": ("bert", "Bert"), "roberta": ("bert", "Roberta"), "xlm-roberta": ("bert", "Roberta"),
            "gpt2": ("gpt2", "Gpt2"), "llama": ("llama", "Llama"), "mistral": ("mistral", "Mistral"),
            "qwen2": ("qwen2", "Qwen2"), "gemma2": ("gemma2", "Gemma2"),
            "deepseek_v3": ("deepseek", "DeepseekV3"), "deepseek_v2": ("deepseek", "DeepseekV2"),
            "smollm3": ("smollm3", "SmolLM3"), "phi3": ("phi3", "Phi3"), "llama4": ("llama4", "Llama4"),
            "llama4_text": ("llama4", "Llama4")}
SUPPORTED = "bert, roberta, gpt2, llama, mistral, qwen2, gemma2, deepseek_v2, deepseek_v3, smollm3, phi3, llama4"


def family_of(config: Config) -> type[Family] | None:
    where = FAMILIES.get(config.model_type)
    if where is None:
        return None
    return getattr(import_module(f"attnscope.models.{where[0]}"), where[1])  # type: ignore[no-any-return]


def open_model(folder: Path, config: Config, *, command: str = "head") -> Family:
    """The checkpoint in `folder` as its family reads it; a family attnscope does not read is refused in one
    line that names what was found and what is supported."""
    from attnscope.models.checkpoint import Checkpoint

    family = family_of(config)
    if family is None:
        raise UsageError(f"{{model}} {folder} is a {config.architecture} (model_type '{config.model_type}'); "
                         f"attnscope {command} reads the heads of {SUPPORTED} ({{text}} still shows its attention "
                         "through transformers)", "model", "text")
    from attnscope.models.shapes import check_weights

    model = family(folder, config, Checkpoint.open(folder))
    check_weights(model)  # every attention weight's shape against what config.json implies, from the headers
    return model
