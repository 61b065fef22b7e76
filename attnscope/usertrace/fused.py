"""Projections that are not four Linear layers: a fused q/k/v projection, and a wrapped nn.MultiheadAttention.

- A fused projection is one Linear writing q, k and v side by side (nanoGPT's `c_attn = Linear(d, 3d)`,
  `qkv`, `Wqkv`, `to_qkv`, `in_proj`, GPT-NeoX's `query_key_value`). Its weight's rows are split into q, k, v
  as the user's code splits its output: by the sizes of the parts its `.split`/`.chunk`/`.unbind` produced
  (read off the recorded tensors, so `split([q, kv, kv], dim=-1)` of a grouped-query projection splits too),
  or by shape, in thirds (q | k | v, as nn.MultiheadAttention's `in_proj_weight` and GPT-2's `c_attn`), or per
  head (`[n_head, 3, d_head]`, GPT-NeoX's `query_key_value`). Each layout is a candidate; the line-up keeps
  the one under which the most reference steps find their equal (transformers' GPT-2 and GPT-NeoX code splits
  the same ways: `split(self.split_size, dim=2)`, `view(..., n_head, 3 * head_size)`).
- A fused K/V projection beside a Q one (x-transformers' and vit-pytorch's `to_kv = Linear(dim, 2 * inner)`,
  `.chunk(2, dim=-1)`), read from the data flow (flow.shared): its rows are k, then v, as its output is split,
  or as the code's own k and v read them (per KV group, `[n_kv_head, 2, d_head]`: solve_rows).
- Any layout at all is first solved from the code's own q, k and v (solve_rows): each value they hold is looked
  up among the projection's outputs, which says its row; the roles in any order (CodeGen's q | v | k per block),
  an order other than q, k, v said in a note (order_note), never a bug, as long as the code's words agree: a part
  it binds to `v` at the split and uses as the keys (or to `k` and uses as the values) is k and v swapped, the
  rows held as the words say (words.py), so the catalog names the swap by experiment. Where the words agree with
  the use, the module's own bias may still say it: a constant-zero block beside learned ones is the keys'
  (BEiT's `cat(q_bias, zeros_like(v_bias), v_bias)`, keybias.py), so the values read from it are a swap too.
- An nn.MultiheadAttention inside the module: its `in_proj_weight` (or `q/k/v_proj_weight`) and `out_proj`.
- `F.multi_head_attention_forward` called in the module's forward with its own parameters: the weights the
  recorded call was given (`in_proj_weight`, or `q/k/v_proj_weight` with `use_separate_proj_weight`, and
  `out_proj_weight`), each as the module holds it where it is one of its parameters (`call_parts`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from attnscope.usertrace import words
from attnscope.usertrace.valueindex import ValueIndex, tie_placings

if TYPE_CHECKING:
    from attnscope.usertrace.keybias import Zero
    from attnscope.usertrace.record import Record

FUSED_WORDS = ("qkv", "c_attn", "in_proj", "query_key_value", "att_proj", "wqkv", "to_qkv", "qkv_proj")


@dataclass
class Part:
    """Rows of a weight (and bias) standing for one projection: `c_attn[0:64]`. Reads like an nn.Linear."""

    name: str
    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None
    rows: tuple[int, ...] | None = None  # the fused weight's rows it holds, in order (None: a whole weight)
    by_words: bool = False  # the rows the code's words name for this role, which its use contradicts (words.py)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


USED_SWAPPED = "which your code then uses the other way round"  # a reading held by the words, against the use
NONE = "(none)"  # the name of the identity a module without an output projection is held by (its merge compared)


def rows(name: str, weight: torch.Tensor, bias: torch.Tensor | None, index: torch.Tensor | slice,
         label: str) -> Part:
    held = range(weight.shape[0])[index] if isinstance(index, slice) else index.reshape(-1).tolist()
    return Part(f"{name}{label}", weight.detach()[index], bias.detach()[index] if bias is not None else None,
                tuple(held))


def order_note(name: str, parts: dict[str, Part]) -> str | None:
    """What a fused projection's layout says where the code reads its rows in another order than q, k, v (CodeGen
    writes q, v, k in each of its 4 blocks): a layout of the weights, read from the code, not a mistake; None where
    the order is q, k, v."""
    if any(part.by_words for part in parts.values()):
        return None  # the rows as the code names them, used the other way round: a swap, named by experiment
    return rows_note(name, {role: list(part.rows) for role, part in parts.items()
                            if role in "qkv" and part.rows is not None})


def rows_note(name: str, held: dict[str, list[int]], codegen: bool = True) -> str | None:
    """order_note's words for the rows each role holds of the packed weight `name`; None where they are q, k, v."""
    order = sorted(held, key=lambda role: min(held[role]))
    if len(order) < 2 or order == sorted(order, key="qkv".index):
        return None
    runs = {len(_runs(held[role])) for role in order}
    count = runs.pop() if len(runs) == 1 else 1
    blocks = f" in each of its {count} blocks" if count > 1 else ""
    written = sorted(order, key="qkv".index)
    moved = [role for role, other in zip(written, order, strict=True) if role != other]
    known = " (CodeGen's checkpoint writes q, v, k)" if codegen and order == ["q", "v", "k"] else ""
    return (f"{name}'s rows hold {', '.join(order)}{blocks}, as your code reads them: a layout of your weights"
            f"{known}, not a mistake; weights written {', '.join(written)} would be read with "
            f"{' and '.join(moved)} swapped")


