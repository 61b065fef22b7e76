"""The user's callable: `FILE.py:NAME` imported under a private module name, `--init` read as literals, and
what its signature asks for.

Importing the file runs its top-level code, as `python FILE.py` would (but not its `__main__` block).
Only the one named `.py` file is imported, under `_attnscope_user_<hash>` (importlib's
`spec_from_file_location`), so a file called `torch.py` cannot shadow the real torch. Its folder is
appended to `sys.path` while it runs, so `import helpers` beside it still works. A file that imports
relatively from its package (`from .config import ModelArgs`) is imported as a module of that package
(package.py), so its relative imports resolve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import inspect
import io
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from attnscope.errors import AttnscopeError, UsageError
from attnscope.usertrace import cacheforms
from attnscope.usertrace.initargs import build
from attnscope.usertrace.package import Package, package_of

MASK_WORDS = ("mask",)
# A bias added to the scores: a position bias (T5's `position_bias`) gets --position-bias's tensor; any other (xformers'
# `attn_bias`, an additive mask) is fed as a mask is, in the convention its code reads.
POSITION_BIAS_WORDS = ("position_bias", "pos_bias", "rel_bias", "relative_bias", "rel_pos")  # rel_pos: LayoutLMv2's
# ALiBi's bias handed in by the model (BLOOM's `alibi`): --alibi's, in the layout the code reads (alibifeed.py)
ALIBI_WORDS = ("alibi",)
DROPOUT_WORDS = ("dropout",)
# A decode step's parameters (--cache N): the cached keys and values, and the position of the first new token.
CACHE_NAMES = ("cache", "kv_cache", "past_key_value", "past_key_values", "layer_past", "past_kv", "past",
               "incremental_state")  # fairseq's: a dict of dicts (keyedcache.py)
POSITION_NAMES = ("start_pos", "pos", "offset", "position_offset", "past_length", "past_len", "n_past",
                  "cache_len", "start_position", "seqlen_offset")
# The new tokens' positions as a tensor [n]: gpt-fast's and torchtune's input_pos, transformers' cache_position
POSITIONS_NAMES = ("input_pos", "input_positions", "cache_position")
# ... or named by its words as indices of several positions (`positions`, `write_indices`, `slot_indices`), or an
# index beside a cache word (`cache_idx`): where a cache written in place takes the new keys and values
POSITIONS_WORDS = ("positions", "indices", "idxs")
INDEX_WORDS = ("index", "idx")
# The new tokens' positions as ids [1, n]: transformers' position_ids, which its model builds as
# cache_position.unsqueeze(0) before calling the attention (an optional one the attention's rotary reads)
POSITION_ID_WORDS = ("position", "positions", "pos")
# RoPE's tables, as the code that passes them in writes them (--rope): LLMs-from-scratch's cos, sin
# [n_pos, d_head]; Meta's freqs_cis [n, d_head / 2] complex; transformers' position_embeddings (cos, sin).
# llama2.c's freqs_cos, freqs_sin: freqs_cis's real and imaginary parts, each [n, d_head / 2].
# rotary_pos_emb: the angles position · inv_freq, [n_Q, d_head / 2], as Qwen2-VL's and GLM-4V's vision towers take them
TABLE_NAMES = ("cos", "sin", "freqs_cis", "freqs_cos", "freqs_sin", "rotary_pos_emb", "position_embeddings",
               "rotary_pos_emb_list")  # the last Qwen-1's: a list of one pair (cos, sin), each [1, n, 1, d_head]
# Those of one angle a pair, laid out for no pairing: the code pairs its coordinates as it will
PAIR_TABLES = ("freqs_cis", "freqs_cos", "freqs_sin", "rotary_pos_emb")
# Constructor arguments filled from --d-feat / --heads when --init does not give them.
D_FEAT_NAMES = ("d_feat", "d_model", "embed_dim", "hidden_size", "dim", "d_embed", "n_embd", "model_dim",
                "emb_dim", "hidden_dim", "d", "n_feat", "size")
HEAD_NAMES = ("n_head", "n_heads", "num_heads", "heads", "h", "nhead", "num_attention_heads", "head_count")
# Meta's, tensor-parallel; Megatron-LM's and ChatGLM's num_attention_heads_per_partition
LOCAL_HEAD_NAMES = ("n_local_heads", "num_local_heads", "n_q_heads", "num_q_heads", "num_attention_heads_per_partition")
HEAD_DIM_NAMES = ("head_dim", "d_head", "head_size", "d_k", "dim_head", "attention_head_size",
                  "hidden_size_per_attention_head")  # the last Megatron-LM's and ChatGLM's
CONFIG_NAMES = ("config", "args", "params", "cfg")  # where a module keeps the config it was built from
# What a memory parameter of cross-attention is called when it defaults to None (Stable Diffusion's
# `forward(x, context=None)`, `context = default(context, x)`): fed when the keys read another width than the queries.
# A parameter that may take sequence lengths (D2L's `valid_lens`: the keys 0 .. L - 1 of each sequence may be seen):
# named so, or a fourth parameter without a default beside query, key and value; read as lengths only where the
# code compares it with an arange over the keys (usertrace/lengths.py).
LENGTH_WORDS = ("len", "length")
# A position embedding the code adds to an input before its projections (DETR's object_queries, query_pos, pos;
# SAM's query_pe, key_pe; transformers' DETR `position_embeddings: torch.Tensor | None`): fed a random tensor the
# shape of that input where it defaults to None, so the code's own additions run (usertrace/posembed.py reads them).
EMBEDDING_WORDS = ("pos", "pe", "posemb", "object_queries", "position_embedding", "position_embeddings")
NOT_EMBEDDING_WORDS = ("input", "ids", "id", "idx", "index", "start", "offset", "cache", "past", "len", "length")
# Those that belong to the keys' side in cross-attention (DETR's spatial_position_embeddings for its memory)
KEY_SIDE_WORDS = ("key", "keys", "k", "kv", "memory", "encoder", "spatial", "src", "context", "image")
MEMORY_NAMES = ("context", "memory", "encoder_hidden_states", "encoder_output", "encoder_out", "key_value_states",
                "cond", "condition", "kv", "enc", "y")


@dataclass
class Target:
    """What `FILE.py:NAME` named: a class (built from --init), a module instance, or a function."""

    path: Path
    name: str
    obj: Any
    kind: str  # "class", "module" or "function"
    module: ModuleType | None = None  # the imported file
    unscripted: tuple[str, ...] = ()  # its TorchScript functions, run as their Python originals (scripted.py)
    code: Path | None = None  # the file its forward is written in, where not `path` (a class of the file's own that
    # inherits it from one beside it, a name imported): the ops are recorded, and lines read, from that file

    @property
    def source(self) -> Path:
        """The file whose lines the ops are recorded at: `code`, else the file named."""
        return self.code if self.code is not None else self.path


class UserCodeError(AttnscopeError):
    """The user's own code raised (importing their file, building their module, a class of --init): one line
    naming their file and line, exit 1. Their forward's failures are shown whole instead (call.py)."""


