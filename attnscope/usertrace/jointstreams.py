"""Joint attention's streams seen before the join: each stream's own q, k and v (the parts `torch.cat` joins, joint.py)
against what the reference's stream computes from that stream's projections, so that a mistake in one stream's own
steps, which the joined tensors the reference starts from already hold, is named.

Read from the data flow and the values alone, for each part the code joins (stream i's q, k or v):
- the projection that makes it (flow.projection_above) and the role that projection holds: the name it is called by
  (`add_k_proj`, `txt_wk`: reference.role_of), or, for one projection making several parts (Flux's fused `qkv` per
  stream), their order among its output's columns (q, k, v; k, v), counted only where another stream's fused
  projection reads its parts in that order (a stream that reads them otherwise than the others is the one wrong);
- its heads as that projection made them: the last tensor above the part made from the projection's output by
  reshapes, transposes, casts and indexing alone;
- whether a norm made the part from those heads: a tensor between them and the part that RMSNorm or LayerNorm over
  each head (or over the whole projection) gives back, its gain and bias solved per head and coordinate
  (fusedsplit.refit_parts); anything else (RoPE on one stream, HunyuanDiT's, a scale) is the code's own, never read.

The reference's stream: each role made by the projection of that role, q and k normalized in every stream where the
code normalizes the q or k of any (joint attention's streams are alike: SD3's, Flux's, HunyuanDiT's norm both sides of
both), v never. A stream that differs is named by experiment, the reference's stream run again with the mistake:
K and V swapped (the projections' roles, or the values normalized and the keys not), a side left unnormalized, the
values normalized by the keys' (or queries') norm; each must give the code's parts back to tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.align import REARRANGING
from attnscope.usertrace.fusedsplit import merged, normed, refit_over_projection, refit_parts

if TYPE_CHECKING:
    from attnscope.usertrace.joint import Joined
    from attnscope.usertrace.record import Record

# ops that hand their input's values on, laid out anew, cast or indexed: the projection's heads as they are
PLAIN = REARRANGING + ("__getitem__", "select", "unbind", "chunk", "split", "narrow", "tensor_split", "view_as",
                       "reshape_as", "t", "T", "mT", "detach")
ROLES = ("q", "k", "v")
WORDS = {"q": "queries", "k": "keys", "v": "values"}


@dataclass(frozen=True)
class Norm:
    """A norm read from the values: the unit norm over the last axis, its gain and bias `[1, heads, 1, d]`, over each
    head ("head") or over the whole projection ("proj", every head's coordinates at once)."""

    record: Record  # the code's tensor it made
    over: str
    unit: Any
    gain: torch.Tensor
    bias: torch.Tensor

    def fits(self, heads: torch.Tensor) -> bool:
        """Whether it can normalize `heads` (as many heads and coordinates as those it was read on)."""
        return tuple(self.gain.shape[1::2]) == tuple(heads.shape[1::2])

    def __call__(self, heads: torch.Tensor) -> torch.Tensor:
        """heads `[n_batch, n_head, n, d_head]` normalized, float64 (fusedsplit.normed)."""
        return normed(self.unit, self.gain, self.bias, heads, self.over)


@dataclass
class Part:
    """One stream's q, k or v as the code joins it."""

    stream: int  # its place in the join
    role: str  # what the join uses it as: "q", "k", "v"
    record: Record  # the code's tensor joined
    cat: Record  # the join
    projection: Record  # the projection that makes it
    joined: torch.Tensor  # the part as heads `[n_batch, n_head, n, d_head]`, float64
    heads: torch.Tensor  # the projection's heads as they are, `[n_batch, n_head, n, d_head]`, float64
    plain: bool  # the part is those heads, laid out anew
    norm: Norm | None  # the norm that made the part from them, where one did
    made_as: str | None = None  # the role its projection holds (its name, or its place in a fused projection)
    read_by: str = ""  # how that role was read: "names", "columns"


@dataclass(frozen=True)
class StreamFault:
    """A stream whose own q, k or v is not what the reference's stream computes, named by experiment."""

    role: str  # "Q", "K" or "V": the reference's step it shows at (`{role}_split`)
    record: Record  # the code's part
    experiment: str
    diagnosis: str
    evidence: str
    max_abs_diff: float | None

    @property
    def split(self) -> Record:
        return self.record

    def words(self) -> tuple[str, str]:
        return self.diagnosis, self.evidence


def fault(records: list[Record], joined: Joined, n_head: int) -> StreamFault | None:
    """The first stream (in the join's order) whose own q, k or v differs from the reference's stream, by experiment;
    None where every stream's parts are what the reference's computes, or where they are not read."""
    streams = read(records, joined, n_head)
    if streams is None:
        return None
    normed = [p for s in streams for p in s.values() if p.role in "qk" and p.norm is not None]
    for s in streams:
        found = _swapped(s, streams, normed) or _missing(s, streams, normed) or _values_normed(s, streams)
        if found is not None:
            return found
    return None


def said(records: list[Record], joined: Joined, n_head: int) -> str:
    """How each stream's own q, k and v are compared before the join, for joint.Joined.note; "" where not read."""
    streams = read(records, joined, n_head)
    if streams is None:
        return ""
    normed = any(p.norm is not None for s in streams for p in s.values() if p.role in "qk")
    how = (", its q and k normalized as your code normalizes them, alike in every stream, its v as projected"
           if normed else "")
    return f"each stream's q, k and v before the join with the heads its own projections make{how}"


def read(records: list[Record], joined: Joined, n_head: int) -> list[dict[str, Part]] | None:
    """Each stream's q, k and v parts, by role as joined, their projections' roles read (`made_as`); None where a
    part's projection or heads are not read."""
    streams = _streams(records, joined, n_head)
    if streams is not None:
        _roles(streams)
    return streams


def _streams(records: list[Record], joined: Joined, n_head: int) -> list[dict[str, Part]] | None:
    """Each stream's q, k and v parts, by role as joined; None where a part's projection or heads are not read."""
    cats = dict(zip(ROLES, (joined.q, joined.k, joined.v), strict=True))
    given = {role: [records[i] for kind, value in cat.args if kind == "list" for k, i in value if k == "rec"]
             for role, cat in cats.items()}
    if any(len(g) != len(joined.parts) for g in given.values()):
        return None
    width = {role: cat.tensor.numel() // joined.n for role, cat in cats.items()}  # each token's features
    if any(n_head * w % width["q"] for w in width.values()):
        return None
    heads = {role: n_head * w // width["q"] for role, w in width.items()}  # fewer for grouped keys and values
    streams: list[dict[str, Part]] = []
    for i, n in enumerate(joined.parts):
        stream = {}
        for role in ROLES:
            part = _part(records, given[role][i], cats[role], i, role, heads[role], n)
            if part is None:
                return None
            stream[role] = part
        streams.append(stream)
    return streams


def _part(records: list[Record], record: Record, cat: Record, stream: int, role: str, n_head: int,
          n: int) -> Part | None:
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import projection_above

    projection = projection_above(records, record.index)
    joined = _heads(record.tensor, n_head, n)
    if projection is None or joined is None:
        return None
    plain = _plain_from(records, projection)
    above = ancestors(record, records) | {record.index}
    held = [i for i in sorted(above) if i in plain and records[i].tensor.numel() == record.tensor.numel()]
    if not held:
        return None
    heads = _heads(records[held[-1]].tensor, n_head, n)
    if heads is None:
        return None
    if record.index in plain:
        return Part(stream, role, record, cat, projection, joined, heads, True, None)
    made = {held[-1]}  # what the code makes from those heads, up to the part
    for r in records[held[-1] + 1:record.index + 1]:
        if any(p in made for p in r.parents):
            made.add(r.index)
    norm = None
    for i in sorted(above & made - plain):  # the last a norm gives back: its gain applied, before RoPE or a scale
        r = records[i]
        if r.tensor.numel() == record.tensor.numel() and r.tensor.is_floating_point():
            norm = _norm_of(heads, r, n_head, n) or norm
    return Part(stream, role, record, cat, projection, joined, heads, False, norm)


def _plain_from(records: list[Record], projection: Record) -> set[int]:
    """The records made from the projection's output by PLAIN ops alone, it included."""
    plain = {projection.index}
    for r in records[projection.index + 1:]:
        first = next((value for kind, value in r.args if kind == "rec"), None)
        if r.func in PLAIN and first in plain:
            plain.add(r.index)
    return plain


def _heads(t: torch.Tensor, n_head: int, n: int) -> torch.Tensor | None:
    """A stream's q, k or v as `[n_batch, n_head, n, d_head]` (float64) from that layout, `[n_batch, n, n_head,
    d_head]` or `[n_batch, n, n_head·d_head]`; None for any other."""
    if t.dim() == 4 and t.shape[1] == n_head and t.shape[2] == n:
        return t.detach().double()
    if t.dim() == 4 and t.shape[1] == n and t.shape[2] == n_head:
        return t.detach().double().transpose(1, 2)
    if t.dim() == 3 and t.shape[1] == n and t.shape[2] % n_head == 0:
        return t.detach().double().unflatten(-1, (n_head, -1)).transpose(1, 2)  # -> [n_batch, n_head, n, d_head]
    return None


def _norm_of(heads: torch.Tensor, record: Record, n_head: int, n: int) -> Norm | None:
    """The norm over each head, or over the whole projection, that gives `record` back from `heads`; None if none."""
    after = _heads(record.tensor, n_head, n)
    if after is None or after.shape != heads.shape:
        return None
    found = refit_parts(heads, after)
    if found is not None:
        return Norm(record, "head", *found)
    found = refit_over_projection(merged(heads), merged(after), *heads.shape[1::2])
    return Norm(record, "proj", *found) if found is not None else None


def _roles(streams: list[dict[str, Part]]) -> None:
    """Each part's `made_as`: the role its projection's name says, where the stream's three say q, k and v; else, for
    parts one projection makes, their order among its columns, where another stream's fused projection reads them in
    that order (q, k, v) and this one does not."""
    from attnscope.usertrace.reference import role_of

    ranked: list[dict[str, str] | None] = []
    for s in streams:
        named = {role: _named_role(p.projection, role_of) for role, p in s.items()}
        distinct = len({p.projection.index for p in s.values()}) == len(s)
        if distinct and sorted(r or "" for r in named.values()) == sorted(ROLES):
            for role, p in s.items():
                p.made_as, p.read_by = named[role], "names"
            ranked.append(None)
            continue
        ranked.append(_ranks(s))
    standard = [r for r in ranked if r is not None and all(k == v for k, v in r.items())]
    if not standard:
        return
    for s, r in zip(streams, ranked, strict=True):
        if r is not None and any(k != v for k, v in r.items()):
            for role, made in r.items():
                s[role].made_as, s[role].read_by = made, "columns"


def _named_role(projection: Record, role_of: Any) -> str | None:
    if not projection.args or projection.args[0][0] != "text":
        return None
    role = role_of(str(projection.args[0][1]))
    return role if role in ROLES else None


def _ranks(stream: dict[str, Part]) -> dict[str, str] | None:
    """The roles the parts one fused projection makes hold by their order among its columns (`{joined role: made
    role}`), the reference's order (q, k, v; k, v where the queries have a projection of their own); None where no
    projection makes two or more parts, or a part's first column is not found in its output."""
    by: dict[int, list[str]] = {}
    for role, p in stream.items():
        by.setdefault(p.projection.index, []).append(role)
    fused = next((roles for roles in by.values() if len(roles) >= 2), None)
    if fused is None:
        return None
    columns = {}
    for role in fused:
        p = stream[role]
        out = p.projection.tensor.detach().double()
        first = p.heads[:, 0, :, 0].reshape(-1)  # head 0, coordinate 0 of every token
        if out.numel() % first.numel():
            return None
        flat = out.reshape(first.numel(), -1)  # [n_batch·n, width]
        hits = (flat == first[:, None]).all(0).nonzero()
        if hits.numel() == 0:
            return None
        columns[role] = int(hits[0])
    order = sorted(fused, key=lambda role: columns[role])
    made = [r for r in ROLES if r in fused] if len(fused) == 3 else ["k", "v"] if set(fused) == {"k", "v"} else None
    if made is None:
        return None
    return dict(zip(order, made, strict=True))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()) + 1e-12))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _at(p: Part) -> str:
    return f"your {p.record.label} (line {p.record.line})"


