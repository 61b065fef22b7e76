"""The queries' and keys' norms (a qk-norm: `q_norm`, `k_layernorm`, `norm_q`) whose gains `__init__` leaves at
their initial value, every one 1 (torch's LayerNorm and RMSNorm, Qwen3's, Gemma 3n's) or every one 0 (Gemma's
`1 + weight`), and their biases at 0. A norm of unit gain over a head is blind to where it sits against RoPE: a
rotation keeps each row's length, so normed before or after the rotation the numbers are the same, and a qk-norm
put after RoPE (qknorm.place) would pass on the module as built and fail on every trained checkpoint. trace moves
such parameters as training does, `value + 0.2 · N(0, 1)` from --seed, before the first run (the reference holds the
same weights), and a note says so. Other parameters are left as the module made them: a gate of 0 or a scale of 1
may be the design, and the reference reads them only where the code's run says so.
"""

from __future__ import annotations

import torch
from torch import nn

from attnscope.usertrace.linearweights import role_of
from attnscope.usertrace.normforms import EPS_NAMES

SPREAD = 0.2


def _is_norm(module: nn.Module) -> bool:
    """A norm by its kind (torch's LayerNorm, RMSNorm, GroupNorm) or by what it holds: an epsilon and a name that
    says norm (`Qwen3RMSNorm.variance_epsilon`, `LlamaRMSNorm`)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    return "norm" in type(module).__name__.lower() and any(hasattr(module, e) for e in EPS_NAMES)


def _at_start(tensor: torch.Tensor) -> bool:
    """Every value 1, or every value 0: a gain or a bias as `__init__` sets it."""
    return tensor.numel() > 0 and (bool((tensor == 1).all()) or bool((tensor == 0).all()))


def move(module: nn.Module, seed: int) -> list[str]:
    """Move the gains and biases of the module's q/k norms that are all at their initial value (`_at_start`), in
    place; the names moved, in the module's order. Nothing is moved where any of a norm's own vectors was trained
    already (not every one at its start)."""
    generator = torch.Generator().manual_seed(seed + 15485863)
    moved: list[str] = []
    with torch.no_grad():
        for name, norm in module.named_modules():
            if not name or role_of(name) not in ("q", "k") or not _is_norm(norm):
                continue
            own = [(n, p) for n, p in norm.named_parameters(recurse=False)
                   if p.dim() == 1 and p.is_floating_point() and p.device.type != "meta"]
            if not own or not all(_at_start(p) for _, p in own):
                continue
            for n, p in own:
                p.add_((SPREAD * torch.randn(p.shape, generator=generator, dtype=torch.float64)).to(p.dtype))
                moved.append(f"{name}.{n}")
    return moved


def note(names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    them = "them" if len(names) > 1 else "it"
    return (f"{shown}: a q/k norm's gain and bias as your module's __init__ sets them (every one 1, or 0), where a "
            "norm's place against RoPE cannot show (a rotation keeps a row's length): trace moved "
            f"{them} as training does, + 0.2·N(0, 1) from --seed; your code and the reference hold the same weights")
