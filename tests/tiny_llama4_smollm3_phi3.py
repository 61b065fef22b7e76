"""Tiny random Llama 4 (text, and inside a multimodal checkpoint), SmolLM3 and Phi-3/Phi-4 models, built from
transformers' own configs and classes and saved with save_pretrained, with tiny_models' small LLaMA tokenizer.

Each covers every layer kind its family has, with a chunk or window shorter than tiny_models.SENTENCE:
- llama4: layers 0, 2 RoPE + chunked (chunk 4) + L2 qk-norm; layers 1, 3 NoPE + full + temperature tuning
  (floor_scale 2, so the factor changes within the sentence); MoE on layers 1, 3 (3 experts, top 2), dense on
  0, 2; Llama 3.1's RoPE scaling; GQA.
- llama4_mm: a Llama4ForConditionalGeneration (a tiny vision tower beside it), keys under language_model.model.
- smollm3: layers RoPE/full, NoPE/full, RoPE/sliding, NoPE/sliding (window 4).
- phi3: Phi-3 mini 128k's shape: longrope beyond original_max_position_embeddings 8, sliding window 4.
- phi4: Phi-4 mini's shape: partial_rotary_factor 0.75, longrope, no window.
`build(name, folder)` returns transformers' eager model loaded back from the folder: the oracle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import _tokenizer, perturb

NAMES = ("llama4", "llama4_mm", "smollm3", "phi3", "phi4")
DECODER = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
           "tie_word_embeddings": False, "initializer_range": 0.3}


def _longrope(pairs: int) -> dict:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [1.5 + 0.5 * i for i in range(pairs)], "original_max_position_embeddings": 8}


def _llama4_text(vocab: int):
    import transformers as tf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    return tf.Llama4TextConfig(vocab_size=vocab, **DECODER, head_dim=8, intermediate_size=24, intermediate_size_mlp=40,
                               num_hidden_layers=4, no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2,
                               attn_scale=0.5, num_local_experts=3, num_experts_per_tok=2, interleave_moe_layer_step=2,
                               use_qk_norm=True, rope_parameters=scaling, pad_token_id=0)


def config_and_class(name: str, vocab: int):
    import transformers as tf

    if name == "llama4":
        return _llama4_text(vocab), tf.Llama4ForCausalLM
    if name == "llama4_mm":
        vision = tf.Llama4VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                       image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                                       projector_output_dim=32, pixel_shuffle_ratio=0.5, initializer_range=0.3)
        return tf.Llama4Config(text_config=_llama4_text(vocab).to_dict(), vision_config=vision.to_dict()), \
            tf.Llama4ForConditionalGeneration
    if name == "smollm3":
        return tf.SmolLM3Config(vocab_size=vocab, **DECODER, intermediate_size=40, num_hidden_layers=4,
                                no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=4,
                                layer_types=["full_attention", "full_attention", "sliding_attention",
                                             "sliding_attention"], pad_token_id=0), tf.SmolLM3ForCausalLM
    if name == "phi3":
        return tf.Phi3Config(vocab_size=vocab, **DECODER, intermediate_size=40, num_hidden_layers=2, sliding_window=4,
                             rope_parameters=_longrope(4), original_max_position_embeddings=8, pad_token_id=0), \
            tf.Phi3ForCausalLM
    parameters = {**_longrope(3), "partial_rotary_factor": 0.75}
    return tf.Phi3Config(vocab_size=vocab, **DECODER, intermediate_size=40, num_hidden_layers=2,
                         rope_parameters=parameters, partial_rotary_factor=0.75, original_max_position_embeddings=8,
                         pad_token_id=0), tf.Phi3ForCausalLM


def build(name: str, folder: Path):
    """Save a tiny model and its tokenizer to `folder`; return transformers' eager model read back."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer("llama")
    config, cls = config_and_class(name, len(tokenizer))
    torch.manual_seed(NAMES.index(name))
    model = perturb(cls(config).eval())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


def text_model(name: str, model):
    """The decoder whose `layers` hold the attention modules."""
    if name == "llama4_mm":
        return model.language_model.model
    return model.model