def _stream_words(s: dict[str, Part], streams: list[dict[str, Part]]) -> str:
    p = s["q"]
    return f"stream {p.stream + 1} of {len(streams)} ({int(p.joined.shape[2])} tokens)"


def _key_norm(s: dict[str, Part], streams: list[dict[str, Part]], heads: torch.Tensor) -> Norm | None:
    """The norm the reference's stream gives its keys, one that fits `heads`: the one the code applies to its key
    projection's heads (in whichever part), else another stream's keys'."""
    own = [p.norm for p in s.values() if "k" in (p.made_as, p.role)]
    others = [p.norm for t in streams if t is not s for p in t.values() if p.role == "k"]
    return next((n for n in own + others if n is not None and n.fits(heads)), None)


def _swapped(s: dict[str, Part], streams: list[dict[str, Part]], normed: list[Part]) -> StreamFault | None:
    """kv.swapped: the part joined as keys made by the value projection and the one joined as values by the key
    projection (their roles read), or, roles unread, the values normalized and the keys not where the code normalizes
    the queries or keys of a stream. The reference's stream: K the key projection's heads (normalized where it
    normalizes keys), V the value projection's; the code's parts are those the other way round, swapped after the
    keys' norm or before it."""
    k, v = s["k"], s["v"]
    by_roles = k.made_as == "v" and v.made_as == "k"
    by_norms = k.made_as in (None, "k") and v.made_as in (None, "v") and k.plain and v.norm is not None and any(
        p.stream != k.stream or p.role == "q" for p in normed)
    if not by_roles and not by_norms:
        return None
    keys, values = v.heads, k.heads  # the key projection's heads and the value projection's
    norm = v.norm or k.norm or (_key_norm(s, streams, keys) if normed else None)
    K = norm(keys) if norm is not None else keys
    when = ""
    if not (_close(k.joined, values) and _close(v.joined, K)):
        if norm is None or not (_close(k.joined, norm(values)) and _close(v.joined, keys)):
            return None
        when = ", before the keys' norm"
    if _close(k.joined, K) and _close(v.joined, values):
        return None  # the swap changes nothing here
    how = ("read from the names of their projections" if by_roles and k.read_by == "names" else
           "read from the order of your fused projection's columns, which your other streams read as q, k, v"
           if by_roles else f"your values normalized and your keys not, where your code normalizes {_who(normed)}")
    diagnosis = (f"keys and values swapped in one stream: in {_stream_words(s, streams)}, {_at(k)}, joined as the "
                 f"keys (line {_cat_line(k)}), is made by your {_name(k)} and {_at(v)}, joined as the values, by "
                 f"your {_name(v)}{when} ({how}); join each stream's keys with the keys and its values with the "
                 "values")
    evidence = (f"by experiment: the reference's {_stream_words(s, streams)} run again with K and V swapped{when} "
                f"gives back {_at(k)} and {_at(v)} to tolerance, where as the reference's they differ by "
                f"{_diff(k.joined, K):.1e}")
    return StreamFault("K", k.record, "kv.swapped", diagnosis, evidence, _diff(k.joined, K))