@dataclass
class Plan:
    """How the signature is fed: which parameters get tensors, the mask, None, or 0.0 (dropout)."""

    signature: str
    tensors: list[str]
    mask: str | None = None
    nones: list[str] = field(default_factory=list)
    zeros: list[str] = field(default_factory=list)
    positional_only: set[str] = field(default_factory=set)
    cache: str | None = None  # gets (K_cache, V_cache) with --cache, else None
    cache_values: str | None = None  # the values' parameter where the code takes them apart (cacheforms.py):
    # `cache` then gets K_cache alone
    positions: list[str] = field(default_factory=list)  # get the first new position (0, or --cache N)
    position_tensors: list[str] = field(default_factory=list)  # get the new positions, arange(n_cache, n_cache + n)
    position_rows: list[str] = field(default_factory=list)  # get them for each sequence, [n_batch, n] (Griffin's
    # segment_pos, asserted [b, t]): read from the run where the code raised on an input (runs/trace_otherwise.py)
    position_ids: list[str] = field(default_factory=list)  # get them as ids [1, n], as transformers' model passes
    # optional position ids, left at their default (None) unless the code raises on it (Qwen2-VL makes its own
    # 3-row mrope ids from None; RecurrentGemma's rotary reads position_ids.shape): then given them (position_ids)
    position_ids_later: list[str] = field(default_factory=list)
    cache_held: bool = False  # the module holds its cache itself (heldcache.py): --cache N fills it
    tables: list[str] = field(default_factory=list)  # get RoPE's tables (--rope)
    tables_optional: bool = False  # every one of them defaults to None: the module may make its own
    tables_unasked: list[str] = field(default_factory=list)  # those given None without --rope (with_own_tables)
    read_tables: list[str] = field(default_factory=list)  # of them, those read as tables by their use (as_table)
    bias: str | None = None  # a position bias: gets --position-bias's tensor, else None
    bias_required: bool = False  # the position bias has no default: --position-bias must give it
    alibi: str | None = None  # ALiBi's bias handed in by the model (BLOOM's `alibi`): --alibi's (alibifeed.py)
    alibi_required: bool = False  # it has no default: refused without --alibi
    alibi_form: str = ""  # the layout it is given in (alibifeed.FORMS), under --alibi; "" without
    order: list[str] = field(default_factory=list)  # every parameter, in the signature's order
    optional: list[str] = field(default_factory=list)  # others defaulting to None: a memory's candidates
    given: dict[str, Any] = field(default_factory=dict)  # --forward's arguments, built: given as they are
    other_masks: list[str] = field(default_factory=list)  # mask parameters besides `mask` (given None): tried in turn
    said: dict[str, str] = field(default_factory=dict)  # parameter -> why it was given None, a note: the code
    # multiplies its attention weights by it (transformers' head_mask), it makes RoPE's tables itself
    embeddings: list[str] = field(default_factory=list)  # get a random position embedding (EMBEDDING_WORDS)
    embeddings_required: list[str] = field(default_factory=list)  # those of them without a default
    # how they are shaped: "input" (the input's own [n_batch, n, d]), or a relative embedding's (feeds.RELATIVE:
    # ESPnet's pos_emb [1, 2n-1, d], positions n-1 .. -(n-1)), tried where the code raises on the input's shape
    embedding_form: str = "input"
    lengths: str | None = None  # a parameter that may take sequence lengths (D2L's valid_lens); it is the mask
    # parameter once the code is seen to compare it with an arange over the keys (usertrace/lengths.py)
    # read from the run where the first reading raised (runs/trace_otherwise.py): a parameter handed its input as a
    # list of that many (Music Transformer's `inputs` = [q, k, v], indexed [0], [1], [2]); parameters defaulting to
    # None handed the input itself (torchtune's `y`: self-attention, y is x, the same tensor)
    listed: dict[str, int] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)
    grouped: list[str] = field(default_factory=list)  # memories handed [n_batch, 1, n_K, d] (Flamingo's media)
    rule_beside: bool = False  # a --mask file given alone to `mask`, the rule (--causal, --window) to another
    heads_folded: bool = False  # a mask per sequence may go to `mask` as [n_batch·n_head, n_Q, n_K] (masking.forms)
    # mask parameters left at their default (None) because the code raised on the mask trace handed them (TimeSformer's
    # `mask`, the padding of its regrouped sequences): the mask is the reference's alone (trace_layouts)
    masks_at_default: list[str] = field(default_factory=list)
    # the mask parameter the code raised on in every shape trace handed it, run None so (refused_mask): its name,
    # those shapes, and where and how the code raised
    refused: tuple[str, tuple[tuple[int, ...], ...], str] | None = None
    mask_by_use: bool = False  # `mask` named otherwise (`key_padding`): kept where the code applies it (maskuse.py)
    flags: list[str] = field(default_factory=list)  # required parameters the code reads as flags (flags.py): False
    mask_open: bool = False  # a required mask the code cannot run on None (flags.mask_needed): where no mask is
    # asked for, given one that masks nothing
    switched: str | None = None  # a switch of the code's own given True under --causal (causalflag.py: its truth
    # makes the code mask the future keys itself)

    def unfed(self) -> str:
        found = ", ".join(self.tensors) if self.tensors else "none"
        return (f"{self.signature}: trace feeds 1 tensor (x [n_batch, n, d]: self-attention), 2 to a module (x and "
                "the memory its keys and values come from: cross-attention) or 3 (query, key, value); its "
                f"parameters without a default are {found}")

    @property
    def self_attention(self) -> bool:
        return len(self.tensors) == 1

    def memory(self) -> str | None:
        """The parameter a self-attention forward takes its keys' and values' input from when given one
        (`context=None`): named so (MEMORY_NAMES), else the only parameter defaulting to None."""
        if not self.self_attention:
            return None
        named = [n for n in self.optional if n.lower() in MEMORY_NAMES]
        return named[0] if named else self.optional[0] if len(self.optional) == 1 else None

    def memories(self) -> list[str]:
        """Every parameter a self-attention forward may take its keys' and values' input from: each defaulting to
        None (Mllama's `cross_attention_states=None` beside `use_cache=None`), those named so first; which one the
        key and value projections read is told by the data flow (roles.uses_memory), not the name."""
        if not self.self_attention:
            return []
        named = [n for n in self.optional if n.lower() in MEMORY_NAMES]
        return named + [n for n in self.optional if n not in named]

    def with_mask(self, name: str) -> Plan:
        """This plan with the mask given to `name` (fairseq's key_padding_mask beside attn_mask), the others None."""
        others = [m for m in [self.mask, *self.other_masks] if m is not None and m != name]
        return dataclasses.replace(self, mask=name, other_masks=others,
                                   nones=[n for n in self.nones if n != name] + [m for m in others
                                                                                  if m not in self.nones])

    def by_use(self, name: str) -> Plan:
        """This plan with the mask given to `name`, a parameter defaulting to None that is not named like a mask
        (`key_padding=None`, `adj=None`): the mask's only where the run shows the code applying it to its
        scores or weights (maskuse.py)."""
        return dataclasses.replace(self.with_mask(name), optional=[n for n in self.optional if n != name],
                                   mask_by_use=True)

    def without_mask(self) -> Plan:
        """This plan with its mask parameter given None, the mask going to the next mask parameter (if any)."""
        if self.mask is None:
            return self
        if self.other_masks:
            moved = self.with_mask(self.other_masks[0])
            return dataclasses.replace(moved, other_masks=[m for m in moved.other_masks if m != self.mask],
                                       nones=moved.nones if self.mask in moved.nones else [*moved.nones, self.mask])
        return dataclasses.replace(self, mask=None, nones=[*self.nones, self.mask])

    def without_masks(self) -> Plan:
        """This plan with every mask parameter given None (code that refuses a mask: it makes its own)."""
        masks = [m for m in (self.mask, *self.other_masks) if m is not None]
        return dataclasses.replace(self, mask=None, other_masks=[], lengths=None,
                                   nones=[*self.nones, *(m for m in masks if m not in self.nones)])

    def causal_mask(self, window: bool = False) -> str | None:
        """The mask parameter whose name says it takes the causal rule (CLIP's `causal_attention_mask` beside its
        `attention_mask`), or with `window` the local window's (ModernBERT's `sliding_window_mask`, which its local
        layers read instead of `attention_mask`; else one named for the causal rule), where the forward takes
        another mask as well: --causal's (--window's) mask goes there, a --mask file to the other; None where no
        name says so, or it is the only mask parameter."""
        masks = [m for m in (self.mask, *self.other_masks) if m is not None]
        named = [m for m in masks if says_causal(m)]
        named = [m for m in masks if says_window(m)] + named if window else named
        return named[0] if named and len(masks) > 1 else None

    def fed_by_lengths(self) -> bool:
        """Whether the mask parameter takes sequence lengths (read from the code: usertrace/lengths.py)."""
        return self.mask is not None and self.mask == self.lengths

    def lengths_dropped(self, required: bool) -> Plan:
        """This plan where its lengths candidate takes no lengths: an input where it has no default (so that a
        signature of four tensors is refused as such), else left at its default."""
        if self.lengths is None:
            return self
        tensors = [n for n in self.order if n in self.tensors or (required and n == self.lengths)]
        optional = [n for n in self.order if n in self.optional or (not required and n == self.lengths)]
        return dataclasses.replace(self, tensors=tensors, optional=optional, lengths=None)

    def with_own_tables(self, rope: bool = True) -> Plan:
        """This plan with RoPE's tables given None (each defaults to None): under --rope (`rope`), the module makes
        its own, as transformers' layers of 4.4x do from their rotary_emb; without it, the code runs without them
        (Zamba2's position_embeddings=None, read only under its config's use_mem_rope), and where it raises so, the
        run asks for --rope (runs/trace_relative.tables_asked)."""
        words = f"{', '.join(self.tables)} = None: your module makes RoPE's tables itself, and runs so (--forward " \
                "gives them)" if rope else f"{', '.join(self.tables)} = None, its default: your code runs without " \
                "RoPE's tables, and the reference rotates nothing (--rope makes them and rotates alike)"
        said = {name: words if i == 0 else "" for i, name in enumerate(self.tables)}  # one note for them all
        return dataclasses.replace(self, tables=[], tables_optional=False, nones=[*self.nones, *self.tables],
                                   said={**self.said, **said}, tables_unasked=[] if rope else list(self.tables))

    def with_positions_given(self) -> Plan:
        """This plan with its optional position ids given the new tokens' positions, as transformers' model passes
        them (`position_ids = cache_position.unsqueeze(0)`): a 4.4x layer that makes RoPE's tables itself from its
        rotary_emb reads them (`position_ids.shape[0]`), and raises given None."""
        later = self.position_ids_later
        words = (f"{', '.join(later)}: given the new tokens' positions, torch.arange(n_Q)[None], as transformers' "
                 "model passes them (position_ids = cache_position.unsqueeze(0)), which your module makes RoPE's "
                 "tables from")
        return dataclasses.replace(self, position_ids=[*self.position_ids, *later], position_ids_later=[],
                                   said={**self.said, later[0]: words})

    def with_embedding_form(self, form: str) -> Plan:
        """This plan with its position embeddings shaped as `form` says (feeds.RELATIVE)."""
        return dataclasses.replace(self, embedding_form=form)

    def with_embedding_as_bias(self) -> Plan:
        """This plan with its one required position embedding given the position bias (--position-bias), where no
        parameter is named for one: BROS' `bbox_pos_emb`, a relative key table it views [n, n, n_batch, d_head]."""
        if self.bias is not None or len(self.embeddings_required) != 1:
            return self
        name = self.embeddings_required[0]
        return dataclasses.replace(self, bias=name, bias_required=True, embeddings_required=[],
                                   embeddings=[e for e in self.embeddings if e != name])

    def without_embeddings(self) -> Plan:
        """This plan with its position embeddings given None (their default), where the code runs on no other."""
        return dataclasses.replace(self, embeddings=[], nones=[*self.nones, *self.embeddings])

    def with_pairs(self, names: list[str]) -> Plan:
        """This plan with `names` given RoPE's `(cos, sin)`: parameters the code unpacks in two (pairparams.py,
        nanochat's `cos_sin`; Gemma 3's `position_embeddings: torch.Tensor = None`, annotated as one tensor and read
        as a position embedding until its `cos, sin = position_embeddings` says it is a pair), read so under
        --rope."""
        names = [n for n in names if n in self.tensors or n in self.optional or n in self.embeddings]
        if not names:
            return self
        required = any(n in self.tensors or n in self.embeddings_required for n in names) \
            or bool(self.tables and not self.tables_optional)
        return dataclasses.replace(self, tensors=[n for n in self.tensors if n not in names],
                                   optional=[n for n in self.optional if n not in names],
                                   embeddings=[n for n in self.embeddings if n not in names],
                                   embeddings_required=[n for n in self.embeddings_required if n not in names],
                                   tables=[*self.tables, *names], tables_optional=not required)

    def as_table(self, name: str) -> Plan:
        """This plan with the tensor parameter `name` given RoPE's whole table (under --rope): a parameter whose
        values the code multiplies into its queries and keys (paramuse.turns: Flux's `pe`), whatever its name; the
        form it runs on is read from its run (tableforms.holders)."""
        return dataclasses.replace(self, tensors=[n for n in self.tensors if n != name],
                                   embeddings=[n for n in self.embeddings if n != name],
                                   embeddings_required=[n for n in self.embeddings_required if n != name],
                                   tables=[*self.tables, name], tables_optional=False, read_tables=[name])

    def check_fed(self) -> None:
        """Refused in one line where trace cannot feed the inputs the signature asks for."""
        if len(self.tensors) not in (1, 2, 3):
            raise UsageError(self.unfed())

    def with_memory(self, name: str) -> Plan:
        """This plan with `name` fed as the memory of cross-attention (x for the queries, it for K and V)."""
        return dataclasses.replace(self, tensors=[*self.tensors, name],
                                   optional=[n for n in self.optional if n != name])

    def with_alias(self, name: str) -> Plan:
        """This plan with `name`, defaulting to None, handed the input itself (self-attention: torchtune's `y` is x)."""
        return dataclasses.replace(self, aliases=[*self.aliases, name],
                                   optional=[n for n in self.optional if n != name])

    def decoded_alone(self) -> Plan:
        """This plan of `forward(query, key, value, .., cache)` for a decode step: the queries' parameter the one
        input, the key's and the value's handed it too (CTRL's `forward(v, k, q, mask, layer_past)`, which its block
        calls with the same normed x three times): the new tokens beside the cache, as self-attention reads them."""
        first, *rest = self.tensors
        return dataclasses.replace(self, tensors=[first], aliases=[*self.aliases, *rest])

    def as_list(self, name: str, count: int) -> Plan:
        """This plan with the input `name` handed as a list of `count` (Music Transformer's `inputs` = [q, k, v])."""
        return dataclasses.replace(self, listed={**self.listed, name: count})

    def as_positions(self, name: str, rows: bool = False) -> Plan:
        """This plan with the tensor parameter `name` given the new tokens' positions, arange(n_cache, n_cache + n_Q)
        (mistral-src's `positions`), not an input (nor a position embedding); `rows`: one row of them for each
        sequence, [n_batch, n_Q] (Griffin's `segment_pos`)."""
        return dataclasses.replace(self, tensors=[n for n in self.tensors if n != name],
                                   embeddings=[n for n in self.embeddings if n != name],
                                   embeddings_required=[n for n in self.embeddings_required if n != name],
                                   position_tensors=[*(n for n in self.position_tensors if n != name),
                                                     *([] if rows else [name])],
                                   position_rows=[*self.position_rows, *([name] if rows else [])])

    def as_embedding(self, name: str) -> Plan:
        """This plan with the tensor parameter `name` given a position embedding trace makes (Transformer-XL's `r`),
        not an input."""
        return dataclasses.replace(self, tensors=[n for n in self.tensors if n != name],
                                   embeddings=[*self.embeddings, name],
                                   embeddings_required=[*self.embeddings_required, name])

    def as_grouped(self, name: str) -> Plan:
        """This plan with the memory `name` handed as one group of its n_K tokens, [n_batch, 1, n_K, d_feat]
        (Flamingo's media [b, t, m, d]: t images of m latents each)."""
        return dataclasses.replace(self, grouped=[*self.grouped, name])

    def with_rule_beside(self, name: str) -> Plan:
        """This plan with a --mask file given alone to the mask parameter `name`, the rule to another beside it."""
        return dataclasses.replace(self.with_mask(name), rule_beside=True)


