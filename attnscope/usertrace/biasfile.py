"""A --position-bias file's shape, read before the user's code runs: the sizes it says where no flag and no --mask
file does (its last two axes the queries' and keys' counts, as the mask file's last axis says n_K), and whether it
fits the sizes chosen, so a file of another shape is refused in one line that says both shapes, not met as an error
raised in the user's code. Two readings, as keytable.table_of takes them: an additive bias `[.., n_Q, n_K]` (T5's
`position_bias`, `[1, n_head, n_Q, n_K]`) and a relative key table `[n_Q, n_K, d_head]` (SpeechT5's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch


def _table(shape: tuple[int, ...], self_attention: bool) -> bool:
    """Whether a 3-D file reads as a relative key table [n_Q, n_K, d_head] rather than a bias [n_head, n_Q, n_K]:
    of self-attention, its first two axes equal where its last two are not (a table's n_Q = n_K)."""
    return len(shape) == 3 and self_attention and shape[0] == shape[1] != shape[2]


def sizes(shape: tuple[int, ...], self_attention: bool, cache: int, batch_given: bool) -> dict[str, int]:
    """n_Q (self-attention without a cache: the keys' count is the queries'), n_K (keys given apart) and n_batch (a
    4-D bias's first axis) as a file of `shape` says them; an axis of 1 is shared and says nothing."""
    if len(shape) < 2:
        return {}
    n_Q, n_K = shape[:2] if _table(shape, self_attention) else shape[-2:]
    found: dict[str, int] = {}
    if self_attention and not cache and n_Q > 1:
        found["n_Q"] = n_Q
    if not self_attention:
        found |= {name: n for name, n in (("n_Q", n_Q), ("n_K", n_K)) if n > 1}
    if len(shape) == 4 and shape[0] > 1 and not batch_given:
        found["n_batch"] = shape[0]
    return found


def check(bias: torch.Tensor, sizes: dict[str, int], name: str = "--position-bias") -> None:
    """Refused where `bias` fits the reference's scores `[n_batch, n_head, n_Q, n_K]` (the sizes known; an axis of 1
    broadcasts) neither as an additive bias nor as a relative key table `[n_Q, n_K, d_head]`."""
    shape = tuple(int(s) for s in bias.shape)
    dims = ("n_batch", "n_head", "n_Q", "n_K") if "n_batch" in sizes else ("n_head", "n_Q", "n_K")
    paired = list(zip(reversed(shape), reversed(dims), strict=False))
    additive = len(shape) >= 2 and all(n == 1 or sizes.get(dim, n) == n for n, dim in paired) \
        and all(n == 1 for n in shape[:max(0, len(shape) - len(dims))])
    if additive or (len(shape) == 3 and shape[:2] == (sizes["n_Q"], sizes["n_K"])):
        return
    scores = ", ".join(f"{dim} = {sizes[dim]}" if dim in sizes else dim for dim in dims)
    table = f"[{sizes['n_Q']}, {sizes['n_K']}, {sizes.get('d_head', 'd_head')}]"
    raise UsageError(f"{name} holds {list(shape)}, which fits the scores [{scores}] neither as an additive bias "
                     "[.., n_Q, n_K] (its axes those of the scores from the right, or 1: T5's [1, n_head, n_Q, n_K]) "
                     f"nor as a relative key table [n_Q, n_K, d_head] = {table} (SpeechT5's): give a file of one of "
                     "those shapes, or --nq/--nk/--batch that match the file")
