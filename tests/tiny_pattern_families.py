"""Tiny random models of the families whose modeling code computes attention itself (no attention interface):
BLOOM and MPT (ALiBi), GPT-J (interleaved partial rotary, a parallel block), Falcon in each of its layouts.
Built from transformers' own configs and classes, every weight drawn away from its initial value
(tiny_models.save_random), saved with a small GPT-2 BPE tokenizer. `build(name, folder)` returns transformers'
eager model read back: the oracle.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import _tokenizer, save_random


def _configs(vocab: int):
    import transformers as tf

    shared = {"vocab_size": vocab, "initializer_range": 0.3}
    falcon = {**shared, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 3, "ffn_hidden_size": 40,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
    return {
        # 6 heads: not a power of two, so ALiBi's extra slopes; the residuals after the norms
        "bloom": (tf.BloomConfig(**shared, hidden_size=36, n_head=6, n_layer=3,
                                 apply_residual_connection_post_layernorm=True), tf.BloomForCausalLM),
        "bloom_pre": (tf.BloomConfig(**shared, hidden_size=32, n_head=4, n_layer=2), tf.BloomForCausalLM),
        # 6 heads again (MPT's slopes are BLOOM's), its own softmax_scale
        "mpt": (tf.MptConfig(**shared, d_model=36, n_heads=6, n_layers=3, max_seq_len=64,
                             attn_config={"softmax_scale": 0.3}), tf.MptForCausalLM),
        # rotary_dim 4 of a head of 8, interleaved; biased MLP and lm_head
        "gptj": (tf.GPTJConfig(**shared, n_embd=32, n_head=4, n_layer=3, rotary_dim=4, n_positions=64, n_inner=40),
                 tf.GPTJForCausalLM),
        # Falcon 40B/180B's layout: grouped query/key/value per KV group, two LayerNorms, parallel attention
        "falcon": (tf.FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2), tf.FalconForCausalLM),
        # Falcon 7B's: multi-query (one key and value head), one LayerNorm, parallel attention
        "falcon_mq": (tf.FalconConfig(**falcon, multi_query=True, parallel_attn=True), tf.FalconForCausalLM),
        # the old layout without multi-query: fused per head as BLOOM's, sequential, with biases and a rope_theta
        "falcon_seq": (tf.FalconConfig(**falcon, multi_query=False, parallel_attn=False, bias=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
                       tf.FalconForCausalLM),
    }


NAMES = ("bloom", "bloom_pre", "mpt", "gptj", "falcon", "falcon_mq", "falcon_seq")


def build(name: str, folder: Path, **sizes):
    """Save a tiny `name` model and its tokenizer to `folder`; return transformers' eager model read back."""
    tokenizer = _tokenizer("gpt2")
    config, cls = _configs(len(tokenizer))[name]
    return save_random(folder, tokenizer, config, cls, 70 + NAMES.index(name), **sizes)
