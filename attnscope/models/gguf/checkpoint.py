"""A GGUF file seen as a checkpoint in transformers' names (models/checkpoint.py's interface: `keys`, `shape`,
`nbytes`, `slice`, `tensor`, `rows`), each tensor read from its own memory map of the file and dequantized
when asked for, so a run through layers 0..L reads those layers' bytes and nothing else.

What transformers' GGUF loader does to a tensor on its way to the model is done here on the rows read
(`modeling_gguf_pytorch_utils`: its name map, from gguf-py's `tensor_mapping.py`, and its `TensorProcessor`s):
- LLaMA's attn_q and attn_k (`LlamaTensorProcessor._reverse_permute_weights`): llama.cpp's converter
  (`LlamaModel.permute`) interleaves each head's two rotary halves, row i of the first half and row i of the
  second stored side by side; head h's rows are put back in transformers' half-split order. The reorder stays
  inside a head, so head h is still rows h·d_head ..., read alone.
- Gemma 2 and 3's norms (`Gemma2TensorProcessor`): llama.cpp stores `1 + w`; 1 is subtracted, as the page
  computes Gemma's `(1 + w)`.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from attnscope.errors import UsageError
from attnscope.models.gguf import quants
from attnscope.models.gguf.buffers import Buffers
from attnscope.models.gguf.header import Header, TensorInfo, read_bytes, with_bytes

if TYPE_CHECKING:
    import numpy as np
    import torch

# GGUF's block tensor names -> transformers' (gguf-py's tensor_mapping.py, read the other way round)
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}
# Gemma's four norms per layer: ffn_norm is the one before the MLP
GEMMA = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
         "post_ffw_norm": "post_feedforward_layernorm"}
PHI3 = {"ffn_up": "mlp.gate_up_proj"}  # Phi-3 keeps gate and up fused
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def transformers_name(arch: str, name: str) -> str | None:
    """The key transformers gives a GGUF tensor; None for one the family pages never read (rope_freqs, ...)."""
    if name in TOP:
        return TOP[name]
    match = BLOCK_NAME.fullmatch(name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    table = {**BLOCK, **(GEMMA if arch in ("gemma2", "gemma3") else {}), **(PHI3 if arch == "phi3" else {})}
    return f"model.layers.{layer}.{table[part]}.{kind}" if part in table else None


KEEP_SHARE = 0.5  # at most this share of the memory available when the file is opened is kept dequantized
KEEP_CAP = 8 << 30  # and never more than 8 GiB
KEEP_FRACTION = 16  # and at most a sixteenth of the model's float32 weights,
KEEP_FLOOR = 32 << 20  # or 32 MiB where that is more (a small model is kept whole)
PRODUCT_ROWS = 4096  # rows of a weight expanded at a time by `product` (the LM head: 9 MiB of SmolLM2's float32)


class GgufCheckpoint:
    """Every tensor of a GGUF file (or its shards) in transformers' names, dequantized to float32 when read.

    A run that reads the layers again (`--generate`: every layer for each new token) says so (`reads_again`):
    from then on each whole tensor is dequantized once and kept, while the kept tensors stay within `keep_bytes`
    (a sixteenth of the model's float32 weights, or 32 MiB where that is more; never over half the memory
    available when the file was opened, nor 8 GiB); past that bound a tensor is expanded again from the file's
    bytes at each read (expand.py: torch, about 0.7 ns a value, the same bits), and the LM head's product is
    taken a few thousand rows at a time (`product`), so its [vocab, d_model] float32 matrix is never whole. A
    single pass (`--all-layers`, a long text) keeps nothing: a layer's float32 weights are let go with the
    layer."""

    def __init__(self, header: Header) -> None:
        from attnscope.models.gguf.config import architecture, config_of

        self.folder = header.path  # what the run names and reads the tokenizer from: the file itself
        self.source = header.path
        self.arch = architecture(header)
        config = config_of(header)
        self.n_head = config["num_attention_heads"]
        self.n_kv_head = config["num_key_value_heads"]
        self._infos: dict[str, TensorInfo] = {}
        for name, info in header.tensors.items():
            key = transformers_name(self.arch, name)
            if key is not None:
                self._infos[key] = info
        self._keep = False
        self._kept: dict[str, torch.Tensor] = {}
        self._kept_bytes = 0
        self._buffers = Buffers()
        float32_bytes = 4 * sum(math.prod(info.shape) for info in self._infos.values())
        self.keep_bytes = min(_keep_bound(), max(KEEP_FLOOR, float32_bytes // KEEP_FRACTION))
        self._check_shapes(config)

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._kept.clear()
        self._kept_bytes = 0
        self._buffers.clear()

    def reads_again(self) -> None:
        """The run reads its layers again (decoding): keep what is dequantized from now on, within the bound."""
        self._keep = True

    # --- what is there ----------------------------------------------------------------------------------

    @property
    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    @property
    def sharded(self) -> bool:
        return len({info.path for info in self._infos.values()}) > 1

    def shape(self, key: str) -> list[int]:
        return list(self._info(key).shape)

    def nbytes(self, key: str) -> int:
        return self._info(key).nbytes

    def source_of(self, key: str, text: str) -> str:
        """Where a slice came from: the GGUF tensor, the slice, its type and what was done to it
        (`blk.1.attn_q.weight[64:128, :] (Q4_1 -> float32, rotary rows reordered)`)."""
        info = self._info(key)
        done = [f"{quants.names().get(info.ggml_type, info.ggml_type)} -> float32"]
        if self._permuted(info) is not None:
            done.append("rotary rows reordered")
        if self._offset(info):
            done.append("stored as 1 + w")
        return f"{info.name}{text} ({', '.join(done)})"

    # --- reading ----------------------------------------------------------------------------------------

    def slice(self, key: str, axis: str, lo: int, hi: int) -> tuple[np.ndarray, str]:
        """Rows (`axis="rows"`) or columns lo:hi of a weight, or lo:hi of a bias, float32 NumPy: rows are read
        alone (whole heads of a reordered Q or K), columns from the whole weight."""
        info = self._info(key)
        rank = len(info.shape)
        if axis == "rows" or rank == 1:
            group = self._permuted(info) or 1  # read whole heads where rows are reordered within a head
            first, last = lo - lo % group, -(-hi // group) * group
            values = self._rows(info, first, last)[lo - first : hi - first]
            text = f"[{lo}:{hi}]" if rank == 1 else f"[{lo}:{hi}, :]"
        else:
            values = self._rows(info, 0, info.shape[0])[:, lo:hi]
            text = f"[:, {lo}:{hi}]"
        return values.copy(), text

    def tensor(self, key: str) -> torch.Tensor:
        if key in self._kept:
            return self._kept[key]
        info = self._info(key)
        size = 4 * math.prod(info.shape)
        if self._keep and self._kept_bytes + size <= self.keep_bytes:  # dequantized once, kept for the run
            self._kept[key] = whole = self._expanded(info, 0, info.shape[0])
            self._kept_bytes += size
            return whole
        return self._expanded(info, 0, info.shape[0], reused=self._keep)

    def product(self, key: str, h: torch.Tensor) -> torch.Tensor:
        """`h @ W.T` for the matrix `key` `[n_out, d_model]` (the LM head), `[.., n_out]`: the kept float32 matrix
        where there is one, else `PRODUCT_ROWS` of its rows expanded at a time, so a [vocab, d_model] float32
        matrix is never held whole. Each output is the same dot product either way (one row of W against h), and
        the same bits (tests/test_gguf_expand.py)."""
        import torch
        import torch.nn.functional as F

        if key in self._kept:
            return h @ self._kept[key].T  # [.., d_model] @ [d_model, n_out]
        info = self._info(key)
        step = PRODUCT_ROWS - PRODUCT_ROWS % (self._permuted(info) or 1)  # whole heads of a reordered Q or K
        parts = [F.linear(h, self._expanded(info, lo, min(lo + step, info.shape[0]), reused=True))  # [.., rows]
                 for lo in range(0, info.shape[0], step)]
        return torch.cat(parts, dim=-1)  # [.., n_out]

    def rows(self, key: str, index: list[int]) -> torch.Tensor:
        """Rows `index` of a matrix (the embedding's rows for these token ids), float32: only those are read."""
        import numpy as np
        import torch

        info = self._info(key)
        vocab = info.shape[0]
        bad = [i for i in index if not 0 <= i < vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside {info.name}'s {vocab} rows: the tokenizer does not belong "
                             "to this model (its vocabulary is larger than the model's)")
        unique = sorted(set(index))
        picked = np.concatenate([self._rows(info, i, i + 1) for i in unique])  # [n_unique, d_model]
        where = {token: row for row, token in enumerate(unique)}
        return torch.from_numpy(picked[[where[i] for i in index]])  # [n_tokens, d_model]

    # --- internals --------------------------------------------------------------------------------------

    def _check_shapes(self, config: dict[str, object]) -> None:
        """The norms' and MLP's shapes against the metadata (models/shapes.py checks the attention's and the
        embedding's once the family is open): a damaged dimension is refused here, not met inside PyTorch."""
        d, d_ff, d_head = config["hidden_size"], config.get("intermediate_size"), config.get("head_dim")
        fused = (2 if self.arch == "phi3" else 1) * d_ff if isinstance(d_ff, int) else None
        wanted = {"q_norm.weight": [d_head], "k_norm.weight": [d_head], "norm.weight": [d],  # the first that ends it
                  "gate_up_proj.weight": [fused, d], "gate_proj.weight": [d_ff, d], "up_proj.weight": [d_ff, d],
                  "down_proj.weight": [d, d_ff], "lm_head.weight": [config.get("vocab_size"), d]}
        for key, info in self._infos.items():
            want = next((shape for end, shape in wanted.items() if key.endswith(end)), None)
            if want is not None and None not in want and list(info.shape) != want:
                raise UsageError(f"{{model}} {info.path}: tensor {info.name} is {list(info.shape)}, but the metadata "
                                 f"implies {want} (embedding_length {d}, feed_forward_length {d_ff}); the file is "
                                 "damaged or its metadata does not describe it", "model")

    def _info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise UsageError(f"{self.source}: no tensor for {key}; the GGUF file is incomplete, or its metadata "
                             "does not describe these weights") from None

    def _permuted(self, info: TensorInfo) -> int | None:
        """The rows per head of a LLaMA Q or K (or its bias) llama.cpp reordered; None for any other tensor."""
        if self.arch != "llama" or not re.search(r"\.attn_[qk]\.", info.name):
            return None
        heads = self.n_head if ".attn_q." in info.name else self.n_kv_head
        return info.shape[0] // heads

    def _offset(self, info: TensorInfo) -> bool:
        """Gemma's norms, stored as 1 + w (transformers' Gemma2TensorProcessor: any `norm.weight`)."""
        return self.arch in ("gemma2", "gemma3") and "norm.weight" in info.name

    def _expanded(self, info: TensorInfo, lo: int, hi: int, reused: bool = False) -> torch.Tensor:
        """Rows lo:hi of a tensor as `_rows` gives them, float32: a matrix of a type expand.py takes is expanded by
        torch (its byte rows put back in transformers' order first: a block never spans two rows), into an array
        of `_buffers` that no tensor holds any more with `reused` (decoding), the rest by `_rows`."""
        import torch

        from attnscope.models.gguf.expand import TYPES, expand

        name = quants.names().get(info.ggml_type)
        if len(info.shape) != 2 or name not in TYPES or self._offset(info):
            return torch.from_numpy(self._rows(info, lo, hi))
        width, group = quants.row_bytes(info.ggml_type, info.shape[1]), self._permuted(info)
        into = self._buffers.take(hi - lo, info.shape[1]) if reused else None

        def use(raw: np.ndarray) -> torch.Tensor:  # [rows · bytes per row], in the file's map
            if group is not None:  # whole heads: lo and hi on head boundaries
                raw = _unpermute(raw.reshape(hi - lo, width), group).reshape(-1)
            return expand(torch.from_numpy(raw), name, hi - lo, info.shape[1], into)  # [rows, cols]

        return with_bytes(info, lo * width, hi * width, use)

    def _rows(self, info: TensorInfo, lo: int, hi: int) -> np.ndarray:
        """Rows lo:hi (lo and hi on head boundaries for a reordered Q or K), dequantized and put back in
        transformers' order: a fresh float32 array."""
        cols = info.shape[-1] if len(info.shape) > 1 else info.shape[0]
        if len(info.shape) == 1:
            raw = read_bytes(info, 0, info.nbytes)
            values = quants.dequantize(raw, info.ggml_type, 1, cols, f"{info.path}: {info.name}")[0, lo:hi]
        else:
            width = quants.row_bytes(info.ggml_type, cols)
            raw = read_bytes(info, lo * width, hi * width)
            values = quants.dequantize(raw, info.ggml_type, hi - lo, cols, f"{info.path}: {info.name}")
        group = self._permuted(info)
        if group is not None:
            values = _unpermute(values, group)
        if self._offset(info):
            values = values - 1  # in float32, as transformers subtracts from the float32 it dequantized
        return values


def _keep_bound() -> int:
    """Bytes of dequantized tensors a run may keep: `KEEP_SHARE` of the memory available now, at most `KEEP_CAP`
    (where the available memory is unknown, 1 GiB)."""
    from attnscope.cost import available_memory

    available = available_memory()
    return min(KEEP_CAP, int(available * KEEP_SHARE)) if available is not None else 1 << 30


def _unpermute(values: np.ndarray, per_head: int) -> np.ndarray:
    """transformers' `_reverse_permute_weights` on whole heads: `[heads, per_head/2, 2, ...]` -> `[heads, 2,
    per_head/2, ...]`."""
    rest = values.shape[1:]
    heads = values.shape[0] // per_head
    split = values.reshape(heads, per_head // 2, 2, *rest)  # [n_head, d_head/2, 2, d_model]
    return split.swapaxes(2, 1).reshape(values.shape)  # [n_head, 2, d_head/2, d_model] -> [rows, d_model]
