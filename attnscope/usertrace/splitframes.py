"""heads.split_without_permute in the frames other than the plain one (headtrials.trials_split tries X_feat `[n_batch,
n, d_feat]` viewed straight as `[n_batch, n_head, n, d_head]`): a projection the code holds time-first, `[n, n_batch,
d_feat]` (fairseq's), viewed straight as `[n_batch·n_head, n, d_head]` without its `.transpose(0, 1)`; keys viewed
straight as `[n_batch, n_head, d_head, n]`, ready for `q @ k` without the transpose the permute would have made
(PatchTST's `k_s`); heads in front of the batch, `[n_head·n_batch, n, d_head]`. One of q, k and v, two of them (the
third split right), or all three.

The frames are read from what the code holds, not tried blindly: a source frame is the time-first one only where the
code's inputs or tensors are laid time-first, and a frame of the heads only where the code holds a tensor of its shape
(its leading axes merged or not). Each trial views the reference's projection, laid as the code lays it, straight to
that frame, moves the axes back to the reference's `[n_batch, n_head, n, d_head]`, and runs the rest of the reference
(the qk-norm it applies to each head, its RoPE) on it; rerun.reproduces decides, as for every entry of the catalog.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch

from attnscope.usertrace.rerun import Base, replay

Frame = tuple[str, ...]  # axes by letter: B n_batch, H n_head, n the tokens, d d_head
Made = tuple[Frame, dict[str, torch.Tensor]]  # a frame and the steps a view into it makes
HEADS: Frame = ("B", "H", "n", "d")  # the reference's
# The frames code holds its heads in for the product with the other side (the ones a straight view can land in)
FRAMES: tuple[Frame, ...] = (("B", "H", "n", "d"), ("B", "H", "d", "n"), ("H", "B", "n", "d"), ("B", "n", "H", "d"),
                             ("n", "B", "H", "d"))
# Each source frame of the projection, its width split as [n_head, d_head]: what the right view gives before the permute
SOURCES: dict[str, Frame] = {"batch": ("B", "n", "H", "d"), "time": ("n", "B", "H", "d")}
CHANGES = {"Q": "q", "K": "k_new", "V": "v_new"}

Rotate = Callable[[torch.Tensor, str], torch.Tensor]


def trials(b: Base, rotate: Rotate | None) -> Iterator[tuple[dict[str, torch.Tensor], str]]:
    """The rerun's steps and their words for each frame the code's tensors allow, one role alone, then all three;
    the plain frame (batch-first, viewed as `[n_batch, n_head, n, d_head]`) left to headtrials.trials_split.
    `rotate(x, role)` turns "Q" or "K" as the reference's RoPE does (None: no RoPE)."""
    if b.kind != "module" or b.col:
        return
    shapes = {tuple(r.tensor.shape) for r in b.ctx.records if r.tensor.is_floating_point()}
    for source in ("batch", "time") if _time_first(b) else ("batch",):
        wrong: dict[str, list[Made]] = {}
        for role in CHANGES:
            made = _role(b, role, source, shapes, rotate)
            if made:
                wrong[role] = made
        for role, made in wrong.items():
            for frame, steps in made:
                if source == "batch" and frame == HEADS:  # trials_split's own trial
                    continue
                yield _trial(b, {role: (frame, steps)}, source)
        # each pair, then all three, in one frame, or the keys laid ready for q @ k beside the others
        groups = [roles for size in range(2, len(wrong) + 1) for roles in itertools.combinations(wrong, size)]
        for roles in groups:
            for frame in FRAMES:
                ready = tuple({"n": "d", "d": "n"}.get(a, a) for a in frame)
                for keys in dict.fromkeys((frame, ready)):
                    wanted = {role: keys if role == "K" else frame for role in roles}
                    chosen = {role: m for role, f in wanted.items() for m in wrong[role] if m[0] == f}
                    if len(chosen) < len(wanted) or (source == "batch" and keys == frame == HEADS):
                        continue
                    yield _trial(b, chosen, source)


