"""The catalog's key and value mistakes of the input a projection reads, where the code takes its keys and values
from inputs of its own (`forward(query, key, value)`, a cross-attention's `key`, `value`): each projection right, fed
the other input. `k = self.k_proj(value)` and `v = self.v_proj(key)` (the inputs swapped: kv.swapped); the keys made
from the value input (kv.keys_from_values); the values from the key input (kv.values_from_keys). Self-attention
feeds one x to all three, where none of these changes a number (kvtrials.by_other_weights gives None there). The
keys are rotated as the reference rotates them; a qk-norm or a pooling between the projection and the heads is
left to the entries that rerun those."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attnscope.usertrace.kvtrials import by_other_weights, heads_of
from attnscope.usertrace.rerun import Base, replay
from attnscope.usertrace.roperead import read_rope, rope_turn
from attnscope.usertrace.trials import Trial


def inputs_swapped(b: Base) -> Iterator[Trial]:
    """kv.swapped at the inputs: K = value · W_kᵀ + b_k and V = key · W_vᵀ + b_v."""
    keys, values = _keys_from(b, 2), _values_from(b, 1)
    if keys is None or values is None:
        return
    steps = replay(b, k_new=keys[1], v_new=values[1])
    steps["K_feat"], steps["V_feat"] = keys[0], values[0]
    yield Trial(steps, f"keys and values swapped at their inputs: {{who}} is what the reference computes with the "
                f"key projection fed the value input and the value projection the key input (`self.{keys[2]}(value)` "
                f"for the keys, `self.{values[2]}(key)` for the values); each projection is right, its input is the "
                "other's")


def projections_swapped(b: Base) -> Iterator[Trial]:
    """kv.swapped at the projections where the keys' and values' inputs differ (a position added to what the keys
    read, not the values: Mask2Former's `k_proj(x + pos)`, `v_proj(x)`): K = key · W_vᵀ + b_v and V = value · W_kᵀ
    + b_k, each input where it belongs and each projection the other's. Where the two inputs are one x,
    kvtrials.trials_swapped's swap of the reference's own K and V is the same run, and this gives nothing."""
    made_k, made_v = by_other_weights(b, "v", 1), by_other_weights(b, "k", 2)
    if made_k is None or made_v is None or b.raw_keys is not None \
            or any(name in b.ref for name in ("K_normed", "K_pooled", "V_normed", "V_pooled")):
        return
    keys, values = heads_of(made_k[0], b.k_new, b.strided), heads_of(made_v[0], b.v_new, b.strided)
    if keys is None or values is None:
        return
    rope = read_rope(b)
    keys = keys.to(b.k_new.dtype)
    steps = replay(b, k_new=rope_turn(rope)(keys, rope.k_pos) if rope is not None else keys,
                   v_new=values.to(b.v_new.dtype))
    steps["K_feat"], steps["V_feat"] = made_k[0], made_v[0]
    yield Trial(steps, f"keys and values swapped at their projections: {{who}} is what the reference computes with "
                f"the keys made by the value projection and the values by the key projection, each from its own "
                f"input (`self.{made_k[1]}(...)` for the keys, `self.{made_v[1]}(...)` for the values)")


def keys_from_value_input(b: Base) -> Iterator[Trial]:
    """kv.keys_from_values at the inputs: K = value · W_kᵀ + b_k, the values as they are."""
    keys = _keys_from(b, 2)
    if keys is None:
        return
    steps = replay(b, k_new=keys[1])
    steps["K_feat"] = keys[0]
    yield Trial(steps, f"the keys made from the value input: {{who}} is what the reference computes with the key "
                f"projection fed the value input (`self.{keys[2]}(value)`) where it should read the key input")


def values_from_key_input(b: Base) -> Iterator[Trial]:
    """kv.values_from_keys at the inputs: V = key · W_vᵀ + b_v, the keys as they are."""
    values = _values_from(b, 1)
    if values is None:
        return
    steps = replay(b, v_new=values[1])
    steps["V_feat"] = values[0]
    yield Trial(steps, f"the values made from the key input: {{who}} is what the reference computes with the value "
                f"projection fed the key input (`self.{values[2]}(key)`) where it should read the value input")


def _keys_from(b: Base, index: int) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The reference's input `index` through the key projection: the projection's output [n_batch, n, width], its
    heads as the code's new keys hold them (rotated where the reference rotates), the projection's name."""
    if b.raw_keys is not None or "K_normed" in b.ref or "K_pooled" in b.ref:
        return None
    made = by_other_weights(b, "k", index)
    if made is None:
        return None
    heads = heads_of(made[0], b.k_new, b.strided)
    if heads is None:
        return None
    heads = heads.to(b.k_new.dtype)
    rope = read_rope(b)
    return made[0], rope_turn(rope)(heads, rope.k_pos) if rope is not None else heads, made[1]


def _values_from(b: Base, index: int) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The reference's input `index` through the value projection: its output, its heads, its name."""
    if b.raw_keys is not None or "V_pooled" in b.ref or "V_normed" in b.ref:
        return None
    made = by_other_weights(b, "v", index)
    if made is None:
        return None
    heads = heads_of(made[0], b.v_new, b.strided)
    return None if heads is None else (made[0], heads.to(b.v_new.dtype), made[1])
