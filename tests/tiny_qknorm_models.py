"""Tiny random models of the qk-norm families (Qwen3, Qwen3-MoE, Gemma 3 text and multimodal, OLMo 2), built from
transformers' own configs and classes and saved with save_pretrained, with a small BPE tokenizer of each family's
tokenizer class (tiny_models.py's recipe).

Every tiny model covers its family's layer types on a text longer than its window (SENTENCE), with grouped KV
heads, a head_dim other than hidden_size / heads where the family allows it, and weights drawn with std 0.3 (norm
weights too: Gemma's `1 + w` and the q/k norms matter) so the patterns are sharp, not flat.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import _bpe, save_random

FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2")
WINDOW = 4
DECODER = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "tie_word_embeddings": False, "initializer_range": 0.3}


def _tokenizer(family: str):
    from transformers import GemmaTokenizer, GPT2Tokenizer, Qwen2Tokenizer

    if family.startswith("gemma3"):
        vocab, merges = _bpe(False, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])
        return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    vocab, merges = _bpe(True, ["<|endoftext|>"])
    return (GPT2Tokenizer if family == "olmo2" else Qwen2Tokenizer)(vocab=vocab, merges=merges)


def gemma3_text_config(vocab: int, **sizes):
    """Layers 0 and 2 sliding (a window of 4), layer 1 full; scores scaled by 12^-½; a softcap in the config that
    Gemma 3 does not apply."""
    import transformers as tf

    return tf.Gemma3TextConfig(**{**DECODER, "vocab_size": vocab, "head_dim": 16, "num_hidden_layers": 3,
                                  "query_pre_attn_scalar": 12, "sliding_window": WINDOW, "attn_logit_softcapping": 5.0,
                                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                  **sizes})


def _config_and_class(family: str, vocab: int):
    import transformers as tf

    if family == "qwen3":  # layer 0 full, layers 1 and 2 sliding; every bias; head_dim 16 on a width of 32
        return tf.Qwen3Config(**DECODER, vocab_size=vocab, head_dim=16, num_hidden_layers=3, attention_bias=True,
                              use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), tf.Qwen3ForCausalLM
    if family == "qwen3_moe":  # layers 0 and 2 route through 4 experts (top 2, renormalised), layer 1 dense
        return tf.Qwen3MoeConfig(**DECODER, vocab_size=vocab, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1],
                                 decoder_sparse_step=1), tf.Qwen3MoeForCausalLM
    if family == "gemma3_text":
        return gemma3_text_config(vocab), tf.Gemma3ForCausalLM
    if family == "gemma3":  # the multimodal checkpoint: a tiny vision tower beside the same language model
        vision = {"hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}
        config = tf.Gemma3Config(text_config=gemma3_text_config(vocab).to_dict(), vision_config=vision,
                                 mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2,
                                 eoi_token_index=vocab - 3)
        return config, tf.Gemma3ForConditionalGeneration
    return tf.Olmo2Config(**DECODER, vocab_size=vocab, num_hidden_layers=2, eos_token_id=0,  # OLMo 2 7B's base
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), tf.Olmo2ForCausalLM


def build(family: str, folder: Path, **sizes):
    """Save a tiny `family` model and its tokenizer to `folder`; return transformers' eager model read back."""
    tokenizer = _tokenizer(family)
    config, cls = _config_and_class(family, len(tokenizer))
    return save_random(folder, tokenizer, config, cls, FAMILIES.index(family), **sizes)


def decoder_layers(model) -> list:
    """The decoder layers of any of these models (the language model's, in the multimodal one)."""
    inner = model.model
    return list(getattr(inner, "language_model", inner).layers)
