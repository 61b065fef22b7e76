"""The catalog's head mistakes: heads merged by a view before the permute or after another permute, heads split
by a view without the transpose."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import torch

from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.roperead import read_rope, rope_turn
from attnscope.usertrace.trials import Trial


def trials_merge(b: Base) -> Iterator[Trial]:
    yield from _returned_merge(b)
    if "x_rsh2" in b.ref and "x_raw" in b.ref and b.ref["x_raw"].dim() == 4:
        yield Trial(replay(b, merge="view"), "heads merged in the wrong order: {who} is what the reference computes "
                    "with x_raw [n_batch, n_head, n_Q, d_head] viewed as [n_batch, n_Q, d_feat] without first moving "
                    "n_head behind n_Q (view before permute), so each row mixes the positions of one head; "
                    ".permute(0, 2, 1, 3).contiguous() before the view")
        if b.col:  # the column form's merge of heads held [n_batch, n_head, n_Q, d_head] (SqueezeBert's)
            yield Trial(replay(b, merge="column view"), "heads merged in the wrong order: {who} is what the reference "
                        "computes with x_raw [n_batch, n_head, n_Q, d_head] viewed as [n_batch, d_feat, n_Q] without "
                        "first moving d_head in front of n_Q (view before permute), so each column mixes the "
                        "positions of one head; .permute(0, 1, 3, 2).contiguous() before the view")
        yield from _held_merge(b)
        n_batch, n_Q = b.ref["x_raw"].shape[0], b.ref["x_raw"].shape[2]
        if n_batch != n_Q and any(tuple(r.tensor.shape[:2]) == (n_Q, n_batch) for r in b.ctx.records
                                  if r.tensor.dim() == 3):  # time-first code (usertrace/timefirst.py)
            yield Trial(replay(b, merge="time"), "heads merged in the wrong order: {who} is what the reference "
                        "computes with x_raw as [n_batch·n_head, n_Q, d_head] viewed straight as time-first "
                        "[n_Q, n_batch, d_feat] without first moving n_Q in front (view before transpose), so each "
                        "row mixes the positions and heads of one sequence; .transpose(0, 1).contiguous() before the "
                        "view")


def trials_merge_permuted(b: Base) -> Iterator[Trial]:
    """x_raw `[n_batch, n_head, n_Q, d_head]` permuted another way than (0, 2, 1, 3) before the view to `[n_batch,
    n_Q, d_feat]` (einops' `'b h n d -> b n (d h)'`: the head index the fastest), the output projection reading it
    so."""
    if "x_rsh2" not in b.ref or "x_raw" not in b.ref or b.ref["x_raw"].dim() != 4 or (b.col and not b.strided):
        return  # the column form's merge is its own (SqueezeBert's), but for a strided split's (SuperGlue's)
    dims = ("n_batch", "n_head", "n_Q", "d_head")
    # under a strided split merged the same way round (stridedheads.py), the reference's is (0, 2, 3, 1): head-major
    orders = ((0, 2, 1, 3), (0, 1, 3, 2), (0, 3, 1, 2), (0, 3, 2, 1)) if b.strided else \
        ((0, 2, 3, 1), (0, 1, 3, 2), (0, 3, 1, 2), (0, 3, 2, 1))
    for order in orders:
        steps = _merged_as(b, replay(b), order)
        if steps is None:
            return
        became = ", ".join(dims[a] for a in order)
        fix = (".permute(0, 2, 3, 1) gives [n_batch, n_Q, d_head, n_head], the order your projections' features "
               "were split in (strided), then .reshape") if b.strided else (
            ".permute(0, 2, 1, 3) (or .transpose(1, 2), einops' 'b h n d -> b n (h d)') gives [n_batch, n_Q, n_head, "
            "d_head], then .reshape")
        yield Trial(steps, f"heads merged with the wrong permute: {{who}} is what the reference computes with x_raw "
                    f"[n_batch, n_head, n_Q, d_head] permuted {order} to [{became}], then viewed as [n_batch, n_Q, "
                    f"d_feat], so each row holds the heads' features in another order than the output projection "
                    f"reads; {fix}")


def _merged_as(b: Base, steps: dict[str, torch.Tensor], order: tuple[int, ...],
               x_raw: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
    """A replay's `steps` with its x_raw `[n_batch, n_head, n_Q, d_head]` (or `x_raw`, its values as the code lays
    them out before the view) permuted by `order` before the view to `[n_batch, n_Q, d_feat]`, and what follows the
    merge (the code's output gate, the output projection) again from there; None where the replay has no such
    x_raw."""
    x_raw = steps.get("x_raw") if x_raw is None else x_raw
    if x_raw is None or x_raw.dim() != 4:
        return None
    n_batch, n_head, n_Q, d = x_raw.shape
    merged = x_raw.permute(order).reshape(n_batch, n_Q, n_head * d)
    steps.pop("x_rsh1", None)
    steps["x_rsh2"] = merged
    if b.gate is not None and "x_gated" in steps:  # the code's output gate (outgate.py), where it gates
        merged = (x_raw * b.gate).permute(order).reshape(n_batch, n_Q, n_head * d) if b.gate_first \
            else merged * steps["gate"]
        steps["x_gated"] = merged
    if "x" in steps and b.w_o is not None:
        steps["x"] = torch.nn.functional.linear(merged, *b.w_o)
    return steps


def _held_merge(b: Base) -> Iterator[Trial]:
    """x_raw as the code holds it, where that is no plain `[n_batch, n_head, n_Q, d_head]` nor its heads in the batch
    (Hiera's `[B, heads, units, tokens_per_unit, d]`, whose `.transpose(1, 3)` puts the tokens back in order before
    the reshape), reshaped straight to `[n_batch, n_Q, d_feat]` without that permute: the view-before-permute
    mistake in the code's own layout."""
    from attnscope.usertrace.align import compare
    from attnscope.usertrace.rerun import record_holding

    right = b.ref["x_raw"]
    inner = record_holding(b.ctx.records, right, None, "", b.sums)
    if inner is None or b.col or b.gate is not None or inner.tensor.dim() <= right.dim():
        return  # (a gate on the merge: the code's gate is read on the reference's merge alone)
    held = compare(inner, right)[0].layout
    n_batch, n_head, n_Q, d = right.shape
    steps = replay(b)
    x_raw = steps["x_raw"]
    made = _merged_as(b, steps, (0, 1, 2, 3), held.apply(x_raw, tuple(inner.tensor.shape)).reshape(x_raw.shape))
    if made is None:
        return
    yield Trial(made, f"heads merged in the wrong order: {{who}} is what the reference computes with x_raw as your "
                f"code holds it ({inner.label}, line {inner.line}, {list(inner.tensor.shape)}) reshaped straight to "
                f"[n_batch, n_Q, d_feat] = {[n_batch, n_Q, n_head * d]}, without first moving its axes into [n_batch, "
                "n_Q, n_head, d_head] (view before permute), so each row mixes positions and heads; permute it so "
                "before the reshape, as the split's permute is undone")


def _returned_merge(b: Base) -> Iterator[Trial]:
    """What a call returns, where it is the divergence (firststep.return_differs): the last step as the code holds it
    (`attn @ v`, [n_batch·n_head, n_Q, d_V] say) reshaped straight into the returned tensor's shape, the heads never
    moved behind the queries (xformers' BMHK output without its permute back)."""
    returned, last = b.ctx.returned, b.last
    if returned is None or b.col or b.ref[last].dim() != 4 or "n_head" not in b.dims[last]:
        return
    from attnscope.usertrace.align import compare, layouts
    from attnscope.usertrace.rerun import record_holding

    right = b.ref[last]
    inner = record_holding(b.ctx.records, right, None, "", b.sums)  # the code's own tensor of the last step
    if inner is None:
        return
    held = compare(inner, right)[0].layout
    into = [layout for layout in layouts(tuple(right.shape), tuple(returned.tensor.shape))
            if not layout.same and layout.split is None]
    if not into:
        return
    steps = replay(b)
    # the run's last step laid out as the code holds it, then reshaped straight into the returned shape
    wrong = held.apply(steps[last], tuple(inner.tensor.shape)).reshape(returned.tensor.shape)
    steps[last] = into[0].undo(wrong, tuple(right.shape))
    dims = b.dims[last]
    target = ", ".join(dims[i] for i in into[0].order)
    kept = f" (as your code holds it, {list(inner.tensor.shape)})" if tuple(inner.tensor.shape) != tuple(right.shape) \
        else ""
    order = ", ".join(str(i) for i in into[0].order)
    yield Trial(steps, f"heads merged in the wrong order: {{who}} is what the reference computes with {last} "
                f"[{', '.join(dims)}]{kept} reshaped straight to {list(returned.tensor.shape)}, without first "
                f"moving its axes into the order [{target}], so each row mixes positions and heads; .permute({order}) "
                f"it from [{', '.join(dims)}] before the reshape")


def trials_split(b: Base) -> Iterator[Trial]:
    """Each of Q, K and V split by a view without the transpose (one helper for all three: all of them), then
    rotated where the reference rotates. A module's X_feat [n_batch, n, d_feat] viewed straight as [n_batch,
    n_head, n, d_head]; a function's inputs with the heads behind the tokens, [n_batch, n, n_head, d] (xformers'
    BMHK), reshaped straight to [n_batch·n_head, n, d]."""
    if b.kind != "module" and b.ctx.layout != "bthd":
        return
    rope = read_rope(b)
    if b.kind == "module":  # a fused projection's output reshaped straight, then split (usertrace/fusedsplit.py)
        from attnscope.usertrace import fusedsplit

        def turn(x: torch.Tensor, role: str) -> torch.Tensor:
            assert rope is not None
            return rope_turn(rope)(x, rope.q_pos if role == "Q" else rope.k_pos)

        for steps, words in fusedsplit.trials(b, turn if rope is not None else None):
            yield Trial(steps, words)
    from attnscope.usertrace import splitframes

    wrong: dict[str, dict[str, torch.Tensor]] = {}  # role -> the replay's change, and the steps the view makes
    for role, change, name in (("Q", "q", "Q_rot"), ("K", "k_new", "K_rot"), ("V", "v_new", "")):
        feat, split = (f"{role}_feat", f"{role}_split") if b.kind == "module" else (role, role)
        feat = f"{role}_pooled" if f"{role}_pooled" in b.ref else feat  # pooled after the projection (pooled.py)
        normed = f"{role}_normed" if b.kind == "module" and f"{role}_normed" in b.ref else None
        if feat not in b.ref or split not in b.ref or b.ref[split].dim() != 4:
            continue
        if b.names[change[0]] not in (split, name, normed):  # another step between the split and the attention
            continue
        shape = b.ref[split].shape
        if normed is not None and b.ref[normed].shape != shape:
            # a norm over the whole projection (OLMo 2's), before the split: the view takes the normed projection
            views = {split: b.ref[normed].reshape(shape)}
        else:
            # [n_batch, n, d_feat] read as [n_batch, n_head, n, d_head]; a function's [n_batch, n, n_head, d] so too,
            # and a module's in the column form, [n_batch, d_feat, n] (timm's MultiQueryAttention2d's map without its
            # transpose(-1, -2))
            source = b.ref[feat] if b.kind == "module" and not b.col else b.ref[feat].transpose(1, 2).contiguous()
            viewed = source.reshape(shape)
            # a norm of each head's d_head (Persimmon's q_layernorm on [n_batch, n, n_head, d_head] before the view,
            # SD3's norm_q after it): the view keeps each row of d_head whole, so the norm and the view give the
            # reference's norm viewed so (one gain that every head shares)
            views = {split: viewed} if normed is None else {
                split: viewed, normed: b.ref[normed].transpose(1, 2).contiguous().reshape(shape)}
        plain = views.get(normed or "", views[split])
        turned = rope_turn(rope)(plain, rope.q_pos if role == "Q" else rope.k_pos) \
            if rope is not None and role != "V" else plain
        wrong[role] = {change: turned, **views}
        # the norm of each head refit and applied after the view (a gain per head: Cohere's), or after RoPE
        refit = None if normed is None or b.kind != "module" else \
            splitframes.normed_heads(b, role, views[split], turn if rope is not None else None)
        if refit is not None and (normed not in views or not torch.allclose(
                refit[normed].double(), views[normed].double(), rtol=1e-4, atol=1e-5)):
            wrong[role] = refit
    yield from _split_trials(b, wrong)
    if b.kind == "module":  # a time-first projection, keys viewed ready for q @ k, heads before the batch
        for steps, words in splitframes.trials(b, turn if rope is not None else None):
            yield Trial(steps, words)


def _split_trials(b: Base, wrong: dict[str, dict[str, torch.Tensor]]) -> Iterator[Trial]:
    # one role alone, each pair (q and k viewed straight, v right), then all three
    runs = [list(roles) for size in range(1, len(wrong) + 1) for roles in itertools.combinations(wrong, size)]
    for roles in runs:
        changes = {"Q": "q", "K": "k_new", "V": "v_new"}
        changed = {changes[r]: wrong[r][changes[r]] for r in roles}
        splits = {step: t for r in roles for step, t in wrong[r].items() if step != changes[r]}
        if b.kind != "module":  # a function's split is its q itself, or what RoPE then turns
            splits = {name: t for name, t in splits.items() if b.names[changes[name][0]] != name}
        steps = {**replay(b, **changed), **splits}  # type: ignore[arg-type]
        yield Trial(steps, _split_words(b, roles), lead=functools.partial(_split_led, b, roles))


def _split_led(b: Base, roles: list[str], step: str) -> str:
    """_split_words with the diverged step's role named first (Whisper's keys split before its queries)."""
    first = step[:1]
    return _split_words(b, [first, *(r for r in roles if r != first)] if first in roles else roles)


def _split_words(b: Base, roles: list[str]) -> str:
    n = "n_Q" if roles[0] == "Q" else "n_K"
    if b.kind != "module":
        d = "d_V" if roles[0] == "V" else "d_K"
        also = f" ({' and '.join(roles[1:])} split the same way)" if len(roles) > 1 else ""
        return (f"heads split without the transpose: {{who}} is what the reference computes with "
                f"{roles[0]} as your code takes it, [n_batch, {n}, n_head, {d}], reshaped straight to "
                f"[n_batch·n_head, {n}, {d}] or viewed as [n_batch, n_head, {n}, {d}]{also}, so each head "
                f"holds a run of positions of several heads, not one head of every position; .permute(0, 2, "
                f"1, 3) (or .transpose(1, 2)) to [n_batch, n_head, {n}, {d}] before the reshape")
    also = f" ({' and '.join(f'{r}_feat' for r in roles[1:])} split the same way)" if len(roles) > 1 else ""
    if b.col:  # a map's channels first: [n_batch, d_feat, n] viewed as [n_batch, n_head, n, d_head]
        return (f"heads split without the transpose: {{who}} is {roles[0]}_feat [n_batch, d_feat, "
                f"{n}] (your columns, a map's channels first) viewed straight as [n_batch, n_head, {n}, "
                f"d_head]{also}, so each head's rows mix its channels and positions; view as [n_batch, "
                f"n_head, d_head, {n}], then .transpose(-1, -2)")
    return (f"heads split without the transpose: {{who}} is {roles[0]}_feat [n_batch, {n}, d_feat] "
            f"viewed straight as [n_batch, n_head, {n}, d_head]{also}, so each head holds a run of whole "
            f"feature rows of several positions, not one slice of every position; view as [n_batch, {n}, "
            "n_head, d_head], then .transpose(1, 2)")