def parse_spec(spec: str) -> tuple[Path, str]:
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise UsageError(f"{spec!r}: name a class or function in a Python file as FILE.py:NAME, "
                         "e.g. my_attention.py:MultiHeadedAttention")
    path = Path(file)
    if path.suffix != ".py":
        raise UsageError(f"{file}: trace imports Python source files only (.py); give FILE.py:NAME")
    if not path.exists():
        raise UsageError(f"{file}: no such file")
    if not path.is_file():
        raise UsageError(f"{file}: not a file")
    if not name.replace(".", "_").isidentifier():
        raise UsageError(f"{name!r} is not a Python name; give FILE.py:NAME, e.g. my_attention.py:attention")
    return path.resolve(), name


_CTRL_C: list[bool] = []  # set when a real SIGINT arrives while the user's code runs


def _on_sigint(signum: int, frame: Any) -> None:
    """Python's own SIGINT handler (`signal.default_int_handler`), remembering that the interrupt was real."""
    _CTRL_C.append(True)
    raise KeyboardInterrupt


@contextlib.contextmanager
def user_code(path: Path, quiet: bool = False, root: Path | None = None) -> Iterator[None]:
    """While the user's code runs: its folder on sys.path (last, so it shadows nothing), and `root`, the folder
    that holds its package where it imports relatively (package.py); its prints on stderr (dropped where `quiet`),
    so that stdout holds only attnscope's output (`--json` stays one JSON object), and SIGINT noted, so that a
    KeyboardInterrupt their code raises itself is told from Ctrl-C (`users`)."""
    folders = [f for f in dict.fromkeys([str(path.parent)] + ([str(root)] if root is not None else []))
               if f not in sys.path]
    sys.path.extend(folders)
    main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    before = signal.getsignal(signal.SIGINT) if main else None  # None: set outside Python, not to be replaced
    if before is not None:
        signal.signal(signal.SIGINT, _on_sigint)
    _CTRL_C.clear()
    try:
        with contextlib.redirect_stdout(_Prints(io.StringIO() if quiet else sys.stderr)):
            yield
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
        for folder in folders:
            if folder in sys.path:
                sys.path.remove(folder)


