"""The special tokens a `tokenizers.Tokenizer` adds around a text, as transformers' tokenizers add them: the
post-processor of a tokenizer.json (models/tokenizer.py) and of a GGUF file's vocabulary (models/gguf/tokenizer.py)."""

from __future__ import annotations

from typing import Any


def add_special_tokens(tokenizer: Any, settings: dict[str, Any]) -> None:
    """transformers' `TokenizersBackend.update_post_processor`: `[bos] $A [eos]` as the flags say."""
    from tokenizers import processors

    special = []
    parts = {}
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = _token_text(settings.get(name))
        token_id = tokenizer.token_to_id(token) if token else None
        if settings.get(flag) and token is not None and token_id is not None:
            special.append((token, token_id))
            parts[name] = token
    bos = f"{parts['bos_token']}:0 " if "bos_token" in parts else ""
    eos = f" {parts['eos_token']}:0" if "eos_token" in parts else ""
    bos1 = f" {parts['bos_token']}:1" if "bos_token" in parts else ""
    eos1 = f" {parts['eos_token']}:1" if "eos_token" in parts else ""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos}{bos1} $B:1{eos1}", special_tokens=special)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None
