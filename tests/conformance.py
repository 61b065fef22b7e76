"""The conformance matrix's models: one tiny trained-looking checkpoint per row of attnscope/models/support.py,
built by the family's own builder (tests/tiny_*.py) with every weight drawn away from its initial value, and
transformers' eager model read back from it (the oracle).

`BUILDERS` maps each row's family to `build(folder) -> eager model`; a row without one fails the matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

Builder = Callable[[Path], object]


def _pages() -> dict[str, Builder]:
    import tiny_deepseek
    import tiny_gemma4
    import tiny_indexer
    import tiny_linear
    import tiny_llama4_smollm3_phi3 as modern
    import tiny_models
    import tiny_qknorm_models as qknormed

    def page(family: str) -> Builder:
        return lambda folder: tiny_models.build(family, folder)

    def qk(family: str) -> Builder:
        return lambda folder: qknormed.build(family, folder)

    def todays(name: str) -> Builder:
        return lambda folder: modern.build(name, folder)

    return {"Bert": page("bert"), "Roberta": page("roberta"), "ModernBert": page("modernbert"), "Gpt2": page("gpt2"),
            "Llama": page("llama"), "Mistral": _mistral_lm, "Qwen2": page("qwen2"), "Gemma2": page("gemma2"),
            "DeepseekV3": lambda folder: tiny_deepseek.build(folder, 3),
            "DeepseekV2": lambda folder: tiny_deepseek.build(folder, 2),
            "SmolLM3": todays("smollm3"), "Phi3": todays("phi3"), "Llama4": todays("llama4"),
            "GptOss": page("gpt_oss"), "Qwen3": qk("qwen3"), "Qwen3Moe": qk("qwen3_moe"), "Gemma3": qk("gemma3_text"),
            "Olmo2": qk("olmo2"),
            "EmbeddingGemma": lambda folder: qknormed.build("gemma3_text", folder, use_bidirectional_attention=True),
            "Gemma4": lambda folder: tiny_gemma4.build("gemma4_text", folder),
            "DeepseekV32": lambda folder: tiny_indexer.build(folder, "v32"),
            "GlmMoeDsa": lambda folder: tiny_indexer.build(folder, "glm5"),
            **{row: (lambda folder, name=name: tiny_linear.build(name, folder))
               for row, name in (("Qwen3Next", "qwen3_next"), ("Qwen3_5", "qwen3_5_text"),
                                 ("KimiLinear", "kimi_linear"), ("MiniMax", "minimax"))}}


def _mistral_lm(folder: Path):
    """tiny_models' Mistral (a window of 4 on every layer) with its language-model head, so it can decode."""
    import tiny_models
    import transformers as tf

    tokenizer = tiny_models._tokenizer("mistral")
    config, _ = tiny_models._config_and_class("mistral", len(tokenizer))
    return tiny_models.save_random(folder, tokenizer, config, tf.MistralForCausalLM, seed=40)


def _encoder_decoders() -> dict[str, Builder]:
    import tiny_encdec

    def encdec(family: str) -> Builder:
        return lambda folder: tiny_encdec.build(family, folder)

    return {"T5": encdec("t5"), "Umt5": encdec("umt5"), "Bart": encdec("bart"), "Marian": encdec("marian"),
            "MBart": encdec("mbart"), "Whisper": encdec("whisper")}


def _through_transformers() -> dict[str, Builder]:
    """The families with no page, each row's tiny_interface model: three through the attention interface, two
    hybrids."""
    import tiny_interface

    def interface(name: str) -> Builder:
        return lambda folder: tiny_interface.build(name, folder)[0]

    return {f"{how}:{name}": interface(name) for how, names in (("interface", ("gpt_neox", "mixtral", "cohere2")),
                                                                  ("hybrid", tiny_interface.HYBRIDS))
            for name in names}


def _pattern_families() -> dict[str, Builder]:
    """The pages of families whose modeling code computes attention itself (tests/tiny_pattern_families.py)."""
    import tiny_pattern_families

    return {row: (lambda folder, name=name: tiny_pattern_families.build(name, folder))
            for row, name in (("Bloom", "bloom"), ("Mpt", "mpt"), ("GptJ", "gptj"), ("Falcon", "falcon"))}


