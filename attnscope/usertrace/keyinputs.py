"""Keys and values read from a tensor the module computes from its input: Segformer's and PVT's spatial reduction
(`sr = Conv2d(stride=sr_ratio)` over x laid out as an image, then a LayerNorm), a pooled memory
(`F.adaptive_avg_pool1d(x.transpose(1, 2), m)`), a downsampled sequence; and each of q, k and v read through a tensor
of its own (CvT's depthwise Conv2d + BatchNorm2d per role, the class token kept aside and joined back; its AvgPool2d
keys and values; a depthwise Conv1d or a norm before each role's Linear). The forward takes x, but its key and
value projections read other tensors made from x, so n_K is their length.

Read from the run, never from names or widths: the projections behind the scores' right operand and the pattern's
partner (flow.operands) each read a tensor made from the forward's input by ops of no projection (one and the same,
or one each), and the query projection reads the input itself or a tensor of its own made so, as long as the input.
Each tensor is its role's input side, a convention, not attention: the reference's projections read them
(`Inputs.own`, as queries.py's latents), n_K the keys' length, and a mistake after the projections is still named by
experiment. A tensor is kept only where the module's own parameters made it (a convolution, a norm) or, of another
length than the input, an op that summarizes positions (a pooling, a mean, an interpolation): the input merely laid
out anew for the keys (a transpose that scrambles the tokens) or cut (`x[:, :-1]`) is a mistake the line-up shows,
no convention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record


@dataclass(frozen=True)
class KeyInput:
    tensors: dict[str, torch.Tensor]  # role -> what its projection reads, [n_batch, n, d_feat]: K and V, Q where made
    records: dict[str, Record]  # role -> the op that made it
    projections: tuple[str, ...]  # the key's and the value's projection (one, fused or read twice)
    made: dict[str, list[Record]]  # role -> the ops of the module's weights or the poolings that made it (CvT's
    # conv2d and batch_norm)
    kept: int = 0  # the input's tokens kept aside and joined back as they are (CvT's class token)


def find(records: list[Record], inputs: Inputs, module: Any, held: dict[str, str] | None = None) -> KeyInput | None:
    """The tensors the key and value projections (and the query one, where it reads one of its own) read, where the
    module makes them from its one input; None otherwise. `held` (role -> the projection the reference holds for it,
    posembed.projections): each role's tensor is the one its projection reads (keys and values swapped in the code
    then stay a mistake of the projections, as the reference finds it)."""
    from attnscope.usertrace.flow import operands
    mapped = inputs.layout == "col" and inputs.grid is not None  # a feature map [n_batch, d_feat, n_h, n_w]
    if module is None or inputs.own or inputs.layout != "row" and not mapped or inputs.cache is not None \
            or set(inputs.roles.values()) != {"Q"} or len(inputs.roles) != 1:
        return None
    given = next(iter(inputs.roles))
    found = operands(records)
    if found is None:
        return None
    reads = [_projected(records, index) for index in found[:3]]
    if any(r is None for r in reads):
        return None
    (q_call, q_in), (k_call, k_in), (v_call, v_in) = reads  # type: ignore[misc]
    x, names = inputs.tensors[given], set(inputs.tensors)
    roles = _roles(records, (q_call, k_call, v_call))
    if mapped:
        return _maps(records, inputs, module, given, roles, (q_call, k_call, v_call), (q_in, k_in, v_in))
    if q_in[0] == "rec" and k_in == ("text", given) and v_in == ("text", given):  # CaiT's self.q(x[:, 0])
        return _selected(records, records[q_in[1]], records[q_call], module, x, names, roles)
    if k_in[0] != "rec" or v_in[0] != "rec":
        return None
    keys, values = records[k_in[1]], records[v_in[1]]
    made = {"K": _side(keys, records, module, x, names, roles), "V": _side(values, records, module, x, names, roles)}
    if made["K"] is None or made["V"] is None or keys.tensor.shape[-2] != values.tensor.shape[-2]:
        return None
    chosen = {"K": keys, "V": values}
    if q_in != ("text", given):  # CvT's conv_proj_q before proj_q: the queries' input side of their own
        queries = records[q_in[1]] if q_in[0] == "rec" else None
        if queries is None or queries.tensor.shape != x.shape:
            return None
        if not _same(queries.tensor, x):  # x split and joined back as it is reads as x
            q_made = _side(queries, records, module, x, names, roles)
            if q_made is None:
                return None
            made["Q"], chosen["Q"] = q_made, queries
    calls = tuple(dict.fromkeys(str(records[c].args[0][1]) for c in (q_call, k_call, v_call)
                                if c != q_call or "Q" in chosen))
    reader = {str(records[c].args[0][1]): role for role, c in zip("QKV", (q_call, k_call, v_call), strict=True)
              if role in chosen}
    if held and len(reader) == len(chosen):  # each role the tensor the reference's projection for it reads
        chosen = {role: chosen[reader.get(held.get(role.lower(), ""), role)] for role in chosen}
    return KeyInput({role: r.tensor.detach() for role, r in chosen.items()}, chosen, calls,
                    {role: ops for role, ops in made.items() if ops}, _kept(keys, records, x))


def _maps(records: list[Record], inputs: Inputs, module: Any, given: str, roles: frozenset[str] | None,
          calls: tuple[int, int, int], reads: tuple[tuple[str, Any], ...]) -> KeyInput | None:
    """A feature map's keys and values read from maps the module makes from it, where the queries read the map
    itself (timm's MobileNetV4 MultiQueryAttention2d with kv_stride: a strided depthwise Conv2d and a BatchNorm2d for
    each of k and v before its 1x1 Conv2d): each `[n_batch, d_feat, n_h', n_w']`, its positions in raster order the
    role's tokens, in the column form's `[n_batch, d_feat, n_K]`. None where they are not so made."""
    q_in, k_in, v_in = reads
    if q_in != ("text", given) or k_in[0] != "rec" or v_in[0] != "rec":
        return None
    x = inputs.handed()[given]
    chosen = {"K": records[k_in[1]], "V": records[v_in[1]]}
    made: dict[str, list[Record]] = {}
    for role, record in chosen.items():
        t = record.tensor
        if not t.is_floating_point() or t.dim() != 4 or x.dim() != 4 or t.shape[:2] != x.shape[:2]:
            return None
        texts, parameters = _history(record, records, module, roles)
        if texts & set(inputs.tensors) != {given} or not parameters:
            return None  # made by no weight of the module's: the map laid out anew or cut, no input side
        made[role] = _making(record, records, module, parameters)
    if chosen["K"].tensor.shape[2:] != chosen["V"].tensor.shape[2:]:
        return None
    projections = tuple(dict.fromkeys(str(records[c].args[0][1]) for c in calls[1:]))
    return KeyInput({role: r.tensor.detach().flatten(2) for role, r in chosen.items()}, chosen, projections, made)


def apply(inputs: Inputs, found: KeyInput) -> bool:
    """`inputs` with the tensors as the reference's key and value (and query) inputs, n_K their length, and the note
    that says so; False (nothing changed) where the reference's mask does not fit that length."""
    if "K" not in found.tensors:
        return _apply_selected(inputs, found)
    n_K = int(found.tensors["K"].shape[-1 if inputs.layout == "col" else -2])
    mask = inputs.mask
    if mask is not None and mask.dim() >= 1 and mask.shape[-1] not in (1, n_K):
        return False
    inputs.own = dict(found.tensors)
    inputs.own_from = "keys"
    n_input = inputs.sizes.get("n_K")
    inputs.sizes["n_K"] = n_K
    by = " and ".join(found.projections)
    if "Q" not in found.tensors and found.records["K"].index == found.records["V"].index:
        record = found.records["K"]
        op = record.details.get("op", record.call)
        inputs.notes.append(f"your key and value projections ({by}) read a tensor your module makes from its input "
                            f"(line {record.line}: {op}), n_K = {n_K} where the input has {n_input}: read as the "
                            "keys' and values' input side (a spatial reduction, a pooling, a memory of its own), a "
                            "convention, not a mistake: the reference's key and value projections read the same "
                            "tensor")
        return True
    words = {"Q": "queries", "K": "keys", "V": "values"}
    parts = ", ".join(f"{words[role]} line {ops[0].line} ({', '.join(dict.fromkeys(r.call for r in ops))})"
                      for role in "QKV" if (ops := found.made.get(role)))
    kept = f"; {found.kept} token{'s' if found.kept > 1 else ''} of your input kept aside and joined back " \
        "unchanged (a class token)" if found.kept else ""
    roles = "query, key and value" if "Q" in found.tensors else "key and value"
    inputs.notes.append(f"your {roles} projections ({_listed(found.projections)}) each read a tensor your module "
                        "makes from its input: "
                        f"{parts}{kept}; n_K = {n_K} where the input has {n_input}: read as each role's input side (a "
                        "convolutional or pooled projection), a convention, not a mistake: the reference's "
                        "projections read the same tensors")
    return True


