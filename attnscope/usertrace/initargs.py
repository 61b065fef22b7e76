"""`--init`: a constructor's keyword arguments, read with `ast`, never `eval`.

A value is a Python literal (numbers, strings, True/False/None, tuples, lists, sets, dicts: what
`ast.literal_eval` reads), or a call of a class defined in the user's own file, with such values as its
arguments: `--init "config=GPTConfig(n_embd=64, n_head=4)"` builds nanoGPT's config dataclass, as
`CausalSelfAttention(config)` wants it; a transformers model config the file imports is such a class too
(`--init "config=GraniteConfig(hidden_size=64, ...)"` for HF's `GraniteAttention(config)`: load.own_classes).
A value may also be a layer of torch.nn, `nn.Linear(64, 64, bias=False)` (or `torch.nn.Linear`, or `Linear` alone),
one of TORCH_LAYERS, for a constructor that takes its projections as modules (torchtune's `MultiHeadAttention(
q_proj=..., k_proj=..., ...)`, built by its `llama3` builders): these run PyTorch's code alone.
Nothing else is evaluated: no names (but a called class's), no other attribute access (`torch.float32`), no calls of
functions or of classes from elsewhere (`__import__`), no operators (`1 + 1`). The classes are called when the module
is built (load.construct), as the user's code, under the same guard.

Text a parser cannot take safely is refused in one line (exit 2): longer than MAX_CHARS (`1+1+...` with
20,000 terms overflows the parser's recursion), not encodable as UTF-8 (an invalid byte on the command
line), nested too deep (100,000 unary minus signs run the parser out of memory).

`--forward` (extra arguments of the forward: `"start_pos=0, use_cache=False"`) is read by the same rules,
`option` naming it in messages.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attnscope.errors import UsageError

MAX_CHARS = 10_000
SHOWN = 60  # how much of a value a message quotes
EXAMPLE = '--init "d_feat=200, n_head=5"'
# torch.nn layers a value may build (a constructor given its projections as modules, torchtune's)
TORCH_LAYERS = ("Linear", "LayerNorm", "RMSNorm", "Identity", "Dropout", "Embedding", "Conv1d", "Conv2d", "GELU",
                "SiLU", "ReLU")
MAX_LAYER_NUMBERS = 1 << 26  # the integers a layer's call is given, multiplied: its weight's size at most


@dataclass(frozen=True)
class ClassCall:
    """`GPTConfig(n_embd=64, n_head=4)`: a class of the user's file and its arguments, called by `build`."""

    cls: type
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    text: str

    def __repr__(self) -> str:
        return self.text


def build(value: Any) -> Any:
    """The value with every class call made (innermost first), containers rebuilt around them."""
    if isinstance(value, ClassCall):
        return value.cls(*(build(a) for a in value.args), **{k: build(v) for k, v in value.kwargs})
    if isinstance(value, (list, tuple, set)):
        return type(value)(build(v) for v in value)
    if isinstance(value, dict):
        return {build(k): build(v) for k, v in value.items()}
    return value


def has_calls(value: Any) -> bool:
    if isinstance(value, ClassCall):
        return True
    if isinstance(value, (list, tuple, set)):
        return any(has_calls(v) for v in value)
    if isinstance(value, dict):
        return any(has_calls(k) or has_calls(v) for k, v in value.items())
    return False


def parse_init(text: str | None, classes: Mapping[str, type] | None = None, file: str = "the file",
               option: str = "--init", example: str = EXAMPLE) -> dict[str, Any]:
    """`"d_feat=200, n_head=5"` -> {"d_feat": 200, "n_head": 5}; `classes` are the classes the user's file
    defines (by name), the only names a value may call; `file` names it in messages, `option` (and `example`
    of it) the option read (`--forward` reads its arguments so too)."""
    if not text or not text.strip():
        return {}
    if len(text) > MAX_CHARS:
        raise UsageError(f"{option} is {len(text):,} characters long; its arguments fit in {MAX_CHARS:,}, "
                         f"e.g. {example}")
    try:
        text.encode("utf-8")
    except UnicodeError:
        raise UsageError(f"{option} holds a byte that is not UTF-8 text; write the arguments in plain text, e.g. "
                         f"{example}") from None
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except (SyntaxError, ValueError):
        raise UsageError(f"{option} {_quote(text)}: write keyword arguments, e.g. {example}") from None
    except (RecursionError, MemoryError):
        raise UsageError(f"{option} is nested too deeply to read; write plain keyword arguments, e.g. {example}") \
            from None
    if not isinstance(call, ast.Call) or call.args:
        raise UsageError(f"{option} {_quote(text)}: keyword arguments only (name=value), e.g. {example}")
    reader = _Reader(dict(classes or {}), file, option)
    values: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise UsageError(f"{option}: ** is not allowed; write each argument as name=value")
        try:
            values[keyword.arg] = reader.value(keyword.value, f"{keyword.arg}={_source(keyword.value)}")
        except (RecursionError, MemoryError):
            raise UsageError(f"{option}: {keyword.arg}= is nested too deeply to read; write plain literals") \
                from None
    return values


