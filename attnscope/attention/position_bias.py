"""A position bias added to the scores, as its own step: `position_bias` (the bias as given) and
`biased_scores = scores + position_bias`, before the mask and the softmax.

T5 learns its positions this way instead of embedding them: a table of `relative_attention_num_buckets`
numbers per head, looked up by the bucket of each (query, key) distance (models/families/t5.py makes the bucketed
`[1, n_head, n_Q, n_K]` bias; transformers' `T5Attention.compute_bias`), and added to the unscaled scores
(`eager_attention_forward` in modeling_t5.py: `scores + position_bias`, then the mask). Here the bias is data:
any float tensor that broadcasts to the scores, from a family page, a file (`--position-bias FILE` on sdpa and
mha) or a Python caller. ALiBi (alibi.py) is the same idea with a fixed formula and has its own steps, so the
two are not combined in one run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.trace import Trace


def check_bias(bias: Tensor, scores_shape: tuple[int, ...]) -> None:
    """The bias is a float tensor that broadcasts to the scores `[.., n_Q, n_K]` (as an additive mask does)."""
    from attnscope.cost import broadcast_shapes

    shape = list(bias.shape)
    if not bias.is_floating_point():
        raise UsageError(f"{{position_bias}} is {str(bias.dtype).removeprefix('torch.')}: a position bias is added "
                         "to the scores, so it must hold floats", "position_bias")
    if bias.dim() < 2:
        raise UsageError(f"{{position_bias}} is {shape}: give it as [.., n_Q, n_K] (T5's is [1, n_head, n_Q, n_K])",
                         "position_bias")
    try:
        fits = broadcast_shapes(bias.shape, scores_shape) == tuple(scores_shape)
    except ValueError:
        fits = False
    if not fits:
        raise UsageError(f"{{position_bias}} is {shape} but the scores are {list(scores_shape)}: the bias must "
                         "broadcast to them ([.., n_Q, n_K], 1 for any axis it shares)", "position_bias")


def add_position_bias(trace: Trace, logits: Tensor, last: str, bias: Tensor,
                      leading: tuple[str, ...]) -> tuple[Tensor, str]:
    """Steps `position_bias` (the bias as given, in the scores' dtype; `leading` names its axes before
    n_Q, n_K) and `biased_scores`."""
    check_bias(bias, tuple(logits.shape))
    bias = bias.to(device=logits.device, dtype=logits.dtype)
    trace.add("position_bias", bias, (*leading[len(leading) - (bias.dim() - 2):], "n_Q", "n_K"),
              "input: a position bias, added to the scores (T5's relative position bias)")
    biased = logits + bias  # [.., n_Q, n_K]
    trace.add("biased_scores", biased, trace.step(last).dims, f"{last} + position_bias", biased.numel())
    return biased, "biased_scores"
