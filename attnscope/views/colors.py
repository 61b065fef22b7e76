"""A perceptual colour scale for attention weights: viridis (dark blue, low, to yellow, high).

Perceptually uniform and readable by people with the common colour-vision deficiencies, and bright where
the attention is large on dark and light backgrounds alike. The anchors are matplotlib's viridis at
eleven evenly spaced points; between them the colour is interpolated linearly.
"""

from __future__ import annotations

VIRIDIS = (
    (68, 1, 84), (72, 36, 117), (65, 68, 135), (53, 95, 141), (42, 120, 142), (33, 145, 140),
    (34, 168, 132), (68, 191, 112), (122, 209, 81), (189, 223, 38), (253, 231, 37),
)


def viridis(fraction: float) -> tuple[int, int, int]:
    """The colour of `fraction` in [0, 1] (clamped; NaN is the low end)."""
    if not fraction > 0.0:  # also NaN
        return VIRIDIS[0]
    if fraction >= 1.0:
        return VIRIDIS[-1]
    position = fraction * (len(VIRIDIS) - 1)
    low = int(position)
    t = position - low
    a, b = VIRIDIS[low], VIRIDIS[low + 1]
    return (round(a[0] + (b[0] - a[0]) * t), round(a[1] + (b[1] - a[1]) * t), round(a[2] + (b[2] - a[2]) * t))


def hex_color(fraction: float) -> str:
    r, g, b = viridis(fraction)
    return f"#{r:02x}{g:02x}{b:02x}"