def _role(b: Base, role: str, source: str, shapes: set[tuple[int, ...]], rotate: Rotate | None
          ) -> list[Made]:
    """Each frame `role`'s projection may be viewed straight into, with the steps that view makes (the split, the
    normed heads, the change the replay takes)."""
    change = CHANGES[role]
    feat, split, rot = f"{role}_feat", f"{role}_split", f"{role}_rot"
    feat = f"{role}_pooled" if f"{role}_pooled" in b.ref else feat
    normed = f"{role}_normed" if f"{role}_normed" in b.ref else None
    if feat not in b.ref or split not in b.ref or b.ref[split].dim() != 4 or b.ref[feat].dim() != 3:
        return []
    if b.names[change[0]] not in (split, rot if role != "V" else "", normed):  # another step between them
        return []
    n_batch, n_head, n, d = (int(s) for s in b.ref[split].shape)
    if source == "time" and n_batch == n:
        return []  # time-first and batch-first read the same sizes: a frame the data cannot tell apart
    sizes = {"B": n_batch, "H": n_head, "n": n, "d": d}
    head_norm = normed is not None and b.ref[normed].shape == b.ref[split].shape
    if normed is not None and not head_norm:
        projection = b.ref[normed]  # a norm over the whole projection (OLMo 2's), before the view
    else:
        projection = b.ref[feat]
    made: list[Made] = []
    for frame in FRAMES:
        if frame == SOURCES[source] or not _held(frame, sizes, shapes):
            continue
        if head_norm and frame[-1] != "d":  # each head's row of d_head is no row of the view
            continue
        viewed = view_straight(projection, source, frame, sizes)
        refit = normed_heads(b, role, viewed, rotate) if head_norm else None
        if refit is not None:  # the norm after the view, or after RoPE: on the code's own heads
            made.append((frame, refit))
            continue
        steps = {split: viewed}
        plain = viewed
        if head_norm and normed is not None:  # the norm of each row of d_head, viewed the same way
            rows = b.ref[normed].transpose(1, 2).reshape(n_batch, n, n_head * d)
            plain = steps[normed] = view_straight(rows, source, frame, sizes)
        steps[change] = rotate(plain, role) if rotate is not None and role != "V" else plain
        made.append((frame, steps))
    return made


def normed_heads(b: Base, role: str, viewed: torch.Tensor, rotate: Rotate | None) -> dict[str, torch.Tensor] | None:
    """The steps the reference's per-head qk-norm and RoPE make from heads viewed the wrong way (`viewed`, `[n_batch,
    n_head, n, d_head]`), in the order the reference does them (the norm before RoPE, or on the rotated heads), the
    norm refit from the reference's own heads before and after it, its gain per head applying to the code's heads
    as its norm would (Cohere's `[n_head, d_head]` weights); the change the replay takes under `CHANGES[role]`. None
    where the reference norms no head of `role`'s, or the refit does not give its own norm back."""
    from attnscope.usertrace.fusedsplit import refit_norm
    from attnscope.usertrace.reference import late_norm

    normed, split, rot = f"{role}_normed", f"{role}_split", f"{role}_rot"
    if role == "V" or normed not in b.ref or b.ref[normed].shape != b.ref[split].shape:
        return None
    late = rotate is not None and late_norm(b.order, normed)
    norm = refit_norm(b.ref[rot] if late else b.ref[split], b.ref[normed])
    if norm is None or (late and rot not in b.ref):
        return None
    steps = {split: viewed}
    if late and rotate is not None:
        steps[rot] = rotate(viewed, role)
        steps[normed] = norm(steps[rot]).to(viewed.dtype)
        steps[CHANGES[role]] = steps[normed]
        return steps
    steps[normed] = norm(viewed).to(viewed.dtype)
    steps[CHANGES[role]] = rotate(steps[normed], role) if rotate is not None else steps[normed]
    return steps


