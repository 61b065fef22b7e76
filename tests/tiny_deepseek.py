"""Tiny random DeepSeek-V3 and DeepSeek-V2 models, from transformers' own configs and classes, saved with
save_pretrained beside a LLaMA-style tokenizer (DeepSeek's checkpoints ship a LlamaTokenizerFast).

Sizes cover what the family page must get right: a dense layer then mixture-of-experts layers (sigmoid router
with groups, a correction bias and shared experts for V3; softmax with group-limited greedy for V2), a
compressed query (q_lora_rank) or a plain q_proj, d_K != d_V, DeepSeek-V3's interleaved rotary layout, and
yarn scaling with mscale_all_dim for the scores' scale. Weights are drawn with std 0.3 (the router's correction
bias too), so patterns are sharp and the routing is not a tie.
"""

from __future__ import annotations

from pathlib import Path

import torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def config(version: int = 3, **sizes):
    import transformers as tf

    common = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
              "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 10, "v_head_dim": 12,
              "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
              "first_k_dense_replace": 1, "max_position_embeddings": 128, "initializer_range": 0.3,
              "tie_word_embeddings": False}
    if version == 3:
        made = tf.DeepseekV3Config(**common, routed_scaling_factor=2.5, n_shared_experts=1)
    else:
        made = tf.DeepseekV2Config(**common, routed_scaling_factor=1.5, n_shared_experts=2,
                                   topk_method="group_limited_greedy", mlp_bias=True)
    for name, value in sizes.items():
        setattr(made, name, value)
    return made


def build(folder: Path, version: int = 3, **sizes):
    """Save a tiny DeepSeek-V`version` and its tokenizer to `folder`; return transformers' eager model read
    back (the oracle). `sizes` override the config's (q_lora_rank=None, rope_parameters=YARN, ...)."""
    import transformers as tf
    from tiny_models import _tokenizer, perturb

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer("llama")
    made = config(version, vocab_size=len(tokenizer), **sizes)
    cls = tf.DeepseekV3ForCausalLM if version == 3 else tf.DeepseekV2ForCausalLM
    torch.manual_seed(30 + version)
    model = perturb(cls(made).eval())  # e_score_correction_bias too
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()
