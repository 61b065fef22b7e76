"""Tiny random models of the linear-attention hybrids (Qwen3-Next, Qwen3.5's text model, Kimi Linear, MiniMax),
built from transformers' own configs and classes and saved with save_pretrained, with a small Qwen2 BPE tokenizer
(tiny_models.py's recipe).

Each has both layer kinds: Qwen3-Next and Qwen3.5 linear, linear, full (gated, partial RoPE), linear; Kimi Linear
linear, full (MLA without RoPE), linear; MiniMax lightning, full, lightning, full. The Qwen linear layers have 6 value
heads served by 2 key heads (the full layers 4 heads), Qwen3-Next's MLP in layers 1 and 3 routes through experts.
Weights are drawn with std 0.3 off their init (norm weights, A_log, dt_bias too); A_log is then moved down by 1.5
so the decays stay in (0, 1) without vanishing on a sentence, which keeps M's far columns readable. MiniMax's
slopes are its formula's (saved as buffers, not learned), kept.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import _bpe, perturb

FAMILIES = ("qwen3_next", "qwen3_5_text", "kimi_linear", "minimax")
COMMON = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "tie_word_embeddings": False, "initializer_range": 0.3}
LINEAR = {"linear_conv_kernel_dim": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
          "linear_num_key_heads": 2, "linear_num_value_heads": 6}
QWEN_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _config_and_class(family: str, vocab: int):
    import transformers as tf

    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**COMMON, **LINEAR, vocab_size=vocab, head_dim=16, num_hidden_layers=4,
                                  layer_types=QWEN_LAYERS, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=12, shared_expert_intermediate_size=14, decoder_sparse_step=2,
                                  norm_topk_prob=True), tf.Qwen3NextForCausalLM
    if family == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(**COMMON, **LINEAR, vocab_size=vocab, head_dim=16, num_hidden_layers=4,
                                    layer_types=QWEN_LAYERS), tf.Qwen3_5ForCausalLM
    # MiniMax: lightning, full, twice (the last layer's slope is about 0: a lightning layer there would not decay);
    # scaled residuals; experts in every layer; blocks of 4 tokens. No window: with one, transformers 5.23's cached
    # generate disagrees with its own forward without a cache
    if family == "minimax":
        return tf.MiniMaxConfig(**COMMON, vocab_size=vocab, head_dim=8, num_hidden_layers=4, num_local_experts=4,
                                num_experts_per_tok=2, block_size=4,
                                layer_types=["linear_attention", "full_attention"] * 2,
                                full_attn_alpha_factor=1.2, full_attn_beta_factor=0.9, linear_attn_alpha_factor=0.8,
                                linear_attn_beta_factor=1.1, mlp_alpha_factor=0.9, mlp_beta_factor=1.3), \
            tf.MiniMaxForCausalLM
    # MLA expands a key and a value for every head: num_key_value_heads as many as the heads
    return tf.KimiLinearConfig(**{**COMMON, "num_key_value_heads": 4}, vocab_size=vocab, num_hidden_layers=3,
                               kv_lora_rank=12, q_lora_rank=None,
                               qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=8, linear_head_dim=8,
                               linear_num_heads=4, linear_conv_kernel_dim=3, moe_intermediate_size=12,
                               num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                               layer_types=["linear_attention", "full_attention", "linear_attention"],
                               mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=0,
                               eos_token_id=0), tf.KimiLinearForCausalLM


def build(family: str, folder: Path, **sizes):
    """Save a tiny `family` model and its tokenizer to `folder`; return transformers' eager model read back."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = _bpe(True, ["<|endoftext|>"])
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    config, cls = _config_and_class(family, len(tokenizer))
    for name, value in sizes.items():
        setattr(config, name, value)
    torch.manual_seed(40 + FAMILIES.index(family))
    # MiniMax's slope_rate and the decays made from it are a formula's (get_slope_rate), saved as buffers: kept
    model = perturb(cls(config).eval(), keep=("slope_rate", "_decay"))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("A_log"):
                tensor.add_(-1.5)  # exp(A_log) about 0.2: decays exp(g) around 0.6..0.9, not vanishing
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


def linear_modules(model) -> dict[int, object]:
    """layer -> its linear attention module (Gated DeltaNet or KDA)."""
    found = {}
    for index, layer in enumerate(model.model.layers):
        module = getattr(layer, "linear_attn", None)
        if module is None and getattr(layer, "block_type", None) == "linear_attention":  # Kimi's, MiniMax's
            module = layer.self_attn
        if module is not None:
            found[index] = module
    return found


def build_multimodal(folder: Path):
    """Qwen3.5's multimodal checkpoint (`qwen3_5`, Qwen3_5ForConditionalGeneration): a tiny vision tower beside the
    same text model as `qwen3_5_text`'s, its settings under text_config, its keys under model.language_model."""
    import transformers as tf
    from transformers import Qwen2Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = _bpe(True, ["<|endoftext|>"])
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    n = len(tokenizer)
    text, _ = _config_and_class("qwen3_5_text", n)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 20, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 14, "num_position_embeddings": 16}
    config = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, image_token_id=n - 1,
                              video_token_id=n - 2, vision_start_token_id=n - 3, vision_end_token_id=n - 4)
    torch.manual_seed(43)
    model = perturb(tf.Qwen3_5ForConditionalGeneration(config).eval())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tf.Qwen3_5ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").eval()
