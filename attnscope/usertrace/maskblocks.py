"""mask.off_by_one's changes for a mask that is no band: a pattern the causal rule cuts (Llama 4's chunked local
attention, `j <= i` within blocks of C positions; a causal mask beside blocks or global tokens of a --mask file),
its causal edge moved by one key, and its blocks' boundaries moved by one position; and a prefix LM's (GIT's, `j <= i
or j < P`), its causal edge moved after the prefix."""

from __future__ import annotations

import torch


def changes(allowed: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """The mask (True = may attend, [.., n, n], the same for every sequence and head) as a symmetric pattern cut by
    the causal rule (`sym & (j <= i)`, sym = the mask or its transpose), with its causal edge one key wider or
    narrower (`j <= i + 1`, `j <= i - 1`) and, where the pattern is blocks of C positions (chunks), their boundaries
    moved by one position either way; each with its words. Nothing for a band (masktrials._band's) or a mask that
    is not so."""
    n_Q, n_K = allowed.shape[-2:]
    if n_Q != n_K or n_Q < 3:
        return []
    cells = allowed.reshape(-1, n_Q, n_K)
    if not bool((cells == cells[:1]).all()):
        return []
    grid = cells[0]
    rel = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None]  # j - i
    prefix = _prefix(grid, rel)
    if prefix is not None:  # a prefix LM: the causal edge moved in the rows after the prefix, the prefix kept
        seen, later = torch.arange(n_K)[None, :] < prefix, torch.arange(n_Q)[:, None] >= prefix
        return [(changed.expand_as(allowed), words) for changed, words in (
            (grid | ((rel == 1) & later), f"the causal edge is off by 1 after your mask's prefix of {prefix} "
             "positions (seen by all, among themselves both ways): each later query also sees the next key after it; "
             "{who} is what the reference computes with `j <= i + 1` where `j <= i` is meant"),
            ((rel <= -1) | seen, f"the causal edge is off by one the other way after your mask's prefix of {prefix} "
             "positions (seen by all, among themselves both ways): no later query may see its own key; {who} is "
             "what the reference computes with `j < i` where `j <= i` is meant (`triu(..., diagonal=0)` for a "
             "future mask that is `triu(..., diagonal=1)`)"))]
    sym = grid | grid.T
    if bool(sym.all()) or not bool(torch.equal(sym & (rel <= 0), grid)):
        return []  # the causal rule alone (masktrials' own changes), or no pattern the rule cuts
    found = [(sym & (rel <= 1), "the causal edge is off by 1 inside your mask's pattern: each query also sees the "
              "next key after it where the pattern lets it; {who} is what the reference computes with `j <= i + 1` "
              "where `j <= i` is meant"),
             (sym & (rel <= -1), "the causal edge is off by one the other way inside your mask's pattern: no query "
              "may see its own key; {who} is what the reference computes with `j < i` where `j <= i` is meant")]
    chunk = _chunk(sym)
    if chunk is not None:
        i, j = torch.arange(n_Q)[:, None], torch.arange(n_K)[None, :]
        for shift in dict.fromkeys((1, chunk - 1)):
            moved = ((i + shift) // chunk == (j + shift) // chunk) & (rel <= 0)
            how = "earlier" if shift == 1 else "later"
            found.append((moved, f"the chunks' boundaries are off by 1: {{who}} is what the reference computes with "
                          f"each chunk of {chunk} positions starting one position {how} (`(i + {shift}) // {chunk} "
                          f"== (j + {shift}) // {chunk}` where `i // {chunk} == j // {chunk}` is meant: a chunk "
                          "starts at a multiple of its size, position 0 the first chunk's first)"))
    return [(changed.expand_as(allowed), words) for changed, words in found]


def _prefix(grid: torch.Tensor, rel: torch.Tensor) -> int | None:
    """The length P of a prefix LM's prefix where `grid` [n, n] is `j <= i or j < P` (GIT's image tokens, a prefix
    LM's prompt: the first P positions see each other both ways, every later one sees them and the keys up to
    itself), 1 < P < n; None otherwise."""
    n = grid.shape[-1]
    j = torch.arange(n)[None, :]
    return next((p for p in range(2, n) if bool(torch.equal((rel <= 0) | (j < p), grid))), None)


def _chunk(sym: torch.Tensor) -> int | None:
    """The size C where `sym` [n, n] is blocks of C positions along the diagonal from position 0
    (`i // C == j // C`, the last block maybe shorter), with at least two blocks; None otherwise."""
    n = sym.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for chunk in range(2, n):
        if bool(torch.equal(i // chunk == j // chunk, sym)):
            return chunk
    return None
