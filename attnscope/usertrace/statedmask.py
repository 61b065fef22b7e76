"""What the code's own words say of its mask's polarity, where its ops cannot.

A boolean mask is read by a module either way round: `scores.masked_fill(mask == 0, -1e9)` masks where the mask is
False (the tutorials', F.scaled_dot_product_attention's convention), `scores.masked_fill(mask, -1e9)` where it is
True (nn.MultiheadAttention's). Both are right for some caller, so the ops alone never make either a bug
(masking.py reads the one the code uses). The code's words can: a comment on the line that applies the mask ("mask
is True where a key may be attended"), the docstring of the function or class around it, or the file's docstring
("True = masked", "1 for tokens that are not masked, 0 for padding", "filled with -inf where False"). Where they
state one polarity and the ops read the other, the module contradicts itself, and the mask is given as its words
say, so that the run shows what the code does with it (experiments.py's `mask.polarity` names it).

The nearest words decide: the comments on the applying line and the two above it, then the other comments above it
in its function, then the docstrings of the function and class holding that line, then those of the traced class and
its forward (and of the classes of the file it inherits from, nearest first), then the file's docstring, then the
docstrings of the functions the traced target
reaches (the methods of its classes, the functions of the file it calls or names, and theirs) that take a parameter
of the mask's name, never a neighbour's it does not reach (a file of several styles states a convention for each);
a place whose words state both polarities states none. Only sentences that name a mask are read, and never one that
names another of the forward's mask parameters, nor one of an additive mask ("-inf = masked", "0 = may attend" of a
float bias), whose 0 is not False.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

# a 1 or 0 (or 1s, as fairseq's "padding elements are indicated by 1s"), never 1.5 or 0.1
_TRUE = r"true|ones?|non-?zeros?|(?<![\w.+\-])1(?:s\b)?(?!\w|\.\d)"
_FALSE = r"false|zeros?|(?<![\w.+\-])0(?:s\b)?(?!\w|\.\d)"
# "not masked" before "masked": the first alternative that matches at a place wins
_ATTEND = (r"not (?:be )?(?:masked|padd?(?:ed|ing)?|ignored|blocked|hidden)|non-?(?:masked|padd?(?:ed|ing)?)|unmasked"
           r"|(?:may|can|should|to|will)(?: be)? attend(?:ed)?|attend(?:ed|s|ing)?|keep|kept|valid|visible|allowed"
           r"|take part|participates?|real tokens?|seen|unpadded")
_MASKED = (r"masked(?: out)?|mask(?:ed)? out|ignored?|padd?(?:ed|ing)?|pad|blocked|hidden|excluded|disallowed"
           r"|not allowed|cannot (?:be )?attend(?:ed)?|can ?not attend|(?:not|never) attend(?:ed)?|prevented|filled"
           r"|invalid|dropped|removed")
_MEANING = rf"(?P<attend>{_ATTEND})|(?P<masked>{_MASKED})"
# after a value only, "attention" says what the value means (Keras': "1 indicates attention and 0 indicates no
# attention"); before one it is the weights' word ("attention weights are 0 where ...")
_VALUE_MEANING = rf"(?P<attend>{_ATTEND}|(?<!no )attention)|(?P<masked>{_MASKED}|no attention)"
_JOIN = r"\s*(?:=|==|:|->|→|means?|for|where|when|if|indicates?|marks?|is|are|denotes?|at|as)\s*"
# a value, then up to six words, then what it means: "True = masked", "1 for tokens that are not masked"
_VALUE_FIRST = re.compile(rf"\b(?P<value>{_TRUE}|{_FALSE}){_JOIN}(?:[\w`'*]+\s+){{0,6}}?(?:{_VALUE_MEANING})\b", re.I)
# what it means, then the value: "filled with -finfo.max where False", "positions to ignore are True"
_MEANING_FIRST = re.compile(rf"\b(?:{_MEANING})\b(?:[^.;:\n]|\.(?=\S)){{0,40}}?\b"
                            r"(?:where|when|if|is|are|=|set to|equal to|(?:(?:is|are)\s+)?(?:indicated|marked|denoted"
                            r"|represented) (?:by|with|as))\s+(?:(?:the|its|a|this)\s+)?"
                            rf"(?:\w*mask\w*\s+(?:is\s+|==\s*)?)?(?P<value>{_TRUE}|{_FALSE})\b", re.I)
# a large negative value written where the mask has a value: "Write a very low value (indicating -inf) to the positions
# where mask == 0" (Umar Jamil's transformer), "fill the scores with -1e9 where the mask is False": masked there
_LOW_FIRST = re.compile(r"(?:\b(?:very|large|big)\s+(?:low|small|negative)\s+(?:values?|numbers?)|negative infinity"
                        r"|(?<!\w)[-−]\s*(?:inf\b|∞|1e\d+)|finfo\S*min\b|minimum (?:float )?values?)"
                        r"(?:[^.;\n]){0,60}?\b(?:where|when|if)\s+(?:(?:the|its|a|this)\s+)?"
                        rf"(?:\w*mask\w*\s+(?:is\s+|==\s*)?)(?P<value>{_TRUE}|{_FALSE})\b", re.I)
# an additive mask's words, a large negative number meaning masked: "0 = may attend, -inf = masked", "a float bias"
_ADDITIVE = re.compile(r"additive|float (?:mask|bias)|"
                       r"(?:[-−]\s*(?:inf\b|infinity|∞)|-\s*1e\d+|finfo\S*min|-10+\.?0*)\s*"
                       rf"(?:=|==|:|->|→|means?|for|where|when|if|is|are)\s*(?:\w+\s+){{0,3}}?(?:{_MEANING})", re.I)


@dataclass(frozen=True)
class Stated:
    kind: str  # "attend" (True = may attend) or "masked" (True = masked out)
    line: int
    words: str  # the sentence that says it
    turned: bool = False  # said of what the code made of the mask turned round (a helper's parameter, a variable)
    named: bool = False  # said in a sentence that names the mask parameter itself, not a mask in general


# the mask followed through the code (masking.flow): each op that reads it (its line, whether what it read was
# turned round), and each name the code gave what it made of it (with the same)
Flow = tuple[list[tuple[int, bool]], dict[str, bool]]


def read(path: Path, line: int | None, parameter: str, others: tuple[str, ...] = (),
         traced: tuple[str, ...] = (), flow: Flow | None = None, reads: str | None = None) -> Stated | None:
    """The polarity the code's words give `parameter`'s mask, read nearest the line that applies it first. Words of
    a helper's parameter that the mask reaches turned round (`fill(scores, ~mask)` into `def fill(scores, mask):
    "True = masked"`), or of a variable that holds it turned round (`# pad: True = masked` over `pad = mask == 0`),
    are said of the mask turned back. Words of a helper or a comment that agree with the ops' reading `reads` say
    only that the helper keeps its own word, and the next place is read; the traced target's own words (its class's,
    its forward's, the file's) decide either way, as words that disagree anywhere do."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    comments = _comments(source)
    uses, names = flow if flow is not None else ([], {})
    own = _own_lines(tree, traced)
    for place in _places(tree, comments, line, traced, parameter, uses):
        found: dict[str, Stated] = {}
        named: dict[str, Stated] = {}  # said in sentences that name the parameter: these outrank a mask in general
        mine = True  # whether every text that says something here is the traced target's own
        for text, at, turned in place:
            for s in _statements(text, at, parameter, others):
                flip = bool(turned) if turned is not None else _named(s.words, text, parameter, names)
                kind = {"attend": "masked", "masked": "attend"}[s.kind] if flip else s.kind
                found.setdefault(kind, Stated(kind, s.line, s.words, flip))
                if s.named:
                    named.setdefault(kind, found[kind] if found[kind].words == s.words else
                                     Stated(kind, s.line, s.words, flip))
                mine = mine and turned is False and at in own
        if len(named) == 1:  # "key_padding_mask: True marks a padded key" beside "a boolean mask ..., True = may
            found = named  # attend" the module builds of it (a file's header)
        if len(found) == 1:
            said = next(iter(found.values()))
            if said.kind == reads and not mine:
                continue  # a helper (a comment) that keeps its own word says nothing of the contract trace is under
            return Stated(said.kind, _line_of(source, said.line, said.words), said.words, said.turned)
    return None  # where one place says both polarities, it says none: the next one is read


