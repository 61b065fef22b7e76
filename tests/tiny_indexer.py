"""Tiny random DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) models, from transformers' own configs and
classes, saved with save_pretrained beside a LLaMA-style tokenizer.

Sizes cover what the sparse indexer must get right: index_topk 4, well under the test sentence's 18 tokens, so
most queries drop keys; 4 index heads of 16 with an 8-wide rotary part (the rest passes); a dense layer then
mixture-of-experts layers; GLM-5's interleaved indexer RoPE and a "shared" layer that keeps the previous full
layer's choice; yarn scaling (its attention scaling multiplies the indexer's cos and sin too). Every weight is
drawn from N(0, 0.3) (tiny_models.perturb): LayerNorm k_norm's weight and bias included.
"""

from __future__ import annotations

from pathlib import Path

import torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
SIZES = {"hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12, "n_routed_experts": 8,
         "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
         "max_position_embeddings": 128, "initializer_range": 0.3, "tie_word_embeddings": False,
         "index_topk": 4, "index_head_dim": 16, "index_n_heads": 4}
# name -> (model_type, config overrides)
VARIANTS = {
    "v32": ("deepseek_v32", {}),
    "v32-yarn": ("deepseek_v32", {"rope_parameters": YARN, "attention_bias": True, "index_topk": 6}),
    "glm5": ("glm_moe_dsa", {"index_topk_pattern": "FSF", "n_group": 1, "topk_group": 1}),
}


def build(folder: Path, name: str, **sizes):
    """Save tiny `name` (VARIANTS) and its tokenizer to `folder`; return transformers' eager model read back."""
    import transformers as tf
    from tiny_models import _tokenizer, perturb

    model_type, overrides = VARIANTS[name]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer("llama")
    config_class, cls = ((tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM) if model_type == "deepseek_v32"
                         else (tf.GlmMoeDsaConfig, tf.GlmMoeDsaForCausalLM))
    config = config_class(**{**SIZES, **overrides, **sizes, "vocab_size": len(tokenizer)})
    torch.manual_seed(list(VARIANTS).index(name) + 70)
    model = perturb(cls(config).eval())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()
