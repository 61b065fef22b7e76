"""Shared fixtures. Tiny models are built on the fly; nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch

# The tests never reach the network: a model that is not on disk must fail fast, as offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_COLOR", "1")


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture()
def runner():
    """A CliRunner whose results' stderr has each message on one line (tests/cli_main.unwrapped)."""
    from cli_main import unwrapped
    from typer.testing import CliRunner

    class Runner(CliRunner):
        def invoke(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            result = super().invoke(*args, **kwargs)
            result.stderr_bytes = unwrapped(result.stderr_bytes.decode()).encode()
            return result

    return Runner()


def _llama4_reference_runs() -> None:
    """transformers 5.24.0's `Llama4ForConditionalGeneration.forward` reads `outputs.image_outputs` off its language
    model's `MoeCausalLMOutputWithPast`, which has no such field, and raises AttributeError on every input with
    return_dict (an upstream bug; attnscope's own Llama 4 path never calls that forward). The eager reference the
    tests compare with is transformers' own code: the missing attribute is given as None (what its
    Llama4CausalLMOutputWithPast takes when there is no image output), and nothing else changes. Only where the
    installed transformers has the bug."""
    try:
        import inspect

        from transformers.modeling_outputs import MoeCausalLMOutputWithPast
        from transformers.models.llama4 import modeling_llama4
    except ImportError:
        return
    forward = modeling_llama4.Llama4ForConditionalGeneration.forward
    if hasattr(MoeCausalLMOutputWithPast, "image_outputs") or \
            "image_outputs=outputs.image_outputs" not in inspect.getsource(forward):
        return
    MoeCausalLMOutputWithPast.image_outputs = None  # type: ignore[attr-defined]


_llama4_reference_runs()