def _exact_through_the_interface() -> dict[str, Builder]:
    """MiniMax-M2 and OLMo 3, exact through the attention interface (issue #33), tiny from their own configs."""
    import transformers as tf
    from tiny_encdec import save_random
    from tiny_models import _tokenizer

    sizes = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64}

    def build(config_class, cls, seed: int, **more) -> Builder:
        def made(folder: Path):
            tokenizer = _tokenizer("llama")
            torch.manual_seed(seed)
            config = config_class(**sizes, **more, vocab_size=len(tokenizer))
            return save_random(cls(config), tokenizer, folder)
        return made

    return {"interface:minimax_m2": build(tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM, 60, num_hidden_layers=2,
                                          head_dim=8, rotary_dim=4, num_local_experts=4,
                                          num_experts_per_tok=2),
            "interface:olmo3": build(tf.Olmo3Config, tf.Olmo3ForCausalLM, 61, num_hidden_layers=4, sliding_window=4,
                                     pad_token_id=None)}  # its default 1 is the tokenizer's <s>: generate would mask it


def _with_picture(build: Callable[[str, Path], object], draw: Callable[[Path], object], name: str) -> Builder:
    """`build(name, folder)`, then the test picture drawn beside the model, `picture.png`."""
    def made(folder: Path):
        eager = build(name, folder)
        draw(folder / "picture.png")
        return eager
    return made


def _vision_towers() -> dict[str, Builder]:
    """The vision towers on --image (tests/tiny_vision.py), each folder holding its image processor and the test
    picture, `picture.png`."""
    import tiny_vision

    return {f"vision:{name}": _with_picture(tiny_vision.build, tiny_vision.draw, kind)
            for name, kind in (("vit", "vit"), ("deit", "deit"), ("dinov2", "dinov2_with_registers"),
                               ("clip", "clip"), ("siglip", "siglip_vision_model"))}


def _vision_language_models() -> dict[str, Builder]:
    """The vision-language models on --text with --image (tests/tiny_vlm.py), each folder holding its processor and
    the test picture, `picture.png`; LLaVA's row over a Mistral (a window of 4)."""
    import tiny_vlm

    return {f"vlm:{row}": _with_picture(tiny_vlm.build, tiny_vlm.image, name)
            for row, name in (("gemma3", "gemma3"), ("llama4", "llama4"), ("llava", "llava_mistral"),
                              ("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl"))}


BUILDERS: dict[str, Builder] = {**_pages(), **_encoder_decoders(), **_through_transformers(), **_pattern_families(),
                                **_exact_through_the_interface(), **_vision_towers(), **_vision_language_models()}


def attention_layers(eager) -> list[int]:
    """The layers with attention (every layer but a hybrid's Mamba or convolution layers), as transformers'
    config names them: what output_attentions' entries stand for, in order."""
    import tiny_interface

    return tiny_interface.attention_layers(eager)


# The watch column (attnscope.watch, issue 42; tests/watch_conformance.py): "exact" where the family's attention
# goes through transformers' attention interface (each layer's pattern against eager output_attentions, generate's
# rows too); "own" where the family computes it in its own code (BLOOM, MPT, GPT-J, Falcon: said in one line,
# transformers' own output_attentions from its eager run); "modules" for an encoder-decoder (whose modules' layer_idx
# repeat: every attention module numbered in module order, the encoder's, then the decoder's self and cross).
# Which of the four computes its own is read from the installed transformers (GPT-J moved onto the interface in
# 5.24), by its modeling module's names, not attnscope's.
WATCH_OWN = {"Bloom": "bloom", "Mpt": "mpt", "GptJ": "gptj", "Falcon": "falcon"}


def _own_code(name: str) -> bool:
    import importlib

    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return "ALL_ATTENTION_FUNCTIONS" not in vars(module)


def watch_column(family: str) -> str:
    from test_conformance import ENCODER_DECODERS

    if family in WATCH_OWN and _own_code(WATCH_OWN[family]):
        return "own"
    return "modules" if family in ENCODER_DECODERS else "exact"


def assert_trained_looking(folder: Path) -> None:
    """Every floating tensor the checkpoint holds varies: no norm weight of ones, no zero bias or sink, no table
    left as initialised to a constant (Marian's and Whisper's sinusoids are not learned, and vary anyway)."""
    from safetensors.torch import load_file

    for path in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                assert float(tensor.float().std()) > 1e-3, f"{path.name}: {name} is constant ({tensor.flatten()[0]})"


def eager_attentions(eager, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' eager `output_attentions` on `ids`: every attention layer's `[n_head, n, n]` (MiniMax's entries
    for its lightning layers, their states, left out)."""
    with torch.no_grad():
        out = eager(torch.tensor([ids]), output_attentions=True)
    kept = attention_layers(eager)
    every = len(out.attentions) == eager.config.get_text_config().num_hidden_layers
    return tuple(a[0] for i, a in enumerate(out.attentions) if not every or i in kept)
