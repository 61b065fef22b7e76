"""The catalog's kv.keys_from_values: the keys made by the value projection (`k = self.v_proj(x)`, a copy-paste
slip, the mirror of kv.values_from_keys), rotated, normed and pooled as the keys are; the values left as they are."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attnscope.usertrace.kvtrials import by_other_weights, heads_of
from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.roperead import ReadRope, read_rope, rope_turn
from attnscope.usertrace.trials import Trial

WORDS = ("the keys are the values: {who} is what the reference computes with K = V{how}, as though the key "
         "projection were the value one (`k = v`, or `self.v_proj(x)` for the keys)")


def trials_keys_from_values(b: Base) -> Iterator[Trial]:
    if b.k_new.shape[:-1] != b.v_new.shape[:-1] or b.raw_keys is not None:
        return
    rope = read_rope(b)
    plain = b.v_new if b.k_new.shape == b.v_new.shape else None
    if plain is not None and "K_normed" not in b.ref:
        keys = rope_turn(rope)(plain, rope.k_pos) if rope is not None else plain
        yield Trial(_values_projected(b, replay(b, k_new=keys)),
                    WORDS.replace("{how}", ", then rotated as the keys are" if rope is not None else ""))
    if plain is not None and "K_normed" in b.ref:
        yield from _normed(b, plain, rope)
    if "K_pooled" in b.ref and "V_pooled" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        # keys made by the value projection before the code pools them (pooled.py): the pooled keys the
        # reference reads are the code's own, so K_feat alone is the values' projection
        yield Trial(_values_projected(b, replay(b)), WORDS.replace("{how}", " before your code pools them"))
    yield from _key_input_by_values(b, rope)


def _normed(b: Base, values: torch.Tensor, rope: ReadRope | None) -> Iterator[Trial]:
    """The value projection's output normed by the keys' qk-norm (refit from the reference's keys before and after
    it, over each head), then rotated where the reference rotates."""
    from attnscope.usertrace.fusedsplit import refit_norm

    unnormed, normed = b.ref.get("K_split"), b.ref.get("K_normed")
    if unnormed is None or normed is None or unnormed.shape != values.shape:
        return
    norm = refit_norm(unnormed, normed)
    if norm is None:
        return
    keys = norm(values).to(values.dtype)
    turned = rope_turn(rope)(keys, rope.k_pos) if rope is not None else keys
    steps = replay(b, k_new=turned)
    steps["K_split"], steps["K_normed"] = values, keys
    done = ", normed and rotated" if rope is not None else ", normed"
    yield Trial(_values_projected(b, steps), WORDS.replace("{how}", f"{done} as the keys are"))


def _key_input_by_values(b: Base, rope: ReadRope | None) -> Iterator[Trial]:
    """The key input through the value projection (`k = shape(self.v_lin(key))`): where the code takes its keys and
    values from inputs of their own, K = V never holds, yet its keys are key · W_vᵀ + b_v, split into heads as the
    reference splits K_feat, rotated as its keys are."""
    made = by_other_weights(b, "v", 1)
    if made is None or "K_normed" in b.ref or "K_pooled" in b.ref:
        return
    feat, name = made
    heads = heads_of(feat, b.k_new, b.strided)
    if heads is None:
        return
    heads = heads.to(b.k_new.dtype)
    keys = rope_turn(rope)(heads, rope.k_pos) if rope is not None else heads
    steps = replay(b, k_new=keys)
    steps["K_feat"] = feat
    yield Trial(steps, f"the keys made by the value projection: {{who}} is what the reference computes with the key "
                f"input through {name} (K = key · W_vᵀ + b_v, `self.v_proj(key)`), the key projection left unused; "
                "your keys and values come from inputs of their own, so K = V is not what it gives")


def _values_projected(b: Base, steps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`steps` with K_feat the values' projection, V_feat (`k = self.v_proj(x)`)."""
    if "V_feat" in b.ref and "K_feat" in b.ref and b.ref["V_feat"].shape == b.ref["K_feat"].shape:
        steps["K_feat"] = b.ref["V_feat"]
    return steps