def blocks(name: str, linear: nn.Linear, roles: str, bounds: list[int]) -> dict[str, Part]:
    """`linear`'s rows cut at `bounds` into consecutive blocks, one per role, in order."""
    return {role: rows(name, linear.weight, linear.bias, slice(start, end), f"[{start}:{end}]")
            for role, (start, end) in zip(roles, itertools.pairwise(bounds), strict=True)}


def inner_mha(module: nn.Module) -> tuple[str, nn.MultiheadAttention] | None:
    found = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]
    return found[0] if len(found) == 1 else None


def mha_parts(name: str, mha: nn.MultiheadAttention) -> dict[str, tuple[str, object]]:
    """q, k, v, o of a wrapped nn.MultiheadAttention, as `F.multi_head_attention_forward` splits them."""
    d = mha.embed_dim
    prefix = f"{name}." if name else ""
    if mha.in_proj_weight is not None:
        weight, bias = mha.in_proj_weight, mha.in_proj_bias
        parts = {role: rows(f"{prefix}in_proj_weight", weight, bias, slice(i * d, (i + 1) * d),
                            f"[{i * d}:{(i + 1) * d}]") for i, role in enumerate("qkv")}
    else:
        bias = mha.in_proj_bias
        parts = {role: Part(f"{prefix}{role}_proj_weight", getattr(mha, f"{role}_proj_weight").detach(),
                            bias.detach()[i * d:(i + 1) * d] if bias is not None else None)
                 for i, role in enumerate("qkv")}
    out: dict[str, tuple[str, object]] = {role: (part.name, part) for role, part in parts.items()}
    out["o"] = (f"{prefix}out_proj", mha.out_proj)
    return out