class _Reader:
    def __init__(self, classes: dict[str, type], file: str, option: str = "--init") -> None:
        self.classes, self.file, self.option = classes, file, option

    def value(self, node: ast.expr, where: str) -> Any:
        if not any(isinstance(n, ast.Call) for n in ast.walk(node)):
            try:
                return ast.literal_eval(node)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise UsageError(self._refusal(node, where)) from None
        if isinstance(node, ast.Call):
            return self._call(node, where)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [self.value(e, where) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else set(items) if isinstance(node, ast.Set) else items
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {self.value(k, where): self.value(v, where)  # type: ignore[arg-type]
                    for k, v in zip(node.keys, node.values, strict=True)}
        raise UsageError(self._refusal(node, where))

    def _call(self, node: ast.Call, where: str) -> ClassCall:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        own = self.classes.get(name) if name is not None else None
        cls = own if own is not None else _torch_layer(node.func)
        if cls is None:
            raise UsageError(self._refusal(node, where))
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise UsageError(f"{self.option}: {_quote(where)}: * and ** are not allowed in a call; give each argument")
        args = tuple(self.value(a, where) for a in node.args)
        kwargs = tuple((str(k.arg), self.value(k.value, where)) for k in node.keywords)
        if own is None:  # a torch.nn layer: its weight within memory, said before it is
            sizes = [v for v in (*args, *(v for _, v in kwargs)) if isinstance(v, int) and not isinstance(v, bool)]
            if any(v < 0 for v in sizes):
                raise UsageError(f"{self.option}: {_quote(_source(node))} is given a negative size; give widths of 1 "
                                 "or more, e.g. nn.Linear(64, 64)")
            try:
                inspect.signature(cls).bind(*args, **dict(kwargs))
            except TypeError as exc:
                raise UsageError(f"{self.option}: {_quote(_source(node))}: {exc}; e.g. nn.Linear(64, 64)") from None
            if math.prod(abs(v) for v in sizes if v) > MAX_LAYER_NUMBERS:
                raise UsageError(f"{self.option}: {_quote(_source(node))} would hold more than {MAX_LAYER_NUMBERS:,} "
                                 "numbers; trace needs no more than a few thousand features, e.g. nn.Linear(64, 64)")
        return ClassCall(cls, args, kwargs, _source(node))

    def _refusal(self, node: ast.expr, where: str) -> str:
        """Say what in the value is not allowed: a call of something else, a name, an attribute, an operator."""
        allowed = ("is not a Python literal (numbers, strings, True/False/None, tuples, lists, dicts) or a call "
                   f"of a class {self.file} defines, a transformers config class it imports or a torch.nn layer "
                   "(nn.Linear(64, 64))")
        defined = _callable(self.file, self.classes)
        layers = {id(n) for part in ast.walk(node) if isinstance(part, ast.Call) and _torch_layer(part.func)
                  for n in ast.walk(part.func)}  # nn.Linear(...): allowed, its attribute too
        for part in ast.walk(node):
            if id(part) in layers or isinstance(part, ast.Call) and id(part.func) in layers:
                continue
            if isinstance(part, ast.Call):
                func = _source(part.func)
                if isinstance(part.func, ast.Attribute):
                    return f"{self.option}: {_quote(where)} {allowed}: {func}(...) is called through an attribute"
                if not isinstance(part.func, ast.Name):
                    return f"{self.option}: {_quote(where)} {allowed}: {func}(...) calls no class by its name"
                if part.func.id not in self.classes:
                    return f"{self.option}: {_quote(where)} {allowed}: {func} is not one of its classes{defined}"
            if isinstance(part, ast.Attribute):
                return f"{self.option}: {_quote(where)} {allowed}: attribute access ({_source(part)}) is not allowed"
        return f"{self.option}: {_quote(where)} {allowed}"


def _torch_layer(func: ast.expr) -> type | None:
    """The torch.nn layer class `func` names (`nn.Linear`, `torch.nn.Linear`, `Linear`), or None."""
    path = []
    while isinstance(func, ast.Attribute):
        path.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    path = [func.id, *reversed(path)]
    if path[-1] not in TORCH_LAYERS or path[:-1] not in ([], ["nn"], ["torch", "nn"]):
        return None
    import torch  # here, not at the top: reading --init's text needs no torch

    layer = getattr(torch.nn, path[-1], None)
    return layer if isinstance(layer, type) else None


def _callable(file: str, classes: dict[str, type]) -> str:
    """' (model.py defines A, B; it imports GraniteConfig)': what --init may call, each where it comes from."""
    imported = sorted(n for n, c in classes.items() if "_attnscope_user_" not in str(getattr(c, "__module__", "")))
    own = sorted(n for n in classes if n not in imported)
    parts = ([f"{file} defines {', '.join(own)}"] if own else []) + ([f"it imports {', '.join(imported)}"]
                                                                     if imported else [])
    return f" ({'; '.join(parts)})" if parts else ""


def _source(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except (RecursionError, MemoryError, ValueError):
        return "..."


def _quote(text: str) -> str:
    return text if len(text) <= SHOWN else text[: SHOWN - 1] + "…"
