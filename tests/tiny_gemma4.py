"""Tiny random Gemma 4 models (text, and the text part of the multimodal checkpoint), built from transformers' own
`Gemma4TextConfig` and classes and saved with save_pretrained, with a small BPE tokenizer of Gemma's tokenizer class
(tiny_models.py's recipe: every weight and saved buffer drawn off its init, `layer_scalar` included).

Six layers, sliding (a window of 4) and full in turn, so that every kind of Gemma 4 layer is there:
- sliding layers 0 and 2: d_head 16, 2 KV heads, their own k_proj and v_proj;
- full layers 1 and 3: `global_head_dim` 32, 1 KV head (`num_global_key_value_heads`), K = V (`attention_k_eq_v`:
  no v_proj), proportional RoPE turning a quarter of each head;
- layers 4 (sliding) and 5 (full) share the KV cache of layers 2 and 3 (`num_kv_shared_layers` 2): no k_proj,
  no v_proj, no k_norm;
- per-layer inputs (`hidden_size_per_layer_input` 8), a final logit softcap; "moe" adds the MoE block beside the
  MLP (`enable_moe_block`, 4 experts, top 2) and the double-wide MLP on the shared layers.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import _bpe, save_random

FAMILIES = ("gemma4_text", "gemma4_moe", "gemma4")
WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention"] * 3


def _tokenizer():
    from transformers import GemmaTokenizer

    vocab, merges = _bpe(False, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)


def text_config(vocab: int, **sizes):
    import transformers as tf

    return tf.Gemma4TextConfig(**{
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "num_kv_shared_layers": 2, "num_hidden_layers": 6, "layer_types": LAYER_TYPES,
        "sliding_window": WINDOW, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab,
        "final_logit_softcapping": 5.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
        "initializer_range": 0.3, **sizes})


def _config_and_class(family: str, vocab: int):
    import transformers as tf

    if family == "gemma4_text":
        return text_config(vocab), tf.Gemma4ForCausalLM
    if family == "gemma4_moe":
        return text_config(vocab, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=12,
                           use_double_wide_mlp=True, tie_word_embeddings=True), tf.Gemma4ForCausalLM
    vision = {"hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4, "position_embedding_size": 64}
    config = tf.Gemma4Config(text_config=text_config(vocab).to_dict(), vision_config=vision, audio_config=None,
                             image_token_id=vocab - 1, boi_token_id=vocab - 2, eoi_token_id=vocab - 3,
                             video_token_id=vocab - 4)
    return config, tf.Gemma4ForConditionalGeneration


def build(family: str, folder: Path, **sizes):
    """Save a tiny `family` model and its tokenizer to `folder`; return transformers' eager model read back."""
    tokenizer = _tokenizer()
    config, cls = _config_and_class(family, len(tokenizer))
    return save_random(folder, tokenizer, config, cls, 40 + FAMILIES.index(family), **sizes)


def decoder_layers(model) -> list:
    inner = model.model
    return list(getattr(inner, "language_model", inner).layers)
