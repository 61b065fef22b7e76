"""The query heads' width where the query projection writes more than the queries: Qwen3-Next's `q_proj` makes
num_heads · head_dim · 2 features (each head's queries beside its gate), so its width over the head count is not
d_head. Where the module says head_dim, the heads are read at that width; where it says no head count, the output
projection's width says it (what the merged heads are), not the query projection's. widerows.py then reads which
rows the queries are, from the run.
"""

from __future__ import annotations


def head_count(q_width: int, k_width: int, o_width: int | None, d_head: int) -> int | None:
    """n_head from the module's head_dim: the output projection's input width over it where the query projection
    writes a multiple of that width (a gate beside the queries) and the keys' heads group those, else the query
    projection's width over it; None where d_head divides neither."""
    if o_width and o_width % d_head == 0 and q_width % o_width == 0 and _groups(k_width, o_width // d_head, d_head):
        return o_width // d_head
    return q_width // d_head if q_width % d_head == 0 else None


def query_width(q_width: int, k_width: int, n_head: int, d_head: int | None) -> int:
    """The width the query heads read: n_head · head_dim where the module says head_dim, the query projection writes
    a whole multiple of it (the rest a gate, or a second query) and the keys' heads of head_dim group the n_head
    (a differential attention's keys, two a head, are not); else the query projection's width."""
    if d_head and q_width != n_head * d_head and q_width % (n_head * d_head) == 0 and _groups(k_width, n_head, d_head):
        return n_head * d_head
    return q_width


def _groups(k_width: int, n_head: int, d_head: int) -> bool:
    """Whether the keys' width is heads of d_head that the n_head query heads share (as many, or GQA's fewer)."""
    return k_width % d_head == 0 and 0 < k_width // d_head <= n_head and n_head % (k_width // d_head) == 0
