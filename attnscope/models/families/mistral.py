"""Mistral <- Llama <- Family

Mistral: LLaMA's layout and forward (llama.py), with a sliding window of `sliding_window` keys on every layer
when the config sets one (transformers' `MistralAttention`), and no biases anywhere."""

from __future__ import annotations

from attnscope.models.families.llama import Llama


class Mistral(Llama):
    model_types = ("mistral",)

    def biases(self) -> tuple[bool, bool]:
        return False, False

    def mlp_biased(self) -> bool:
        return False

    def window(self, layer: int) -> int | None:
        return self.config.optional_integer("sliding_window")