def view_straight(projection: torch.Tensor, source: str, frame: Frame, sizes: dict[str, int]
                  ) -> torch.Tensor:
    """The reference's `[n_batch, n, d_feat]` laid as the code lays it (`source`: batch-first, or time-first
    `[n, n_batch, d_feat]`), viewed straight as `frame`'s axes, then moved back to `[n_batch, n_head, n, d_head]`."""
    laid = projection if source == "batch" else projection.transpose(0, 1)
    viewed = laid.contiguous().reshape([sizes[a] for a in frame])  # the view without the permute
    return viewed.permute([frame.index(a) for a in HEADS])  # -> [n_batch, n_head, n, d_head]


def _held(frame: Frame, sizes: dict[str, int], shapes: set[tuple[int, ...]]) -> bool:
    """Whether the code holds a tensor of `frame`'s shape, its two leading axes merged or not."""
    shape = tuple(sizes[a] for a in frame)
    return shape in shapes or (shape[0] * shape[1], *shape[2:]) in shapes


def _time_first(b: Base) -> bool:
    """Whether the code lays its tokens time-first: its inputs were (inputs.InputOptions.layout "time"), or it holds
    a tensor `[n, n_batch, ..]` of the queries' or the keys' length."""
    if b.ctx.layout == "time":
        return True
    n_batch = int(b.q.shape[0]) if b.q.dim() == 4 else None
    lengths = {b.n_Q, int(b.k_new.shape[-2])} - {n_batch}
    return n_batch is not None and any(r.tensor.dim() == 3 and int(r.tensor.shape[1]) == n_batch
                                       and int(r.tensor.shape[0]) in lengths for r in b.ctx.records)



def _trial(b: Base, chosen: dict[str, Made], source: str
           ) -> tuple[dict[str, torch.Tensor], str]:
    changed = {CHANGES[r]: steps[CHANGES[r]] for r, (_, steps) in chosen.items()}
    splits = {name: t for r, (_, steps) in chosen.items() for name, t in steps.items() if name != CHANGES[r]}
    steps = {**replay(b, **changed), **splits}  # type: ignore[arg-type]
    role, (frame, _) = next(iter(chosen.items()))
    names = _names(b, role)
    n = names["n"]
    laid = f"[n_batch, {n}, d_feat]" if source == "batch" else f"time-first [{n}, n_batch, d_feat]"
    right = ", ".join(names[a] for a in SOURCES[source])
    held = ", ".join(names[a] for a in frame)
    merged = f"{names[frame[0]]}·{names[frame[1]]}, " + ", ".join(names[a] for a in frame[2:])
    same = [f"{r}_feat" for r in chosen if r != role and chosen[r][0] == frame]
    other = [f"{r}_feat viewed straight as [{', '.join(_names(b, r)[a] for a in chosen[r][0])}]"
             for r in chosen if r != role and chosen[r][0] != frame]
    also = other + ([f"{' and '.join(same)} split the same way"] if same else [])
    said = f" ({'; '.join(also)})" if also else ""
    words = (f"heads split without the transpose: {{who}} is what the reference computes with {role}_feat as your "
             f"code holds it, {laid}, viewed straight as [{held}] or [{merged}]{said}, so each head holds a run of "
             f"whole feature rows of several positions, not one slice of every position; view as [{right}], then "
             f"permute the axes to [{held}]")
    return steps, words


def _names(b: Base, role: str) -> dict[str, str]:
    """The axes of `role`'s heads by name: n_Q or n_K, d_head or d_V."""
    d = "d_V" if role == "V" and b.sizes.get("d_V", b.d_head) != b.d_head else "d_head"
    return {"B": "n_batch", "H": "n_head", "n": "n_Q" if role == "Q" else "n_K", "d": d}
