"""Tiny GGUF files written as llama.cpp's converter writes them (convert_hf_to_gguf.py), from tiny random models
of transformers' own classes with every weight perturbed off its init: `gguf.GGUFWriter`, llama.cpp's key and
tensor names, its rotary reorder of LLaMA's Q and K rows (`LlamaModel.permute`), Gemma's norms stored as
`1 + w`, Phi-3's fused projections, 2-D weights quantized by `gguf.quants.quantize` (Q8_0 or Q4_0), the rest
F32, and a byte-level BPE tokenizer in `tokenizer.ggml.*`.

`write(family, folder, quant)` returns the file; the reference is transformers' own GGUF loader reading it
(`reference(path)`: `from_pretrained(..., gguf_file=...)`, eager attention).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tiny_models import _bpe, perturb

# our family -> (llama.cpp's architecture, the transformers config class, its keyword arguments). Sizes are such
# that every matrix's rows are whole blocks of 32; Gemma's and Qwen 3's head size is what transformers' GGUF path
# assumes where the file is silent (query_pre_attn_scalar 256, Qwen3Config's head_dim 128).
SHAPES = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "initializer_range": 0.3}
FAMILIES = {
    "llama": ("llama", "LlamaConfig", {"num_hidden_layers": 2, "rope_theta": 100000.0}),
    "qwen2": ("qwen2", "Qwen2Config", {"num_hidden_layers": 2, "rope_theta": 1000000.0}),
    "qwen3": ("qwen3", "Qwen3Config", {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                       "head_dim": 128}),
    "gemma2": ("gemma2", "Gemma2Config", {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                          "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4}),
    "gemma3": ("gemma3", "Gemma3TextConfig", {"num_hidden_layers": 6, "num_attention_heads": 2,
                                              "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
                                              "sliding_window": 4}),
    "llama3": ("llama", "LlamaConfig", {"num_hidden_layers": 2, "rope_theta": 500000.0, "max_position_embeddings": 64,
                                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16}}),
    "phi3": ("phi3", "Phi3Config", {"num_hidden_layers": 2, "rope_theta": 10000.0, "pad_token_id": 0}),
    "phi3long": ("phi3", "Phi3Config", {"num_hidden_layers": 2, "pad_token_id": 0,
                                        "original_max_position_embeddings": 8,
                                        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                            "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                            "long_factor": [1.5 + 0.5 * i for i in range(8)],
                                                            "original_max_position_embeddings": 8}}),
}
CLASSES = {"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
           "phi3": "Phi3ForCausalLM", "phi3long": "Phi3ForCausalLM"}
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def hf_model(family: str, vocab: int, seed: int = 0):
    import transformers as tf

    arch, config_class, sizes = FAMILIES[family]
    tied = family != "qwen2"  # Qwen 2's file then has its own output.weight
    config = getattr(tf, config_class)(**{**SHAPES, **sizes, "vocab_size": vocab, "tie_word_embeddings": tied})
    torch.manual_seed(seed)
    return perturb(getattr(tf, CLASSES[family])(config).eval())


def write(family: str, folder: Path, quant: str = "Q8_0", *, name: str | None = None, pre: str = "smollm") -> Path:
    """A GGUF of a tiny random `family` model, its matrices quantized as `quant`; `pre`: the tokenizer's split
    (`tokenizer.ggml.pre`: SmolLM's is GPT-2's, Qwen 2's its own regex)."""
    import gguf

    vocab, merges = _bpe(True, ["<|endoftext|>"])
    tokens = sorted(vocab, key=vocab.__getitem__)
    model = hf_model(family, len(tokens))
    arch = FAMILIES[family][0]
    config = model.config
    path = folder / (name or f"tiny-{family}-{quant}.gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the full layers' base is the file's (llama.cpp fixes 10k)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if family in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
    _tokenizer(writer, tokens, merges, pre)
    for key, tensor in model.state_dict().items():
        name = gguf_name(family, key)
        if name is None:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = permute(data, config.num_attention_heads, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in name:
            data = permute(data, config.num_attention_heads, config.num_key_value_heads)
        if family.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # Gemma2Model.modify_tensors: llama.cpp stores 1 + w
        _add(writer, name, data, quant)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", rope_freqs(rope, head_dim))
    if rope.get("rope_type") == "longrope":  # convert_hf_to_gguf.py's Phi3MiniModel
        import math

        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rope_freqs(rope: dict, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.generate_extra_tensors`: Llama 3's scaling as a factor per frequency."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_name(family: str, key: str) -> str | None:
    if key == "lm_head.weight":
        return None if family != "qwen2" else "output.weight"
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if key in top:
        return top[key]
    parts = key.split(".")
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    table = {**NAMES, **(GEMMA_NAMES if family.startswith("gemma") else {})}
    if family.startswith("phi3"):
        table["mlp.gate_up_proj"] = "ffn_up"
    if ".rotary_emb." in key:
        return None
    return f"blk.{layer}.{table[module]}.{kind}"


def permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: each head's rotary halves interleaved row by row."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add(writer, name: str, data: np.ndarray, quant: str) -> None:
    import gguf

    if data.ndim == 2 and quant != "F32":
        kind = getattr(gguf.GGMLQuantizationType, quant)
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, data.astype(np.float32))


def _tokenizer(writer, tokens: list[str], merges: list[tuple[str, str]], pre: str = "smollm") -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == "<|endoftext|>" else 1 for token in tokens])
    writer.add_token_merges([" ".join(merge) for merge in merges])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)


def reference(path: Path):
    """transformers' own GGUF loader: the model dequantized whole, eager attention, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def write_split(source: Path, target: Path, shards: int) -> None:
    """`source` rewritten as gguf-split writes a split model: `target`'s stem -0000k-of-0000n.gguf, each shard a
    GGUF of its own (GGUFWriter's split_max_tensors), the metadata in the first."""
    import math

    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch, split_max_tensors=math.ceil(len(reader.tensors) / shards))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_sentencepiece(arch: str, folder: Path) -> Path:
    """A GGUF holding only a SentencePiece-style vocabulary (`tokenizer.ggml.model` "llama": "▁" pieces, scores,
    control tokens, merges) as llama.cpp writes LLaMA 2's and Gemma's, and one tensor."""
    import gguf

    specials = ["<unk>", "<s>", "</s>"] if arch == "llama" else ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab, merges = _bpe(False, specials)
    tokens = sorted(vocab, key=vocab.__getitem__)
    path = folder / f"sentencepiece-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("attention.head_count", 2)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_token_merges([" ".join(merge) for merge in merges])
    writer.add_bos_token_id(tokens.index("<s>" if arch == "llama" else "<bos>"))
    writer.add_eos_token_id(tokens.index("</s>" if arch == "llama" else "<eos>"))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
