"""heads.split_without_permute where the code splits the heads of a fused projection's output: OpenELM's qkv
`[n_batch, n, (n_head + 2·n_kv_head)·d_head]` reshaped straight to `[n_batch, n_head + 2·n_kv_head, n, d_head]`
(the reshape to `[n_batch, n, n_head + 2·n_kv_head, d_head]` and its transpose left out), then split by head counts
on axis 1. Each "head" then holds a run of whole feature rows of several positions, queries, keys and values mixed;
the per-projection experiment (one X_feat viewed straight) cannot give it back.

The rerun rebuilds the fused output from the reference's Q_feat, K_feat and V_feat at the rows the fused weight gives
each (fused.Part.rows, read from the code's data flow), reshapes it straight, splits it in the fused order, and runs
the rest of the reference on the result: the qk-norm the reference applies after the split (its gain and kind refit
from the reference's own tensors, `refit_norm`), RoPE where the reference rotates, then the attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from attnscope.usertrace.cutnames import layer_of
from attnscope.usertrace.rerun import Base, replay

Norm = Callable[[torch.Tensor], torch.Tensor]


def trials(b: Base, rotate: Callable[[torch.Tensor, str], torch.Tensor] | None) -> Iterator[tuple[dict, str]]:
    """The rerun's steps and their words, where the reference's projections are rows of one fused weight;
    `rotate(x, role)` turns "Q" or "K" as the reference's RoPE does (None: no RoPE)."""
    parts = _fused_rows(b)
    if parts is None or any(f"{role}_pooled" in b.ref for role in "QKV"):  # pooled after the projection: no split
        return
    feats = {role: b.ref.get(f"{role}_feat") for role in "QKV"}
    splits = {role: b.ref.get(f"{role}_split") for role in "QKV"}
    if any(t is None or t.dim() != 3 for t in feats.values()) or any(t is None or t.dim() != 4
                                                                      for t in splits.values()):
        return
    n_batch, n, _ = feats["Q"].shape  # type: ignore[union-attr]
    if any(int(feats[r].shape[-2]) != n for r in "KV"):  # type: ignore[union-attr]
        return
    width = 1 + max(max(rows) for rows in parts.values())
    fused = torch.zeros(n_batch, n, width, dtype=torch.float64)
    for role, rows in parts.items():
        fused[..., list(rows)] = feats[role].double()  # type: ignore[union-attr]
    for wrong, words in (_by_heads(fused, parts, splits), _per_group(fused, parts, splits)):
        if wrong is None:
            continue
        steps = _rest(b, wrong, splits, rotate)
        if steps is not None:
            yield steps, words


