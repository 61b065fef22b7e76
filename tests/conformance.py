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
            "EmbeddingGemma": lambda folder: qknormed.build("gemma3_text", folder, use_bidirectional_attention=True)}


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


BUILDERS: dict[str, Builder] = {**_pages(), **_encoder_decoders(), **_through_transformers(), **_pattern_families()}


def attention_layers(eager) -> list[int]:
    """The layers with attention (every layer but a hybrid's Mamba or convolution layers), as transformers'
    config names them: what output_attentions' entries stand for, in order."""
    import tiny_interface

    return tiny_interface.attention_layers(eager)


def assert_trained_looking(folder: Path) -> None:
    """Every floating tensor the checkpoint holds varies: no norm weight of ones, no zero bias or sink, no table
    left as initialised to a constant (Marian's and Whisper's sinusoids are not learned, and vary anyway)."""
    from safetensors.torch import load_file

    for path in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                assert float(tensor.float().std()) > 1e-3, f"{path.name}: {name} is constant ({tensor.flatten()[0]})"


def eager_attentions(eager, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' eager `output_attentions` on `ids`: every layer's `[n_head, n, n]`."""
    with torch.no_grad():
        out = eager(torch.tensor([ids]), output_attentions=True)
    return tuple(a[0] for a in out.attentions)
