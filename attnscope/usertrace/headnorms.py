"""qk-norms held one per head, read from the data flow: each norm module normalizes one head's slice of q or k (a
ModuleList of nn.LayerNorm(d_head) applied over `torch.split(q, 1, dim=1)` and joined by torch.cat, StableLM's
StableLmLayerNormPerHead; norms in any container, called in a loop over `q[:, h]` or `q.unbind(1)`). Which head a
norm normalizes is read from what it is given (the slice of an earlier tensor of the run, at that head's index on an
axis as long as the heads), never from its place in the container where it is called. Gains with no norm module (an
nn.ParameterList of per-head weights passed to F.layer_norm or F.rms_norm in a loop) are read so too, each op as the
norm it computes. The norms of one such split, one for each head, are taken as one norm with a row of weights per
head (`PerHead`), as the reference's qk-norm holds Cohere's. A list of norms never called (a side left unnormed) is
read by its order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from attnscope.usertrace import normforms
from attnscope.usertrace.record import Record

LISTS = (nn.ParameterList, nn.ParameterDict)  # parameters held, no norm computed: their ops read them
DEPTH = 6  # how many ops back a norm's input is looked for as a head's slice (a split, a squeeze, a contiguous)


class PerHead(nn.Module):
    """The norms of one split as one norm over `[..., heads, width]`: head j through its own norm; `weight` (and
    `bias`) `[heads, width]`, their rows stacked in head order."""

    def __init__(self, norms: list[nn.Module], width: int) -> None:
        super().__init__()
        self.norms = norms  # a plain list: their parameters are read as the rows below, not registered twice
        weights = [w for w in (normforms.weight_of(m, width) for m in norms) if w is not None]
        biases = [b.detach() for b in (getattr(m, "bias", None) for m in norms) if isinstance(b, torch.Tensor)]
        self.weight = nn.Parameter(torch.stack([w.reshape(width) for w in weights]).clone(), requires_grad=False) \
            if len(weights) == len(norms) else None
        self.bias = nn.Parameter(torch.stack([b.reshape(width) for b in biases]).clone(), requires_grad=False) \
            if len(biases) == len(norms) else None
        self.eps = normforms.own_eps(norms[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([norm(x[..., j, :]) for j, norm in enumerate(self.norms)], dim=-2)


def group(found: list[tuple[str, Any]], records: list[Record], counts: set[int], width: int,
          module: nn.Module | None = None, role_of: Callable[[str], str | None] = lambda name: None
          ) -> list[tuple[str, Any]]:
    """`found` with the norms that each normalize one head of one split (as many as the split has heads, one of
    `counts`, each head once) replaced by one PerHead, named by the module above them, in the order the run first
    uses them; containers whose every parameter is such a norm's dropped. The module's own 1-D parameters that an
    F.layer_norm or F.rms_norm takes as its weight (an nn.ParameterList of gains a head, no norm module) are such
    norms too. Norms held in one list and never called, one for each head, are a PerHead by their index (`_idle`).
    Unchanged where no split is read so."""
    units = [(name, norm, r, {id(p) for p in norm.parameters()}) for name, norm in found
             if isinstance(norm, nn.Module) and not isinstance(norm, LISTS)
             and normforms.weight_of(norm, width) is not None and not any(True for _ in norm.children())
             for r in (_first_use(name, norm, records),) if r is not None]
    if module is not None:
        units += _bare(module, records, width, [name for name, m in found if not isinstance(m, LISTS)])
    sources = {id(norm): held for _, norm, _, held in units}
    splits: dict[tuple[int, int], dict[int, tuple[str, Any]]] = {}
    first: dict[tuple[int, int], int] = {}
    for name, norm, r, _ in units:
        given = [records[v] for k, v in r.args if k == "rec"]
        at = _sliced(given[0], records, counts) if given and given[0].tensor.shape[-1] == width else None
        if at is None:
            continue
        source, axis, head = at
        heads = splits.setdefault((source, axis), {})
        if head in heads:  # two norms on one head: no reading
            return found
        heads[head] = (name, norm)
        first[(source, axis)] = min(first.get((source, axis), r.index), r.index)
    groups = [(key, heads) for key, heads in splits.items()
              if len(heads) > 1 and sorted(heads) == list(range(len(heads))) and len(heads) in counts
              and len({type(m) for _, m in heads.values()}) == 1]
    used = {id(m) for _, m, _, _ in units}
    idle = _idle([(name, m) for name, m in found if id(m) not in used], records, counts, width)
    for j, heads in enumerate(idle):  # never called: held in a list, a norm per head at its index
        first[(-1, j)] = len(records) + j
        sources.update({id(m): {id(p) for p in m.parameters()} for _, m in heads.values()})
        groups.append(((-1, j), heads))
    if not groups:
        return found
    grouped = {id(m) for _, heads in groups for _, m in heads.values()}
    params = {p for _, heads in groups for _, m in heads.values() for p in sources[id(m)]}
    kept = [(name, m) for name, m in found if id(m) not in grouped
            and not (isinstance(m, nn.Module) and any(True for _ in m.parameters())
                     and all(id(p) in params for p in m.parameters()))]
    made = [(first[key], _above([n for n, _ in heads.values()], role_of),
             PerHead([heads[j][1] for j in range(len(heads))], width)) for key, heads in groups]
    return kept + [(name, m) for _, name, m in sorted(made, key=lambda t: t[0])]


def _idle(found: list[tuple[str, Any]], records: list[Record], counts: set[int],
          width: int) -> list[dict[int, tuple[str, Any]]]:
    """The norms no op of the run reads, held in one container (`k_layernorm.norms.0`, `.1`: StableLM's
    StableLmLayerNormPerHead whose forward is never called), as many as one of `counts` (n_head or n_kv_head), one
    of a type, indexed 0, 1, ...: a norm per head, head j the one at index j (no data flow to read it from; the
    list's order is the one its forward would zip with the heads). Each container's norms by head."""
    held: dict[str, dict[int, tuple[str, Any]]] = {}
    for name, norm in found:
        above, _, index = name.rpartition(".")
        if not above or not index.isdigit() or not isinstance(norm, nn.Module) or isinstance(norm, LISTS) \
                or any(True for _ in norm.children()) or normforms.weight_of(norm, width) is None \
                or _first_use(name, norm, records) is not None:
            continue
        held.setdefault(above, {})[int(index)] = (name, norm)
    return [heads for heads in held.values()
            if len(heads) > 1 and sorted(heads) == list(range(len(heads))) and len(heads) in counts
            and len({type(m) for _, m in heads.values()}) == 1]


def _texts(r: Record) -> dict[str, str]:
    """The names an op was given, by keyword (`weight`, `bias`, `eps=...` as said) or by place ("0", "1", ...)."""
    out: dict[str, str] = {}
    for i, (kind, value) in enumerate(r.args):
        if kind == "text":
            out[str(i)] = value
        elif kind == "kw" and isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], tuple) \
                and value[1][0] == "text":
            out[value[0]] = value[1][1]
    return out


def _first_use(name: str, norm: nn.Module, records: list[Record]) -> Record | None:
    """The first op that reads one of the norm's parameters (the module's call on one head's slice)."""
    held = {f"{name}.{p}" for p, _ in norm.named_parameters()}
    return next((r for r in records if set(_texts(r).values()) & held), None)


def _bare(module: nn.Module, records: list[Record], width: int,
          held: list[str]) -> list[tuple[str, Any, Record, set[int]]]:
    """The module's own 1-D parameters of `width` that an F.layer_norm or F.rms_norm takes as its weight (and bias),
    outside every norm module `held`: each op as the norm module that computes it (its eps as the op says, else
    the function's default), with the op."""
    params = dict(module.named_parameters())
    out: list[tuple[str, Any, Record, set[int]]] = []
    for r in records:
        kind = r.func.split(".")[-1]
        if kind not in ("layer_norm", "rms_norm"):
            continue
        said = _texts(r)
        weight, bias = params.get(said.get("weight", "")), params.get(said.get("bias", ""))
        if weight is None or weight.dim() != 1 or weight.shape[0] != width \
                or any(said["weight"].startswith(f"{h}.") for h in held):
            continue
        eps = next((float(v.split("=", 1)[1]) for v in said.values() if v.startswith("eps=")), None)
        norm: nn.LayerNorm | nn.RMSNorm = nn.LayerNorm(width, eps=1e-5 if eps is None else eps,
                                                       bias=bias is not None) \
            if kind == "layer_norm" else nn.RMSNorm(width, eps=eps)
        norm = norm.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            if bias is not None and isinstance(norm, nn.LayerNorm):
                norm.bias.copy_(bias)
        out.append((said["weight"], norm, r, {id(weight)} | ({id(bias)} if bias is not None else set())))
    return out


def _sliced(x: Record, records: list[Record], counts: set[int]) -> tuple[int, int, int] | None:
    """(the record split, its head axis, the head) where `x` is one head of an ancestor (its slice at head j on an
    axis of a length in `counts`, kept or dropped), nearest first; None where it is none."""
    seen, frontier = {x.index}, [x.index]
    for _ in range(DEPTH):
        nxt = [p for i in frontier for p in records[i].parents if p not in seen]
        for p in nxt:
            seen.add(p)
            whole = records[p].tensor
            if not isinstance(whole, torch.Tensor) or whole.shape[-1] != x.tensor.shape[-1]:
                continue
            for axis in range(whole.dim() - 1):
                if whole.shape[axis] not in counts:
                    continue
                for j in range(whole.shape[axis]):
                    part = whole.select(axis, j)
                    if _same(part, x.tensor) or _same(part.unsqueeze(axis), x.tensor):
                        return p, axis, j
        frontier = nxt
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))


def _above(names: list[str], role_of: Callable[[str], str | None]) -> str:
    """The module above the norms (`q_layernorm` of `q_layernorm.norms.0`, `.1`, ...): their common prefix less the
    container's own name where that names no role (`role_of`: reference.role_of, handed in so that neither
    module imports the other)."""
    parts = names[0].split(".")
    common = [p for i, p in enumerate(parts) if all(len(n.split(".")) > i and n.split(".")[i] == p for n in names)
              and all(n.split(".")[:i] == parts[:i] for n in names)]
    while len(common) > 1 and role_of(".".join(common).replace("norm", "")) is None:
        common.pop()
    return ".".join(common) or names[0]
