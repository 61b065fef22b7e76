"""Tiny random models of families attnscope has no page for, traced through transformers' attention interface
(models/nopage/interface.py): one of each layer kind the interface hands over (causal, sliding, softcapped, sinks,
bidirectional), with GQA where the family has it, and two hybrids (Jamba's Mamba layers, LFM2's convolutions).
`build(name, folder, **sizes)` saves one and its tokenizer and returns transformers' eager model read back (with
the tokenizer); `sizes` override the config's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_encdec import save_random
from tiny_models import _tokenizer


def _families():
    import transformers as tf

    decoder = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2}
    return {
        # partial rotary (a quarter of each head turns), q/k/v biases, one head per KV head
        "gpt_neox": (tf.GPTNeoXConfig(hidden_size=32, intermediate_size=40, num_attention_heads=4,
                                      num_hidden_layers=2, rotary_pct=0.25), tf.GPTNeoXForCausalLM),
        # three sliding layers of 4, then a full NoPE one (layer_types from sliding_window_pattern)
        "cohere2": (tf.Cohere2Config(**decoder, num_hidden_layers=4, sliding_window=4), tf.Cohere2ForCausalLM),
        # its own attention_multiplier in place of 1/sqrt(d_head)
        "granite": (tf.GraniteConfig(**decoder, num_hidden_layers=2, attention_multiplier=0.3,
                                     embedding_multiplier=2.0, residual_multiplier=0.5), tf.GraniteForCausalLM),
        # a mixture of experts before every layer's output, a window of 4 on every layer
        "mixtral": (tf.MixtralConfig(**decoder, num_hidden_layers=2, sliding_window=4, num_local_experts=4,
                                     num_experts_per_tok=2), tf.MixtralForCausalLM),
        # softcapped scores, alternating sliding and full layers
        "vaultgemma": (tf.VaultGemmaConfig(**decoder, num_hidden_layers=3, head_dim=8, sliding_window=4,
                                           attn_logit_softcapping=3.0), tf.VaultGemmaForCausalLM),
        # a learned sink per head that scales the output (its eager keeps the softmax whole)
        "granite_swa": (tf.GraniteSWAConfig(**decoder, num_hidden_layers=3, sliding_window=4,
                                            attention_multiplier=0.4), tf.GraniteSWAForCausalLM),
        # an encoder: no mask at all
        "electra": (tf.ElectraConfig(embedding_size=32, hidden_size=32, intermediate_size=40, num_attention_heads=4,
                                     num_hidden_layers=2), tf.ElectraModel),
        # hybrids: Mamba layers 0, 1, 3, 4 and attention on 2 and 5 (i % attn_layer_period == attn_layer_offset),
        # experts on every other layer
        "jamba": (tf.JambaConfig(**decoder, num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2,
                                 num_experts=4), tf.JambaForCausalLM),
        # short convolutions on layers 0 and 2, attention on 1 and 3 (full_attn_idxs)
        "lfm2": (tf.Lfm2Config(**decoder, num_hidden_layers=4, full_attn_idxs=[1, 3]), tf.Lfm2ForCausalLM),
    }


FAMILIES = ("gpt_neox", "cohere2", "granite", "mixtral", "vaultgemma", "granite_swa", "electra")
HYBRIDS = ("jamba", "lfm2")  # attention on some layers only (tests/test_interface_stream.py)


def attention_layers(model) -> list[int]:
    """The layers with attention, as transformers' config lists each layer's kind (Mamba's "linear_attention",
    LFM2's "conv": none)."""
    config = model.config.get_text_config()
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(kinds) if kind not in ("linear_attention", "conv")]


def build(name: str, folder: Path, **sizes):
    """Save a tiny `name` model and its tokenizer to `folder`; return transformers' eager model and the tokenizer."""
    config, cls = _families()[name]
    tokenizer = _tokenizer("bert" if name == "electra" else "gpt2")
    config = type(config)(**{**config.to_dict(), "vocab_size": len(tokenizer), **sizes})  # derived sizes again
    torch.manual_seed((FAMILIES + HYBRIDS).index(name))
    return save_random(cls(config), tokenizer, folder), tokenizer
