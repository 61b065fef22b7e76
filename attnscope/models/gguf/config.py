"""A GGUF file's metadata as the config.json its family page reads: llama.cpp's keys (`{arch}.block_count`,
`{arch}.attention.head_count`, ...) under transformers' names (`num_hidden_layers`, `num_attention_heads`, ...),
as transformers' GGUF loader maps them (`integrations/ggml.py` `GGUF_CONFIG_MAPPING`, read by
`modeling_gguf_pytorch_utils.load_gguf_checkpoint`), plus what llama.cpp itself reads from the file or fixes
in its code and transformers' mapping leaves at the config class's defaults:

- `{arch}.attention.key_length` is the head size where the file has it (Gemma, Qwen 3), else
  embedding_length / head_count; `{arch}.rope.dimension_count` short of it is a partial rotary factor (Phi-4
  mini; LLaMA-family pages turn the whole head whatever it says, as transformers' default RoPE does);
- `{arch}.rope.scaling.type` linear or yarn, with `.factor` and `.original_context_length`;
- `{arch}.attention.sliding_window` (Gemma 2 and 3, Phi-3), Gemma 2's `{arch}.attn_logit_softcapping` and
  `{arch}.final_logit_softcapping`;
- Gemma's query scale: llama.cpp's `f_attention_scale`, 1/sqrt(head size), except Gemma 2 and 3 27B (46 and 62
  layers), 1/sqrt(embedding_length / head_count): `query_pre_attn_scalar`.
- `tie_word_embeddings` when the file has no `output.weight` (transformers' loader decides the same way).
"""

from __future__ import annotations

from typing import Any

from attnscope.errors import UsageError, printable
from attnscope.models.gguf.header import LAZY_TYPES, Array, Header, read_bytes

# general.architecture -> (model_type, the class transformers would build, what it reads)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", "LLaMA, Mistral, SmolLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen 2, Qwen 2.5"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen 3"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "Gemma 2"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", "Gemma 3's text model"),
    "phi3": ("phi3", "Phi3ForCausalLM", "Phi-3, Phi-4"),
}
SUPPORTED = ", ".join(f"{arch} ({what})" for arch, (_, _, what) in ARCHITECTURES.items())
LARGE_GEMMA = {"gemma2": 46, "gemma3": 62}  # 27B's layers: llama.cpp's LLM_TYPE_27B
PER_LAYER = ("attention.head_count", "attention.head_count_kv")  # llama.cpp allows an array of one per layer


def architecture(header: Header) -> str:
    arch = header.metadata.get("general.architecture")
    if arch is None:
        raise UsageError(f"{{model}} {header.path} has no general.architecture in its metadata; it is not a model "
                         "llama.cpp converted", "model")
    if not isinstance(arch, str) or len(arch) > 64:
        raise UsageError(f"{{model}} {header.path}: its general.architecture is not an architecture's name; the "
                         "file's metadata is damaged: download it again, or convert the model again", "model")
    if arch not in ARCHITECTURES:
        raise UsageError(f"{{model}} {header.path} is a GGUF of architecture {printable(repr(arch))}; attnscope reads "
                         f"GGUF files of {SUPPORTED}", "model")
    return arch