def call_parts(module: nn.Module, records: list[Record]) -> tuple[dict[str, tuple[str, object]], str] | None:
    """q, k, v, o as the module's own `F.multi_head_attention_forward` call was given them (the first such
    call), and how: `in_proj_weight` split in thirds, as the kernel splits it, or `q/k/v_proj_weight`; the
    output projection `out_proj_weight`. A weight that is a parameter of the module is read as the module holds
    it, so a call passing it transposed (`self.out_proj.weight.t()`) differs from the reference; one the code
    computes (CLIP's `torch.cat([q_proj.bias, ...])`) as it was passed. None where no such call was recorded."""
    call = next((r for r in records if r.func == "multi_head_attention_forward"
                 and "projections" in (r.details.get("kernel") or {})), None)
    if call is None:
        return None
    given = call.details["kernel"]["projections"]
    params = list(module.named_parameters())

    def held(key: str) -> tuple[str, torch.Tensor | None]:
        value = given.get(key)
        if not isinstance(value, torch.Tensor):
            return key, None
        for name, p in params:
            if value is p:
                return name, p.detach()
        for name, p in params:  # a view of one of its parameters laid out otherwise: .t(), .mT
            if value.shape == p.shape and value.stride() != p.stride() and \
                    value.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
                return f"{name} (as the module holds it; line {call.line} passes it transposed)", p.detach()
        return f"the {key} passed at line {call.line}", value.detach()

    bias_name, bias = held("in_proj_bias")
    if given.get("use_separate_proj_weight"):
        weights = [held(f"{role}_proj_weight") for role in "qkv"]
    else:
        name, weight = held("in_proj_weight")
        if weight is None or weight.dim() != 2 or weight.shape[0] % 3:
            return None
        third = weight.shape[0] // 3
        weights = [(f"{name}[{i * third}:{(i + 1) * third}]", weight[i * third:(i + 1) * third]) for i in range(3)]
    out_name, out_weight = held("out_proj_weight")
    if any(w is None or w.dim() != 2 for _, w in (*weights, (out_name, out_weight))):
        return None
    assert out_weight is not None
    parts: dict[str, tuple[str, object]] = {}
    start = 0
    for role, (name, weight) in zip("qkv", weights, strict=True):
        assert weight is not None
        end = start + weight.shape[0]
        parts[role] = (name, Part(name, weight, bias[start:end] if bias is not None else None))
        start = end
    out_bias = held("out_proj_bias")[1]
    parts["o"] = (out_name, Part(out_name, out_weight, out_bias))
    return parts, f"the weights your F.multi_head_attention_forward call passes (line {call.line})"


def fused_linear(linears: list[tuple[str, nn.Linear]]) -> tuple[str, nn.Linear] | None:
    """The Linear writing q, k and v at once: named like one (qkv, c_attn, ...) and wider than it reads, or,
    failing a name, the only one writing exactly three times what it reads."""
    named = [(n, m) for n, m in linears if any(w in n.lower().replace(".", "_") for w in FUSED_WORDS)
             and m.out_features > m.in_features]
    if len(named) == 1:
        return named[0]
    tripled = [(n, m) for n, m in linears if m.out_features == 3 * m.in_features]
    return tripled[0] if len(tripled) == 1 else None


def output_linear(linears: list[tuple[str, nn.Linear]], fused: tuple[str, nn.Linear],
                  role_of: Callable[[str], str | None]) -> tuple[str, nn.Linear] | None:
    """The output projection beside a fused one: the Linear writing d_feat back (nanoGPT's `c_proj`); by its
    name where several could be (o, out, proj, dense), else the only one."""
    d_feat = fused[1].in_features
    others = [(n, m) for n, m in linears if n != fused[0] and m.out_features == d_feat]
    if len(others) == 1:
        return others[0]
    by_role = [(n, m) for n, m in others if role_of(n) == "o"]
    by_word = [(n, m) for n, m in others if any(w in n.lower() for w in ("out", "proj", "dense"))]
    chosen = by_role if len(by_role) == 1 else by_word
    return chosen[0] if len(chosen) == 1 else None