def _missing(s: dict[str, Part], streams: list[dict[str, Part]], normed: list[Part]) -> StreamFault | None:
    """qknorm.missing: this stream's queries or keys joined as their projection made them, where the code normalizes
    the queries or keys of a stream (this one's other side, or another stream's same side)."""
    if not normed:
        return None
    for role in ("q", "k"):
        p = s[role]
        if not p.plain:
            continue
        fit = [o for o in normed if o.norm is not None and o.norm.fits(p.heads)]
        same = [o for o in fit if o.role == role and o.stream != p.stream]
        shown = same or [o for o in fit if o.stream == p.stream] or fit
        norm = shown[0].norm if shown else None
        if norm is None:
            continue
        want = norm(p.heads)
        if _close(p.joined, want):
            continue
        side = WORDS[role]
        diagnosis = (f"the {side} of one stream never normalized: in {_stream_words(s, streams)}, {_at(p)}, joined as "
                     f"the {side} (line {_cat_line(p)}), is your {_name(p)}'s heads as they are, where your code "
                     f"normalizes {_who(shown)} (qk-norm: every stream's queries and keys alike)")
        evidence = (f"by experiment: the reference's {_stream_words(s, streams)} run again with its {side}' norm left "
                    f"out gives back {_at(p)} exactly, where normalized as your {_who(shown[:1])} are it differs by "
                    f"{_diff(p.joined, want):.1e}")
        return StreamFault(role.upper(), p.record, "qknorm.missing", diagnosis, evidence, _diff(p.joined, want))
    return None