def _by_heads(fused: torch.Tensor, parts: dict[str, tuple[int, ...]], splits: dict[str, Any]
              ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """OpenELM's: the roles in blocks, the output reshaped straight to `[n_batch, heads, n, d_head]` and split by
    heads on axis 1."""
    n_batch, n, width = fused.shape
    d_head = int(splits["Q"].shape[-1])
    if width % d_head:
        return None, ""
    straight = fused.reshape(n_batch, width // d_head, n, d_head)  # the reshape without the transpose
    order = sorted(parts, key=lambda role: min(parts[role]))  # the roles in the fused weight's order
    heads = [len(parts[role]) // d_head for role in order]
    total = " + ".join(f"{h}" for h in heads)
    return dict(zip(order, torch.split(straight, heads, dim=1), strict=True)), (
        f"heads split without the transpose: {{who}} is the fused projection's output [n_batch, n, {width}] reshaped "
        f"straight to [n_batch, {total}, n, d_head] and split by heads on axis 1, so each head holds a run of whole "
        "feature rows of several positions, queries, keys and values mixed, not one head of every position; reshape "
        f"to [n_batch, n, {total}, d_head], then .transpose(1, 2), before the split")


def _per_group(fused: torch.Tensor, parts: dict[str, tuple[int, ...]], splits: dict[str, Any]
               ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """EfficientFormer's: each head's rows hold its q, k and v side by side (`[n_head, d_q + d_k + d_v]`), the output
    reshaped straight to `[n_batch, n_head, n, d_q + d_k + d_v]` and split along the last axis."""
    n_batch, n, width = fused.shape
    heads = int(splits["Q"].shape[1])
    if heads < 2 or width % heads or any(int(splits[role].shape[1]) != heads for role in "KV"):
        return None, ""
    group = width // heads
    grid = torch.arange(width).view(heads, group)
    columns: dict[str, list[int]] = {}
    for role, rows in parts.items():
        within = sorted({r % group for r in rows})
        if list(rows) != grid[:, within].reshape(-1).tolist():
            return None, ""  # not each head's own columns, in head order
        columns[role] = within
    straight = fused.reshape(n_batch, heads, n, group)
    sizes = " + ".join(str(len(columns[role])) for role in sorted(columns, key=lambda r: columns[r][0]))
    return {role: straight[..., cols] for role, cols in columns.items()}, (
        f"heads split without the transpose: {{who}} is the fused projection's output [n_batch, n, {width}] reshaped "
        f"straight to [n_batch, {heads}, n, {sizes}] before the split, so each head holds a run of whole feature rows "
        f"of several positions, not one head of every position; reshape to [n_batch, n, {heads}, {sizes}], then "
        ".transpose(1, 2)")


def _rest(b: Base, wrong: dict[str, torch.Tensor], splits: dict[str, Any],
          rotate: Callable[[torch.Tensor, str], torch.Tensor] | None) -> dict | None:
    """The reference run on from the heads `wrong` (by role) split wrong: its norms, RoPE and the attention."""
    steps: dict[str, torch.Tensor] = {}
    changed: dict[str, torch.Tensor] = {}
    for role, change in (("Q", "q"), ("K", "k_new"), ("V", "v_new")):
        x = wrong[role]
        if tuple(x.shape) != tuple(splits[role].shape):
            return None
        n_batch, _, n, _ = x.shape
        steps[f"{role}_split"] = x
        steps[f"{role}_feat"] = x.transpose(1, 2).reshape(n_batch, n, -1)
        if f"{role}_normed" in b.ref:
            norm = refit_norm(splits[role], b.ref[f"{role}_normed"])
            if norm is None:
                return None
            x = steps[f"{role}_normed"] = norm(x)
        if rotate is not None and role != "V":
            x = rotate(x, role)
        changed[change] = x
    return {**replay(b, **changed), **steps}  # type: ignore[arg-type]


def _fused_rows(b: Base) -> dict[str, tuple[int, ...]] | None:
    """The fused weight's rows of q, k and v (one weight for all three), by role; None otherwise."""
    found = b.ctx.projections
    if found is None:
        return None
    parts: dict[str, Any] = {role: found.linears.get(role, (None, None))[1] for role in "qkv"}
    names = {layer_of(getattr(p, "name", "")) for p in parts.values()}
    if any(getattr(p, "rows", None) is None for p in parts.values()) or len(names) != 1:
        return None
    return {role.upper(): tuple(part.rows) for role, part in parts.items()}


def refit_norm(before: torch.Tensor, after: torch.Tensor) -> Norm | None:
    """The qk-norm the reference applied to `before` (`[.., n_head, n, d_head]`) to give `after`, as a function:
    RMSNorm (`x · rsqrt(mean(x²) + eps) · g`) or LayerNorm (`(x − mean) · rsqrt(var + eps) · g + b`) over the last
    axis, the gain (and bias) solved per head and coordinate; None where neither gives `after` back."""
    parts = refit_parts(before, after)
    if parts is None:
        return None
    unit, gain, bias = parts
    return lambda x: unit(x.double()) * gain + bias


def refit_parts(before: torch.Tensor, after: torch.Tensor) -> tuple[Norm, torch.Tensor, torch.Tensor] | None:
    """refit_norm's norm in its parts: the unit norm over the last axis (RMSNorm's or LayerNorm's), and the gain and
    bias `[1, heads, 1, d]` solved per head and coordinate."""
    before, after = before.double(), after.double()
    if before.dim() != 4 or before.shape != after.shape:
        return None

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def layer(x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(-1, keepdim=True)
        return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)

    for unit, biased in ((rms, False), (layer, True)):
        u = unit(before)
        if biased:  # least squares per head and coordinate: after = u · g + b
            mu, ma = u.mean((0, 2), keepdim=True), after.mean((0, 2), keepdim=True)
            gain = ((u - mu) * (after - ma)).sum((0, 2), keepdim=True) / (u - mu).pow(2).sum((0, 2), keepdim=True)
            bias = ma - gain * mu
        else:
            gain = (u * after).sum((0, 2), keepdim=True) / u.pow(2).sum((0, 2), keepdim=True).clamp_min(1e-30)
            bias = torch.zeros_like(gain)
        if torch.allclose(u * gain + bias, after, rtol=1e-4, atol=1e-4 * float(after.abs().max())):
            return unit, gain, bias
    return None


def refit_over_projection(before: torch.Tensor, after: torch.Tensor, heads: int,
                          d: int) -> tuple[Norm, torch.Tensor, torch.Tensor] | None:
    """refit_parts where the norm runs over the whole projection `[.., n, heads·d]`, every head's coordinates at once
    (OLMo 2's): its unit, and the gain and bias per head and coordinate `[1, heads, 1, d]`."""
    parts = refit_parts(before[:, None], after[:, None])
    if parts is None:
        return None
    unit, gain, bias = parts
    return unit, gain.reshape(heads, d)[None, :, None], bias.reshape(heads, d)[None, :, None]


def normed(unit: Norm, gain: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, over: str) -> torch.Tensor:
    """x `[.., heads, n, d]` normalized by a refit norm's parts (the gain and bias per head and coordinate) over
    each head ("head") or over every head's coordinates at once ("proj"), float64."""
    if over == "head":
        return unit(x.double()) * gain + bias
    whole = unit(merged(x.double())).unflatten(-1, tuple(x.shape[-3::2])).transpose(-3, -2)  # [.., heads, n, d]
    return whole * gain + bias


def merged(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-3, -2).flatten(-2)  # [.., heads, n, d] -> [.., n, heads·d]