def _selected(records: list[Record], record: Record, call: Record, module: Any, x: torch.Tensor, names: set[str],
              roles: frozenset[str] | None) -> KeyInput | None:
    """The queries' input side where the query projection reads some of the input's tokens, or a summary of them, and
    the key and value projections the input itself: CaiT's class attention `self.q(x[:, 0])`, a Perceiver-AR-like
    last token `x[:, -1:]`, a pooled token `x.mean(1, keepdim=True)`; `[n_batch, n_Q, d_feat]` (one token selected
    away, `[n_batch, d_feat]`, as one), n_Q fewer than the input's tokens. None where no projection is on the way
    from the input alone to it."""
    texts, _ = _history(record, records, module, roles)
    t = record.tensor
    if texts & names != names or len(names) != 1 or not t.is_floating_point() or t.shape[0] != x.shape[0] \
            or t.shape[-1] != x.shape[-1] or x.dim() != 3:
        return None
    if t.dim() == 2:  # one token selected away: [n_batch, d_feat] -> [n_batch, 1, d_feat]
        t = t.unsqueeze(1)
    if t.dim() != 3 or t.shape[1] >= x.shape[1]:
        return None
    from attnscope.usertrace.align import ancestors

    up = sorted(ancestors(record, records) | {record.index})
    return KeyInput({"Q": t.detach()}, {"Q": record}, (str(call.args[0][1]),), {"Q": [records[i] for i in up]})