def _values_normed(s: dict[str, Part], streams: list[dict[str, Part]]) -> StreamFault | None:
    """qknorm.on_values: this stream's values normalized by its keys' (or queries') norm."""
    v = s["v"]
    if v.norm is None:
        return None
    tried = [("keys", _key_norm(s, streams, v.heads)), ("queries", s["q"].norm)]
    for side, norm in tried:
        if norm is None or not norm.fits(v.heads) or not _close(v.joined, norm(v.heads)):
            continue
        diagnosis = (f"the values normalized in one stream: in {_stream_words(s, streams)}, {_at(v)}, joined as the "
                     f"values (line {_cat_line(v)}), is your {_name(v)}'s heads normalized by the {side}' norm; "
                     "qk-norm normalizes q and k alone, the values stay as projected")
        evidence = (f"by experiment: the reference's {_stream_words(s, streams)} run again with its values normalized "
                    f"by the {side}' norm gives back {_at(v)} to tolerance, where as projected they differ by "
                    f"{_diff(v.joined, v.heads):.1e}")
        return StreamFault("V", v.record, "qknorm.on_values", diagnosis, evidence, _diff(v.joined, v.heads))
    return None


def _who(parts: list[Part]) -> str:
    """Which stream's sides the code normalizes, in words: "stream 1's keys (line 22)"."""
    said = [f"stream {p.stream + 1}'s {WORDS[p.role]} (line {p.norm.record.line if p.norm else p.record.line})"
            for p in parts[:2]]
    return " and ".join(said)


def _name(p: Part) -> str:
    first = p.projection.args[0] if p.projection.args else None
    return str(first[1]) if first is not None and first[0] == "text" else p.projection.label


def _cat_line(p: Part) -> int:
    return p.cat.line
