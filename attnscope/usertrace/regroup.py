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

if TYPE_CHECKING:
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lineup import LineUp
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec


@dataclass
class Grouping:
    """The code's groups: `index[g, i]`, the flat position `b · n_tokens + t` of group g's i-th token."""

    index: torch.Tensor  # [n_group, n_in_group]
    n_batch: int
    n_tokens: int
    record: Record  # the regrouped input, as the code made it

    def group(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the input's tokens `[n_batch, n_tokens, ..]` as the code's groups
        `[n_groups, n_in_group, ..]`."""
        flat = tensor.reshape(self.n_batch * self.n_tokens, *tensor.shape[2:])
        return flat[self.index.reshape(-1)].reshape(*self.index.shape, *tensor.shape[2:])

    def pattern(self) -> torch.Tensor:
        """The mask the grouping is, `[n_batch, n_tokens, n_tokens]`: True where two tokens share a group."""
        label = torch.empty(self.n_batch * self.n_tokens, dtype=torch.long)
        label[self.index.reshape(-1)] = torch.arange(self.index.shape[0]).repeat_interleave(self.index.shape[1])
        label = label.reshape(self.n_batch, self.n_tokens)
        return label[:, :, None] == label[:, None, :]

    def words(self) -> str:
        """The grouping in words: how many groups of how many tokens, and which tokens the first one holds."""
        n_group, size = self.index.shape
        first = self.index[0] % self.n_tokens
        step = {int(b) - int(a) for a, b in zip(first[:-1], first[1:], strict=True)}
        held = (f"tokens {int(first[0])}, {int(first[1])}, … {int(first[-1])} ({step.pop()} apart)"
                if len(step) == 1 and size > 2 and next(iter(step)) > 1 else
                f"tokens {int(first[0])} to {int(first[-1])}" if step == {1} else
                f"tokens {', '.join(str(int(t)) for t in first[:6])}{', …' if size > 6 else ''}")
        return (f"groups of {size} tokens ({n_group // self.n_batch} a sequence; the first holds {held}), made at "
                f"line {self.record.line} ({self.record.details.get('op', self.record.call)})")


def find(records: list[Record], x: torch.Tensor) -> Grouping | None:
    """The code's regrouping of its input `x` `[n_batch, n_tokens, d_feat]`: the first tensor of the run that holds
    x's rows (exactly, each once) as more sequences than x has, each sequence's tokens from one of x's; None where
    there is none."""
    if x.dim() != 3 or not x.is_floating_point():
        return None
    n_batch, n_tokens, width = x.shape
    rows = x.reshape(-1, width)
    where = {tuple(row.tolist()): i for i, row in enumerate(rows)}
    if len(where) != len(rows):  # repeated rows: no permutation can be read
        return None
    for record in records:
        t = record.tensor
        if not t.is_floating_point() or t.dim() < 3 or t.shape[-1] != width or t.numel() != x.numel() \
                or t.dtype != x.dtype or t.shape[0] <= n_batch or (n_batch * n_tokens) % t.shape[0]:
            continue
        found = [where.get(tuple(row.tolist())) for row in t.reshape(-1, width)]
        if any(i is None for i in found) or len(set(found)) != len(found):
            continue
        index = torch.tensor(found).reshape(t.shape[0], -1)
        if index.shape[1] < 2:  # one token a group: time-first code's transpose of a batch of one, no attention
            continue
        if bool(((index // n_tokens) != (index[:, :1] // n_tokens)).any()):  # a group across sequences
            continue
        return Grouping(index, n_batch, n_tokens, record)
    return None


def read(module: Any, shapes: Any, inputs: Inputs, records: list[Record], train: bool, spec: Spec,
         lined: LineUp) -> tuple[Inputs, LineUp, str] | None:
    """(the inputs as groups, the line-up on them, a note), where the code attends within groups it makes itself and
    the line-up on the groups fits better than `lined`; None otherwise (one self-attention input of batch-first
    rows, no causal or window rule, a boolean --mask file or none)."""
    from attnscope.errors import AttnscopeError
    from attnscope.usertrace.lineup import _better, line_up

    if lined.divergence is None or len(inputs.tensors) != 1 or inputs.layout != "row" or inputs.cache is not None \
            or inputs.allowed is not None or spec.window:
        return None
    name, x = next(iter(inputs.tensors.items()))
    grouping = find(records, x)
    if grouping is None:
        return None
    # the causal rule within each group is the global one there only where each group keeps its tokens in order
    # (chunked causal attention)
    if spec.causal and not bool((grouping.index[:, 1:] > grouping.index[:, :-1]).all()):
        return None
    fits, mask = _grouped_mask(grouping, inputs.mask)
    if not fits:
        return None
    n_group, size = grouping.index.shape
    grouped = dataclasses.replace(inputs, tensors={name: grouping.group(x)}, mask=mask, notes=[],
                                  sizes={**inputs.sizes, "n_batch": n_group, "n_Q": size, "n_K": size})
    try:
        again = line_up(module, shapes, grouped, _returned_grouped(records, grouping), train, spec)
    except (AttnscopeError, RuntimeError, ValueError):
        return None
    if again.no_reference is not None or not _better(again, lined):
        return None
    d = again.divergence
    if d is not None and d.experiment is None and d.record is not None and "returned" in d.record.details \
            and tuple(d.record.tensor.shape[:2]) == tuple(grouping.index.shape):  # the return, regrouped: its fold
        d.diagnosis = (f"every group is the reference's, but what your code returns (line {d.record.line}) does not "
                       f"put the tokens back where line {grouping.record.line} took them from: regrouped as that "
                       f"line lays them, it differs from the reference's {d.reference}; fold the groups back with "
                       "the inverse of the unfolding (the same views, the permute undone)")
    said = (f"your code attends within {grouping.words()}: it moves them into the batch axis, each group a sequence "
            f"of its own, and folds the output back; the reference is run on the same groups "
            + ("(the --mask file allows no pair across them, and is read within each)" if inputs.mask is not None
               else "(a --mask [n_batch, n_Q, n_K] True where two tokens share a group says the same)")
            + (", the causal rule within each group, its tokens in order" if spec.causal else ""))
    return grouped, again, said


def _grouped_mask(grouping: Grouping, mask: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    """(whether the reference's mask fits the groups, that mask within each group `[n_groups, 1, n_in_group,
    n_in_group]`, None where it allows every pair of a group); it does not fit where it allows a pair across groups
    (no grouping), or is no boolean of one mask for all heads."""
    if mask is None:
        return True, None
    if mask.dtype != torch.bool:
        return False, None
    L = grouping.n_tokens
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


def _returned_grouped(records: list[Record], grouping: Grouping) -> list[Record]:
    """The run's records, what the code returned in the input's layout `[n_batch, n_tokens, ..]` regrouped as the
    code's unfolding laid its input (its fold undone), so that it is compared with the reference's output on the
    groups."""
    shape = (grouping.n_batch, grouping.n_tokens)
    out = []
    for record in records:
        if "returned" in record.details and tuple(record.tensor.shape[:2]) == shape and record.tensor.dim() >= 3:
            record = dataclasses.replace(record, tensor=grouping.group(record.tensor))
        out.append(record)
    return out
