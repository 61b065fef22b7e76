"""A decode step's cache the module holds itself: tensors it writes the new keys and values into at their positions
and reads back joined (Meta's llama: `self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk` then
`self.cache_k[:bsz, : start_pos + seqlen]`; gpt-fast's and torchtune's `KVCache` submodule, buffers `k_cache`,
`v_cache` [n_batch, n_kv_head, max_len, d_head] written at `input_pos` by slice assignment or `index_copy_`).

Read from what the code writes, not from names: the module's tensors that are not parameters (buffers, or plain
attributes as Meta's) are kept, the forward is run once as a decode step after n_cache positions (its start position,
`start_pos`, or `input_pos` as arange(n_cache, n_cache + n)), and the tensors it changed are its cache. A module
that counts its positions itself (torchtune's `cache_pos` buffer, moved by `add_(seq_len)`; an older KVCache's
`size`) writes from its count on: an integer each call moved n further is that count, set n_cache further before
each call. The region it
wrote says the layout: the axis written from n_cache on, n long, holds the positions, and the region's extents on the
others match one of the layouts code keeps (cachelayouts.BASES). The keys are the one whose name says keys (`k`,
`key`), else the first held. Every run then hands them trace's `(K_cache, V_cache)`: each tensor made anew,
[n_batch, .., n_cache + n, ..] in its layout, the cached positions filled and the new ones zero, so that code that
attends to its whole cache (gpt-fast's mask over max_len) attends to those positions alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Place = tuple[Any, str, str]  # the module holding it, its attribute, its full name (`kv_cache.k_cache`)


@dataclass
class Held:
    keys: Place
    values: Place
    layout: str  # cachelayouts.BASES's
    # the module's own count of the positions it holds (torchtune's cache_pos, an older `size`), as before a run:
    # a hook before each call of the module sets it n_cache further (runs/trace.py)
    counters: list[tuple[Any, str, Any]] = field(default_factory=list)

    def names(self) -> str:
        return f"{self.keys[2]}, {self.values[2]}"


def places(module: Any, tensors: bool = False) -> list[Any]:
    """The module's tensors that are not parameters, of 3 dims or more (buffers, plain attributes), each once
    (`tensors`: each with the tensor, (module, attribute, name, tensor))."""
    import torch

    found: dict[int, Any] = {}
    for path, sub in module.named_modules():
        own = [(n, t) for n, t in sub._buffers.items() if t is not None]
        own += [(n, t) for n, t in vars(sub).items() if isinstance(t, torch.Tensor)
                and not isinstance(t, torch.nn.Parameter)]
        for name, tensor in own:
            if tensor.dim() >= 3 and tensor.is_floating_point() and id(tensor) not in found:
                found[id(tensor)] = (sub, name, f"{path}.{name}" if path else name) + ((tensor,) if tensors else ())
    return list(found.values())


def counts(module: Any) -> list[tuple[Any, str, Any]]:
    """The module's integers that may count positions: integer buffers and tensor attributes, and int attributes
    of its submodules (torchtune's `cache_pos`, an older KVCache's `size`), each with a copy of its value."""
    import torch

    found: list[tuple[Any, str, Any]] = []
    for _, sub in module.named_modules():
        for name, value in [*sub._buffers.items(), *vars(sub).items()]:
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
                    and value.dtype != torch.bool:
                found.append((sub, name, value.clone()))
            elif isinstance(value, int) and not isinstance(value, bool) and not name.startswith("_"):
                found.append((sub, name, value))
    return found


def moved(before: list[tuple[Any, str, Any]], n_new: int) -> list[tuple[Any, str, Any]]:
    """Of `before`'s integers, those a run moved n_new further for each call (every element of a tensor alike): a
    count of positions."""
    import torch

    out = []
    for owner, name, old in before:
        now = getattr(owner, name, None)
        if isinstance(old, torch.Tensor):
            step = now - old if isinstance(now, torch.Tensor) and now.shape == old.shape and old.numel() else None
            if step is not None and bool((step == step.flatten()[0]).all()) and _runs(int(step.flatten()[0]), n_new):
                out.append((owner, name, old))
        elif isinstance(now, int) and not isinstance(now, bool) and _runs(now - old, n_new):
            out.append((owner, name, old))
    return out


def _runs(step: int, n_new: int) -> bool:
    """Whether a count moved by `step` over one or more runs of n_new tokens each (a run may call the code twice)."""
    return n_new > 0 and step > 0 and step % n_new == 0


def counted(found: list[tuple[Any, str, Any]], by: int) -> None:
    """Each count set `by` further than it was before the runs (0: back as it was)."""
    for owner, name, old in found:
        setattr(owner, name, old + by)  # a new tensor (or int) each time: the kept one stays as it was


def restored(before: list[tuple[Place, torch.Tensor]], counts_before: list[tuple[Any, str, Any]]) -> None:
    """The module's tensors and counts set back as `kept` and `counts` found them (copies: a run writes into them).
    A tensor still of its kept shape is set back in place, so it stays the object the run's labels name (a fixed
    table's buffer, Nezha's relative encodings, read by its name); one the code replaced by another shape, anew."""
    for (owner, name, _), old in before:
        now = getattr(owner, name, None)
        if now is not None and now.shape == old.shape and now.dtype == old.dtype and now.device == old.device \
                and not now.is_inference():
            now.copy_(old)
        else:
            setattr(owner, name, old.clone())
    counted(counts_before, 0)


def before_call(found: list[tuple[Any, str, Any]], by: int, *_: Any) -> None:
    """A forward pre-hook: the counts set `by` further than before the runs, for this call."""
    counted(found, by)


def kept(module: Any) -> list[tuple[Place, torch.Tensor]]:
    """Each place with a copy of what it holds, before a run."""
    return [(place, getattr(place[0], place[1]).clone()) for place in places(module)]


def read(before: list[tuple[Place, torch.Tensor]], cache: tuple[torch.Tensor, torch.Tensor], n_new: int) -> Held | None:
    """The cache the run wrote into, from the places as they were `before` it: two tensors written from position
    n_cache on, n_new long, in a layout whose other extents are the cache's; None where the run wrote no such pair."""
    import torch

    from attnscope.usertrace.cacheforms import role
    from attnscope.usertrace.cachelayouts import BASES, DIMS, held

    n_cache = int(cache[0].shape[2])
    written: list[tuple[Place, str, set[int]]] = []  # the place, its layout, which of the keys (0), values (1) fit
    for place, old in before:
        now = getattr(place[0], place[1])
        if not isinstance(now, torch.Tensor) or now.shape != old.shape:
            continue
        changed = (now != old)
        if not bool(changed.any()):
            continue
        starts, extents = [], []
        for axis in range(changed.dim()):
            where = changed.movedim(axis, 0).flatten(1).any(1).nonzero().flatten()
            starts.append(int(where.min()))
            extents.append(int(where.max()) - int(where.min()) + 1)
        for layout in BASES:
            axis = DIMS[layout].index("n_cache")
            fit = {i for i, part in enumerate(cache) if _fits(held(part, layout).shape, axis, n_new, layout, starts,
                                                                extents, n_cache)}
            if fit:
                written.append((place, layout, fit))
                break
    if len(written) != 2 or written[0][1] != written[1][1]:
        return None
    said = [role(place[2].rsplit(".", 1)[-1]) for place, _, _ in written]
    # the keys: the one only the keys' shape fits (latent attention's d_K ≠ d_V), else the one named for keys
    swap = written[0][2] == {1} or written[1][2] == {0} or (written[0][2] == written[1][2] and said == [1, 0])
    first, second = written[::-1] if swap else written
    return Held(first[0], second[0], first[1])


