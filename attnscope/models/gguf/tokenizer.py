"""A GGUF file's tokenizer, built from its `tokenizer.ggml.*` metadata as transformers builds it
(`AutoTokenizer.from_pretrained(folder, gguf_file=...)`: `integrations/gguf/gguf_tokenizer_mapping.py`'s
`get_gguf_tokenizer` and `convert_gguf_tokenizer`, then `TokenizersBackend.update_post_processor`).

A byte-level BPE vocabulary split as GPT-2 splits (`tokenizer.ggml.model` "gpt2", a `pre` with no split of its
own: SmolLM's) is built here with the `tokenizers` library alone, as `byte_level_tokenizer` and
`add_gguf_special_tokens` build it, in a tenth of a second; every other kind (SentencePiece vocabularies, the
Llama 3 and Qwen splits) through transformers' own `convert_gguf_tokenizer`, handed the metadata already read.
tests/test_gguf*.py hold the ids equal to AutoTokenizer's.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from attnscope.errors import UsageError
from attnscope.models.gguf.header import Strings
from attnscope.models.post_processor import add_special_tokens

# tokenizer.ggml.* -> the names transformers' GGUF_TOKENIZER_MAPPING gives them
TOKENIZER = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
             "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
             "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
             "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}
SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
           "pad_token": "padding_token_id"}
PLAIN_SPLIT = frozenset({None, "default", "gpt-2", "gpt2", "smollm"})  # GPT-2's ByteLevel regex, nothing more
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def load(path: Path) -> Any:
    return _load(path, path.stat().st_mtime_ns)


@lru_cache(maxsize=4)
def _load(path: Path, _mtime: int) -> Any:
    from attnscope.models.gguf.open import header_of

    header = header_of(path)
    meta = {key: value.values() if isinstance(value, Strings) else value for key, value in header.metadata.items()
            if key.startswith("tokenizer.ggml.") or key == "general.architecture"}
    if not isinstance(meta.get("tokenizer.ggml.tokens"), list):
        raise UsageError(f"{{model}} {path} holds no tokenizer (no tokenizer.ggml.tokens in its metadata), so "
                         "{text} cannot be read; convert the model again with its tokenizer", "model", "text")
    found = {name: meta[f"tokenizer.ggml.{key}"] for key, name in TOKENIZER.items() if f"tokenizer.ggml.{key}" in meta}
    settings: dict[str, Any] = {name: meta[f"tokenizer.ggml.{name}"] for name in ("add_bos_token", "add_eos_token")
                                if f"tokenizer.ggml.{name}" in meta}
    if found.get("tokenizer_type") == "llama":  # get_gguf_tokenizer: sentencepiece adds BOS unless the file says
        settings.setdefault("add_bos_token", True)
    tokens = found["tokens"]
    for name, key in SPECIAL.items():
        index = meta.get(f"tokenizer.ggml.{key}")
        settings[name] = tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
    try:
        if found.get("tokenizer_type") == "gpt2" and found.get("pre_tokenizer_type") in PLAIN_SPLIT:
            tokenizer = _byte_level(found, settings)
        else:
            tokenizer = _through_transformers(str(meta["general.architecture"]), found)
    except Exception as exc:  # the tokenizers library's Rust side raises the plain Exception ("out of vocabulary")
        if type(exc) is not Exception and not isinstance(exc, (ValueError, KeyError, TypeError)):
            raise
        raise UsageError(f"{{model}} {path}: its tokenizer metadata cannot be read ({str(exc)[:120]})", "model") \
            from None
    if "add_bos_token" in settings or "add_eos_token" in settings or tokenizer.post_processor is None:
        add_special_tokens(tokenizer, settings)  # TokenizersBackend.update_post_processor
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _byte_level(found: dict[str, Any], settings: dict[str, Any]) -> Any:
    """`byte_level_tokenizer` (a GPT2Tokenizer of the respelled vocabulary and the file's merges), then
    `add_gguf_special_tokens`, and the special tokens GPT2Tokenizer and the file's ids name."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(found["tokens"])}
    merges = [tuple(merge.split(" ")) for merge in found.get("merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    kinds = found.get("token_type") or []
    defaults = ["<|endoftext|>"] + [settings[name] for name in SPECIAL if settings.get(name)]
    special = [token for token, kind in zip(found["tokens"], kinds, strict=False)
               if kind == CONTROL and set(token) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token in dict.fromkeys(special + defaults)])
    user = [token for token, kind in zip(found["tokens"], kinds, strict=False)
            if kind == USER_DEFINED and token in vocab]
    if user:
        tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in user])
    return tokenizer


def _through_transformers(arch: str, found: dict[str, Any]) -> Any:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer, _ = convert_gguf_tokenizer(arch, found)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (transformers' `convert_slow_tokenizer.bytes_to_unicode`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
