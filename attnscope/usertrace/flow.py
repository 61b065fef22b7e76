"""Which Linear layer is q, k, v and o, read from the data flow of the recorded run, never from names or the
order of registration (minGPT registers `key, query, value`):

- Q is the projection whose output becomes the left operand of the scores' matmul (the matmul the softmax
  reads from), K the right one (`Q Kᵀ`); where the softmax reads several (a relative term of the code's own beside
  `Q Kᵀ`: Shaw's `q · rel_kᵀ`, DeBERTa's `q · pos_keyᵀ`), the one both of whose sides are made by projections of
  what the values' projection (or the other side's) reads;
- V is the one multiplied by the pattern (the matmul with an operand that comes from the softmax);
- O the Linear that reads what that matmul made (never one the run does not call, or calls on something else: LUKE's
  entity queries idle without entities, a gate on x; with none, the module is compared up to the merge).
A fused kernel (`F.scaled_dot_product_attention(q, k, v)`) says the three by the order of its arguments.
Where the flow allows several readings (a tensor that comes from two projections), names break the tie, then
the order of registration. A Linear whose output reaches two of Q, K and V (x-transformers' and vit-pytorch's
`to_kv`, chunked into K and V; `to_qkv`, chunked in three) is a fused projection: `shared` says which roles it
writes, and fused.py splits its rows. Only for projections of one input (self-attention): where the forward takes query,
key and value apart, the input each projection reads is its role (a transpose there is a bug to report).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.align import ancestors
from attnscope.usertrace.kernels import ATTENTION_KERNELS
from attnscope.usertrace.record import LEFT, MATMULS, SOFTMAXES, mentioned
from attnscope.usertrace.scoreaxes import rows_from_right
from attnscope.usertrace.scoreform import keys_left

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record

ROLES = ("q", "k", "v", "o")
# Code that never calls a softmax (Rabe & Staats' chunked attention, a flash-attention loop in PyTorch) exponentiates
# each block of scores less a running max and multiplies the values by that: its first such exp stands for the pattern
EXPONENTS = ("exp", "exp_")
MAX_LINEARS = 12  # more than that, and the flow is not read (4 of 12 is 11,880 readings)


def roles(records: list[Record], names: list[str], role_of: Any) -> tuple[dict[str, str], str] | None:
    """{role: Linear name} read from the data flow, and how the tie was broken ("" when the flow alone
    decided); None where the flow does not say (no scores matmul recorded, a fused projection)."""
    if not records or not 4 <= len(names) <= MAX_LINEARS:
        return None
    read = {r.args[1] for r in records if r.style == "linear" and len(r.args) > 1 and r.args[1][0] == "text"}
    if len(read) > 1:  # query, key and value given apart: each projection's role is the input it reads
        return None
    flow = _flow(records)
    if flow is None:
        return None
    sources, readers = flow
    # no Linear reads what the pattern made: O is never one the run did not call, nor one it called on something
    # else (LUKE's entity queries, held and idle without entities; a gate on x); only a weight the code multiplies
    # some other way (`out @ self.W_o`) is left to the names and the order
    ran = called(records)
    outputs = readers or {n for n in names if mentioned(n, records) and n not in ran}
    fitting = [chosen for chosen in itertools.permutations(names, 4)
               if all(name in found for name, found in zip(chosen, sources, strict=False))
               and chosen[3] in outputs and chosen[3] not in set().union(*sources)]
    if not fitting:
        return None
    how = ""
    if len(fitting) > 1:
        by_name = [c for c in fitting if all(role_of(n) == role for n, role in zip(c, ROLES, strict=True))]
        fitting, how = (by_name, "names") if by_name else (fitting, "registration order")
    return dict(zip(ROLES, fitting[0], strict=True)), how


def shared(records: list[Record], names: list[str]) -> dict[str, str] | None:
    """{role: Linear name} where one Linear writes two or all three of q, k, v (the flow reaching the scores'
    operands and the pattern's V from it alone) and another reads what the pattern made (o); None where the
    flow says otherwise, or each role has a Linear of its own (`roles` reads those)."""
    if not records or not 2 <= len(names) <= MAX_LINEARS:
        return None
    flow = _flow(records)
    if flow is None or any(len(found) != 1 for found in flow[0]):
        return None
    found = dict(zip("qkv", (next(iter(s)) for s in flow[0]), strict=True))
    if len(set(found.values())) == 3:
        return None
    readers = flow[1] - set(found.values())
    if len(readers) != 1:
        return None
    return {**found, "o": readers.pop()}


def shared_without_output(records: list[Record], names: list[str]) -> dict[str, str] | None:
    """{q, k, v: Linear name} where one Linear writes two or all three of q, k, v and none reads what the pattern
    made (HF's BertSelfAttention with `self.key(x)` written for the values, its `value` Linear never called); None
    otherwise."""
    if not records or not 1 <= len(names) <= MAX_LINEARS:  # one: a fused qkv alone (LayoutLMv2's qkv_linear)
        return None
    flow = _flow(records)
    if flow is None or any(len(found) != 1 for found in flow[0]) or flow[1]:
        return None
    found = dict(zip("qkv", (next(iter(s)) for s in flow[0]), strict=True))
    return found if len(set(found.values())) < 3 else None


def without_output(records: list[Record], names: list[str]) -> dict[str, str] | None:
    """{q, k, v: Linear name} where three Linear layers write q, k and v, one each, and none reads what the
    pattern made (HF's BertSelfAttention returns the merged heads; its output projection lives in BertSelfOutput);
    None otherwise."""
    if not records or not 3 <= len(names) <= MAX_LINEARS:
        return None
    flow = _flow(records)
    if flow is None or any(len(found) != 1 for found in flow[0]) or flow[1]:
        return None
    found = dict(zip("qkv", (next(iter(s)) for s in flow[0]), strict=True))
    ran = called(records)
    if any(mentioned(n, records) and n not in ran for n in names if n not in found.values()):
        return None  # a weight the code multiplies some other way (`out @ self.W_o`) may be its output projection
    return found if len(set(found.values())) == 3 else None


def made_by(records: list[Record]) -> dict[int, str]:
    """{record: the name of the Linear (or projection weight) whose output it is}, for each projection's call."""
    return {r.index: r.args[0][1] for r in records if r.style == "linear" and r.args and r.args[0][0] == "text"}


def called(records: list[Record]) -> set[str]:
    """The Linear layers the run called (by name)."""
    return set(made_by(records).values())


def _flow(records: list[Record]) -> tuple[list[set[str]], set[str]] | None:
    """The Linear layers the scores' left and right operands and the pattern's V come from, and those that read
    what the pattern made; None where no scores matmul was recorded."""
    operands = _operands(records)
    if operands is None:
        return None
    left, right, value, after = operands
    made = made_by(records)
    made = {i: name for i, name in made.items() if not along_tokens(records, records[i], made)}
    nearest = _nearest(records, made)
    readers = {made[r.index] for r in records if r.index in made and after is not None
               and after in ancestors(r, records)}
    return [nearest[left], nearest[right], nearest[value]], readers


def operands(records: list[Record]) -> tuple[int, int, int, int | None] | None:
    """The records of the scores' left and right operands, the pattern's partner (V), and the record made from
    pattern and V (a fused kernel: its q, k, v and its output); None where no scores matmul was recorded."""
    return _operands(records)


def _operands(records: list[Record]) -> tuple[int, int, int, int | None] | None:
    """The records of the scores' left and right operands, the pattern's partner (V), and the record made
    from pattern and V; None where no softmax reads a matmul's product."""
    for r in records:
        if r.func.endswith(ATTENTION_KERNELS):
            given = records_read(r)
            if len(given) >= 3:
                return given[0], given[1], given[2], r.index
    softmax = next((r for r in records if r.func.split(".")[-1] in SOFTMAXES), None)
    if softmax is None:  # online softmax (chunked, flash-style): each block's exp stands for the pattern
        return next((found for r in records if r.func.split(".")[-1] in EXPONENTS
                     and (found := operands_at(records, r)) is not None), None)
    return operands_at(records, softmax)


def operands_at(records: list[Record], softmax: Record) -> tuple[int, int, int, int | None] | None:
    """`_operands` of one softmax: the records of its scores' left and right operands, its pattern's partner (V),
    and the record made from pattern and V; None where no matmul made its scores or reads its pattern."""
    above = ancestors(softmax, records)
    scores = [r for r in records if r.index in above and r.func.split(".")[-1] in MATMULS + ("einsum",)
              and len(records_read(r)) >= 2]
    if not scores:
        return None
    for r in records[softmax.index + 1:]:
        given = records_read(r)
        if r.func.split(".")[-1] in MATMULS + ("einsum",) and len(given) >= 2:
            from_pattern = [softmax.index in ancestors(records[g], records) | {g} for g in given[-2:]]
            if from_pattern.count(True) == 1:
                value = given[-2:][from_pattern.index(False)]
                product = _content(records, scores, value)
                left, right = records_read(product)[-2:]
                if _keys_left(records, product, r, from_pattern[1]):
                    left, right = right, left
                return left, right, value, r.index
    return None


def _keys_left(records: list[Record], product: Record, value_product: Record, pattern_right: bool) -> bool:
    """Whether the scores' left operand holds the keys: the operand whose tokens the product with the values
    contracts (scoreaxes.keys_left: the pattern followed through its transposes, `bmm(v, w_.permute(0, 2, 1))` after
    `bmm(q, k)`); where the axes cannot be followed, an einsum whose output's rows are its right operand's
    (`einsum("aecd,abcd->acbe", key, query)`) or `V @ pattern`, the column form's `Kᵀ Q`."""
    read = keys_left(records, product, value_product)
    if read is not None:
        return read
    rows_right = rows_from_right(product)
    return rows_right != (pattern_right and value_product.func.split(".")[-1] in MATMULS)


def _content(records: list[Record], scores: list[Record], value: int) -> Record:
    """The content scores' product among the products the softmax reads: the last, unless it is a term of the
    code's own (Shaw's q · rel_k, DeBERTa's c2p and p2c, Transformer-XL's q · R: one side made from a table, or by a
    projection of one); then the last whose two sides are each made by a projection of what the other side's or the
    values' projections read. The last where none is."""

    def fed(index: int) -> set[Any]:  # what the projections `index` is made by read
        up = ancestors(records[index], records) | {index}
        return {tuple(records[i].args[1]) for i in up if records[i].style == "linear" and len(records[i].args) > 1}

    values = fed(value)
    if not values:
        return scores[-1]
    for product in reversed(scores):
        sides = [fed(i) for i in records_read(product)[-2:]]
        if all(side & (values | other) for side, other in zip(sides, sides[::-1], strict=True)):
            return product
    return scores[-1]


def records_read(record: Record) -> list[int]:
    """The records an op read, in the order of its arguments (a list's in its order: `torch.einsum(eq, [q, k])`;
    keyword tensors after)."""
    out = [i for kind, value in record.args for k, i in ([(kind, value)] if kind != "list" else value) if k == "rec"]
    out += [value[1][1] for kind, value in record.args if kind == "kw" and value[1][0] == "rec"]
    return out


def along_tokens(records: list[Record], linear: Record, made: dict[int, str]) -> bool:
    """Whether `linear` mixes the tokens of a projection's output rather than projecting features: the axis of what
    it reads that its weight contracts (the record's `contracts`) is that output's token axis (the axis before the
    features, or after them in the column form) where it reads the output itself, else as long as the tokens of a
    projection's output it comes from (`made`: record -> Linear, itself no such pooling), those tokens not as many
    as that output's features. rtdl's and Linformer's `key_compression = nn.Linear(n_tokens, k)` over
    `k.transpose(1, 2)`, lucidrains' `einsum('bnd,nk->bkd', keys, proj_k)` with a Parameter `[seq_len, k]`, `E.t()
    @ k`, after a fused projection cut apart too: a pooling of the projected keys or values (pooled.py reads it),
    never one of q, k, v or o. The forward's input compressed so before the projections likewise (keyinputs.py)."""
    read = next((records[value] for kind, value in linear.args[1:2] if kind == "rec"), None)
    axis = linear.details.get("contracts")
    size = _contracted_size(records, linear)
    if size is None or axis is None:
        return False
    above = ancestors(read, records) | {read.index} if read is not None else set()
    if not any(i in made for i in above):
        # made from the forward's input alone, no projection on the way: its tokens, `[n_batch, n, d_feat]` as the
        # first op read it, contracted (`nn.Linear(n, k)` over `x.transpose(1, 2)`, Linformer's E over x: an input
        # compressed along the sequence before the key and value projections), where another projection reads
        # that input's features (a module laid out `[n_batch, d_feat, n]` whose projections all read its first axis
        # after a transpose projects features)
        roots = [records[i].details.get("source_shape") for i in above if not records[i].parents] \
            if read is not None else [linear.details.get("source_shape")]
        widths = {_contracted_size(records, r) for r in records if r.index in made and r.index != linear.index}
        return any(shape is not None and len(shape) == 3 and shape[-2] == size != shape[-1]
                   and shape[-1] in widths for shape in roots)
    if read is None:  # the column form's `W @ x` of the input: its features
        return False
    for i in above:
        if i not in made or i == linear.index or records[i].tensor.dim() < 2 \
                or along_tokens(records, records[i], made):  # a pooling's output: its tokens are no projection's
            continue
        shape = records[i].tensor.shape
        tokens, features = (-1, -2) if LEFT in records[i].args else (-2, -1)
        if i == read.index:  # the projection's output itself: the axis says it, whatever the sizes
            return axis == tokens
        if shape[tokens] == size != shape[features]:
            return True
    return False


CUTS = ("chunk", "split", "unbind", "__getitem__", "narrow", "tensor_split", "select")  # ops that cut a tensor apart


def keys_are_values(records: list[Record]) -> bool:
    """Whether the scores' right operand and the pattern's partner hold the same numbers, each made from the whole
    output of the projection above it, nothing cut from it on the way (the keys are the values: one projection for
    both, Linformer's share_kv; a fused K/V projection's keys read twice are cut from it: `v = k` after the chunk)."""
    import torch

    found = _operands(records)
    if found is None:
        return False
    keys, values = records[found[1]], records[found[2]]
    if not keys.tensor.is_floating_point() or keys.tensor.dim() < 2 or not any(
            k.shape == values.tensor.shape and torch.equal(k, values.tensor)
            for k in (keys.tensor, keys.tensor.transpose(-1, -2))):  # `q @ k.transpose(-1, -2)`, `v = k`
        return False
    made, _ = linears_of(records)
    for end in (keys, values):
        above = ancestors(end, records) | {end.index}
        start = next((i for i in sorted(above, reverse=True) if i in made
                      and not along_tokens(records, records[i], made)), None)
        if start is None or any(records[i].func in CUTS for i in above if i > start
                                and start in ancestors(records[i], records)):
            return False
    return True


def _contracted_size(records: list[Record], linear: Record) -> int | None:
    """How many entries a projection's weight contracts: the length of the axis of its input it contracts (the
    record's `contracts`), the forward's input read as the first op saw it."""
    axis = linear.details.get("contracts")
    read = next((records[value] for kind, value in linear.args[1:2] if kind == "rec"), None)
    shape = tuple(read.tensor.shape) if read is not None else linear.details.get("source_shape")
    if axis is None or shape is None or not -len(shape) <= axis < 0:
        return None
    return int(shape[axis])


def token_mixers(records: list[Record]) -> set[str]:
    """The weights (Linear layers, parameters) every call of which mixes the tokens of a projection's output
    (along_tokens): poolings of the keys or values along the sequence, never one of q, k, v or o."""
    made, _ = linears_of(records)
    mixing: dict[str, bool] = {}
    for i, name in made.items():
        mixing[name] = mixing.get(name, True) and along_tokens(records, records[i], made)
    return {name for name, always in mixing.items() if always}


def _ancestors(records: list[Record], made: dict[int, str]) -> dict[int, set[str]]:
    """For each record, the Linear layers its value comes from (itself included, for a Linear's output)."""
    out: dict[int, set[str]] = {}
    for r in records:  # in order: a record's parents come before it
        found = {made[r.index]} if r.index in made else set()
        for p in r.parents:
            found |= out.get(p, set())
        out[r.index] = found
    return out


def _nearest(records: list[Record], made: dict[int, str]) -> dict[int, set[str]]:
    """For each record, the Linear layers nearest above it: those its value comes from with no other Linear between
    (itself, for a Linear's output). A layer further up feeds a role's projection and makes no role itself (PVT-v2's
    linear mode: `sr`, a 1x1 conv over the pooled map, before the fused `kv`; keys made from the projected queries
    still come from the key projection, the query one above it)."""
    out: dict[int, set[str]] = {}
    for r in records:  # in order: a record's parents come before it
        out[r.index] = {made[r.index]} if r.index in made else set().union(*(out.get(p, set()) for p in r.parents))
    return out


def linears_of(records: list[Record]) -> tuple[dict[int, str], dict[int, set[str]]]:
    """{record: the Linear it is the output of}, and for each record the Linear layers its value comes from."""
    made = made_by(records)
    return made, _ancestors(records, made)


def input_roles(records: list[Record], names: list[str]) -> dict[str, str] | None:
    """{parameter: Q, K or V} for the forward's tensor parameters `names`, read from the data flow: Q the one the
    scores' left operand comes from, K the right one's, V the pattern's partner's (the queries' and the memory's, K
    and V both, where two tensors are fed); None where the flow does not say it (no scores matmul recorded, an
    operand from several inputs or none, two roles from one input where three are fed)."""
    found = operands(records)
    if found is None:
        return None
    left, right, value, _ = found
    reached = _inputs_of(records, set(names))
    sides = [reached.get(left, set()), reached.get(right, set()), reached.get(value, set())]
    if any(len(side) != 1 for side in sides):
        return None
    q, k, v = (next(iter(side)) for side in sides)
    if len(names) == 3 and len({q, k, v}) == 3:
        return {q: "Q", k: "K", v: "V"}
    if len(names) == 2 and k == v and q != k:
        return {q: "Q", k: "K"}
    return None


def from_first_only(records: list[Record], names: list[str]) -> bool:
    """Whether the scores' both operands and the pattern's partner all come from the first of the forward's tensor
    parameters `names` alone, the others never read on their way (fairseq's MultiheadAttention with
    self_attention=True projects q, k and v from `query` and ignores `key` and `value`); in a run that stopped
    before its pattern, whether its ops read the first alone."""
    if len(names) < 2:
        return False
    found, reached = operands(records), _inputs_of(records, set(names))
    if found is None:  # a run that stopped before its pattern: no op of it read any but the first
        return set().union(*reached.values()) == {names[0]}
    return all(reached.get(side, set()) == {names[0]} for side in found[:3])


def inputs_of(records: list[Record], names: set[str]) -> dict[int, set[str]]:
    """For each record, the forward's parameters among `names` its value comes from."""
    return _inputs_of(records, names)


def projection_inputs(records: list[Record], names: list[str]) -> dict[str, set[str]]:
    """{Linear name: the forward's tensor parameters (`names`) its input comes from}, over every call of it."""
    reached = _inputs_of(records, set(names))
    out: dict[str, set[str]] = {}
    for r in records:
        if r.style != "linear" or len(r.args) < 2 or r.args[0][0] != "text":
            continue
        kind, value = r.args[1]
        fed = {value} & set(names) if kind == "text" else reached.get(value, set()) if kind == "rec" else set()
        out.setdefault(r.args[0][1], set()).update(fed)
    return out


def sources(records: list[Record]) -> tuple[set[str], set[str], set[str]] | None:
    """The Linear layers the scores' left and right operands and the pattern's V come from; None where no scores
    matmul was recorded."""
    flow = _flow(records)
    return (flow[0][0], flow[0][1], flow[0][2]) if flow is not None else None


def readers(records: list[Record]) -> set[str]:
    """The Linear layers that read what the pattern made (the output projection's candidates)."""
    flow = _flow(records)
    return flow[1] if flow is not None else set()


def before_any_pattern(records: list[Record], name: str) -> bool:
    """Whether the run called the Linear `name` and every call of it reads only what no softmax, exp or attention
    kernel made: a branch beside the attention (ConvBERT's `conv_out_layer` over the module's input), never an
    output projection."""
    patterns = {r.index for r in records if r.func.split(".")[-1] in (*SOFTMAXES, *EXPONENTS)
                or r.func.endswith(ATTENTION_KERNELS)}
    made = made_by(records)
    calls = [r for r in records if made.get(r.index) == name] if patterns else []
    return bool(calls) and all(not ancestors(r, records) & patterns for r in calls)


def _inputs_of(records: list[Record], names: set[str]) -> dict[int, set[str]]:
    """For each record, the forward's tensor parameters among `names` its value comes from."""
    out: dict[int, set[str]] = {}
    for r in records:
        found: set[str] = set()
        for kind, value in r.args:
            if kind == "kw":
                kind, value = value[1]
            if kind == "text" and value in names:
                found.add(value)
        for p in r.parents:
            found |= out.get(p, set())
        out[r.index] = found
    return out


def projection_above(records: list[Record], index: int) -> Record | None:
    """The projection nearest above record `index` in its data flow (a Linear's call, `x @ W`: a record of style
    "linear" with what it reads as its second argument), record `index` itself included; None where none is."""
    start = records[index]
    above = sorted(ancestors(start, records) | {start.index}, reverse=True)
    return next((records[i] for i in above if records[i].style == "linear" and len(records[i].args) > 1), None)
