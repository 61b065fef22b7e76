"""Attention over groups of tokens the module makes itself, read from the run (runs/trace_readings.py asks, where the
first line-up diverges).

MobileViT's unfolding (the feature map cut into patches, `[B, C, H, W] -> [B·P, N, C]`: the N tokens at one pixel
position of the patches attend to each other), a window partition inside the module (Swin's
`x.view(B, H/w, w, W/w, w, C).permute(...).reshape(-1, w·w, C)`) and chunked local attention
(`x.view(B·n_chunks, chunk, C)`) move the tokens of one sequence into the batch axis as groups, attend within each
group, and fold back. Such a regrouping is a permutation of the input's rows: a tensor of the run whose rows (its last
axis d_feat) are the input's own rows, each once, with more sequences than the input (`find`). The reference is then
run on those groups (each group a sequence of its own: the same weights, the same steps, `group` of each input), so
that the code's per-group tensors line up with it, and what the code returns is compared folded back into groups as
its own unfolding laid them. The grouping is the code's convention: a note says it, and the mask that describes it
(a token sees the tokens of its group alone). A --mask file (for a forward that takes none, it describes the
reference) that allows no pair across groups is read within each group; one that does is no such grouping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnscope.words import run_of

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lined import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


@dataclass
class Grouping:
    """The code's groups: `index[g, i]`, the flat position `b · n_tokens + t` of group g's i-th token."""

    index: torch.Tensor  # [n_group, n_in_group]; -1: a token of zeros the code pads a group with
    n_batch: int
    n_tokens: int
    record: Record  # the regrouped input, as the code made it
    source: Record | None = None  # the tensor whose rows the code regroups, where it is not the input (a norm of it)
    left: tuple[int, ...] = ()  # the tokens each sequence keeps out of every group (TimeSformer's cls token)

    @property
    def pads(self) -> int:
        """How many tokens of zeros the code pads its groups with (SAM's window partition of a grid that no window
        size divides)."""
        return int((self.index < 0).sum())

    def group(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the input's tokens `[n_batch, n_tokens, ..]` as the code's groups
        `[n_groups, n_in_group, ..]`, a padded token zeros."""
        flat = tensor.reshape(self.n_batch * self.n_tokens, *tensor.shape[2:])
        flat = torch.cat([flat, torch.zeros_like(flat[:1])])  # the last row: a padded token's
        index = torch.where(self.index < 0, flat.shape[0] - 1, self.index)
        return flat[index.reshape(-1)].reshape(*self.index.shape, *tensor.shape[2:])

    def group_kept(self, tensor: torch.Tensor) -> torch.Tensor:
        """`group`, of a tensor that holds each sequence's tokens but those left out of every group
        (`[n_batch, n_tokens - len(left), ..]`, as TimeSformer returns its patches without its cls token)."""
        rank = torch.full((self.n_tokens,), -1, dtype=torch.long)
        kept = [t for t in range(self.n_tokens) if t not in self.left]
        rank[kept] = torch.arange(len(kept))
        at = self.index.clamp(min=0)
        index = torch.where(self.index < 0, -1, at // self.n_tokens * len(kept) + rank[at % self.n_tokens])
        return dataclasses.replace(self, index=index, n_tokens=len(kept), left=()).group(tensor)

    def pattern(self) -> torch.Tensor:
        """The mask the grouping is, `[n_batch, n_tokens, n_tokens]`: True where two tokens share a group (a token
        left out of every group: with itself alone)."""
        label = torch.arange(self.n_batch * self.n_tokens) + self.index.shape[0]  # each its own, but grouped ones
        groups = torch.arange(self.index.shape[0]).repeat_interleave(self.index.shape[1])
        kept = self.index.reshape(-1) >= 0
        label[self.index.reshape(-1)[kept]] = groups[kept]
        label = label.reshape(self.n_batch, self.n_tokens)
        return label[:, :, None] == label[:, None, :]

    def words(self) -> str:
        """The grouping in words: how many groups of how many tokens, and which tokens the first one holds."""
        n_group, size = self.index.shape
        first = self.index[0][self.index[0] >= 0] % self.n_tokens
        padded = f"; {self.pads // self.n_batch} tokens of zeros pad each sequence's" if self.pads else ""
        held = run_of("tokens", [int(t) for t in first])
        normed = f" of your {self.source.label} (line {self.source.line})" if self.source is not None else ""
        left = f"; {run_of('tokens', list(self.left))} of each sequence set aside, in no group" \
            if len(self.left) > 1 else f"; token {self.left[0]} of each sequence set aside, in no group" \
            if self.left else ""
        return (f"groups of {size} tokens{normed} ({n_group // self.n_batch} a sequence; the first holds {held}"
                f"{padded}{left}), made at line {self.record.line} ({self.record.details.get('op', self.record.call)})")


def find(records: list[Record], x: torch.Tensor, source: Record | None = None) -> Grouping | None:
    """The code's regrouping of its input `x` `[n_batch, n_tokens, d_feat]` (or of `source`, a norm of it, as x's
    tokens laid out): the first tensor of the run that holds x's rows (exactly, each once, and beside them only rows
    of zeros: a padding) as more sequences than x has, each sequence's tokens from one of x's; None where there is
    none."""
    if x.dim() != 3 or not x.is_floating_point():
        return None
    n_batch, n_tokens, width = x.shape
    rows = (x if source is None else source.tensor).reshape(-1, width)
    where = {tuple(row.tolist()): i for i, row in enumerate(rows)}
    zero = tuple([0.0] * width)
    if len(where) != len(rows) or zero in where:  # repeated rows: no permutation can be read
        return None
    where[zero] = -1  # a padded token
    for record in records:
        t = record.tensor
        if not t.is_floating_point() or t.dim() < 3 or t.shape[-1] != width or 2 * t.numel() <= x.numel() \
                or t.dtype != x.dtype or t.shape[0] <= n_batch or (source is not None and record.index <= source.index):
            continue
        found = [where.get(tuple(row.tolist())) for row in t.reshape(-1, width)]
        kept = [i for i in found if i is not None and i >= 0]
        if any(i is None for i in found) or len(set(kept)) != len(kept):
            continue
        left = _left_out(set(range(len(rows))) - set(kept), n_batch, n_tokens)
        if left is None:
            continue
        index = torch.tensor(found).reshape(t.shape[0], -1)
        if index.shape[1] < 2:  # one token a group: time-first code's transpose of a batch of one, no attention
            continue
        sequence = torch.where(index < 0, -1, index // n_tokens)
        first = sequence.max(dim=1, keepdim=True).values
        if bool(((sequence != first) & (sequence >= 0)).any()) or bool((first < 0).any()):  # a group across
            continue  # sequences, or of padding alone
        return Grouping(index, n_batch, n_tokens, record, source, left)
    return None


def _left_out(missing: set[int], n_batch: int, n_tokens: int) -> tuple[int, ...] | None:
    """The tokens each sequence keeps out of the groups, where the rows no group holds (`missing`, flat positions)
    are the same tokens of every sequence, fewer than half of them (a cls token set aside: `x[:, 1:]` regrouped);
    None where they are not."""
    tokens = sorted({i % n_tokens for i in missing})
    if len(missing) != len(tokens) * n_batch or 2 * len(tokens) >= n_tokens:
        return None
    return tuple(tokens)


def normed_after(records: list[Record], grouping: Grouping, module: Any) -> Record | None:
    """A norm of the groups, made after the code regrouped its input, that a projection reads (TimeSformer's
    `temporal_layernorm(temporal_embedding)` on `[B·H·W, T, C]`): an op of torch's norms on the groups, or what a
    norm submodule of the module's gives back on them; None where the projections read the groups as they are.
    A norm of each token (its features alone) is the same whether before or after the regrouping, so the
    reference's projections read it as their input side, as prenorm.py reads a norm of the input."""
    from attnscope.usertrace.prenorm import NORMS, by_norm_module

    made = grouping.record
    for call in records[made.index + 1:]:
        if call.style != "linear" or len(call.args) < 2 or call.args[1][0] != "rec":
            continue
        read = records[call.args[1][1]]
        if read.index == made.index or read.tensor.shape != made.tensor.shape:
            continue
        if (read.func in NORMS and made.index in read.parents) or by_norm_module(module, made.tensor, read.tensor):
            return read
    return None


def normed_source(records: list[Record], x: torch.Tensor, name: str) -> Record | None:
    """A norm of the input `name` (`x`, `[n_batch, n_tokens, d_feat]`, or laid out as an image) that the code
    regroups rather than x itself (SAM's block: norm1, then its window partition): an op of torch's norms on x alone,
    no projection on the way, as many values as x; None where there is none."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.prenorm import NORMS

    for record in records:
        t = record.tensor
        if record.func not in NORMS or t.numel() != x.numel() or t.shape[-1] != x.shape[-1] \
                or not t.is_floating_point():
            continue
        history = [records[i] for i in ancestors(record, records) | {record.index}]
        texts = {a for r in history for k, a in r.args if k == "text" and isinstance(a, str)}
        if any(r.style == "linear" for r in history) or name not in texts:
            continue
        return record
    return None


def read(module: Any, shapes: Any, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
         lined: LineUp) -> tuple[Inputs, LineUp, str] | None:
    """(the inputs as groups, the line-up on them, a note), where the code attends within groups it makes itself and
    the line-up on the groups fits better than `lined`; None otherwise (one self-attention input of batch-first
    rows, no causal or window rule, a boolean --mask file or none)."""
    from attnscope.usertrace.ranking import better_fit
    from attnscope.usertrace.relined import line_up_again

    # a feature map in the column form (MobileViT's [B, C, H, W], unfolded into [B·P, N, C]): its rows regrouped
    col = inputs.layout == "col" and spec.layout == "col"
    if lined.divergence is None or len(inputs.tensors) != 1 or (inputs.layout != "row" and not col) \
            or inputs.cache is not None or inputs.allowed is not None or spec.window:
        return None
    name, x = next(iter(inputs.tensors.items()))
    if col:  # [n_batch, d_feat, n] -> the rows [n_batch, n, d_feat] the groups are made of, run in the row form
        x, spec = x.transpose(1, 2), dataclasses.replace(spec, layout="row")
        if x.dim() != 3:
            return None
    free = not inputs.own or inputs.own_from == "norm"  # a norm of x the projections read (prenorm.py): regrouped
    grouping = find(records, x) if free else None
    normed = normed_source(records, x, name) if grouping is None and free else None
    if normed is not None:  # SAM's block: its norm1, partitioned into windows (padded), is what it attends over
        grouping = find(records, x, normed)
    after = None
    if grouping is None and not inputs.own and lined.trace is not None:  # Hiera's mask units: q, k, v cut after
        from attnscope.usertrace import headgroups  # the projection into groups with an axis of their own

        after = headgroups.find(records, lined.trace)
        grouping = Grouping(after.index, after.n_batch, after.n_tokens, after.record) if after is not None else None
    merged = None
    if grouping is None and not inputs.own and lined.trace is not None:  # the same groups moved into the batch axis
        from attnscope.usertrace.gathered import grouping as pieces  # ([(b h g), m, d]): read from its scores' pieces

        merged = pieces(lined.trace, records)
        grouping = Grouping(*merged) if merged is not None else None
    if grouping is None or (grouping.pads and (spec.causal or inputs.mask is not None)):
        return None
    # the causal rule within each group is the global one there only where each group keeps its tokens in order
    # (chunked causal attention)
    if spec.causal and not bool((grouping.index[:, 1:] > grouping.index[:, :-1]).all()):
        return None
    fits, mask = _grouped_mask(grouping, inputs.mask)
    if not fits:
        return None
    n_group, size = grouping.index.shape
    side = x if grouping.source is None else grouping.source.tensor.reshape(x.shape)
    normed = normed_after(records, grouping, module) if grouping.source is None else None
    held = grouping.group(side) if normed is None else \
        normed.tensor.reshape(*grouping.index.shape, x.shape[-1])  # the groups normed, as the code's own
    own = {} if inputs.own_from == "norm" else inputs.own  # the norm regrouped is now the input side itself
    grouped = dataclasses.replace(inputs, tensors={name: held}, own=own, mask=mask, notes=[], grid=None,
                                  layout="row", sizes={**inputs.sizes, "n_batch": n_group, "n_Q": size, "n_K": size})
    regrouped = after.regrouped(records) if after is not None else records
    # padded: compared unfolded
    regrouped = regrouped if grouping.pads else _returned_grouped(regrouped, grouping, int(x.shape[-1]) if col else 0,
                                                                  inputs.grid is not None)
    again = line_up_again(module, shapes, grouped, regrouped, train, spec)
    if again is None or not better_fit(again, lined):
        return None
    d = again.divergence
    if d is not None and d.experiment is None and d.record is not None and "returned" in d.record.details \
            and tuple(d.record.tensor.shape[:2]) == tuple(grouping.index.shape):  # the return, regrouped: its fold
        d.diagnosis = (f"every group is the reference's, but what your code returns (line {d.record.line}) does not "
                       f"put the tokens back where line {grouping.record.line} took them from: regrouped as that "
                       f"line lays them, it differs from the reference's {d.reference}; fold the groups back with "
                       "the inverse of the unfolding (the same views, the permute undone)")
    _as_run(again, records)
    moved = ("it cuts its queries, keys and values into them after the projection, an axis of their own beside the "
             "heads, and merges the output back; the reference is run on the same groups, your tensors compared with "
             "the groups moved into the batch axis") if after is not None else \
        ("it cuts its queries, keys and values into them after the projection, moves them into the batch axis and "
         "puts the output back; the reference is run on the same groups, your tensors' rows and cells gathered from "
         "its") if merged is not None else \
        ("it moves them into the batch axis, each group a sequence of its own, and folds the output back; the "
         "reference is run on the same groups")
    said = (f"your code attends within {grouping.words()}: {moved}"
            + (", the norm your code regroups read as their input side" if grouping.source is not None else "")
            + (f", the norm of their tokens your projections read (line {normed.line}) read as their input "
               "side" if normed is not None else "")
            + (", its padded tokens zeros (your code attends to them too), and what your code returns compared in "
               "groups, before the fold" if grouping.pads else
               " (the --mask file allows no pair across them, and is read within each)" if inputs.mask is not None
               else " (the tokens set aside neither attend nor are compared)" if grouping.left
               else " (a --mask [n_batch, n_Q, n_K] True where two tokens share a group says the same)")
            + (", the causal rule within each group, its tokens in order" if spec.causal else ""))
    return grouped, again, said


def _as_run(lined: LineUp, records: list[Record]) -> None:
    """`lined`'s rows and divergence at the run's own records, where the line-up read them regrouped: each such row
    says its layout as the groups moved into the batch axis (its axes then named from the run, not the step)."""
    for row in lined.rows:
        if row.record is not None and row.record.tensor.shape != records[row.record.index].tensor.shape:
            row.record = records[row.record.index]
            row.layout = "regrouped, the groups moved into the batch axis" + (f": {row.layout}" if row.layout else "")
            row.order, row.merged, row.split = None, False, None
    d = lined.divergence
    if d is not None and d.record is not None and d.record.tensor.shape != records[d.record.index].tensor.shape:
        d.record = records[d.record.index]


def _grouped_mask(grouping: Grouping, mask: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    """(whether the reference's mask fits the groups, that mask within each group `[n_groups, 1, n_in_group,
    n_in_group]`, None where it allows every pair of a group); it does not fit where it allows a pair across groups
    (no grouping), or is no boolean of one mask for all heads."""
    if mask is None:
        return True, None
    if mask.dtype != torch.bool:
        return False, None
    L = grouping.n_tokens
    if mask.dim() == 3 and mask.shape[0] > 1 and bool((mask == mask[:1]).all()):
        mask = mask[:1]  # read as a mask a head where n_batch = n_head (inputs._per_sequence), each the same
    try:
        full = torch.broadcast_to(mask, (grouping.n_batch, 1, L, L))[:, 0]  # [n_batch, n_Q, n_K]
    except RuntimeError:
        return False, None
    if bool((full & ~grouping.pattern()).any()):
        return False, None
    index = grouping.index  # [n_groups, size]
    queries = full.reshape(grouping.n_batch * L, L)[index]  # [n_groups, size, n_K]: each group's queries' rows
    inner = queries.gather(2, (index % L)[:, None, :].expand(-1, index.shape[1], -1))  # their group's keys alone
    return True, None if bool(inner.all()) else inner[:, None]


def _returned_grouped(records: list[Record], grouping: Grouping, width: int = 0, image: bool = False) -> list[Record]:
    """The run's records, what the code returned in the input's layout `[n_batch, n_tokens, ..]` regrouped as the
    code's unfolding laid its input (its fold undone), so that it is compared with the reference's output on the
    groups. `width`: the features of a feature map returned as the code takes it, `[n_batch, width, n_h, n_w]` or
    `[n_batch, width, n_tokens]` (the column form), read as its rows first; `image`: the input handed as an image
    `[n_batch, n_h, n_w, d_feat]`, a return laid out so (timm's Swin block, Florence-2's windows) read as its rows
    in raster order first."""
    shape = (grouping.n_batch, grouping.n_tokens)
    out = []
    for record in records:
        t = record.tensor
        if "returned" in record.details and image and t.dim() == 4 and t.shape[0] == shape[0] \
                and t.shape[1] * t.shape[2] == shape[1] and 1 not in tuple(t.shape[1:3]):
            t = t.flatten(1, 2)  # [n_batch, n_h, n_w, d] -> [n_batch, n_tokens, d], raster order
        if "returned" in record.details and width and t.dim() >= 3 and tuple(t.shape[:2]) == (shape[0], width) \
                and t[0, 0].numel() == shape[1]:
            t = t.flatten(2).transpose(1, 2)  # [n_batch, width, ..] -> its rows [n_batch, n_tokens, width]
        if "returned" in record.details and tuple(t.shape[:2]) == shape and t.dim() >= 3:
            record = dataclasses.replace(record, tensor=grouping.group(t))
        elif "returned" in record.details and grouping.left and t.dim() >= 3 \
                and tuple(t.shape[:2]) == (shape[0], shape[1] - len(grouping.left)):  # returned without them
            record = dataclasses.replace(record, tensor=grouping.group_kept(t))
        out.append(record)
    return out