class _Prints:
    """The user's sys.stdout while their code runs: writes go to attnscope's stderr, but closing it closes only
    this stand-in (their later writes to it fail as on a closed file), never the stderr attnscope reports on."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _open(self) -> Any:
        if self.closed:
            raise ValueError("I/O operation on closed file.")  # what a closed io.TextIOWrapper raises
        return self._stream

    def write(self, text: str) -> int:
        return self._open().write(text)

    def writelines(self, lines: Any) -> None:
        self._open().writelines(lines)

    def flush(self) -> None:
        self._open().flush()

    def close(self) -> None:
        self.closed = True


def import_file(path: Path) -> ModuleType:
    name = f"_attnscope_user_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    package = _package(path)
    if package is not None:  # its relative imports resolve in its package: `__package__` is the package's name
        name = f"{package.name}.{name}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        with user_code(path, root=package.root if package is not None else None):
            spec.loader.exec_module(module)
    except SyntaxError as exc:  # in the file, or in a module of the user's it imports
        sys.modules.pop(name, None)
        raise UsageError(_syntax_error(exc, path)) from None
    except BaseException as exc:  # SystemExit, GeneratorExit, a BaseException of their own: all theirs
        sys.modules.pop(name, None)
        if not users(exc):
            raise
        raise UserCodeError(f"{where(exc, path)}: importing {path.name} raised {one_line(exc)}") from None
    return module


def _package(path: Path) -> Package | None:
    """The package the file imports relatively from (package.py), checked to be the one `import` finds: a package of
    the same name installed or earlier on sys.path would hand the file its modules, not the ones beside it."""
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    package = package_of(path, source)
    if package is None:
        return None
    top = package.name.split(".")[0]
    mine = (package.root / top).resolve()
    held = sys.modules.get(top)
    places = list(getattr(held, "__path__", []) or []) if held is not None else None
    if places is None:
        found = importlib.machinery.PathFinder.find_spec(top, sys.path + [str(package.root)])
        places = list(found.submodule_search_locations or []) if found is not None else []
    if places and all(Path(p).resolve() != mine for p in places):
        raise UsageError(f"{path.name} imports relatively from its package {top} ({mine}), but `import {top}` "
                         f"finds {places[0]}: run trace on a copy whose imports are absolute, or from an "
                         f"environment where {top} is the package in {package.root}")
    return package


def _syntax_error(exc: SyntaxError, path: Path) -> str:
    """`file.py:LINE: syntax error: ...`; a NUL byte (which Python's compiler reports with no line) at the line
    that holds it, else without one."""
    file = Path(exc.filename) if exc.filename else path
    line, nul = exc.lineno, exc.lineno is None and "null bytes" in str(exc.msg)
    if nul:
        with contextlib.suppress(OSError, ValueError):
            data = file.read_bytes()
            line = data.count(b"\n", 0, data.index(b"\0")) + 1
    where_ = f"{file.name}:{line}" if line else file.name
    if nul:
        return f"{where_}: holds a NUL byte, which Python source cannot hold: is it a Python file saved as text?"
    return f"{where_}: syntax error: {exc.msg}"


def users(exc: BaseException) -> bool:
    """Whether an exception out of the user's code is theirs to report: anything but a real Ctrl-C (which stops
    attnscope too: a SIGINT arrived) and attnscope's own errors. A KeyboardInterrupt their code raises itself
    is theirs, one line naming where."""
    if isinstance(exc, KeyboardInterrupt):
        return not _CTRL_C
    return not isinstance(exc, AttnscopeError)


def where(exc: BaseException, path: Path, code: Path | None = None) -> str:
    """`file.py:LINE`, the last frame of the traceback inside the user's file, or inside `code`, the file the
    target's code is written in (Target.code: an inherited `__init__` fails there); else just the file."""
    line = user_line(exc, path)
    if not line and code is not None and (line := user_line(exc, code)):
        return f"{code.name}:{line}"
    return f"{path.name}:{line}" if line else path.name