def _apply_selected(inputs: Inputs, found: KeyInput) -> bool:
    """`inputs` with the queries a selection of the input's tokens (_selected): the reference's query input, n_Q
    their count, the input the keys' and values' side; False where the reference's mask does not fit n_Q."""
    t = found.tensors["Q"]
    n_Q = int(t.shape[-2])
    mask = inputs.mask
    if mask is not None and mask.dim() >= 2 and mask.shape[-2] not in (1, n_Q):
        return False
    inputs.own = {"Q": t}
    inputs.own_from = "selected"
    n_input = inputs.sizes["n_Q"]
    inputs.sizes["n_Q"], inputs.sizes["n_K"] = n_Q, n_input
    from attnscope.usertrace.inputs import role_dims

    for name, op in inputs.ops.items():  # the input is the keys' side: [n_batch, n_K, d_feat]
        if op.startswith("torch.randn("):
            inputs.ops[name] = f"torch.randn({', '.join(role_dims('K', inputs.sizes, True, inputs.layout))})"
    record = found.records["Q"]
    op = record.details.get("op", record.call)
    inputs.notes.append(f"your query projection ({found.projections[0]}) reads {n_Q} of the {n_input} tokens of your "
                        f"input, or a summary of them (line {record.line}: {op}), where the key and value projections "
                        f"read all of them: read as the queries' input side (a class token, the last token, a pooled "
                        f"token), n_Q = {n_Q}, a convention, not a mistake: the reference's query projection reads "
                        "the same tensor, and its keys and values every token")
    return True


def _side(record: Record, records: list[Record], module: Any, x: torch.Tensor, names: set[str],
          roles: frozenset[str] | None) -> list[Record] | None:
    """The ops of the module's weights or the poolings that made `record`, a tensor a projection reads, from the
    input x alone (`record` itself where none is needed: a tensor equal to x's rows); None where `record` is no
    input side (x laid out anew or cut, a projection on the way, another input read)."""
    texts, parameters = _history(record, records, module, roles)
    if len(texts & names) != 1 or not _batched(record.tensor, x):
        return None
    if not parameters and (record.tensor.shape[-2] == x.shape[-2] or not _pooled(record, records)):
        return None  # made by no weight of the module's and no pooling: x laid out anew or cut, no input side
    return _making(record, records, module, parameters)


def _making(record: Record, records: list[Record], module: Any, parameters: set[str]) -> list[Record]:
    """The ops that made `record` with the module's weights (`parameters`: also the Linear layers over the input's
    tokens, _history) or a pooling; `record` itself where none did."""
    from attnscope.usertrace.align import ancestors

    held = _held(module) | parameters
    up = sorted(ancestors(record, records) | {record.index})
    return [records[i] for i in up if any(_arg_text(a) in held for a in records[i].args)
            or any(word in records[i].func for word in POOLING)] or [record]