def split_layouts(name: str, linear: nn.Linear, records: list[Record], n_head: int | None,
                  d_head: int | None, zero: Zero | None = None) -> list[tuple[str, dict[str, Part]]]:
    """Every way of reading the fused weight's rows as q, k, v, each with how it was found (`zero`: the rows of its
    bias the code holds at a constant zero, keybias.py)."""
    weight, bias, width = linear.weight, linear.bias, linear.out_features
    layouts: list[tuple[str, dict[str, Part]]] = []
    for sizes, line in recorded_splits(name, records, width):
        layouts.append((f"split as its output is split at line {line}",
                        blocks(name, linear, "qkv", [0, sizes[0], sizes[0] + sizes[1], width])))
    for sizes, line in recorded_splits(name, records, width, per_group=True):
        # each head's (or group's) rows cut by the split (EfficientFormer's `reshape(B, N, H, -1).split([kd, kd, d_v],
        # dim=3)`): [width / Σ sizes, Σ sizes], q, k and v its columns
        grid = torch.arange(width).view(width // sum(sizes), sum(sizes))
        cuts = [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
        groups = width // sum(sizes)
        parts = {role: rows(name, weight, bias, grid[:, cuts[i]:cuts[i + 1]].reshape(-1), f"[per group, part {i}]")
                 for i, role in enumerate("qkv")}
        widths = " + ".join(map(str, sizes))
        layouts.append((f"split as its output is split at line {line}, in each of {groups} groups of rows (a head's, "
                        f"or a key/value group's) [{widths}]", parts))
    if n_head and d_head and width > n_head * d_head and (width - n_head * d_head) % 2 == 0 \
            and width != 3 * n_head * d_head:  # grouped-query: q's n_head heads, then k's and v's fewer
        q, kv = n_head * d_head, (width - n_head * d_head) // 2
        layouts.append(("split by widths, n_head·d_head for q, then n_kv_head·d_head each for k and v",
                        blocks(name, linear, "qkv", [0, q, q + kv, width])))
    if width % 3 == 0:
        third = width // 3
        layouts.append(("split in thirds, q | k | v", blocks(name, linear, "qkv", [0, third, 2 * third, width])))
        if n_head and d_head and 3 * n_head * d_head == width:  # GPT-NeoX: [n_head, 3, d_head]
            grid = torch.arange(width).view(n_head, 3, d_head)  # [n_head, 3, d_head]: the fused row numbers
            # grid[:, i]: [n_head, d_head] -> [n_head·d_head]
            parts = {role: rows(name, weight, bias, grid[:, i].reshape(-1), f"[per head, part {i}]")
                     for i, role in enumerate("qkv")}
            layouts.append(("split per head, [n_head, 3, d_head]", parts))
    return _with_solved(layouts, solve_rows(name, linear, records, d_head, zero=zero))


def _same_rows(a: dict[str, Part], b: dict[str, Part]) -> bool:
    return a.keys() == b.keys() and all(a[r].weight.shape == b[r].weight.shape and torch.equal(a[r].weight, b[r].weight)
                                        for r in a)


def recorded_splits(name: str, records: list[Record], width: int, count: int = 3, per_group: bool = False
                    ) -> list[tuple[tuple[int, ...], int]]:
    """The sizes (along the last axis) of the `count` parts the fused projection's output was split into, read
    off the recorded parts: `.split(64, dim=2)`, `.split([64, 16, 16], dim=-1)`, `.chunk(3, -1)`, `.chunk(2, -1)`;
    `per_group`: those of a view of the output whose last axis is a whole divisor of its width, narrower (the output
    viewed per head, `reshape(B, N, H, -1)`, then split)."""
    found = []
    made = {r.index for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)}
    if per_group:
        made = {r.index for r in records if r.func in ("view", "reshape") and len(r.parents) == 1
                and r.parents[0] in made and 0 < r.tensor.shape[-1] < width and width % r.tensor.shape[-1] == 0}
    for i, first in enumerate(records):
        if first.details.get("part") != 0 or first.parents[:1] == () or first.parents[0] not in made:
            continue
        whole = records[first.parents[0]].tensor
        parts = [first]
        for r in records[i + 1:]:
            if r.details.get("part") != len(parts) or r.parents[:1] != first.parents[:1]:
                break
            parts.append(r)
        sizes = tuple(int(r.tensor.shape[-1]) for r in parts)
        if len(sizes) == count and sum(sizes) == whole.shape[-1] \
                and all(r.tensor.shape[:-1] == whole.shape[:-1] for r in parts):
            found.append((sizes, first.line))
    return found


def kv_layouts(name: str, linear: nn.Linear, records: list[Record],
               zero: Zero | None = None) -> list[tuple[str, dict[str, Part]]]:
    """Every way of reading a fused K/V weight's rows (x-transformers' and vit-pytorch's `to_kv`, chunked into
    k and v) as k, then v: as its output is split, else in halves."""
    width = linear.out_features
    splits = [(sizes[0], f"split as its output is split at line {line}")
              for sizes, line in recorded_splits(name, records, width, 2)]
    if width % 2 == 0 and all(cut != width // 2 for cut, _ in splits):
        splits.append((width // 2, "split in halves, k | v"))
    layouts = [(how, blocks(name, linear, "kv", [0, cut, width])) for cut, how in splits]
    return _with_solved(layouts, solve_rows(name, linear, records, None, "kv", zero))  # per KV group [n_kv_head, 2, ..]


def _with_solved(layouts: list[tuple[str, dict[str, Part]]],
                 solved: Solved | None) -> list[tuple[str, dict[str, Part]]]:
    """The readings by widths, with the one solved from the code's own tensors first where none of them reads its
    rows (per KV group, packed, ...); that one alone where the code's words name k and v against their use (a
    reading by use would take the swap for the layout)."""
    if solved is not None and solved.swapped:
        return [(solved.how, solved.parts)]
    if solved is not None and not any(_same_rows(solved.parts, parts) for _, parts in layouts):
        layouts.insert(0, (solved.how, solved.parts))
    return layouts


class Solved(NamedTuple):
    how: str
    parts: dict[str, Part]
    swapped: bool  # the code's words name k and v against their use: the rows held by the words (words.py)


def solve_rows(name: str, linear: nn.Linear, records: list[Record], d_head: int | None,
               roles: str = "qkv", zero: Zero | None = None) -> Solved | None:
    """The fused weight's rows for q, k and v, read from what the code computed rather than from widths: each
    value of the code's own q (k, v) that reaches the scores (the pattern) is looked up among the fused
    projection's outputs, which says the row it came from. Whatever the layout (q | k | v blocks, per head
    `[n_head, 3, d_head]` as GPT-NeoX, per KV group `[n_group, q_per_group + 2, d_head]` as litgpt, packed
    `[.., 3, n_head, d_head]` as flash-attn's Wqkv, Falcon's `[n_head + 2, d_head]`), the rows in the order the
    code's heads read them are the layout. Heads a K/V tensor repeats are read once (first appearance: the key/
    value heads in order). None where a role's tensor mixes tokens into its heads (a view that breaks the
    tokens apart is a bug to report, not a layout) or the roles do not share the rows out. A few values the output
    holds twice by chance (two float32 sums that round alike) are tried at either place; more is no reading. The
    roles may come in any order (CodeGen's blocks hold q | v | k): order_note says one other than q, k, v. Where
    the code's own words (words.said) name the part it uses as the keys v, or the values' k (`k, v = v, k` after
    the split, `attn @ k`, a packed axis indexed 2 for the keys), k and v are held by the words: the code swaps
    them. Where the words say nothing against the use, the bias may: the rows the code uses as its values fed a
    constant zero (`zero`, keybias.py) and its keys' a learned bias are the keys' and the values' rows read the
    other way round."""
    from attnscope.usertrace.flow import operands

    found = operands(records)
    made = [r for r in records if r.style == "linear" and r.args and r.args[0] == ("text", name)]
    if found is None or len(made) != 1 or not made[0].tensor.is_floating_point():
        return None
    output = made[0].tensor.detach()
    width = int(output.shape[-1])
    indexed = ValueIndex.of_few_ties(output)
    if indexed is None:  # values made twice, more than by chance: rows cannot be told by value
        return None
    lookup, ties = indexed

    def read(record: Record) -> list[int] | None:
        tensor = record.tensor
        if not tensor.is_floating_point() or tensor.dtype != output.dtype or tensor.numel() == 0 \
                or record.index == made[0].index:
            return None
        source = lookup.positions(tensor.detach())
        if source is None:
            return None
        for placed in tie_placings(source, ties):  # a value two outputs hold by chance: from the place that fits
            order = row_order(placed % width, placed // width)
            if order is not None:
                return order
        return None

    per_role: dict[str, list[list[int]]] = {}
    for role, index in zip("qkv", found[:3], strict=True):
        if role not in roles:  # a fused K/V projection beside a Q one: only k and v are its rows
            continue
        per_role[role] = [order for r in nearest_ancestors(records, index) if (order := read(r)) is not None]
        if not per_role[role]:
            return None
    chosen: dict[str, list[int]] = {}
    for role, orders in per_role.items():  # the widest reading sharing no row with the other roles' nearest
        others = set().union(*(set(per_role[o][0]) for o in per_role if o != role))
        fitting = [order for order in orders if not set(order) & others]
        if not fitting:
            return None
        chosen[role] = max(fitting, key=len)
    if d_head and any(len(order) % d_head for order in chosen.values()):
        # d_head as the module's widths suggested (d_feat / n_head) where the code's heads are narrower or wider
        # (EfficientFormer's key_dim of 8 beside d_feat 48 over 4 heads): the width its queries hand the scores
        own = int(records[found[0]].tensor.shape[-1])
        if own == d_head or any(len(chosen[role]) % own for role in chosen if role in "qk"):
            return None
        d_head = own
    if len(set().union(*map(set, chosen.values()))) != sum(map(len, chosen.values())):
        return None
    if d_head and "q" in chosen:  # the query heads in the order of their rows: an order of the code's is its own
        chosen["q"] = heads_in_row_order(chosen["q"], d_head)  # (gqa.query_order), no layout of the checkpoint
    operand = dict(zip("qkv", found[:3], strict=True))
    first = {role: min((r for r in nearest_ancestors(records, operand[role]) if (order := read(r)) is not None
                        and set(order) <= set(chosen[role])), key=lambda r: r.index) for role in "kv"}
    swapped = named_swapped({role: words.said(records, first[role], operand[role], roles) for role in "kv"}, roles)
    if swapped is None and zero is not None:
        swapped = _biased_swapped(zero, chosen["k"], chosen["v"])
    if swapped is not None:  # the words say k and v: the reference holds the rows by them, the code swaps them
        chosen["k"], chosen["v"] = chosen["v"], chosen["k"]
    parts = {role: rows(name, linear.weight, linear.bias, torch.tensor(order), f"[{row_ranges(order)}]")
             for role, order in chosen.items()}
    if swapped is not None:
        parts = {role: dataclasses.replace(part, by_words=role in "kv") for role, part in parts.items()}
    said = "q, k and v" if roles == "qkv" else "k and v"
    how = f"its rows read from your code's own {said}, each value looked up in the projection's output"
    return Solved(how + (swapped or ""), parts, swapped is not None)


def heads_in_row_order(order: list[int], d_head: int) -> list[int]:
    """`order`'s heads (each d_head rows, in the order read) sorted by their first row: every checkpoint's layout
    (q | k | v, per head, per KV group, packed) holds a role's heads in the order of its rows, each head's rows
    together; code that reads them in another order (q's per-group block moved group-first) or strews a head over
    the rows (q split (d_head, n_head)) lays its heads out wrong: the rows in their own order then."""
    heads = [order[i:i + d_head] for i in range(0, len(order), d_head)]
    if any(sorted(head) != list(range(min(head), min(head) + d_head)) for head in heads):
        return sorted(order)  # a head's features strewn over the rows (q split (d_head, n_head)): no layout either
    return [row for head in sorted(heads, key=min) for row in head]


def named_swapped(said: dict[str, words.Said | None], roles: str) -> str | None:
    """Where the code's words (words.said) give the part it uses as the keys to v, or the one it uses as the values
    to k: how the layout says so, for the reference's description; None where they agree with the use or say
    nothing."""
    named = {role: found.role for role, found in said.items() if found is not None}
    k, v = named.get("k"), named.get("v")
    if k not in ("v", None) or v not in ("k", None) or (k, v) == (None, None):
        return None
    found = [s for s in said.values() if s is not None]
    lines = ", ".join(map(str, sorted({s.line for s in found})))
    indices = ", ".join(map(str, range(len(roles))))
    how = f"as the packed axis's index gives them ({', '.join(roles)}: {indices})" \
        if all(s.by_index for s in found) else "as your code names them"
    return f"; k and v {how} at line {lines}, {USED_SWAPPED}"


def _biased_swapped(zero: Zero, k: list[int], v: list[int]) -> str | None:
    """Where the rows the code uses as its values are fed a constant-zero bias and its keys' a learned one: how the
    bias says so (the zero block is the keys', keybias.py); None otherwise."""
    if not (bool(zero.zero[v].all()) and bool(zero.learned[k].all())):
        return None
    return (f"; k and v as your bias gives them (line {zero.line}: {zero.what}, the keys' bias a constant zero, "
            f"as a softmax cancels it, the values' a learned one), {USED_SWAPPED}")


def nearest_ancestors(records: list[Record], index: int, limit: int = 64, stop: Callable[[Record], bool] | None = None,
                      avoid: frozenset[int] = frozenset()) -> list[Record]:
    """`records[index]` and what it was computed from, nearest first (breadth first), at most `limit`; a record
    `stop` holds for is kept but what it was made from is not followed, and the records `avoid` names never."""
    out: list[Record] = []
    seen, frontier = {index, *avoid}, [index]
    while frontier and len(out) < limit:
        following = []
        for i in frontier:
            out.append(records[i])
            if len(out) >= limit or (stop is not None and stop(records[i])):
                continue
            for p in records[i].parents:
                if p not in seen:
                    seen.add(p)
                    following.append(p)
        frontier = following
    return out[:limit]


def row_order(columns: torch.Tensor, tokens: torch.Tensor) -> list[int] | None:
    """The projection's rows a tensor reads, in the order its axes lay them out (each row once), where every axis
    runs over tokens or over rows, never both: `columns` and `tokens` say where each value came from."""
    keep = []
    for axis in range(columns.dim()):
        first_c, first_t = columns.narrow(axis, 0, 1), tokens.narrow(axis, 0, 1)
        varies_c, varies_t = not bool((columns == first_c).all()), not bool((tokens == first_t).all())
        if varies_c and varies_t:
            return None
        if varies_c:
            keep.append(axis)
    index = tuple(slice(None) if axis in keep else 0 for axis in range(columns.dim()))
    rows_read = columns[index]  # the row axes only, in the tensor's order
    token_axes = tokens[tuple(0 if axis in keep else slice(None) for axis in range(tokens.dim()))]
    if bool((tokens != token_axes.reshape(
            [tokens.shape[a] if a not in keep else 1 for a in range(tokens.dim())])).any()):
        return None  # a token that depends on the row axes: the tokens are mixed into the heads
    return list(dict.fromkeys(int(c) for c in rows_read.reshape(-1).tolist()))


def _runs(order: list[int]) -> list[list[int]]:
    """Rows as runs of consecutive ones, `[[0, 16], [48, 64]]`."""
    runs: list[list[int]] = []
    for r in order:
        if runs and r == runs[-1][1]:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return runs


def row_ranges(order: list[int]) -> str:
    """Rows as runs: `0:16, 48:64`."""
    runs = _runs(order)
    text = ", ".join(f"{a}:{b}" for a, b in runs)
    return text if len(runs) <= 4 else f"{len(runs)} runs of rows, {runs[0][0]}:{runs[0][1]}, ..."