def _own_lines(tree: ast.Module, traced: tuple[str, ...]) -> set[int]:
    """The first lines of the traced target's own docstrings (its classes', their forwards', the function's) and
    the file's: words there are the contract trace calls the code under."""
    holders = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    named = [n for n in holders if n.name in traced]
    return {1, *(n.lineno for c in named for n in [c, *_forwards(c)])}


def _named(words: str, text: str, parameter: str, names: dict[str, bool]) -> bool:
    """Whether a comment's words are said of a variable holding the mask turned round: the sentence names one the
    code gave what it made of the mask (`pad: True = masked`), and not the mask parameter itself."""
    sentence = next((s for s in re.split(r"(?<=[.;])\s+|\n", text) if words in " ".join(s.split())), text)
    said = set(re.findall(r"\w+", sentence))
    if parameter in said:
        return False
    return any(names.get(name, False) for name in said)


def _places(tree: ast.Module, comments: dict[int, str], line: int | None, traced: tuple[str, ...],
            parameter: str, uses: list[tuple[int, bool]]) -> list[list[tuple[str, int, bool | None]]]:
    """The texts to read, nearest first: each a list of (text, its first line, whether what it speaks of holds the
    mask turned round; None for a comment, which says by its names)."""
    places: list[list[tuple[str, int, bool | None]]] = []
    holders = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    own = {id(n) for n in holders if n.name in traced and n.col_offset == 0}
    own |= {id(f) for n in holders if id(n) in own for f in _forwards(n)}

    def turned(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
        """Whether the mask reached `node` (a function; a class's forward) turned round: the first op inside it that
        reads the mask read it so. Never for the traced class or function, which trace hands the mask itself."""
        if id(node) in own:
            return False
        if isinstance(node, ast.ClassDef):
            return any(turned(f) for f in _forwards(node))
        first, last = node.lineno, getattr(node, "end_lineno", None) or node.lineno
        return next((inverted for at, inverted in uses if first <= at <= last), False)

    if line is not None:
        inner = [n for n in holders if n.lineno <= line <= (n.end_lineno or n.lineno)]
        function = max((n for n in inner if not isinstance(n, ast.ClassDef)), key=lambda n: n.lineno, default=None)
        top = function.lineno if function is not None else 1
        places.append([(comments[i], i, None) for i in range(max(top, line - 2), line + 1) if i in comments])
        # then the comments above those in the same function (Keras' "attention_mask: [B, T, S], 1 = attend" at
        # the top of _masked_softmax), nearest first
        places.append([(comments[i], i, None) for i in range(line - 3, top - 1, -1) if i in comments])
        around = sorted(inner, key=lambda n: -n.lineno)
        places.append([(d, n.lineno, turned(n)) for n in around if (d := ast.get_docstring(n))])
    for name in traced:  # the traced class and the classes it inherits from in the file, or the function
        named = [n for n in holders if n.name == name and n.col_offset == 0]
        places.append([(d, n.lineno, False) for c in named for n in [c, *_forwards(c)] if (d := ast.get_docstring(n))])
    if (d := ast.get_docstring(tree) or _header(comments)) is not None:
        places.append([(d, 1, False)])
    # the functions the traced target reaches that take a parameter of the mask's name (flax's
    # dot_product_attention_weights, which the dot_product_attention traced calls; a method of its class): what
    # they say of it. Never a neighbour the target does not reach: a file of several styles says each its own
    places.append([(d, n.lineno, turned(n)) for n in _reached(tree, traced) if parameter in _names(n)
                   and (d := ast.get_docstring(n))])
    return places


def _reached(tree: ast.Module, traced: tuple[str, ...]) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions of the file the traced target holds or names, in the file's order: the methods of its classes,
    then, in turn, each function and class of the file's top level that those name (a call, `staticmethod(fill)`,
    `inner = Core`), and what they name."""
    tops = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    seen: dict[str, ast.AST] = {}
    todo = [name for name in traced if name in tops]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = tops[name]
        todo += [n.id for n in ast.walk(tops[name]) if isinstance(n, ast.Name) and n.id in tops and n.id not in seen]
    held = [n for top in seen.values() for n in ast.walk(top) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return sorted(held, key=lambda n: n.lineno)


def _names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    return [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]


def _line_of(source: str, start: int, words: str) -> int:
    """The line of the file where `words` (as a docstring's text, its whitespace and markup read loosely) begin,
    looked for from line `start` on; `start` where they are not found."""
    lines = source.splitlines(keepends=True)
    before = sum(len(text) for text in lines[:start - 1])
    pattern = r"[\s*`]+".join(re.escape(word) for word in words.split())
    found = re.search(pattern, source[before:])
    return start if found is None else start + source[before:before + found.start()].count("\n")


def _forwards(node: ast.AST) -> list[ast.FunctionDef]:
    body = getattr(node, "body", [])
    return [n for n in body if isinstance(n, ast.FunctionDef) and n.name in ("forward", "__call__")]


def _header(comments: dict[int, str]) -> str | None:
    """The comment lines a file opens with, from its first line on, as one text: a file's words where it has no
    docstring (`# key_padding_mask: [B, T], True marks a padded key.`); None where its first line is no comment."""
    lines: list[str] = []
    while len(lines) + 1 in comments:
        lines.append(comments[len(lines) + 1])
    return "\n".join(lines) or None


def _comments(source: str) -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found[token.start[0]] = token.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return found


def _statements(text: str, at: int, parameter: str, others: tuple[str, ...]) -> list[Stated]:
    said = []
    clean = text.replace("*", "").replace("`", "")
    for sentence in re.split(r"(?<=[.;])\s+|\n\s*\n|\n\s*[-•]\s+", clean):
        sentence = " ".join(sentence.split())
        names = {n.lower() for n in re.findall(r"\w*mask\w*", sentence, re.I)}
        # a sentence of masks, not only of others the code makes (`causal_mask`) or another parameter
        other = any(o != parameter and re.search(rf"\b{re.escape(o)}\b", sentence) for o in others)
        if other or not names & {"mask", "masks", "masked", "masking", parameter.lower()}:
            continue
        if _ADDITIVE.search(sentence):
            continue
        own = parameter.lower() in names and parameter.lower() not in ("mask", "masks")
        for match in [*_VALUE_FIRST.finditer(sentence), *_MEANING_FIRST.finditer(sentence)]:
            true = re.fullmatch(_TRUE, match.group("value"), re.I) is not None
            attend = match.group("attend") is not None
            said.append(Stated("attend" if true == attend else "masked", at, match.group(0), named=own))
        for match in _LOW_FIRST.finditer(sentence):  # the value where the low one is written is the masked one
            true = re.fullmatch(_TRUE, match.group("value"), re.I) is not None
            said.append(Stated("masked" if true else "attend", at, match.group(0), named=own))
    return said
