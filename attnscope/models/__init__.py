"""Models: the protocol and reading at the root, one page per family behind it (families/), the forwards that
run them (forward/), and the families with no page, through transformers (nopage/).

The root: the protocol (family.py, an abstract base class), where a head lives and reading it (weights.py), the
lazy checkpoint reader (checkpoint.py), config.json read defensively (config.py), the model's own tokenizer
(tokenizer.py), the Hugging Face cache lookup (hub.py). families/: a page per family, the encoder-decoders'
three attentions (seq2seq.py). forward/: layers 0..L with layer L traced (run.py), every layer (stream.py),
a long input (long.py), the encoder-decoders' (seq2seq_run.py). nopage/: any other family through
transformers, layers 0..L only (truncated.py), traced through its attention interface (interface.py).

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
| t5, mt5 (umt5) | t5.py | T5 (Umt5): encoder-decoder, relative position bias, no scale (seq2seq.py) |
| bart, marian, mbart | bart.py | Bart, Marian, MBart: encoder-decoders of BartAttention |
| whisper | whisper.py | Whisper: an audio encoder (audio.py reads --audio) and a text decoder |
| gpt_oss | gpt_oss.py | GptOss (LLaMA's, with sinks, biases, alternating windows, yarn RoPE, an MoE MLP) |
| modernbert | modernbert.py | ModernBert (an encoder: fused Wqkv, RoPE, global and local bidirectional layers) |
| qwen3 | qwen3.py | Qwen3 (Qwen2's windows, qk-norm per head: qknormed.py) |
| qwen3_moe | qwen3_moe.py | Qwen3Moe (Qwen3's attention; the MoE MLP run, not traced) |
| gemma3_text, gemma3 (its text part) | gemma3.py | Gemma3 (Gemma 2's, with (1 + w) qk-norm, RoPE per layer type) |
| olmo2 | olmo2.py | Olmo2 (LLaMA's, with qk-norm over the projection, post-norms) |
| bloom | bloom.py | Bloom (ALiBi, query_key_value fused per head, an embedding LayerNorm) |
| mpt | mpt.py | Mpt (ALiBi with BLOOM's slopes, fused Wqkv, no biases); clip_qkv: through transformers |
| gptj | gptj.py | GptJ (GPT-2's names, interleaved partial RoPE, a parallel block) |
| falcon | falcon.py | Falcon (BLOOM's names with RoPE, three qkv layouts, parallel blocks); alibi: transformers |

Following a family's forward across files, step by step (`attnscope head --text`):

| step | made in |
|---|---|
| X, the attention's input (the residual stream after the layer's input norm) | the family's `attention_input`; |
|   the layers before it by its `block` | families/bert.py, gpt2.py, llama.py, ... |
| Q_feat, K_feat, V_feat, Q_split, K_split, V_split | attention/multihead.py `_heads` (weights: the family's |
|   | `projections`) |
| Q_normed, K_normed (qk-norm before RoPE) | variants/qknorm.py, from multihead.py `_heads` |
|   | (`attention_spec().qk_norm`) |
| cos, sin, Q_rot, K_rot | attention/dot_product.py `rotate`, variants/rope.py (the family's |
|   | `attention_spec().rope`; none on NoPE layers) |
| Q_normed, K_normed (Llama 4: an L2 norm after RoPE) | families/llama4_qk_norm.py `Llama4Attention` |
| attn_scales, Q_tuned (Llama 4's NoPE layers) | dot_product.py `tune` with variants/temperature.py |
| alibi_bias, biased_scores (BLOOM, MPT) | dot_product.py `sdpa` with variants/alibi.py |
| K_rep, V_rep, scores, capped_scores, masked_scores, attention | dot_product.py `sdpa` (masks.py for the mask: |
|   causal, window (left or both sides), chunk) | |
| sinks, sink_weight (GPT-OSS) | attention/sinks.py, called by `sdpa` (the values: the module's `sinks`) |
| x_raw, x_rsh1, x_rsh2, x | attention/multihead.py `forward` |
| the head's own X, Q, K, V, ..., out (views of the layer's steps) | head_steps.py `head_trace` |
| an encoder-decoder's X, memory (across), position_buckets | forward/seq2seq_run.py (t5.py: the buckets, bias) |
| position_bias, biased_scores (T5) | dot_product.py `sdpa` with attention/position_bias.py |
| a family with no page: Q, K, V, K_rep, V_rep, scores, capped_scores, mask, masked_scores, | nopage/interface.py |
|   sinks, sink_weight, attention, out (layers before it: transformers' own, truncated.py) | |
| where head h lives (W_Q, b_Q, ..., W_O) | the family's `head_slices`, read by weights.py |
| MLA's Q_latent, ..., KV_latent, K_pe, Q_pe_rot, K_pe_rot, Q_full, KV_up, K_nope, K_full | attention/latent.py |
| MLA: the head's own Q_nope, ..., K_full, out | families/deepseek.py `head_trace` |
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
            "llama4_text": ("llama4", "Llama4"), "gpt_oss": ("gpt_oss", "GptOss"),
            "modernbert": ("modernbert", "ModernBert"), "qwen3": ("qwen3", "Qwen3"),
            "qwen3_moe": ("qwen3_moe", "Qwen3Moe"), "gemma3_text": ("gemma3", "Gemma3"), "gemma3": ("gemma3", "Gemma3"),
            "olmo2": ("olmo2", "Olmo2"), "bloom": ("bloom", "Bloom"), "mpt": ("mpt", "Mpt"), "gptj": ("gptj", "GptJ"),
            "falcon": ("falcon", "Falcon"),
            "t5": ("t5", "T5"), "mt5": ("t5", "T5"), "umt5": ("t5", "Umt5"), "bart": ("bart", "Bart"),
            "marian": ("bart", "Marian"), "mbart": ("bart", "MBart"), "whisper": ("whisper", "Whisper")}
SUPPORTED = ("bert, roberta, gpt2, llama, mistral, qwen2, gemma2, deepseek_v2, deepseek_v3, smollm3, phi3, llama4, "
             "gpt_oss, modernbert, qwen3, qwen3_moe, gemma3, olmo2, bloom, mpt, gptj, falcon, t5, mt5, umt5, bart, "
             "marian, mbart, whisper")


def family_of(config: Config) -> type[Family] | None:
    """The page that computes `config`'s checkpoint; None where there is none, or where the page says it does not
    read this one (a family's static `reads(config)`: Falcon with ALiBi, MPT with clip_qkv), which then runs
    through transformers."""
    where = FAMILIES.get(config.model_type)
    if where is None:
        return None
    family = getattr(import_module(f"attnscope.models.families.{where[0]}"), where[1])
    reads = getattr(family, "reads", None)
    return family if reads is None or reads(config) else None  # type: ignore[no-any-return]


def open_model(folder: Path, config: Config, *, command: str = "head") -> Family:
    """The checkpoint in `folder` as its family reads it; a family attnscope does not read is refused in one
    line that names what was found and what is supported."""
    from attnscope.models.checkpoint import Checkpoint

    family = family_of(config)
    if family is None:
        raise UsageError(f"{{model}} {folder} is a {config.architecture} (model_type '{config.model_type}'); "
                         f"attnscope {command} reads the heads of {SUPPORTED} ({{text}} still traces its attention "
                         "through transformers)", "model", "text")
    from attnscope.models.shapes import check_weights

    model = family(folder, config, Checkpoint.open(folder))
    check_weights(model)  # every attention weight's shape against what config.json implies, from the headers
    return model