def _kept(record: Record, records: list[Record], x: torch.Tensor) -> int:
    """The input's tokens a join (`torch.cat([cls_token, k], dim=1)`) puts back beside the made ones, as they are."""
    if record.func != "cat":
        return 0
    kept = 0
    for kind, value in (a for k, v in record.args for a in (v if k == "list" else [(k, v)])):
        if kind == "rec" and value < len(records):
            part = records[value].tensor
            if part.dim() == x.dim() and part.shape[-2] < x.shape[-2] and part.shape[-1] == x.shape[-1] \
                    and _same(part, x[:, :part.shape[-2]]):
                kept += int(part.shape[-2])
    return kept


def _held(module: Any) -> set[str]:
    return {name for name, _ in (*module.named_parameters(), *module.named_buffers())}


def _arg_text(arg: tuple[str, Any]) -> Any:
    kind, value = arg
    if kind == "kw":
        kind, value = value[1]
    return value if kind == "text" else None


def _projected(records: list[Record], index: int) -> tuple[int, tuple[str, Any]] | None:
    """The projection nearest above record `index` (a Linear's call, `x @ W`) and what it reads: ("text", the
    input's name) or ("rec", a record); None where none is seen."""
    from attnscope.usertrace.flow import projection_above

    call = projection_above(records, index)
    if call is None or call.args[0][0] != "text":
        return None
    return call.index, call.args[1]


def _roles(records: list[Record], calls: tuple[int, ...]) -> frozenset[str] | None:
    """The layers that make Q, K and V (their calls `calls`, projection_above); None where one of those calls mixes
    the tokens of a projection's output (Linformer's `einsum('bnd,nk->bkd', to_k(x), proj_k)`, flow.along_tokens):
    the feature projection is then above it, and every layer on the way counts as one."""
    from attnscope.usertrace.flow import along_tokens, linears_of

    made, _ = linears_of(records)
    if any(c in made and along_tokens(records, records[c], made) for c in calls):
        return None
    return frozenset(str(records[c].args[0][1]) for c in calls)


def _history(record: Record, records: list[Record], module: Any, roles: frozenset[str] | None
             ) -> tuple[set[str], set[str]]:
    """The names the ops that made `record` read (inputs, parameters), and the module's parameters among them;
    a call of a role's projection on the way (`roles`: the layers that make Q, K and V, flow.operands) makes it no
    input side (empty): keys made from the projected queries are a mistake, no convention. Another layer on the way,
    one that makes no role (PVT-v2's linear mode: `sr`, a 1x1 Conv2d over the pooled map, then LayerNorm and GELU
    before the Linear k and v), is the module's own op on the input side, as a strided Conv2d is."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import along_tokens, linears_of

    history = [records[i] for i in ancestors(record, records) | {record.index}]
    made, _ = linears_of(records)
    # a weight over the input's tokens (a Linear over `x.transpose(1, 2)`, Linformer's E over x) is the module's
    # own reduction of the sequence, no projection
    mixers = {r.index for r in history if r.index in made and along_tokens(records, r, made)}
    if any(r.style == "linear" and r.index not in mixers and (roles is None or made.get(r.index) in roles)
           for r in history):
        return set(), set()
    mixers |= {r.index for r in history if r.style == "linear" and r.index in made}
    texts = {made[i] for i in mixers}
    for r in history:
        for kind, value in r.args:
            if kind == "kw":
                kind, value = value[1]
            if kind == "text" and isinstance(value, str):
                texts.add(value)
    return texts, texts & _held(module) | {made[i] for i in mixers}


POOLING = ("pool", "interpolate", "mean", "conv", "sum")  # ops that summarize positions (a pooled memory)


def _pooled(record: Record, records: list[Record]) -> bool:
    """Whether an op that summarizes positions (a pooling, a mean, an interpolation) made `record`."""
    from attnscope.usertrace.align import ancestors

    return any(any(word in records[i].func for word in POOLING) for i in ancestors(record, records) | {record.index})


def _batched(tensor: torch.Tensor, x: torch.Tensor) -> bool:
    """`tensor` is laid out as the input is, `[n_batch, n, d_feat]`, its own length n."""
    return tensor.is_floating_point() and tensor.dim() == x.dim() == 3 and tensor.shape[0] == x.shape[0] \
        and tensor.shape[-1] == x.shape[-1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _listed(words: tuple[str, ...]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