def user_line(exc: BaseException, path: Path) -> int | None:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return frames[-1].lineno if frames else None


def one_line(exc: BaseException, limit: int = 300) -> str:
    try:
        text = " ".join(str(exc).split())
    except BaseException:  # a __str__ of theirs that raises
        text = ""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def find(spec: str) -> Target:
    import torch

    from attnscope.usertrace.scripted import unscripted

    path, name = parse_spec(spec)
    module = import_file(path)
    python = tuple(unscripted(module))  # before the name is looked up: a ScriptFunction named itself is its original
    obj: Any = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{path.name} has no {name}; it defines: {defined_here(module) or 'nothing to trace'}") \
                from None
        except BaseException as exc:  # a module-level __getattr__ of theirs
            if not users(exc):
                raise
            raise UserCodeError(f"{where(exc, path)}: looking up {name} raised {one_line(exc)}") from None
    if inspect.isclass(obj):
        if not issubclass(obj, torch.nn.Module):
            raise UsageError(f"{name} is a class but not a torch.nn.Module; trace takes an nn.Module class or a "
                             "function (query, key, value, mask=None)")
        return Target(path, name, obj, "class", module, python, _written_in(obj.forward, path))
    if isinstance(obj, torch.nn.Module):
        return Target(path, name, obj, "module", module, python, _written_in(type(obj).forward, path))
    if inspect.isfunction(obj):
        return Target(path, name, obj, "function", module, python, _written_in(obj, path))
    raise UsageError(f"{name} is a {type(obj).__name__}; trace takes an nn.Module class or a function")


def _written_in(fn: Any, path: Path) -> Path | None:
    """The Python file `fn` (a forward, or the function traced) is written in, where that is not `path`: a class
    of the file's own that inherits its forward from a file beside it, or a name the file imports (`from
    styles import Attention`; `Attention = nn.MultiheadAttention`), whose ops run there, as `inspect.getsourcefile`
    finds it; None where it is `path`, or no source file holds it (a module with no forward of its own)."""
    import torch

    fn = inspect.unwrap(fn)
    if fn is torch.nn.Module.forward or getattr(fn, "__name__", "") == "_forward_unimplemented":
        return None
    try:
        found = inspect.getsourcefile(fn)
    except TypeError:  # a builtin, a C extension's
        return None
    if found is None:
        return None
    written = Path(found).resolve()
    return written if written != path and written.suffix == ".py" and written.is_file() else None


def defined_here(module: ModuleType) -> str:
    """The classes and functions the file itself defines (not those it imports)."""
    names = [n for n, v in vars(module).items()
             if (inspect.isclass(v) or inspect.isfunction(v)) and getattr(v, "__module__", None) == module.__name__]
    return ", ".join(names)


def own_classes(module: ModuleType | None) -> dict[str, type]:
    """The classes --init may call, by name: those the file itself defines, those of the package it imports
    relatively from (`from .config import ModelArgs`: the user's own code, package.py), and the model configs of
    transformers' own it imports (`from transformers import GraniteConfig`: a PretrainedConfig subclass, data that
    transformers' code builds, as `GraniteAttention(config)` wants it); no other class of elsewhere."""
    if module is None:
        return {}
    top = module.__name__.split(".")[0] + "." if "." in module.__name__ else None
    found = {n: v for n, v in vars(module).items() if inspect.isclass(v) and (
        getattr(v, "__module__", None) == module.__name__
        or (top is not None and str(getattr(v, "__module__", "")).startswith(top)))}
    imported = {n: v for n, v in vars(module).items() if n not in found and inspect.isclass(v)
                and str(getattr(v, "__module__", "")).startswith("transformers.")}
    if imported:
        from transformers import PretrainedConfig

        found |= {n: v for n, v in imported.items() if issubclass(v, PretrainedConfig) and v is not PretrainedConfig}
    return found


def parse_init(text: str | None, target: Target | None = None) -> dict[str, Any]:
    """--init's keyword arguments (initargs.py): literals, and calls of the classes `target`'s file defines."""
    from attnscope.usertrace.initargs import parse_init as parse

    module = target.module if target is not None else None
    return parse(text, own_classes(module), target.path.name if target is not None else "the file")


