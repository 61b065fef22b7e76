from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
