"""A norm the module applies to its input before its projections (vit-pytorch's and lucidrains' `Attention`:
`x = self.norm(x)` then `self.to_qkv(x)`; a cross-attention's `norm_context(context)` before `to_kv`).

Read from the run, never from names alone: the projections the reference holds read, in their one call, not the
forward's input but a norm of it, an op of torch's norms (`F.layer_norm`, `F.rms_norm`, `F.group_norm`,
`F.normalize`) or what a submodule of the module's whose class is a norm (`nn.LayerNorm`, an `RMSNorm` of the
file's) gives back on that input. Every projection that reads that input reads the same normed tensor, so the norm
is the module's input side, a convention, not attention: the reference's projections read the normed tensor
(`Inputs.own`, as posembed.py's sums), and a mistake after them is still named by experiment. A norm some
projections read and others not is left alone (no convention trace can tell from a mistake).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.usertrace.cutnames import layer_of

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record

NORMS = ("layer_norm", "rms_norm", "group_norm", "normalize", "instance_norm")


@dataclass
class Normed:
    tensors: dict[str, torch.Tensor]  # role (Q, K, V) -> what its projection reads, [n_batch, n, d]
    line: dict[str, int]  # role -> the norm's line
    said: dict[str, str]  # role -> the norm as the code writes it


def read(records: list[Record], inputs: Inputs, module: Any, projections: dict[str, str]) -> None:
    """`inputs` with the normed tensors the projections the reference holds (`projections`, role -> name, as
    posembed.projections reads them) read, where they read them. Where the queries are the module's own (queries.py:
    Perceiver's latents, whatever norm they had is in that tensor), the keys' and values' norm of the forward's input
    (Perceiver IO's `layernorm2(inputs)`, a norm the queries' side does not share) is read the same way, their side."""
    queries = set(inputs.own) == {"Q"} and inputs.own_from == "module"
    if module is None or inputs.own and not queries or inputs.layout not in ("row", "time", "col") \
            or inputs.cache is not None or not projections:
        return
    # a fused projection's rows (`to_qkv[0:32]`): the one call of the layer that holds them
    names = {layer_of(name) for name in projections.values()}
    by_role = {role: name for name, role in inputs.roles.items()}
    calls = [r for r in records if r.style == "linear" and len(r.args) > 1 and r.args[0][0] == "text"
             and r.args[0][1] in names and r.args[0][1] != layer_of(projections.get("o", ""))]
    normed: dict[str, Record] = {}  # forward input -> the norm of it every projection reads
    for given in dict.fromkeys(by_role.values()):
        read = {c.args[1][1] if c.args[1][0] == "rec" else -1 for c in calls if _reads(c, records, given)}
        if len(read) != 1 or -1 in read:
            continue  # no projection reads it, or one reads it normed and another as it is
        record = _laid_out(records[next(iter(read))], records)
        if _normed(record, records, inputs.handed(), given, module):  # an image or a feature map as handed
            normed[given] = record
    found = Normed({}, {}, {})
    for role in "KV" if queries else "QKV":
        source = by_role.get(role) or (by_role.get("K") if role == "V" else None) or by_role.get("Q")
        if source is not None and source in normed:
            record = normed[source]
            found.tensors[role] = record.tensor.detach().transpose(0, 1) if inputs.layout == "time" \
                else record.tensor.detach().reshape(inputs.tensors[source].shape)  # a map's positions as tokens
            said = _norm_under_cast(record, records)  # GroupNorm32's `super().forward(x.float()).type(x.dtype)`
            found.line[role], found.said[role] = said.line, said.details.get("op", said.call)
    if found.tensors:
        apply(inputs, found, queries)


CASTS = ("type", "to", "float", "half", "bfloat16", "double", "type_as")  # a dtype handed back, the values kept
# ops that lay a tensor's values out again, none changed (a map laid as rows: `.view(b, c, h*w).transpose(1, 2)`)
LAYOUTS = ("view", "reshape", "flatten", "transpose", "permute", "contiguous", "movedim", "swapaxes", "unflatten")


def _laid_out(record: Record, records: list[Record]) -> Record:
    """The tensor a projection reads, before the code laid it out again for the projection (diffusers' early
    AttentionBlock: its GroupNorm's map `[B, C, H, W]` viewed `[B, C, H·W]` and transposed to rows); the record
    itself where no op of one tensor that moves values alone made it."""
    seen = record
    while seen.func.split(".")[-1] in LAYOUTS and len(seen.parents) == 1 \
            and records[seen.parents[0]].tensor.numel() == seen.tensor.numel():
        seen = records[seen.parents[0]]
    return seen if seen is not record and seen.func.split(".")[-1] in NORMS else record


def _norm_under_cast(record: Record, records: list[Record]) -> Record:
    """The norm op a cast of its output hands on (guided-diffusion's and Stable Diffusion's GroupNorm32: computed in
    float32, `.type(x.dtype)` after it), so that the note writes the norm; else the record itself."""
    seen = record
    while seen.func in CASTS and seen.parents and records[seen.parents[0]].tensor.shape == seen.tensor.shape:
        seen = records[seen.parents[0]]
    return seen if seen.func in NORMS else record


def _reads(call: Record, records: list[Record], given: str) -> bool:
    """Whether a projection's call reads the forward input `given`, as it is or made into another tensor."""
    from attnscope.usertrace.align import ancestors

    kind, value = call.args[1]
    if kind == "text":
        return bool(value == given)
    if kind != "rec":
        return False
    history = [records[i] for i in ancestors(records[value], records) | {value}]
    return any(k == "text" and t == given for r in history for k, t in r.args)


def _normed(record: Record, records: list[Record], inputs: dict[str, torch.Tensor], given: str, module: Any) -> bool:
    """Whether `record` is a norm of the forward input `given` (x) and of no other tensor input: an op of torch's
    norms on it, or the output of one of the module's norm submodules run on it."""

    from attnscope.usertrace.align import ancestors

    x = inputs[given]
    if tuple(record.tensor.shape) != tuple(x.shape) or bool((record.tensor == x).all()):
        return False
    history = [records[i] for i in ancestors(record, records) | {record.index}]
    if any(r.style == "linear" for r in history):
        return False
    texts = {t for r in history for k, t in r.args if k == "text" and isinstance(t, str)}
    if texts & set(inputs) != {given}:
        return False
    return record.func in NORMS or by_norm_module(module, x, record.tensor)


def by_norm_module(module: Any, x: torch.Tensor, made: torch.Tensor) -> bool:
    """Whether one of `module`'s norm submodules (a class named like a norm: nn.LayerNorm, an RMSNorm of the file's)
    gives back `made` when run on `x`."""
    import torch

    with torch.no_grad():
        for name, sub in module.named_modules() if module is not None else ():
            if name and "norm" in type(sub).__name__.lower():
                try:
                    out = sub(x.to(next(sub.parameters(), x).dtype))
                except Exception:  # noqa: BLE001 - a submodule that does not take x is no norm of it
                    continue
                if isinstance(out, torch.Tensor) and out.shape == made.shape \
                        and torch.allclose(out.to(made.dtype), made, atol=1e-6, rtol=1e-5):
                    return True
    return False


def apply(inputs: Inputs, normed: Normed, queries: bool = False) -> None:
    """`inputs` with the normed tensors as the reference's inputs, and the note that says so; `queries`: beside the
    module's own queries, which stay as they are."""
    inputs.own = {**inputs.own, **normed.tensors} if queries else dict(normed.tensors)
    inputs.own_from = "module" if queries else "norm"
    words = {"Q": "queries'", "K": "keys'", "V": "values'"}
    said: dict[tuple[int, str], list[str]] = {}
    for role in sorted(normed.tensors, key="QKV".index):
        said.setdefault((normed.line[role], normed.said[role]), []).append(words[role])
    parts = "; ".join(f"the {_listed(roles)} projections (line {line}: {op})" for (line, op), roles in said.items())
    inputs.notes.append(f"your module normalizes its input before its projections read it: {parts}; read as its "
                        "input side, a convention, not a mistake: the reference's projections read the same normed "
                        "tensor")


def _listed(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
