"""mask.off_by_one's changes for a mask that is no band: a pattern the causal rule cuts (Llama 4's chunked local
attention, `j <= i` within blocks of C positions; a causal mask beside blocks or global tokens of a --mask file),
its causal edge moved by one key, and its blocks' boundaries moved by one position."""

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


def _chunk(sym: torch.Tensor) -> int | None:
    """The size C where `sym` [n, n] is blocks of C positions along the diagonal from position 0
    (`i // C == j // C`, the last block maybe shorter), with at least two blocks; None otherwise."""
    n = sym.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for chunk in range(2, n):
        if bool(torch.equal(i // chunk == j // chunk, sym)):
            return chunk
    return None
