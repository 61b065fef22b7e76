"""Around a bug of the installed transformers release, for the reference runs only (`--check`'s eager model).

transformers 5.24.0's `Llama4ForConditionalGeneration.forward` reads `outputs.image_outputs` off its language
model's `MoeCausalLMOutputWithPast`, which has no such field, so every call with return_dict raises AttributeError
after the whole forward has run (and `generate` with it). Inside `reference_fixes()` that output class answers None
for the attribute, which is what `Llama4CausalLMOutputWithPast` takes where there is no image output; the attention
transformers computes is its own, unchanged. Only where the installed release has the bug; undone on leaving.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def reference_fixes() -> Iterator[None]:
    patched = _llama4_image_outputs()
    try:
        yield
    finally:
        if patched is not None:
            delattr(patched, "image_outputs")


def _llama4_image_outputs() -> type | None:
    """The output class given the missing attribute, or None where nothing needed it."""
    try:
        import inspect

        from transformers.modeling_outputs import MoeCausalLMOutputWithPast
        from transformers.models.llama4 import modeling_llama4
    except ImportError:
        return None
    if hasattr(MoeCausalLMOutputWithPast, "image_outputs"):
        return None
    try:
        source = inspect.getsource(modeling_llama4.Llama4ForConditionalGeneration.forward)
    except (OSError, TypeError):
        return None
    if "image_outputs=outputs.image_outputs" not in source:
        return None
    MoeCausalLMOutputWithPast.image_outputs = None  # type: ignore[attr-defined]
    return MoeCausalLMOutputWithPast
