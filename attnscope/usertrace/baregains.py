"""qk-norm gains the attention module holds as parameters of its own, read from the data flow: no norm submodule,
but q and k normalized by an op (`F.rms_norm`, `F.normalize`, a LayerNorm without its affine, an RMS by hand) and
then multiplied by a 1-D parameter of the norm's width (`q = F.rms_norm(q, (d,)) * self.q_gain`; x-transformers'
`l2norm(q) * self.qk_norm_q_scale`, one row per head), perhaps with a parameter added after (a bias).

Each such product is read as a norm module the reference's qk-norm can take its weights from (`Held`): its form
(RMS rows or mean-free rows of one variance, read from the tensor the gain multiplies), its epsilon (the op's own
`eps=`, else the form's usual one), its gain and bias the module's parameters. normforms.read then fits it as it
fits any norm submodule, so unit-length rows (F.normalize) become an RMSNorm with the gain over √width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from attnscope.usertrace.record import Record

MULS = ("mul", "__mul__", "__rmul__", "mul_")
ADDS = ("add", "__add__", "__radd__", "add_")
SPREAD = 2e-3


class Held(nn.Module):
    """A norm the code writes inline, as a module: `form(x) · weight (+ bias)` over the last axis."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float, rms: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kind, self.eps, self.rms = kind, eps, rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.rms * self.weight
        return y if self.bias is None else y + self.bias


def read(module: nn.Module, records: list[Record], widths: set[int]) -> list[tuple[str, Held]]:
    """The module's own parameters that gain a normalized q or k, as norms, in the order the run uses them: the
    parameter itself (`F.rms_norm(q, (d,)) * self.q_gain`), or a gain the code computes from one parameter alone
    (nGPT's `(self.sqk * c).view(1, 1, n_head, d_head)`, one row a head; its q and k may share it)."""
    every = dict(module.named_parameters(recurse=False))
    own = {name: p for name, p in every.items() if p.dim() >= 1 and p.shape[-1] in widths}
    found: dict[str, Held] = {}
    for r in records:
        if r.func not in MULS:
            continue
        named = [v for k, v in r.args if k == "text" and v in own]
        given = [v for k, v in r.args if k == "rec"]
        made = [(_made_from(records[v], records, every), v) for v in given] if not named and len(given) == 2 else []
        made = [(name, v) for name, v in made if name is not None]
        if len(made) == 1:  # a gain computed from one parameter, the other operand the normed rows
            name, v = made[0]
            gain = records[v].tensor.detach()
            normed = [records[u] for u in given if u != v]
            if gain.dim() == 0 or len(normed) != 1 or gain.shape[-1] not in widths \
                    or normed[0].tensor.numel() <= gain.numel() or len(found) >= 2:
                continue
            named, weight = [name if name not in found else f"{name} (again)"], gain.reshape(-1, gain.shape[-1])
            weight = weight[0] if weight.shape[0] == 1 else weight
        elif len(named) != 1 or len(given) != 1 or named[0] in found and len(found) >= 2:
            continue
        else:  # one gain for q and k both: the keys' named again
            weight, normed = own[named[0]], [records[given[0]]]
            named = [named[0] if named[0] not in found else f"{named[0]} (again)"]
        x = normed[0].tensor
        form = _form(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else None
        if form is None or x.shape[-1] != weight.shape[-1]:
            continue
        kind, rms = form
        eps = _eps(normed[0], kind)
        found[named[0]] = Held(weight, _bias(r, records, own, weight), kind, eps, rms)
    if len(found) == 1:  # one side gained: the other's gain held, never read (its norm left out)
        twin = _twin(every, records, *next(iter(found.items())))
        found.update([twin] if twin is not None else [])
    return list(found.items())


def _twin(every: dict[str, nn.Parameter], records: list[Record], name: str, held: Held) -> tuple[str, Held] | None:
    """Where the run gains q or k alone, the other side's gain (`k = F.rms_norm(k, (d,)) * (1 + self.k_scale)` left
    out, as a norm module held and never called is): the one parameter of the module's own shaped as the used gain's
    and read by no op of the run, made a gain as the used one is made from its parameter (an elementwise `a · w + c`
    fitted on the used pair: `w`, Gemma's `1 + w`, a constant scale), in the used norm's form. None where no such
    parameter, or more than one, or no such map."""
    source = every.get(name)
    if source is None or source.numel() != held.weight.numel():
        return None
    unread = [n for n, p in every.items() if n != name and p.shape == source.shape
              and not any(("text", n) in r.args for r in records)]
    if len(unread) != 1:
        return None
    p, g = source.detach().double().reshape(-1), held.weight.detach().double().reshape(-1)
    fit = torch.linalg.lstsq(torch.stack([p, torch.ones_like(p)], 1), g[:, None]).solution[:, 0]  # g = a · p + c
    a, c = float(fit[0]), float(fit[1])
    if not torch.allclose(a * p + c, g, rtol=1e-6, atol=1e-6 * max(1.0, float(g.abs().max()))):
        return None
    weight = (a * every[unread[0]].detach().double() + c).reshape(held.weight.shape).to(held.weight.dtype)
    return unread[0], Held(weight, None, held.kind, held.eps, held.rms)


def _made_from(record: Record, records: list[Record], params: dict[str, Any]) -> str | None:
    """The one parameter of the module's own a tensor is computed from alone, by ops that never grow it (a scale, a
    view), numbers aside; None where it reads anything else (an input, another parameter, a projection's output)."""
    from attnscope.usertrace.align import ancestors

    up = ancestors(record, records) | {record.index}
    mentioned: set[str] = set()
    for index in up:
        if records[index].tensor.numel() > record.tensor.numel() or not records[index].tensor.is_floating_point():
            return None
        mentioned |= {v for k, v in records[index].args if k == "text" and isinstance(v, str)}
    named = {n for n in mentioned if n in params}
    if len(named) != 1 or any(not _number(n) for n in mentioned - named):
        return None
    return named.pop()


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _form(x: torch.Tensor) -> tuple[str, float] | None:
    """("rms" or "layer", the rows' RMS) where every row over the last axis has one RMS (and, for "layer", mean 0)."""
    rows = x.detach().double().reshape(-1, x.shape[-1])
    if rows.shape[0] < 2 or rows.shape[-1] < 2:
        return None
    centred = rows.mean(-1).abs().max() <= 1e-5 * max(1.0, float(rows.abs().max()))
    rms = rows.pow(2).mean(-1).sqrt()
    low, high = float(rms.min()), float(rms.max())
    if not math.isfinite(high) or low <= 0 or high - low > SPREAD * high:
        return None
    return ("layer" if centred else "rms"), float(rms.median())


def _eps(record: Record, kind: str) -> float:
    for k, v in record.args:
        if k == "kw" and v[0] == "eps" and v[1][0] == "text":
            try:
                return float(v[1][1])
            except (TypeError, ValueError):
                break
    return 1e-5 if kind == "layer" else 1e-6


def _bias(product: Record, records: list[Record], own: dict[str, Any], weight: torch.Tensor) -> torch.Tensor | None:
    """A parameter of the gain's shape added to the product (`F.layer_norm(q, (d,)) * self.q_w + self.q_b`)."""
    for r in records:
        if r.func in ADDS and ("rec", product.index) in r.args:
            added = [v for k, v in r.args if k == "text" and v in own and own[v].shape == weight.shape]
            return own[added[0]].detach() if len(added) == 1 else None
    return None