def forward_values(text: str | None, target: Target) -> dict[str, Any]:
    """--forward's arguments as written (literals; the file's classes unbuilt), read by forward_args' rules."""
    from attnscope.usertrace.initargs import parse_init as parse

    return parse(text, own_classes(target.module), target.path.name, "--forward", '--forward "start_pos=0"')


def forward_args(text: str | None, target: Target, plan: Plan, fn: Any) -> Plan:
    """`plan` with --forward's arguments (`"start_pos=0, use_cache=False"`, read as --init is: literals and
    the file's own classes, built here as the user's code) given to the forward as they are. Refused in one
    line: a parameter the forward does not take, and the inputs and the mask, which trace feeds."""
    from attnscope.usertrace.initargs import parse_init as parse

    example = '--forward "start_pos=0, use_cache=False"'
    values = parse(text, own_classes(target.module), target.path.name, "--forward", example)
    if not values:
        return plan
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    tensors = [n for n in plan.tensors if n not in values]  # a required flag of theirs (use_cache) given here
    for name in values:
        if name in plan.tensors and not tensors:
            raise UsageError(f"--forward {name}=...: {name} is the input trace feeds ({plan.signature}); give the "
                             "other arguments (--causal, --window, --mask and the sizes say what it gets)")
        if name not in params and not takes_any:
            raise UsageError(f"--forward: {plan.signature} takes no argument {name!r}")
        if name in params and params[name].kind == params[name].POSITIONAL_ONLY:
            raise UsageError(f"--forward {name}=...: {name} is positional-only in {plan.signature}")
    built = {k: guarded(target, f"--forward {k}={v!r}", functools.partial(build, v)) for k, v in values.items()}
    built = {k: _as_tensor(v) if k in params and _says_tensor(params[k].annotation) else v for k, v in built.items()}
    optional = [n for n in plan.optional if n not in built]
    for masked in [m for m in (plan.mask, *plan.other_masks) if m in built]:  # --forward's value, never trace's mask
        plan = plan.without_mask() if masked == plan.mask else dataclasses.replace(
            plan, other_masks=[m for m in plan.other_masks if m != masked])
    lengths = None if plan.lengths in built else plan.lengths
    return dataclasses.replace(plan, given=built, tensors=tensors, optional=optional, lengths=lengths,
                               nones=[n for n in plan.nones if n not in built],
                               embeddings=[n for n in plan.embeddings if n not in built])


def _says_tensor(annotation: Any) -> bool:
    """Whether a parameter is annotated as one tensor (`cu_seqlens: torch.Tensor`, `Optional[torch.LongTensor]`,
    `"torch.Tensor | None"`), not a container of them."""
    if annotation is inspect.Parameter.empty:
        return False
    said = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or str(annotation)
    return "Tensor" in said and not any(w in said.lower() for w in ("tuple", "list", "sequence", "dict", "iterable"))


