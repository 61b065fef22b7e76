"""The catalog's mask.transposed: a mask applied with its queries' and keys' axes exchanged (`tril` where `triu` was
meant, `mask.transpose(-1, -2)`, a band built as `j >= i` where `j <= i` is meant): the causal rule mirrored about
its diagonal, the key padding then on the queries."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.trialreads import has_mask
from attnscope.usertrace.trials import Trial

_WHOLE = ("the mask is transposed: {who} is what the reference computes with its mask's last two axes exchanged "
          "(`mask.transpose(-1, -2)`), each query masked as its key should be: a causal rule turned into an "
          "anticausal mask (`triu` where `tril` is meant, `j >= i` for `j <= i`), key padding on the queries; the "
          "mask's rows are the queries (n_Q) and its columns the keys (n_K)")
_RULE = ("the causal or window rule is transposed: {who} is what the reference computes with the rule mirrored "
         "about its diagonal, each query seeing the keys after it where it should see those before it (`triu` "
         "where `tril` is meant, `j >= i` for `j <= i`, key position minus query position with its sign flipped), "
         "the padded keys still masked")


def trials_transposed(b: Base) -> Iterator[Trial]:
    """The whole mask transposed, where it is square; the rule alone mirrored (a band lo <= j - i <= hi turned into
    -hi <= j - i <= -lo, aligned as the reference aligns it), the key padding beside it kept. Each only where it
    changes the mask."""
    from attnscope.usertrace.masktrials import rule_and_keys

    if not has_mask(b):
        return
    assert b.allowed is not None
    allowed = b.allowed
    tried: list[torch.Tensor] = []
    changes: list[tuple[torch.Tensor, str]] = []
    if allowed.shape[-1] == allowed.shape[-2]:
        changes.append((allowed.transpose(-1, -2), _WHOLE))
    rule, keys = rule_and_keys(b)
    if rule is not None and keys is not None:
        mirrored = _mirrored(rule)
        if mirrored is not None:
            changes.append((mirrored & keys, _RULE))
    for changed, words in changes:
        changed = changed.expand_as(allowed)
        if bool(torch.equal(changed, allowed)) or not bool(changed.any()) or any(
                bool(torch.equal(changed, t)) for t in tried):
            continue
        tried.append(changed)
        yield Trial(replay(b, allowed=changed), words)


def _mirrored(rule: torch.Tensor) -> torch.Tensor | None:
    """A rule [n_Q, n_K] that is a band of diagonals lo <= j - i - shift <= hi (shift 0: upper-left; n_K - n_Q:
    lower-right), causal or a window, mirrored about its diagonal: -hi <= j - i - shift <= -lo; its transpose where
    it is square and no band; None otherwise."""
    n_Q, n_K = rule.shape[-2:]
    if bool(rule.any()):
        for shift in dict.fromkeys((n_K - n_Q, 0)):
            rel = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None] - shift
            lo, hi = int(rel[rule].min()), int(rel[rule].max())
            if bool(torch.equal((rel >= lo) & (rel <= hi), rule)):
                return (rel >= -hi) & (rel <= -lo)
    return rule.transpose(-1, -2) if n_Q == n_K else None