def _fits(shape: Any, axis: int, n_new: int, layout: str, starts: list[int], extents: list[int],
          n_cache: int) -> bool:
    """Whether a region written from `starts`, `extents` long, is n_new positions from n_cache on of a part of
    `shape` laid out as `layout` (a batch written whole where one sequence broadcast over the room held for more)."""
    from attnscope.usertrace.cachelayouts import DIMS

    want = list(shape)
    want[axis] = n_new
    fits = len(want) == len(extents) and all(e == w or (DIMS[layout][i] == "n_batch" and e >= w)
                                             for i, (e, w) in enumerate(zip(extents, want, strict=False)))
    return fits and starts[axis] == n_cache and all(s == 0 for i, s in enumerate(starts) if i != axis)


def fill(found: Held, cache: tuple[torch.Tensor, torch.Tensor], n_new: int) -> None:
    """The module's cache made anew for a run of `n_new` tokens: trace's keys and values at positions 0 ..
    n_cache − 1, in its layout, the new positions zero, the batch as trace's."""
    import torch

    from attnscope.usertrace.cachelayouts import DIMS, held

    axis = DIMS[found.layout].index("n_cache")
    for (owner, name, _), part in zip((found.keys, found.values), cache, strict=True):
        laid = held(part, found.layout)
        room = list(laid.shape)
        room[axis] = n_new
        setattr(owner, name, torch.cat([laid, laid.new_zeros(room)], dim=axis))


def note(found: Held) -> str:
    from attnscope.usertrace.cachelayouts import words

    counts = ", ".join(name for _, name, _ in found.counters)
    counting = f" (from its own count of positions, {counts}, set n_cache on before each call)" if counts \
        else ""
    return (f"{found.names()}: your module holds its cache itself, {words(found.layout)}, and writes the new keys "
            f"and values into it at their positions{counting} (read from what a run wrote): it is handed trace's "
            "cached keys and values there, at positions 0 to n_cache − 1, in a cache as long as the cached and the "
            "new positions together. A convention, not a mistake: the reference reads the same keys and values")
