"""The catalog's pattern.transposed: the attention weights multiplied with the values transposed,
`attn.transpose(-2, -1) @ v` (taming-transformers' `torch.bmm(v, w_)` without `w_.permute(0, 2, 1)`,
`einsum("bhqk,bhqd->bhkd", attn, v)`): each query's row of weights, normalized over the keys as it should be, is
used as a column, so output row j sums the values with the weights every query gave key j. The code runs at all
only where n_Q = n_K.

Distinct from softmax.axis: a softmax over the queries' axis normalizes the columns of the scores as they are; here
the rows are normalized right and the transpose meets the values. Where both fit the code's numbers, the rerun that
gives them back to tolerance names the cause, as for every entry.
"""

from __future__ import annotations

from collections.abc import Iterator

from attnscope.usertrace.align import PRE_SOFTMAX
from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.trials import Trial

WORDS = ("the attention weights meet the values transposed: {who} equals the reference's with the weights "
         "transposed before they meet the values: [n_K, n_Q] used where [n_Q, n_K] belongs (`attn.transpose(-2, "
         "-1) @ v`, each output row the values summed with the weights every query gave one key; the shapes agree "
         "only because n_Q = n_K); multiply the weights as they come from the softmax, `attn @ v`, contracting "
         "the keys' axis")


def trials_pattern_transposed(b: Base) -> Iterator[Trial]:
    """The reference's weights transposed before the product with the values, where the scores are square. In the
    column form, where the data flow read no keys' axis (the code contracts its pattern with the values over the
    axis its scores' product gives the queries: scoreaxes.key_axes), the line-up reads the code's scores in the
    layout's orientation, transposed from the code's own: that run holds the whole pattern so transposed, from the
    scores on, and the same output."""
    if b.n_Q != b.n_K or "attention" not in b.ref:
        return
    steps = replay(b, weights_t=True)
    yield Trial(steps, WORDS)
    if b.col and not b.ctx.keys:
        turned = {n: t.transpose(-2, -1) if n in (*PRE_SOFTMAX, "attention") else t for n, t in steps.items()}
        yield Trial(turned, WORDS)