def _as_tensor(value: Any) -> Any:
    """A list or tuple of numbers (nested or not) as a tensor, as the model hands it (Qwen2-VL's `cu_seqlens`, which
    its code subtracts: `cu_seqlens[1:] - cu_seqlens[:-1]`); anything else as it is."""
    import torch

    def numbers(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return len(v) > 0 and all(numbers(x) for x in v)
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(value, (list, tuple)) or not numbers(value):
        return value
    try:
        return torch.tensor(value)
    except (TypeError, ValueError):  # ragged: as given
        return value


def names_parameter(path: Path, line: int | None, names: list[str]) -> str | None:
    """The parameter (of `names`) that the source line `line` of the user's file, or one of the two lines above it,
    names as a word (`assert attn_mask is None`, `if mask is not None: raise ...`, `k_cache, v_cache = kv_cache`);
    None where none does, or the line is unknown."""
    import linecache
    import re

    if line is None or not names:
        return None
    text = " ".join(linecache.getline(str(path), n) for n in range(max(1, line - 2), line + 1))
    return next((name for name in names if re.search(rf"\b{re.escape(name)}\b", text)), None)


def table_kind(name: str) -> str | None:
    """Which of TABLE_NAMES a parameter named `name` is, lower case; also the names other code gives them: `cis`
    as a word is Meta's complex table (lingua's `freq_cis`, minimind's `pos_cis`), as is a complex one of
    frequencies (Umar Jamil's `freqs_complex`); frequencies' `cos` or `sin` llama2.c's two real tables (`freq_cos`).
    None where the name is no table's."""
    lower = name.lower()
    if lower in TABLE_NAMES:
        return lower
    words = lower.split("_")
    freqs = any(w.startswith("freq") for w in words)
    if "cis" in words or (freqs and "complex" in words):
        return "freqs_cis"
    if freqs and len(words) > 1 and words[-1] in ("cos", "sin"):
        return f"freqs_{words[-1]}"
    return None


def is_mask(name: str, default: Any = None) -> bool:
    """Named like a mask; or like a bias added to the scores (xformers' `attn_bias`), where it defaults to None (a
    flag such as `use_bias=False` is no mask)."""
    lower = name.lower()
    return any(word in lower for word in MASK_WORDS) or (
        "bias" in lower and not is_position_bias(name) and default is None)


def is_embedding(name: str, annotation: Any = None) -> bool:
    """Named like a position embedding added to an input (EMBEDDING_WORDS, a word of the name); `position_embeddings`
    only where annotated as one tensor (transformers' RoPE tables are a tuple, `(cos, sin)`)."""
    lower = name.lower()
    if table_kind(name) not in (None, "position_embeddings"):  # cos, sin, freqs_cis: RoPE's, whatever their type
        return False
    if lower == "position_embeddings":
        said = str(annotation)
        return annotation is not inspect.Parameter.empty and "Tensor" in said and "tuple" not in said.lower()
    words = lower.split("_")
    if any(w in NOT_EMBEDDING_WORDS for w in words):  # gpt-fast's input_pos: token positions, not an embedding
        return False
    return any(w in EMBEDDING_WORDS for w in words) or "position_embedding" in lower or lower == "object_queries"


def embedding_side(name: str) -> str:
    """n_K for a key-side embedding (its name says keys, memory, encoder, spatial), else n_Q."""
    return "n_K" if any(w in KEY_SIDE_WORDS for w in name.lower().split("_")) else "n_Q"


def is_lengths(name: str) -> bool:
    """Named like sequence lengths (`valid_lens`, `lengths`, `seq_len`, `key_lengths`), not like a mask."""
    lower = name.lower()
    return any(word in lower for word in LENGTH_WORDS) and not is_mask(name)


def is_positions(name: str) -> bool:
    """Named like the new tokens' positions as a tensor (POSITIONS_NAMES; a word of POSITIONS_WORDS, `kv_write_indices`;
    an index word beside a cache word, `cache_idx`), never like a mask or token ids (`position_ids` [n_batch, n])."""
    lower = name.lower()
    if lower in POSITIONS_NAMES:
        return True
    words = cacheforms.name_words(name)
    if "ids" in words or is_mask(name, None):
        return False
    return any(w in POSITIONS_WORDS for w in words) or (
        any(w in INDEX_WORDS for w in words) and any(w in (*cacheforms.CACHE_WORDS, "kv", "write") for w in words))


def is_position_ids(name: str) -> bool:
    """Named like the new tokens' position ids (`position_ids`, `pos_ids`): a position word beside `ids`."""
    words = cacheforms.name_words(name)
    return "ids" in words and any(w in POSITION_ID_WORDS for w in words) and not is_mask(name, None)


def is_alibi(name: str) -> bool:
    """Named for ALiBi (`alibi`, `alibi_bias`, `alibi_tensor`)."""
    return any(word in name.lower() for word in ALIBI_WORDS)


def is_position_bias(name: str) -> bool:
    return any(word in name.lower() for word in POSITION_BIAS_WORDS)


def says_causal(name: str) -> bool:
    """A mask parameter named for the causal rule (`causal_attention_mask`, `causal_mask`, `is_causal_mask`)."""
    return "causal" in name.lower()


def says_window(name: str) -> bool:
    """A mask parameter named for the local window (`sliding_window_mask`, `window_mask`, `local_attention_mask`)."""
    return any(word in name.lower() for word in ("window", "sliding", "local"))


def is_dropout(name: str) -> bool:
    return any(word in name.lower() for word in DROPOUT_WORDS)


def plan(fn: Any, label: str, train: bool) -> Plan:
    """Read the signature: required parameters are the tensors (1: self-attention x; 3: query, key, value);
    mask-like ones get the mask or None, dropout-like ones None (or 0.0 when their default is a number and
    the module is not in training mode), a cache, a start position and RoPE's tables what a decode step or
    --rope gives them (feeds.py); the others keep their defaults."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise UsageError(f"cannot read the signature of {label}") from None
    text = f"{label}{signature}"
    p = Plan(text, [])
    masks: list[str] = []
    halves: list[tuple[str, bool]] = []  # a cache's keys or values alone (`past_key`, `v_cache`): a pair, or others
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        p.order.append(name)
        required = param.default is param.empty
        lower = name.lower()
        if is_alibi(name) and p.alibi is None and (required or param.default is None):
            p.alibi, p.alibi_required = name, required
        elif is_position_bias(name) and p.bias is None and (required or param.default is None):
            p.bias, p.bias_required = name, required
        elif is_mask(name, None if param.default is param.empty else param.default):
            masks.append(name)
        elif lower in CACHE_NAMES and (required or param.default is None):
            p.cache = name
        elif cacheforms.is_half(name) and (required or param.default is None):
            halves.append((name, required))
        elif lower in POSITION_NAMES and (required or isinstance(param.default, int)):
            p.positions.append(name)
        elif is_positions(name) and (required or param.default is None):
            p.position_tensors.append(name)
        elif is_position_ids(name) and param.default is None:  # optional: its default, else what the model passes
            p.position_ids_later.append(name)
        elif is_position_ids(name) and required:  # Mistral 4's `position_ids: torch.Tensor`: what the model passes
            p.position_ids.append(name)
        elif (required or param.default is None) and is_embedding(name, param.annotation):
            p.embeddings.append(name)
            p.embeddings_required += [name] if required else []
        elif table_kind(name) is not None and (required or param.default is None):
            p.tables_optional = not required and (p.tables_optional or not p.tables)
            p.tables.append(name)
        elif is_dropout(name):
            numeric = isinstance(param.default, (int, float)) and not isinstance(param.default, bool)
            if numeric and param.default and not train:
                p.zeros.append(name)
            elif required or param.default is None:
                p.nones.append(name)
        elif is_lengths(name) and p.lengths is None and (required or param.default is None):
            p.lengths = name
        elif required:
            p.tensors.append(name)
        elif param.default is None:
            p.optional.append(name)
        if param.kind == param.POSITIONAL_ONLY:
            p.positional_only.add(name)
    split = cacheforms.pair([name for name, _ in halves]) if p.cache is None else None
    if split is not None:
        p.cache, p.cache_values = split
    for name, required in halves if split is None else []:  # no pair: what they would be
        (p.tensors if required else p.optional).append(name)
    if p.lengths is None and len(p.tensors) == 4:  # query, key, value and a fourth: lengths, if the code says so
        p.lengths = p.tensors.pop()
    if p.lengths is not None and (masks or len(p.tensors) not in (1, 2, 3)):  # the code has a mask parameter
        p = p.lengths_dropped(signature.parameters[p.lengths].default is inspect.Parameter.empty)
    # a bias beside masks named so (Graphormer's `attn_bias` beside key_padding_mask and attn_mask): what the code
    # adds to the scores besides its masks, a position bias (--position-bias), not one more place for the mask
    biases = [m for m in masks if "bias" in m.lower() and "mask" not in m.lower()]
    if p.bias is None and biases and any("mask" in m.lower() for m in masks):
        masks.remove(biases[0])
        p.bias, p.bias_required = biases[0], signature.parameters[biases[0]].default is inspect.Parameter.empty
    # CLIP's causal_attention_mask, ModernBERT's sliding_window_mask: --causal's, --window's alone
    plain = [m for m in masks if not says_causal(m) and not says_window(m)] or masks
    preferred = [m for m in plain if m.lower() in ("mask", "attn_mask", "attention_mask")] or [
        m for m in plain if "mask" in m.lower()]
    p.mask = (preferred or plain)[0] if masks else None
    p.nones.extend(m for m in masks if m != p.mask)
    p.other_masks = [m for m in masks if m != p.mask]
    return p


def construct(target: Target, init: dict[str, Any], d_feat: int | None,
              heads: int | None) -> tuple[Any, dict[str, Any], dict[int, tuple[int, ...]]]:
    """Build the module from --init, filling a required width / head count from --d-feat / --heads.
    Returns the module, the arguments it was built with, and the memory its __init__ left uninitialised
    (emptyparams.py)."""
    cls = target.obj
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in init if k not in params and not takes_any]
    if unknown:
        raise UsageError(f"--init: {target.name}{inspect.signature(cls)} takes no argument {unknown[0]!r}")
    kwargs = dict(init)
    for name, param in params.items():
        if name in kwargs or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        given = d_feat if name in D_FEAT_NAMES else heads if name in HEAD_NAMES else None
        if given is not None:
            kwargs[name] = given
        elif param.default is param.empty:
            option = " (or --d-feat)" if name in D_FEAT_NAMES else " (or --heads)" if name in HEAD_NAMES else ""
            raise UsageError(f"{target.name}{inspect.signature(cls)} needs {name}: give it with --init "
                             f"\"{name}=...\"{option}{_config_hint(target, name)}")
    from attnscope.usertrace.emptyparams import Watch

    watch = Watch()
    try:
        with user_code(target.path), watch:
            module = cls(**{k: build(v) for k, v in kwargs.items()})
    except BaseException as exc:  # sys.exit() in their __init__ included: theirs, one line, exit 1
        if not users(exc):
            raise
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UserCodeError(f"{target.name}({_short(args)}) failed at {where(exc, target.path, target.code)}: "
                            f"{one_line(exc)}") \
            from None
    return module, kwargs, watch.blank


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _config_hint(target: Target, name: str) -> str:
    """For `__init__(self, config)`: a class of the file that looks like its config, to call in --init."""
    configs = [n for n, c in own_classes(target.module).items()
               if dataclasses.is_dataclass(c) or n.lower().endswith(("config", "args", "params"))]
    if configs:
        return f", e.g. --init \"{name}={configs[0]}(...)\" with {configs[0]}'s fields as literals"
    from attnscope.usertrace.linearweights import role_of

    if role_of(name) is not None or any(w in name.lower() for w in ("proj", "linear", "dense")):
        # a projection given as a module (torchtune's MultiHeadAttention(q_proj=..., output_proj=...))
        return f", a torch.nn layer: --init \"{name}=nn.Linear(64, 64, bias=False)\" with its widths"
    return ""


def head_count(module: Any, init: dict[str, Any], heads: int | None) -> int | None:
    """The module's number of heads: from its constructor arguments, else an attribute such as `n_head`,
    `num_heads` or Meta's `n_local_heads`, else a config object's (`--init "args=ModelArgs(n_heads=4)"`, a
    `self.config`), else the one count its submodules say (a block calling `self.attn`), else --heads. None where
    none says it: the caller asks for --heads, never runs with 0."""
    found = [(f"--init {k}", v) for k, v in init.items() if k in HEAD_NAMES and _count(v)]
    found += [(f"its attribute {k}", value) for k in HEAD_NAMES + LOCAL_HEAD_NAMES
              if _count(value := attribute(module, k))]
    for label, config in _configs(module, init):
        found += [(f"{label}.{k}", value) for k in HEAD_NAMES if _count(value := attribute(config, k))]
    import torch

    wrapped = [(name, m) for name, m in module.named_modules() if isinstance(m, torch.nn.MultiheadAttention)] \
        if isinstance(module, torch.nn.Module) else []
    if len(wrapped) == 1:  # the one nn.MultiheadAttention it wraps says it
        found.append((f"its {wrapped[0][0]}.num_heads", wrapped[0][1].num_heads))
    if not found and isinstance(module, torch.nn.Module):  # the attention it wraps says it, one count in all
        said = {(name, k): value for name, sub in module.named_modules() if name
                for k in HEAD_NAMES + LOCAL_HEAD_NAMES if _count(value := attribute(sub, k))}
        if len(set(said.values())) == 1:  # torchtune's layer calling self.attn, whose num_heads it is
            (name, k), value = next(iter(said.items()))
            found.append((f"its {name}.{k}", value))
    if heads is not None:
        for source, value in found[:1]:
            if value != heads:
                raise UsageError(f"--heads {heads} but the module has {value} heads ({source}); drop --heads")
        return heads
    return found[0][1] if found else None


def head_size(module: Any, init: dict[str, Any]) -> int | None:
    """d_head where the module or its config says it (`head_dim`, `d_head`, `head_size`, `d_k`)."""
    for owner in [module] + [config for _, config in _configs(module, init)]:
        for k in HEAD_DIM_NAMES:
            if _count(value := attribute(owner, k)):
                return int(value)
    return None


def _configs(module: Any, init: dict[str, Any]) -> list[tuple[str, Any]]:
    """The config objects a module was built from or keeps: --init values that are objects of the file's
    classes (`args=ModelArgs(...)`, `config=LlamaConfig(...)`), and its own `config`, `args`, `params`."""
    found = [(f"--init {k}", v) for k, v in init.items()
             if not isinstance(v, (int, float, str, bytes, bool, list, tuple, dict, set, type(None), complex))]
    found += [(f"its {k}", v) for k in CONFIG_NAMES if (v := attribute(module, k)) is not None
              and not isinstance(v, (int, float, str, bool)) and not callable(v)]
    # any other object it keeps that says a head count (`self.hparams`, `self.model_cfg`, a dict or namespace)
    import torch

    held = {id(v) for _, v in found}
    for k, v in (getattr(module, "__dict__", None) or {}).items():
        if k.startswith("_") or id(v) in held or isinstance(v, (int, float, str, bytes, bool, list, tuple, set,
                                                                  torch.Tensor, torch.nn.Module, type(None))) \
                or callable(v):
            continue
        if isinstance(v, dict):
            v = _Mapping(v)
        if any(_count(attribute(v, name)) for name in HEAD_NAMES + HEAD_DIM_NAMES):
            found.append((f"its {k}", v))
    return found


class _Mapping:
    """A dict config read as an object: `config["n_heads"]` as `config.n_heads`."""

    def __init__(self, values: dict[Any, Any]) -> None:
        self.__dict__.update({k: v for k, v in values.items() if isinstance(k, str)})


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def attribute(obj: Any, name: str) -> Any:
    """`getattr(obj, name, None)`, where a property of the user's that raises counts as absent."""
    try:
        return getattr(obj, name, None)
    except BaseException as exc:
        if not users(exc):
            raise
        return None


def guarded(target: Target, what: str, fn: Callable[[], Any]) -> Any:
    """Call the user's code outside forward (a `train()` of theirs, say): what it raises is theirs, one line."""
    try:
        with user_code(target.path):
            return fn()
    except BaseException as exc:
        if not users(exc):
            raise
        raise UserCodeError(f"{where(exc, target.path, target.code)}: {what} raised {one_line(exc)}") from None


def width_hint(init: dict[str, Any], d_feat: int | None) -> int | None:
    """The width the module will be built with, where --d-feat or --init says it (a config's field
    included): what its projections' memory is guarded by before its __init__ allocates them."""
    from attnscope.usertrace.initargs import ClassCall

    found = [d_feat] if d_feat else []
    stack: list[Any] = [init]
    while stack:
        value = stack.pop()
        if isinstance(value, ClassCall):
            stack.append(dict(value.kwargs))
        elif isinstance(value, dict):
            found += [v for k, v in value.items() if k in D_FEAT_NAMES and isinstance(v, int)
                      and not isinstance(v, bool) and v > 0]
            stack += [v for v in value.values() if isinstance(v, (ClassCall, dict))]
    return max(found) if found else None
