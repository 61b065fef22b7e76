"""The name of a role's weight where it is cut from a fused projection: `qkv[0:32]`, `kv[32:64]` (fused.py names the
rows a role reads so). Two roles cut from one layer read the same layer, which the data flow cannot tell apart."""

from __future__ import annotations


def layer_of(name: str) -> str:
    """The layer a role's weight is read from: `qkv[0:32]` -> `qkv`; a whole layer's name as it is."""
    return name.split("[")[0]


def one_layer(first: set[str], second: set[str]) -> bool:
    """Whether two roles' weights (each a set of names) are read, in part, from one and the same layer."""
    return bool({layer_of(n) for n in first} & {layer_of(n) for n in second})
