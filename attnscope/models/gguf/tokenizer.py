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
from attnscope.models.gguf.header import LAZY_TYPES
from attnscope.models.gguf.post_processor import add_special_tokens

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
    meta = {key: header.metadata[key] for key in (*(f"tokenizer.ggml.{key}" for key in (*TOKENIZER, "add_bos_token",
                                                                                     "add_eos_token")),
                                                 "general.architecture") if key in header.metadata}
    if "tokenizer.ggml.tokens" not in meta:
        raise UsageError(f"{{model}} {path} holds no tokenizer (no tokenizer.ggml.tokens in its metadata), so "
                         "{text} cannot be read; convert the model again with its tokenizer", "model", "text")
    meta = {key: value.values() if isinstance(value, LAZY_TYPES) else value for key, value in meta.items()}
    _check_types(path, meta)
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


# tokenizer.ggml.* -> what llama.cpp writes there (convert_hf_to_gguf.py's gguf_writer.add_token_list, ...)
KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "tokens": ((str,), "a list of strings"), "merges": ((str,), "a list of strings (\"a b\")"),
    "scores": ((int, float), "a list of numbers"), "token_type": ((int,), "a list of whole numbers"),
    "model": ((str,), "a name"), "pre": ((str,), "a name"), "precompiled_charsmap": ((int,), "a list of bytes")}


def _check_types(path: Path, meta: dict[str, Any]) -> None:
    """Each tokenizer value of the kind llama.cpp writes, refused in one line naming the key where not (merges
    stored as numbers would fail deep inside the tokenizer's build); a value is never quoted."""
    for key, (types, kind) in KINDS.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        listed = kind.startswith("a list")
        good = isinstance(value, list) and all(isinstance(v, types) and not isinstance(v, bool) for v in value) \
            if listed else isinstance(value, types)
        if not good:
            raise UsageError(f"{{model}} {path}: its metadata tokenizer.ggml.{key} is not {kind}, as llama.cpp writes "
                             "it; the file's tokenizer is damaged, so {text} cannot be read: download it again, or "
                             "convert the model again", "model", "text")
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"{{model}} {path}: its metadata tokenizer.ggml.{key} is not a whole number; the file's "
                             "tokenizer is damaged, so {text} cannot be read", "model", "text")


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