def config_of(header: Header) -> dict[str, Any]:
    """The config.json this file's family page reads."""
    arch = architecture(header)
    meta = header.metadata

    def get(key: str, default: Any = None, *, need: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if need and value is None:
            raise UsageError(f"{{model}} {header.path}: the metadata has no {arch}.{key}; the file is not a complete "
                             "llama.cpp conversion", "model")
        if key in PER_LAYER and isinstance(value, (list, Array)):  # a count per layer (hybrid models)
            raise UsageError(f"{{model}} {header.path}: {arch}.{key} differs by layer; attnscope reads GGUF files "
                             "whose layers all have the same heads", "model")
        if isinstance(value, (list, *LAZY_TYPES)):  # an array (or a text past any setting's length): never quoted
            what = f"an array of {len(value):,} values" if isinstance(value, (list, Array)) else \
                f"a text of {len(value):,} bytes"
            raise UsageError(f"{{model}} {header.path}: its metadata {arch}.{key} is {what}, where llama.cpp writes "
                             "one value; the file's metadata is damaged: download it again, or convert the model "
                             "again", "model")
        return value

    n_head, d_model = get("attention.head_count", need=True), get("embedding_length", need=True)
    for key, value in (("attention.head_count", n_head), ("embedding_length", d_model)):
        if type(value) is not int or value < 1:
            raise UsageError(f"{{model}} {header.path}: {arch}.{key} is {value!r}; it must be a positive whole number",
                             "model")
    model_type, cls, _ = ARCHITECTURES[arch]
    head_dim = get("attention.key_length") or (d_model // n_head if isinstance(d_model, int) and n_head else None)
    config: dict[str, Any] = {
        "model_type": model_type, "architectures": [cls], "num_hidden_layers": get("block_count", need=True),
        "hidden_size": d_model, "intermediate_size": get("feed_forward_length"), "num_attention_heads": n_head,
        "num_key_value_heads": get("attention.head_count_kv", n_head), "head_dim": head_dim,
        "max_position_embeddings": get("context_length"), "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base"), "vocab_size": get("vocab_size", _vocab(meta)),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    rotary = get("rope.dimension_count")
    if isinstance(rotary, int) and isinstance(head_dim, int) and head_dim and rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    scaling = _rope_scaling(get, header) or _rope_freqs(header, config) or _rope_factors(header, get)
    if scaling:
        config["rope_scaling"] = scaling
        if arch == "phi3":  # Phi3Config's own attribute wins over the scaling's (4096 when absent)
            config["original_max_position_embeddings"] = scaling.get("original_max_position_embeddings")
    # the MLP's activation is llama.cpp's code, not the file's: GELU's tanh form for Gemma, SiLU for the others
    config["hidden_activation" if arch in LARGE_GEMMA else "hidden_act"] = (
        "gelu_pytorch_tanh" if arch in LARGE_GEMMA else "silu")
    if arch == "qwen2":
        config["use_sliding_window"] = False  # Qwen2Config's default: the file has no window
    if arch in ("gemma2", "gemma3", "phi3"):
        config["sliding_window"] = get("attention.sliding_window")
    if arch in LARGE_GEMMA:
        large = config["num_hidden_layers"] == LARGE_GEMMA[arch]
        config["query_pre_attn_scalar"] = d_model // n_head if large else head_dim
    if arch == "gemma2":
        config["attn_logit_softcapping"] = get("attn_logit_softcapping", 50.0)
        config["final_logit_softcapping"] = get("final_logit_softcapping", 30.0)
    return {key: value for key, value in config.items() if value is not None}


def _vocab(meta: dict[str, Any]) -> int | None:
    tokens = meta.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, (list, Array)) else None


def _rope_freqs(header: Header, config: dict[str, Any]) -> dict[str, Any] | None:
    """Llama 3.1's and 3.2's RoPE scaling: llama.cpp's converter writes no `rope_scaling`, but the factor that
    divides each frequency, as a tensor (`rope_freqs.weight`, `[d_head / 2]`; LlamaModel.generate_extra_tensors),
    which llama.cpp's `ggml_rope_ext` applies to every position. transformers' longrope with those factors both
    short and long, and no attention factor, turns by the same angles (`_compute_longrope_parameters`: inv_freq
    = 1 / (factors · base^(2i/d)))."""
    info = header.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    factors = _values(header, info)
    context = config.get("max_position_embeddings") or 1
    return {"rope_type": "longrope", "short_factor": factors, "long_factor": factors, "attention_factor": 1.0,
            "original_max_position_embeddings": context}


def _rope_factors(header: Header, get: Any) -> dict[str, Any] | None:
    """Phi-3's longrope (the 128k models, Phi-3.5, Phi-4 mini): llama.cpp's converter (Phi3MiniModel) writes the
    short and long factors as tensors (`rope_factors_short.weight`, `rope_factors_long.weight`), the context they
    switch at as `{arch}.rope.scaling.original_context_length` and the cos/sin factor as `.attn_factors`;
    transformers' longrope reads the same three (`_compute_longrope_parameters`), switching to the long factors
    once the text passes the original context, as Phi3ForCausalLM does."""
    short, long = header.tensors.get("rope_factors_short.weight"), header.tensors.get("rope_factors_long.weight")
    if short is None or long is None:
        return None
    scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": _values(header, short),
                               "long_factor": _values(header, long)}
    original = get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    factor = get("rope.scaling.attn_factor")
    if factor is not None:
        scaling["attention_factor"] = factor
    return scaling


def _values(header: Header, info: Any) -> list[float]:
    """A small F32 (or F16) tensor of the file as numbers."""
    from attnscope.models.gguf.quants import dequantize

    raw = read_bytes(info, 0, info.nbytes)
    return [float(f) for f in dequantize(raw, info.ggml_type, 1, info.shape[-1], f"{header.path}: {info.name}")[0]]


def _rope_scaling(get: Any, header: Header) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        shown = repr(kind) if len(repr(kind)) <= 40 else f"{repr(kind)[:40]}..."
        raise UsageError(f"{{model}} {header.path}: its metadata's RoPE scaling ({architecture(header)}.rope.scaling."
                         f"type) is {printable(shown)}; attnscope reads linear and yarn from GGUF metadata", "model")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": get("rope.scaling.factor", 1.0)}
    original = get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling
