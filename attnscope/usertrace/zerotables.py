"""Parameters of two or more axes that `__init__` leaves all 0: a position-bias table (EfficientFormer's
`attention_biases`, BEiT's and Data2Vec's `relative_position_bias_table`, Dinat's `rpb`, all `torch.zeros` until
training), a low-rank adapter's second factor (LoRA's B). A trained model's never is, and as built it adds nothing:
a mistake in what it feeds (a bias added after the softmax, a table looked up transposed) cannot show, and correct
code passes on it whether or not trace reads it. trace fills such a parameter before the first run, from --seed
(normal values, 1/√fan_in as a projection's), and a note says so; the code and the reference hold the same weights.

Vectors of 0 (biases, a gate, a sink) are left as the module made them: a gate of 0 may be the design (ReZero, a
tanh-gated cross-attention), and the reference reads them only where the code's run says so (unitgains.py moves the
q/k norms' own).
"""

from __future__ import annotations

import torch


def fill(module: torch.nn.Module, seed: int) -> list[str]:
    """Fill the module's floating parameters of two or more axes that are all 0, in place; the names filled, in the
    module's order."""
    generator = torch.Generator().manual_seed(seed + 104729)
    filled: list[str] = []
    with torch.no_grad():
        for name, p in module.named_parameters(remove_duplicate=True):
            if p.dim() < 2 or p.numel() == 0 or not p.is_floating_point() or p.device.type == "meta" \
                    or bool(p.any()):
                continue
            values = torch.randn(p.shape, generator=generator, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5
            p.copy_(values.to(p.dtype))
            filled.append(name)
    return filled


def note(names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    them, it = ("them", "they") if len(names) > 1 else ("it", "it")
    return (f"{shown}: your module's __init__ leaves {them} all 0, as no trained model holds {them}, and as built "
            f"{it} would add nothing, so that a mistake in what {it} feeds could not show: trace filled {them} "
            "from --seed, normal values; your code and the reference hold the same weights")
