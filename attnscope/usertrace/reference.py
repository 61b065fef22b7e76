"""The reference a user's code is lined up with, run on the same inputs.

- a module: its q, k, v and output projections copied into attnscope's `MultiHeadAttention`: four Linear
  layers matched by name (`W_q`, `q_proj`, `query`, `to_q`, `out_proj`, `o`, ... ); a wrapped
  nn.MultiheadAttention's `in_proj_weight` and `out_proj`; a fused q/k/v Linear split into three (fused.py);
  or, when it has exactly four Linear layers, those in the order they were registered
  (`self.linears = clones(nn.Linear(d, d), 4)`). Grouped-query attention follows from the widths (K and V
  narrower than Q). Steps `Q_feat K_feat V_feat Q_split K_split V_split [Q_rot K_rot] [K_cat V_cat]
  [K_rep V_rep] scores [masked_scores] attention x_raw x_rsh2 x`;
- a function: attnscope's `sdpa`, steps `scores [masked_scores] attention out`.
Both scale the scores by 1/sqrt(d_head) (resp. d_K), as `torch.nn.MultiheadAttention` and
`F.scaled_dot_product_attention` do. `Spec` carries what the options say of the attention (--causal,
--window, --rope, --rope-base, --kv-heads, --cache), whether or not the user's forward takes a mask.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from attnscope.errors import UsageError
from attnscope.spec import clip_words
from attnscope.trace import Trace
from attnscope.usertrace import normforms
from attnscope.usertrace.fused import NONE
from attnscope.variants.rope import Rope

if TYPE_CHECKING:
    from attnscope.spec import WindowSide
    from attnscope.usertrace.record import Record

ROLES = ("q", "k", "v", "o")
ROLE_WORDS = {
    "q": {"q", "query", "queries", "wq"},
    "k": {"k", "key", "keys", "wk"},
    "v": {"v", "value", "values", "wv"},
    "o": {"o", "out", "output", "wo", "dense"},
}
NOISE = {"w", "proj", "projection", "linear", "lin", "to", "fc", "layer", "weight", "in", "attn", "attention",
         "self", "l", "dense_layer", "c"}
WEIGHT_WORDS = {"kernel", "weight", "w", "bias"}  # a projection's tensor in its module (Flax's query.kernel)
MHA_STEPS = ("Q_feat", "K_feat", "V_feat", "Q_pooled", "K_pooled", "V_pooled", "Q_split", "K_split", "V_split",
             "Q_normed", "K_normed", "Q_rot", "K_rot",
             "K_cat", "V_cat", "K_rep", "V_rep", "scores", "capped_scores", "biased_scores", "masked_scores",
             "attention", "x_raw", "x_rsh1", "x_rsh2", "gate", "x_gated", "x")
def late_norm(order: list[str], name: str) -> bool:
    """Whether `name` is a qk-norm's step (`Q_normed`, `K_normed`) the reference's run `order` makes after its
    rotation (Spec.qk_norm_after: nGPT's norm on the rotated heads)."""
    rotated = name.replace("_normed", "_rot")
    return name.endswith("_normed") and name in order and rotated in order and order.index(name) > order.index(rotated)


def in_run_order(wanted: tuple[str, ...], order: list[str]) -> tuple[str, ...]:
    """`wanted` with a qk-norm the run makes after its rotation moved after the rotated steps, as the run has it."""
    late = tuple(n for n in wanted if late_norm(order, n))
    if not late or "K_rot" not in wanted:
        return wanted
    rest = [n for n in wanted if n not in late]
    at = rest.index("K_rot") + 1
    return (*rest[:at], *late, *rest[at:])


SDPA_STEPS = ("Q_normed", "K_normed", "Q_rot", "K_rot", "K_rep", "V_rep", "scores", "capped_scores", "biased_scores",
              "masked_scores", "attention", "out")


@dataclass(frozen=True)
class Spec:
    """What the reference computes beside the weights, as the options describe it."""

    causal: str | None = None  # "upper-left" or "lower-right"
    window: int | None = None
    rope_base: float | None = None  # RoPE with this base; None: no RoPE
    cache: int = 0  # a decode step after this many cached positions
    layout: str = "row"  # "col": a function's inputs [.., d, n], out = V softmax(Kᵀ Q) (textbook.sdpa_columns)
    rope_pairing: str = "half-split"  # or "interleaved": GPT-J's and Meta's view_as_complex pairs (2i, 2i + 1)
    alibi: bool = False  # ALiBi's per-head bias on the scores (BLOOM's)
    qk_norm: str | None = None  # qk-norm: "head" (over d_head, timm's qk_norm, Qwen3) or "proj" (OLMo 2); its kind
    # (RMSNorm or LayerNorm), weights and eps are the user's norms' (build_mha)
    # a qk-norm without weights read from the code's rows (rownorms.py: Llama 4's L2Norm, F.rms_norm, F.normalize):
    # the gain its unit rows carry (1, or 1/√width for rows of unit length) and its epsilon; None: the norms' own
    qk_norm_gain: float | None = None
    qk_norm_eps: float | None = None
    # the qk-norm on the rotated heads (ownnorm.py: nGPT's gain per channel after RoPE, which turns with no pair)
    qk_norm_after: bool = False
    # the qk-norm read from the code (ownnorm.py), not told by --qk-norm: its place beside RoPE and its axis are the
    # code's convention, which no experiment then calls a mistake (normtrials.py)
    qk_norm_read: bool = False
    # Llama 4's temperature tuning of the queries (variants/temperature.TemperatureTuning), read from the module's
    # declared floor_scale and attn_scale by experiment (tuning.py); None: none
    temperature: Any = None
    scale: float | None = None  # the scores' scale; None: 1/sqrt(d_head) (resp. d_K)
    position_bias: Any = field(default=None, compare=False)  # a float tensor added to the scores (T5's), or None
    # Conventions read from the code (conventions.py), never from an option: the share of each head RoPE turns
    # (GPT-NeoX's rotary_pct), the position of the first token (0, or 1 in code that counts from 1), and whether
    # the pairing was asked for (--rope-pairing) rather than left to the code
    window_side: str = "left"  # "both": a bidirectional local window, |i - j| <= window // 2 (--window-side)
    rope_fraction: float | None = None
    rope_start: int = 0
    rope_sign: int = 1  # -1: the code turns each pair by −θ (nanochat's x1·cos + x2·sin, −x1·sin + x2·cos)
    # how fast each rotated pair turns, read from the code's rotated tensors where no base gives them (ropefreqs.py:
    # the speedrun's half-truncated RoPE, a frequency schedule of its own); None: the base's, base^(-2i/d)
    rope_freqs: tuple[float, ...] | None = None
    # the angle each token's pair turns by `[n, d_head/2]`, read from the code where no one 1-D position gives it
    # (ropefreqs.Angles: 2-D or axial RoPE, a prefix kept unrotated); None: position · frequency
    rope_angles: Any = field(default=None, compare=False)
    # the RoPE scaling the module declares (declared.own_scaling: yarn's, llama3's, ...) at rope_base, where the
    # frequencies read from the code are what it gives: the reference's Rope, its attention factor with it
    rope_declared: Any = field(default=None, compare=False)
    pairing_asked: bool = False
    base_from_module: bool = False  # rope_base is the module's own (its rope_theta), read where --rope-base said none
    fraction_from_module: bool = False  # rope_fraction is the module's config's (rotary_dim, partial_rotary_factor)
    # What the user typed rather than left to a default: --rope-base B (even 10000) and --causal ALIGN (even
    # upper-left). An asked value is the reference's; the code's own base or alignment is then a bug, not a convention
    base_asked: bool = False
    align_asked: bool = False
    # The scores capped, softcap · tanh(scores / softcap), before the mask (Gemma 2's attn_logit_softcapping): from
    # --softcap (softcap_asked), or read from the module (its config's attn_logit_softcapping), as its RoPE base is;
    # `scale_from` names where a scale read from the module came from ("query_pre_attn_scalar = 24")
    softcap: float | None = None
    softcap_asked: bool = False
    softcap_from_module: bool = False
    scale_from: str | None = None
    # q, k and v clipped after their projection, (min, max): DBRX's clip_qkv, read from the module's config
    # (declared.py), else from the code's own clamp of a projection's output (clips.py)
    clip_qkv: tuple[float, float] | None = None
    # q and k clipped after their qk-norm (HF OLMoE's order), read from where the code's clamp sits (clips.py)
    clip_after_norm: bool = False
    # the arguments the module's __init__ was given (runs/trace._built_with): a config it read and did not keep,
    # where what the module declares (declared.py: its RoPE base, softcap, scale) is read beside the module itself
    built_with: Any = field(default=None, compare=False)
    # A decode step's cache read as holding keys before RoPE, which the code joins and then rotates with the new ones
    # at their positions (cachekeys.py): the reference's cached keys were rotated so, and an experiment's rerun
    # joins before it rotates, as the code does
    cache_before_rope: bool = False
    # A term the code adds to its scores that no option describes (ownterm.py: Shaw's q · rel_k[j − i], Transformer-XL's
    # q · R, DeBERTa's c2p and p2c), taken from the code's run in the scores' layout `[.., n_Q, n_K]`, added as the
    # code adds it: before the scale (`term_before_scale`, scaled with the scores) or after it
    own_term: Any = field(default=None, compare=False)
    term_before_scale: bool = False
    # A term the code adds to its attention's output beside attn @ v (outterm.py: Shaw's relative values), taken from
    # the code's run in x_raw's layout `[n_batch, n_head, n_Q, d_V]`, added to the reference's x_raw
    out_term: Any = field(default=None, compare=False)
    # An output gate the code multiplies its heads' output by before the output projection (outgate.py: OpenFold's
    # sigmoid(linear_g(q_x)), Qwen3-Next's gate), taken from the code's run in x_raw's layout; the reference
    # multiplies its merged heads by it (steps gate, x_gated); `gate_before_merge`: the code gates attn @ v as it is
    out_gate: Any = field(default=None, compare=False)
    gate_before_merge: bool = False
    # Ops of the code's own on its merged heads before the output projection (outops.py: BitNet's sub-norm, LeViT's
    # activation), in words: the reference's output projection is the identity, compared up to the merge
    out_ops: str | None = None
    # Attention sinks the module holds (sinkcols.py: GPT-OSS's `sinks`, one logit a head joined to each row of scores
    # and dropped after the softmax), `[n_head]`, read from the code's run; the reference holds them
    sinks: Any = field(default=None, compare=False)
    # Queries, keys or values the code pools along the tokens after their projection (pooled.py: Hiera's max-pooled
    # queries, Linformer's keys projected along the sequence), role -> the code's own pooled tensor `[n_batch, n,
    # n_head·d_head]`, read from its run: the reference attends over them (steps Q_pooled, K_pooled, V_pooled)
    pooled: Any = field(default=None, compare=False)
    # The code's own scale, one number per head (headscale.py: cosine attention's exp(logit_scale), a learned
    # temperature), `[n_head]`, read from the code's run: each head's q · kᵀ times it, in place of `scale`
    head_scale: Any = field(default=None, compare=False)

    def added(self, d_head: int) -> Any:
        """What the reference adds to its scaled scores: the position bias, the code's own term (scaled with the
        scores where the code adds it before the scale), their sum; None where neither."""
        if self.own_term is None:
            return self.position_bias
        term = self.own_term * (self.scale if self.scale is not None else d_head ** -0.5) \
            if self.term_before_scale else self.own_term
        return term if self.position_bias is None else self.position_bias + term

    def attention(self, n_kv_head: int | None = None) -> Any:
        """The AttentionSpec the reference computes, built here once from what the options said."""
        from attnscope.spec import AttentionSpec

        return AttentionSpec(causal=self.causal, window=self.window, window_side=cast("WindowSide", self.window_side),
                             alibi=self.alibi, rope=self.rope(), softcap=self.softcap,
                             scale=self.scale, n_kv_head=n_kv_head, qk_norm=self._qk_norm(),
                             temperature=self.temperature, sinks=self.sinks is not None, clip_qkv=self.clip_qkv,
                             clip_after_norm=self.clip_after_norm)

    def _qk_norm(self) -> Any:
        """The qk-norm as the reference's spec takes it: its placement, and after RoPE where the code norms there."""
        if self.qk_norm is None or not self.qk_norm_after:
            return self.qk_norm
        from attnscope.variants.qknorm import QkNorm

        return QkNorm(self.qk_norm, after_rope=True)

    def rope(self) -> Any:
        """attnscope's Rope for the reference, None without RoPE."""
        if self.rope_base is None:
            return None
        if self.rope_declared is not None and not self.rope_start and self.rope_sign == 1 \
                and self.rope_angles is None:
            return self.rope_declared
        if self.rope_start or self.rope_sign != 1 or self.rope_freqs or self.rope_angles is not None:
            return StartedRope(self.rope_base, pairing=self.rope_pairing, partial_rotary_factor=self.rope_fraction,
                               start=self.rope_start, sign=self.rope_sign, freqs=self.rope_freqs or (),
                               angles=self.rope_angles)
        return Rope(self.rope_base, pairing=self.rope_pairing, partial_rotary_factor=self.rope_fraction)

    def describe(self) -> str:
        sides = " both sides" if self.window_side == "both" else ""
        parts = [f"causal {self.causal}" if self.causal else "", f"window {self.window}{sides}" if self.window else "",
                 f"RoPE base {self.rope_base:g} ({self.rope_pairing}{self._rope_more()})" if self.rope_base else "",
                 f"after {self.cache} cached positions" if self.cache else "", "ALiBi" if self.alibi else "",
                 f"qk-norm ({self.qk_norm}{', after RoPE' if self.qk_norm_after else ''})" if self.qk_norm else "",
                 f"scale {self.scale:g}" if self.scale is not None
                 else "", f"softcap {self.softcap:g}" if self.softcap is not None else "",
                 clip_words(self.clip_qkv) if self.clip_qkv is not None else "",
                 "position bias" if self.position_bias is not None else "",
                 "your own term on the scores" if self.own_term is not None else "",
                 "your own term on the output" if self.out_term is not None else "",
                 "your gate on the output" if self.out_gate is not None else "",
                 f"your pooled {', '.join(self.pooled)}" if self.pooled is not None else "",
                 "your own scale per head" if self.head_scale is not None else "",
                 self.temperature.describe() if self.temperature is not None else "",
                 "attention sinks" if self.sinks is not None else ""]
        return ", ".join(p for p in parts if p)

    def _rope_more(self) -> str:
        more = [f"{self.rope_fraction:g} of each head" if self.rope_fraction else "",
                f"positions from {self.rope_start}" if self.rope_start else "",
                "its own frequencies" if self.rope_freqs else "",
                "its own angle table" if self.rope_angles is not None else "",
                "turned by −θ" if self.rope_sign == -1 else ""]
        return "".join(f", {m}" for m in more if m)


@dataclass(frozen=True)
class StartedRope(Rope):
    """RoPE as the code computes it: its first token at position `start` (code that counts positions from 1: every
    table is the default one shifted by `start` rows), each pair turned by `sign` · θ (-1: nanochat's
    `x1 * cos + x2 * sin`, the sin table negated). Scores depend on i − j alone, so the attention is the same.
    `freqs`: how fast each pair turns, read from the code (ropefreqs.py), in place of the base's; () : the base's.
    `angles`: the angle each position's pair turns by `[n, d_head/2]` (ropefreqs.Angles), in place of both."""

    start: int = 0
    sign: int = 1
    freqs: tuple[float, ...] = ()
    angles: Any = field(default=None, compare=False)

    def inv_freq(self, d_head: int, seq_len: int | None = None) -> torch.Tensor:
        if not self.freqs:
            return super().inv_freq(d_head, seq_len)
        return torch.tensor(self.freqs, dtype=torch.float32)

    def table_op(self, which: str, d_name: str, d_head: int, n_pos: int, first: int = 0) -> str:
        if self.angles is not None:
            return f"{which}(angles), each token's angles as your code turns its pairs (read from your rotated tensors)"
        if not self.freqs:
            return super().table_op(which, d_name, d_head, n_pos, first)
        freqs = ", ".join(f"{f:.4g}" for f in self.freqs)
        return f"{which}(position · inv_freq), inv_freq = [{freqs}] (read from your rotated tensors)"

    def cos_sin(self, n_pos: int, d_head: int, dtype: torch.dtype, device: Any = None,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.angles is not None:  # the code's own table: positions 0 .. n − 1, as it was read
            if start < 0 or n_pos > self.angles.shape[0]:
                raise UsageError(f"RoPE's angles were read for {self.angles.shape[0]} positions; positions {start} .. "
                                 f"{n_pos - 1} are not among them")
            rows = self.angles[start:n_pos].to(device=device, dtype=torch.float64) * self.sign
            emb = torch.cat((rows, rows), -1) if self.pairing == "half-split" else rows.repeat_interleave(2, -1)
            return emb.cos().to(dtype), emb.sin().to(dtype)
        cos, sin = super().cos_sin(n_pos + self.start, d_head, dtype, device, start=start + self.start)
        return cos, sin * self.sign


@dataclass
class Projections:
    """The user's projections by role (nn.Linear layers, or rows of a fused weight: fused.Part), and how
    they were matched."""

    linears: dict[str, tuple[str, Any]]
    matched_by: str  # "data flow ...", "name", "registration order", "a fused projection, ...", ...
    note: str | None = None  # a convention the reading holds (a fused projection's rows in the order k after v)
    merge_only: bool = False  # an identity output projection where the code's reads more (merge_only)
    joint: bool = False  # identity projections on the code's q, k, v joined from streams (joint.py)

    def describe(self) -> str:
        pairs = ", ".join(f"{role}={name}" for role, (name, _) in self.linears.items())
        how = self.matched_by if self.matched_by.startswith(("a fused", "the nn.")) else f"matched by {self.matched_by}"
        return f"{pairs} ({how})"


SHARED_KV = ("data flow: one projection makes both your keys and your values, K = V (Linformer's share_kv), a "
             "convention, not a mistake: your module holds no other projection for the values")


def role_of(name: str) -> str | None:
    """`W_q` -> q, `out_proj` -> o, `to_out.0` -> o, `linears.2` -> None."""
    parts = name.lower().split(".")
    while parts and (parts[-1].isdigit() or parts[-1] in WEIGHT_WORDS):  # query.kernel, heads.0, W_q.weight
        parts.pop()
    if not parts:
        return None
    words = [w for w in re.split(r"[_\-]", parts[-1]) if w and w not in NOISE]
    found = {role for role, vocabulary in ROLE_WORDS.items() if any(w in vocabulary for w in words)}
    return found.pop() if len(found) == 1 else None


def parameter_projections(module: nn.Module, records: list[Record], spare: bool = False) -> list[tuple[str, Any]]:
    """2-D nn.Parameter weights the code projects with, each read as a Linear would hold it: `x @ W` with W
    `[d_in, d_out]` (TransformerLens' W_Q, the from-scratch ports') as the weight `Wᵀ`, `F.linear(x, W)` as `W`.
    `spare`: instead, the weights the code never uses, of the shape and kind of one it does, whose name says no role
    left to them (unused.py reads theirs from the data flow)."""
    from attnscope.usertrace import fused
    from attnscope.usertrace.record import LEFT

    params = dict(module.named_parameters())
    held = {f"{name}.weight" for name, m in module.named_modules() if isinstance(m, nn.Linear)}
    out: dict[str, Any] = {}
    recipes: dict[str, tuple[bool, bool, str | None]] = {}
    for r in records:
        if r.style != "linear" or not r.args or r.args[0][0] != "text":
            continue
        name = r.args[0][1]
        used = r.details.get("weight")  # as the code reshaped it (qkv_w [3, hdim, dim] flattened), else itself
        cut = name not in params and f"{name}.weight" not in held and used is not None  # rows cut (weightrows.py)
        if name not in out and (cut or name in params and name not in held and params[name].dim() >= 2):
            recipes[name] = (r.func == "matmul", LEFT in r.args,
                             next((a[1] for a in r.args if a[0] == "side" and a[1].startswith("kernel")), None))
            weight = _as_linear(params[name].detach() if used is None else used, *recipes[name])
            if weight is not None:
                out[name] = fused.Part(name, weight, _added_bias(r, records, params, weight.shape[0]))
    said = {role_of(name) for name in out}
    spare_out: dict[str, Any] = {}
    for name, p in params.items():  # a weight the code never used (Flax's value.kernel where it projects with
        # key.kernel twice), read as its sibling of the same shape and kind (key.kernel) is: a role of its own
        # where its name says one no other weight holds; else spare (unused.py reads its role from the flow)
        used = next((u for u in out if u in params and params[u].shape == p.shape and _same_kind(u, name)), None)
        role = role_of(name)
        if name in out or name in held or used is None or mentioned(name, records):
            continue
        weight = _as_linear(p.detach(), *recipes[used])
        bias = params.get(name.rsplit(".", 1)[0] + ".bias") if "." in name else None
        if weight is not None:
            fit = bias is not None and bias.numel() == weight.shape[0]
            part = fused.Part(name, weight, bias.detach().reshape(-1) if fit and bias is not None else None)
            if role is None or role in said:
                spare_out[name] = part
            else:
                out[name] = part
                said.add(role)
    return list((spare_out if spare else out).items())


def mentioned(name: str, records: list[Record]) -> bool:
    """Whether any op the code ran read the weight `name` (an nn.Linear by its name, a parameter)."""
    return any(("text", name) in r.args or ("kw", ("weight", ("text", name))) in r.args for r in records)


def _same_kind(used: str, name: str) -> bool:
    """Two parameters of one kind: held under the same name by two modules (query.kernel, value.kernel), or both
    the attention module's own (W_K, W_V)."""
    return used.split(".")[-1] == name.split(".")[-1] if "." in used or "." in name else True


def _as_linear(weight: torch.Tensor, matmul: bool, left: bool, kernel: str | None = None) -> torch.Tensor | None:
    """A weight as a Linear holds it, [d_out, d_in]: `x @ W` (W [d_in, d_out]) transposed, `W @ x` (the column
    form) and `F.linear(x, W)` as they are; per-head stacks with their heads outer, `W @ x` of [n_head, d_head,
    d_in] and `x @ W` of [n_head, d_in, d_head] as [n_head·d_head, d_in]; Keras' EinsumDense kernels, [d_in, n_head,
    d_head] ("kernel_in") and the output's [n_head, d_head, d_out] ("kernel_out"), likewise. None for a 3-D F.linear
    weight."""
    from attnscope.usertrace.record import kernel_axes

    axes = kernel_axes(kernel) if kernel else None
    if axes is not None and sorted(axes[0] + axes[1]) == list(range(weight.dim())):
        out, given = axes  # an einsum's kernel of any rank: its output's axes as rows, its input's as columns
        rows, columns = [weight.shape[a] for a in out], [weight.shape[a] for a in given]
        return weight.permute(*out, *given).reshape(math.prod(rows), math.prod(columns))
    if weight.dim() > 3 or axes is not None:
        return None
    if weight.dim() == 3 and kernel == "kernel_in":
        return weight.permute(1, 2, 0).reshape(-1, weight.shape[0])  # -> [n_head·d_head, d_in]
    if weight.dim() == 3 and kernel == "kernel_out":
        return weight.reshape(-1, weight.shape[-1]).t()  # -> [d_out, n_head·d_head]
    if weight.dim() == 3:
        if not matmul:
            return None
        heads = weight if left else weight.transpose(1, 2)  # -> [n_head, d_head, d_in]
        return heads.reshape(-1, heads.shape[-1])  # [n_head, d_head, d_in] -> [n_head·d_head, d_in]
    return weight.t() if matmul and not left else weight


COLUMN_VIEWS = ("__getitem__", "unsqueeze", "view", "reshape", "expand")  # a bias made a column, [d_out, 1]


def _added_bias(projection: Record, records: list[Record], params: dict[str, Any], width: int) -> Any:
    """The 1-D nn.Parameter the code adds to a projection's output (`x @ W + b`, `b + x @ W`, `.add(b)`: GPT-2's
    Conv1D written out, the from-scratch ports' W/b pairs; the column form's `W @ x + b[:, None]` or a `[d_out, 1]`
    one), read as that projection's bias; None where none is added or the same bias meets other tensors too.
    `F.linear(x, W, b)`'s own b is its bias."""
    given = called_bias(projection, records, params, width)
    if given is not None:  # F.linear(x, W, b): ("kw", ("bias", ("text", name) or ("rec", i)))
        return given
    for r in records:
        if r.func not in ("add", "__add__", "__radd__", "add_") or ("rec", projection.index) not in r.args:
            continue
        for kind, value in r.args:
            if kind == "rec" and value != projection.index and records[value].func in COLUMN_VIEWS \
                    and records[value].args and records[value].args[0][0] == "text":
                kind, value = records[value].args[0]  # the column form's b[:, None], b.unsqueeze(-1): b as a column
            if kind == "text" and value in params and params[value].numel() == width \
                    and (params[value].dim() - list(params[value].shape).count(1) <= 1
                         or params[value].shape == projection.tensor.shape[-params[value].dim():]):
                # [d_out], [d_out, 1], or laid out as the projection's output ends (Flax's [n_head, d_head])
                return params[value].detach().reshape(width)  # [d_out], [d_out, 1] -> [d_out]
            if kind == "rec" and value != projection.index and records[value].tensor.numel() == width \
                    and records[value].tensor.is_floating_point() and _from_parameters(value, records, params):
                return records[value].tensor.detach().reshape(width)  # x @ W + cat((q_bias, zeros, v_bias))
    return None


def _from_parameters(index: int, records: list[Record], params: dict[str, Any]) -> bool:
    """Whether record `index` is computed from the module's parameters and constants alone (no input reaches it:
    every name its ops read, all the way up, is a parameter), as a bias the code builds is."""
    return parameters_read(index, records, params) is not None


def parameters_read(index: int, records: list[Record], params: dict[str, Any]) -> set[str] | None:
    """The module's parameters record `index` is computed from, all the way up; None where anything else reaches it
    (an input, a name that is no parameter): constants alone read none."""
    seen, stack, read = set(), [index], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for kind, value in records[i].args:
            if kind == "kw":
                kind, value = value[1]
            named = [value] if kind == "text" else [v for k, v in value if k == "text"] if kind == "list" else []
            if kind == "rec":
                stack.append(value)
            elif kind == "list":
                stack.extend(v for k, v in value if k == "rec")
            for name in named:
                if name in params:
                    read.add(name)
                elif isinstance(name, str) and name.replace(".", "_").isidentifier() \
                        and (kind == "list" or name not in ("True", "False", "None")):
                    return None
    return read


def called_bias(projection: Record, records: list[Record], params: dict[str, Any], width: int) -> Any:
    """The bias a projection's `F.linear(x, W, b)` was handed, `width` values: a parameter by name, or any tensor
    the code computed (BEiT's, EVA's and Swin v2's `torch.cat((q_bias, torch.zeros_like(v_bias), v_bias))`), as it
    was at the call; None where none was handed."""
    for kind, value in projection.args:
        if kind != "kw" or value[0] != "bias":
            continue
        source, what = value[1]
        if source == "text" and what in params and params[what].numel() == width:
            return params[what].detach().reshape(width)
        if source == "rec" and records[what].tensor.numel() == width and records[what].tensor.is_floating_point():
            return records[what].tensor.detach().reshape(width)
    return None


def _as_called(name: str, linear: nn.Linear, records: list[Record], params: dict[str, Any]) -> Any:
    """`linear`, or where the code calls its weight through F.linear with a bias of its own making (every call the
    same), its weight with that bias (fused.Part, which reads like an nn.Linear)."""
    from attnscope.usertrace import fused

    calls = [r for r in records if r.style == "linear" and r.func == "linear" and r.args
             and r.args[0] == ("text", name)]
    given = [called_bias(r, records, params, linear.out_features) for r in calls]
    if not given or any(b is None for b in given) or any(not torch.equal(b, given[0]) for b in given[1:]):
        return linear
    if linear.bias is not None and torch.equal(given[0], linear.bias.detach()):
        return linear
    return fused.Part(name, linear.weight.detach(), given[0])


def find_projections(module: nn.Module, records: list[Record] | None = None, n_head: int | None = None,
                     d_head: int | None = None, inputs: dict[str, str] | None = None) -> list[Projections]:
    """Every reading of the module's projections worth lining up, the likeliest first: four Linear layers by
    name, a wrapped nn.MultiheadAttention, a fused q/k/v projection (one candidate per way of splitting it),
    exactly four Linear layers in registration order. `inputs`: the forward's tensor parameters by role (Q, K,
    V), where it takes them apart: each projection's role is then the role of the input it reads. A projection
    applied to each head's slice (blockheads.py) is held block-diagonal, said in the reading's note."""
    from attnscope.usertrace import blockheads

    found = _find_projections(module, records, n_head, d_head, inputs)
    for projections in found:
        said = blockheads.note(projections.linears)
        if said is not None:
            projections.note = f"{projections.note}; {said}" if projections.note else said
    return found


def _find_projections(module: nn.Module, records: list[Record] | None, n_head: int | None, d_head: int | None,
                      inputs: dict[str, str] | None) -> list[Projections]:
    from attnscope.usertrace import blockheads, cutroles, flow, fused, identity, keybias, laterbias, perhead, unused

    if identity.is_holder(module):  # q, k, v given already projected, the heads split by the code (identity.py)
        return [Projections(identity.projections(module), "identity")]
    records = records or []
    params = dict(module.named_parameters())
    linears = [(name, _as_called(name, m, records, params)) for name, m in module.named_modules()
               if isinstance(m, nn.Linear)]
    linears += parameter_projections(module, records)
    # a weight the code mixes the projected tokens by (Linformer's proj_k, rtdl's key_compression): a pooling
    mixers = flow.token_mixers(records)
    linears = [(name, m) for name, m in linears if name not in mixers]
    # a bias the code adds once it has cut the output apart (q = q + self.q_bias after the chunk): laterbias.py
    linears = [(name, laterbias.added(name, m, records, params)) for name, m in linears]
    # one projection every head applies to its own slice, after the split (Persson's Linear(head_dim, head_dim))
    linears = [(name, blockheads.spread(name, m, records, n_head)) for name, m in linears]
    modules, names = dict(linears), [name for name, _ in linears]
    heads = perhead.find(records)
    if heads is not None and all(name in modules for roles in heads.roles for name in roles.values()):
        return [Projections(perhead.projections(heads, modules, names, role_of),
                            f"data flow, per head: {len(heads.roles)} softmaxes, each with q, k and v projections of "
                            "its own, stacked by head in the order your code merges their outputs"
                            + (f"; {NO_OUTPUT}" if heads.o is None else ""))]
    read = flow.roles(records, names, role_of)
    named = {role: [n for n in names if role_of(n) == role] for role in ROLES}
    if read is not None:  # the Linear layers the run called (diffusers' Attention holds add_q_proj beside to_q)
        ran = {role: [n for n in held if mentioned(n, records)] for role, held in named.items()}
        named = ran if all(len(ran[role]) == 1 for role in ROLES) else named
    if read is not None and all(len(named[role]) == 1 for role in ROLES) and any(
            read[0][role] != named[role][0] for role in ROLES):
        # four Linear layers named one role each, used in other roles (k_proj's output multiplied by the pattern,
        # v_proj's making the scores): a swap, never a convention. The reference holds the weights by their names
        # and the line-up shows where the code parts from it (the catalog names the swap by experiment).
        used = ", ".join(f"{read[0][role]} as {role.upper()}" for role in ROLES if read[0][role] != named[role][0])
        return [Projections({role: (named[role][0], modules[named[role][0]]) for role in ROLES},
                            f"name; your code uses {used}")]
    if read is not None and all(len(named[role]) == 1 for role in "qkv") and read[0]["q"] == named["q"][0] \
            and (read[0]["k"], read[0]["v"]) == (named["v"][0], named["k"][0]) and read[0].get("o") in modules \
            and read[0]["o"] not in (named[r][0] for r in "qkv"):
        # the same where only q, k and v are named, the output projection the flow's (`dense`, `proj`), and the
        # keys and values are each other's: k_proj's output multiplied by the pattern and v_proj's rotated as keys
        # is `k, v = v, k` before RoPE, which no flow can tell from correct code (minGPT's `k @ qᵀ`, the query and
        # key weights' roles exchanged, stays the flow's reading: the transposed scores of a correct attention)
        used = ", ".join(f"{read[0][role]} as {role.upper()}" for role in "kv")
        return [Projections({**{role: (named[role][0], modules[named[role][0]]) for role in "qkv"},
                             "o": (read[0]["o"], modules[read[0]["o"]])}, f"name; your code uses {used}")]
    apart = _by_inputs(records, names, inputs, named) if read is None and inputs and len(inputs) > 1 else None
    if apart is not None:
        found_roles, how = apart
        return [Projections({role: (name, modules[name]) for role, name in found_roles.items()}, how)]
    if read is not None:  # the data flow decides; names and order only break its ties
        found_roles, tie = read
        how = "name" if all(role_of(name) == role for role, name in found_roles.items()) else (
            "data flow: Q makes the scores' left operand, K the right, V what the pattern multiplies"
            + (f"; {tie} broke a tie" if tie else ""))
        biased = keybias.biased_swap(found_roles, modules, role_of)
        if biased is not None:  # no bias on the Linear used as V, one on K's: the keys' is the one left out
            found_roles, how = biased
        said = cutroles.swapped(records, found_roles)
        if said is not None:  # rows cut from a packed weight, named k and used as V: held by the words
            found_roles = {**found_roles, "k": found_roles["v"], "v": found_roles["k"]}
            how = f"{how}{said}"
        return [Projections({role: (name, modules[name]) for role, name in found_roles.items()}, how)]
    by_role: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, linear in linears:
        role = role_of(name)
        if role:
            by_role.setdefault(role, []).append((name, linear))
    if all(len(by_role.get(role, [])) == 1 for role in ROLES):
        return [Projections({role: by_role[role][0] for role in ROLES}, "name")]
    inner = fused.inner_mha(module)
    if inner is not None:
        return [Projections(fused.mha_parts(*inner), f"the nn.MultiheadAttention {inner[0] or 'it is'}")]
    called = fused.call_parts(module, records)
    if called is not None:  # F.multi_head_attention_forward called with the module's own parameters
        return [Projections(*called)]
    found = fused.fused_linear(linears)
    out = fused.output_linear(linears, found, role_of) if found is not None else None
    shared = flow.shared(records, names)
    thrown = unused.discarded(records)  # called, its product thrown away (`v = self.Wv(x)`, then `@ k`)
    if shared is not None and len(set(shared.values())) < 4:  # one weight writes two roles, beside unused ones
        spare = [n for n in names if not mentioned(n, records) or n in thrown]
        spare_parts = dict(parameter_projections(module, records, spare=True))
        siblings = unused.sibling_reading(shared, modules | spare_parts, spare + list(spare_parts), role_of,
                                          thrown)
        if siblings is not None:
            return [Projections({role: (name, (modules | spare_parts)[name]) for role, name in siblings[0].items()},
                                siblings[1])]
    lone = flow.shared_without_output(records, names) if shared is None else None
    if lone is not None:  # no output projection, and a weight the run never calls (`self.key(x)` for the values)
        spare = [n for n in names if not mentioned(n, records) or n in thrown]
        siblings = unused.sibling_reading(lone, modules, spare, role_of, thrown)
        if siblings is not None:
            return [Projections({**{role: (name, modules[name]) for role, name in siblings[0].items()},
                                 "o": (NONE, _identity(modules[lone["q"]]))}, f"{siblings[1]}; {NO_OUTPUT}")]
    if shared is not None and shared["q"] != shared["k"] == shared["v"] and flow.keys_are_values(records):
        # one projection's whole output for the keys and the values (Linformer's share_kv), no spare one beside it;
        # beside one the code never uses (a value weight of another kind: a parameter beside Linear layers), that
        # one is the values' and the code's `v = k` the mistake the line-up shows (kv.values_from_keys)
        left = unused.left_value(module, records, modules[shared["k"]], thrown, mentioned)
        if left is not None:
            return [Projections({"q": (shared["q"], modules[shared["q"]]), "k": (shared["k"], modules[shared["k"]]),
                                 "v": left, "o": (shared["o"], modules[shared["o"]])},
                                f"data flow, with a weight your code never uses: {shared['k']} makes your K, V; "
                                f"the reference holds {left[0]}, which fits as the values' projection, as V")]
        return [Projections({"q": (shared["q"], modules[shared["q"]]), "k": (shared["k"], modules[shared["k"]]),
                             "v": (shared["k"], modules[shared["k"]]), "o": (shared["o"], modules[shared["o"]])},
                            SHARED_KV)]
    if shared is not None and shared["q"] != shared["k"] == shared["v"]:  # a fused K/V projection (to_kv)
        return [Projections({"q": (shared["q"], modules[shared["q"]]),
                             **{role: (part.name, part) for role, part in parts.items()},
                             "o": (shared["o"], modules[shared["o"]])}, f"a fused K/V projection, {how}",
                            fused.order_note(shared["k"], parts))
                for how, parts in fused.kv_layouts(shared["k"], modules[shared["k"]], records,
                                                   keybias.zero_rows(module, records, shared["k"]))]
    if shared is not None and len(set(shared.values())) == 2 and (found is None or out is None):
        # q, k, v from one Linear the flow names, whatever its name
        found, out = (shared["q"], modules[shared["q"]]), (shared["o"], modules[shared["o"]])
    if found is not None and out is not None:
        candidates = [Projections({**{role: (part.name, part) for role, part in parts.items()}, "o": out},
                                  f"a fused projection, {how}", fused.order_note(found[0], parts))
                      for how, parts in fused.split_layouts(found[0], found[1], records, n_head, d_head,
                                                            keybias.zero_rows(module, records, found[0]))]
        if candidates:
            return candidates
    if len(linears) == 4:
        return [Projections(dict(zip(ROLES, linears, strict=True)), "registration order")]
    alone = flow.without_output(records, names)
    if alone is not None:  # no output projection (HF's BertSelfAttention): the reference's is the identity, so its
        # x is the merge (of any width: n_head·d_head need not be d_feat)
        how = "data flow"
        if all(len(named[role]) == 1 for role in "qkv") and any(alone[role] != named[role][0] for role in "qkv"):
            # three named one role each, used in others: a swap, held by the names as with an output projection
            how = "name; your code uses " + ", ".join(f"{alone[role]} as {role.upper()}" for role in "qkv"
                                                      if alone[role] != named[role][0])
            alone = {role: named[role][0] for role in "qkv"}
        return [Projections({**{role: (name, modules[name]) for role, name in alone.items()},
                             "o": (NONE, _identity(modules[alone["q"]]))}, f"{how}; {NO_OUTPUT}")]
    listed = ", ".join(f"{n} [{m.in_features} → {m.out_features}]" for n, m in linears) or "none"
    raise UsageError(f"no reference for {type(module).__name__}: trace copies q, k, v and output projections (four "
                     "Linear layers named like W_q/q_proj/query and W_o/out_proj, or exactly four in that order; a "
                     "fused q/k/v Linear such as nanoGPT's c_attn with its output projection; a fused k/v "
                     "Linear such as x-transformers' to_kv beside a q one; or an "
                     f"nn.MultiheadAttention) into attnscope's MultiHeadAttention; its Linear layers are {listed}")


def merge_only(found: Projections) -> Projections | None:
    """`found` with an identity output projection where its own reads more features than the heads write: the merge
    of the heads joined with other features before it (Flux's single-stream block, PaLM's and GPT-J's parallel
    blocks: `linear2(cat(attention, mlp(x)))`), so that the reference is compared up to the merge. None otherwise."""
    (_, q), (name, o) = found.linears["q"], found.linears["o"]
    if o.in_features <= q.out_features:
        return None
    return Projections({**found.linears, "o": (NONE, _identity(q))},
                       f"{found.matched_by}; your {name} reads {o.in_features} features, the {q.out_features} of the "
                       "merged heads beside others (an MLP's, as in a parallel block), so the reference's output "
                       "projection is the identity and it is compared up to the merge of the heads", found.note, True)


NO_OUTPUT = "your code has no output projection, so the reference's is the identity and it is compared up to the " \
    "merge of the heads"


def _identity(query: Any) -> Any:
    """The output projection of a module that has none (HF's BertSelfAttention): the identity over the queries'
    width, so the reference's x is the merge of its heads."""
    from attnscope.usertrace import fused

    width, weight = query.out_features, query.weight
    return fused.Part(NONE, torch.eye(width, dtype=weight.dtype, device=weight.device), None)


def _by_inputs(records: list[Record], names: list[str], inputs: dict[str, str], named: dict[str, list[str]]
               ) -> tuple[dict[str, str], str] | None:
    """{role: Linear name} where the forward takes its queries apart from its keys (and values): each projection's
    role is that of the input it reads (a memory's two, K and V, told apart by the flow: the scores' right operand,
    the pattern's partner), the output projection the one reading what the pattern made; and how they were matched.
    Where three Linear layers are named one of q, k, v each and the inputs say otherwise (`value =
    self.linear_keys(key)` used as the values), the names hold the weights: a swap is a mistake, which the line-up
    then shows and the catalog names. None where the flow does not say it."""
    from attnscope.usertrace import cutroles, flow

    said = None
    fed = flow.projection_inputs(records, list(inputs))
    by_role: dict[str, list[str]] = {}
    for name, params in fed.items():
        roles = {inputs[p] for p in params}
        if name in names and len(roles) == 1:
            by_role.setdefault(roles.pop().lower(), []).append(name)
    if "v" not in by_role and len(by_role.get("k", [])) == 2:  # x and a memory: its two projections by their use
        sides = flow.sources(records)
        if sides is None:
            return None
        keys = [n for n in by_role["k"] if n in sides[1] and n not in sides[2]]
        values = [n for n in by_role["k"] if n in sides[2] and n not in sides[1]]
        if len(keys) != 1 or len(values) != 1:
            return None
        by_role["k"], by_role["v"] = keys, values
        said = cutroles.swapped(records, {"k": keys[0], "v": values[0]})
        if said is not None:  # rows cut from a packed weight, named k and used as V: held by the words
            by_role["k"], by_role["v"] = values, keys
    if any(len(by_role.get(role, [])) != 1 for role in "qkv"):
        return None
    found = {role: by_role[role][0] for role in "qkv"}
    out = [n for n in flow.readers(records) if n not in found.values()]
    if len(out) != 1:
        return None
    found["o"] = out[0]
    how = "name" if all(role_of(found[role]) == role for role in ROLES) else \
        "data flow: each projection's role is the input it reads, the output's what the pattern made"
    if all(len(named[role]) == 1 for role in "qkv") and any(found[role] != named[role][0] for role in "qkv"):
        used = ", ".join(f"{found[role]} on your {role.upper()} input" for role in "qkv"
                         if found[role] != named[role][0])
        return {**{role: named[role][0] for role in "qkv"}, "o": found["o"]}, f"name; your code uses {used}"
    return found, how if said is None else f"data flow, the memory's two projections by your code's words{said}"


def build_mha(found: Projections, n_head: int, spec: Spec = Spec(), module: nn.Module | None = None,
              records: list[Record] | None = None) -> nn.Module:
    """attnscope's MultiHeadAttention holding the user's weights (biases a layer lacks are zero), computing
    what `spec` describes."""
    from attnscope.attention.multihead import MultiHeadAttention

    q, k, v, o = (found.linears[role][1] for role in ROLES)
    d_feat = q.in_features
    names = {role: found.linears[role][0] for role in ROLES}
    merge = names["o"] == NONE  # no output projection: the identity over the merge, of the heads' width
    if k.in_features != v.in_features or o.out_features != d_feat and not merge:  # K, V may read their own width
        raise UsageError(f"{names['k']} and {names['v']} must read the same features and {names['o']} write "
                         f"{names['q']}'s back: found {q.in_features}, {k.in_features}, {v.in_features} in, "
                         f"{o.out_features} out")
    d_head, n_kv_head, d_v = head_widths(names, (q, k, v, o), n_head)
    if spec.rope_base is not None and d_head % 2:
        raise UsageError(f"RoPE rotates pairs of coordinates, so d_head must be even; it is {d_head}")
    qkv_bias = any(m.bias is not None for m in (q, k, v))
    weight = q.weight
    norms = _qk_norms(module, spec, n_head, n_kv_head, d_head, records) if module is not None else {}
    attention = spec.attention(n_kv_head)
    forms: dict[str, Any] = {}
    if not norms and attention.norm is not None and spec.qk_norm_eps is not None:  # a norm without weights
        attention = replace(attention, qk_norm=replace(attention.norm, eps=float(spec.qk_norm_eps)))
    if norms and attention.norm is not None:  # the user's norm's epsilon (nn.RMSNorm's None: its dtype's eps), kind
        forms = _norm_forms(norms, attention.norm, n_head, n_kv_head, d_head)
        if forms:  # read by experiment on the user's own norms (normforms.py): kind, (1 + w), eps, weights
            form = forms["q"]
            attention = replace(attention, qk_norm=replace(attention.norm, eps=float(form.eps), kind=form.kind,
                                                            offset=form.offset))
        else:
            eps = getattr(norms["q"][1], "eps", None)
            eps = torch.finfo(weight.dtype).eps if eps is None else eps
            kind = "layer" if _is_layer_norm(norms["q"][1]) else "rms"
            attention = replace(attention, qk_norm=replace(attention.norm, eps=float(eps), kind=kind))
    reference = MultiHeadAttention(d_feat, n_head, bias=qkv_bias, out_bias=o.bias is not None,
                                   d_head=d_head if d_head * n_head != d_feat else None, device=weight.device,
                                   dtype=weight.dtype, spec=attention,
                                   d_kv_in=k.in_features if k.in_features != d_feat else None,
                                   d_v=d_v if d_v != d_head else None)
    if o.out_features != d_feat:  # the merge of heads other than d_feat wide, compared as it is: x = x_rsh2
        reference.W_o = nn.Linear(o.in_features, o.out_features, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for mine, theirs in ((reference.W_q, q), (reference.W_k, k), (reference.W_v, v), (reference.W_o, o)):
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(mine.bias))
        if spec.sinks is not None and reference.sinks is not None:  # the module's own sinks (sinkcols.py)
            reference.sinks.copy_(spec.sinks.reshape(-1).to(reference.sinks.dtype))
        if not norms and attention.norm is not None and spec.qk_norm_gain is not None:
            reference.q_norm.weight.fill_(spec.qk_norm_gain)
            reference.k_norm.weight.fill_(spec.qk_norm_gain)
        for role, (_, norm) in norms.items():
            mine = getattr(reference, f"{role}_norm")
            theirs, bias = (forms[role].weight, forms[role].bias) if forms else \
                (normforms.weight_of(norm, mine.weight.shape[-1]), getattr(norm, "bias", None))
            if theirs is None:  # a norm whose weight is not read: the reference's unit weight
                continue
            if theirs.numel() != mine.weight.numel():  # a row per head: [heads, 1, d_head] over [.., heads, n, d_head]
                mine.weight = nn.Parameter(theirs.reshape(-1, 1, mine.weight.shape[-1]).clone())
                if mine.bias is not None:
                    mine.bias = nn.Parameter(torch.zeros_like(mine.weight))
            mine.weight.copy_(_as_held(theirs, mine.weight))
            if mine.bias is not None:  # a LayerNorm's (nn.LayerNorm(bias=False) has none: zeros)
                mine.bias.copy_(_as_held(bias, mine.bias) if bias is not None else torch.zeros_like(mine.bias))
    return reference.eval()


def head_widths(names: dict[str, str], linears: tuple[Any, Any, Any, Any], n_head: int) -> tuple[int, int, int]:
    """(d_head, n_kv_head, d_V) from the projections' widths: q writes n_head·d_head (d_head = d_K, the queries' and
    keys' per head), k n_kv_head·d_head, v n_kv_head·d_V and o reads n_head·d_V. The values may be as wide as the keys
    or not (Perceiver IO's v_channels, DeepSeek's v_head_dim beside d_nope + d_rope); a layout these do not fit is
    refused, naming the width that does not."""
    q, k, v, o = linears
    if q.out_features % n_head:
        raise UsageError(f"{names['q']} writes {q.out_features} features, which {n_head} heads do not split evenly; "
                         "a multi-head layout needs q.out = n_head·d_head")
    d_head = q.out_features // n_head
    if k.out_features % d_head:
        raise UsageError(f"{names['k']} writes {k.out_features} features, not a whole number of heads of d_head = "
                         f"{d_head} ({names['q']}'s {q.out_features} over {n_head} heads): queries and keys need one "
                         "width per head")
    n_kv_head = k.out_features // d_head
    if n_head % n_kv_head:
        raise UsageError(f"{n_head} query heads cannot share {n_kv_head} key/value heads evenly")
    if v.out_features % n_kv_head or o.in_features % n_head \
            or v.out_features // n_kv_head != o.in_features // n_head:
        raise UsageError(f"{names['v']} writes {v.out_features} features and {names['o']} reads {o.in_features}: "
                         f"not one value width per head over {n_kv_head} key/value heads and {n_head} query heads "
                         "(a multi-head layout needs v.out = n_kv_head·d_V and o.in = n_head·d_V)")
    return d_head, n_kv_head, v.out_features // n_kv_head


def _qk_norms(module: nn.Module, spec: Spec, n_head: int, n_kv_head: int, d_head: int,
              records: list[Record] | None = None) -> dict[str, tuple[str, Any]]:
    """With --qk-norm, the user's q and k norms whose weights the reference takes: modules with a 1-D `weight` as
    wide as the norm (d_head per head, the projection's width over it) that the run reads (`records`: diffusers'
    Attention holds norm_added_q and norm_added_k beside norm_q and norm_k, for a context its self-attention never
    gets), by name (`q_norm`, `k_norm`), else the only two in registration order; none found: unit weights. An
    nn.LayerNorm (timm's default norm_layer: the mean taken out, a bias) makes the reference's qk-norm a LayerNorm;
    another norm with a bias, or q and k normed by different kinds, is refused in one line."""
    if spec.qk_norm is None:
        return {}
    widths = {"q": d_head, "k": d_head} if spec.qk_norm == "head" else {"q": n_head * d_head, "k": n_kv_head * d_head}
    # per head, a weight row for each (Cohere's [n_head, d_head]) or one that every head shares
    rows = {"q": (1, n_head), "k": (1, n_kv_head)} if spec.qk_norm == "head" else {"q": (1,), "k": (1,)}
    found = [(name, m) for name, m in module.named_modules()  # a ModuleList of norms holds them, and is none
             if m is not module and not isinstance(m, (nn.Linear, nn.ModuleList, nn.ModuleDict))
             and _gain(m, widths.values(), {*rows["q"], *rows["k"]}) is not None]
    if records:  # the norms the run used (their weights read by an op, or the module called on a tensor)
        found = _run_norms(found, records)
    if records and spec.qk_norm == "head":  # a norm per head, each on its own head's slice (headnorms.py)
        from attnscope.usertrace import headnorms

        found = headnorms.group(found, records, {*rows["q"], *rows["k"]} - {1}, d_head, module, role_of)
    if records and not found:  # gains the module holds itself, `F.rms_norm(q, (d,)) * self.q_gain` (baregains.py)
        from attnscope.usertrace import baregains

        found = baregains.read(module, records, set(widths.values()))
    by_role = {role: [(n, m) for n, m in found if role_of(n.replace("norm", "")) == role] for role in ("q", "k")}
    if all(len(by_role[r]) == 1 for r in ("q", "k")):
        norms = {r: by_role[r][0] for r in ("q", "k")}
    elif len(found) == 2:
        norms = dict(zip(("q", "k"), found, strict=True))
    else:
        return {}
    for role, (name, norm) in norms.items():
        if _gain(norm, (widths[role],), rows[role]) is None:
            return {}
        if not _is_layer_norm(norm) and getattr(norm, "bias", None) is not None \
                and getattr(normforms.read(norm, widths[role]), "kind", None) != "layer":  # a LayerNorm by hand
            raise UsageError(f"your {name} is a {type(norm).__name__} with a bias, which the reference's qk-norm "
                             "reads only as nn.LayerNorm's (timm's default norm_layer) or an RMSNorm's weight alone "
                             "(Qwen3, OLMo 2, Gemma 3), so it cannot describe yours")
    (q_name, q_norm), (k_name, k_norm) = norms["q"], norms["k"]
    q_form, k_form = (normforms.read(norm, widths[role]) for role, (_, norm) in norms.items())
    kinds = (q_form.kind, k_form.kind) if q_form is not None and k_form is not None else \
        (_is_layer_norm(q_norm), _is_layer_norm(k_norm))
    if kinds[0] != kinds[1]:
        raise UsageError(f"your {q_name} is a {type(q_norm).__name__} and your {k_name} a {type(k_norm).__name__}; "
                         "the reference normalizes q and k with one kind of norm, LayerNorm or RMSNorm")
    return norms


def _run_norms(found: list[tuple[str, Any]], records: list[Record]) -> list[tuple[str, Any]]:
    """Of the norms `found`, those the run used, and beside them those of a role (q or k, by name) no used one holds:
    a code that leaves one side unnormed (`k_norm` never called) still holds that side's norm, whose weights the
    reference takes (else it reads one norm, and normalizes with unit weights). Two norms found and one used: both."""
    used = [(name, m) for name, m in found if _used(name, m, records)]
    if not used:
        return found
    if len(used) == 1 and len(found) == 2:
        return found
    held = {role_of(name.replace("norm", "")) for name, _ in used}
    return used + [(name, m) for name, m in found if all(m is not u for _, u in used)
                   and role_of(name.replace("norm", "")) in ("q", "k")
                   and role_of(name.replace("norm", "")) not in held]


def _used(name: str, norm: nn.Module, records: list[Record]) -> bool:
    """Whether any op of the run read one of the norm's parameters (`x * norm_q.weight`, `F.rms_norm(..,
    weight=norm_q.weight)`, a weight cast first: `norm_q.weight.to(x.dtype)`)."""
    held = {f"{name}.{p}" for p, _ in norm.named_parameters()}
    return any(mentioned(p, records) for p in held)


def _as_held(value: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """A weight or bias as the reference's norm holds it: a row per head `[heads, d_head]` as `[heads, 1, d_head]`;
    one that every head shares as it is (copy_ repeats it)."""
    return value.reshape(held.shape) if value.numel() == held.numel() else value


def _gain(norm: nn.Module, widths: Any, rows: Any) -> torch.Tensor | None:
    """A norm's weight over one of `widths` (its largest parameter of such a width, whatever it is called: `scale`,
    `gain`; normforms.shaped): 1-D, or one row per head (`[n_head, d_head]`, `[n_head, 1, d_head]`) for one of
    `rows` (the head counts). None where it holds none."""
    for width in dict.fromkeys(widths):
        weight = normforms.shaped(norm, width)
        if weight is not None and weight.numel() // width in rows:
            return weight
    return None


def _norm_forms(norms: dict[str, tuple[str, Any]], norm: Any, n_head: int, n_kv_head: int,
                d_head: int) -> dict[str, Any]:
    """The forms the user's q and k norms compute (normforms.read: RMSNorm or LayerNorm, w or Gemma's 1 + w, eps),
    read by running each on a probe; empty where either is not read, or the two read as different kinds, or with
    their weights offset differently (the reference's one qk-norm cannot hold them)."""
    widths = {"q": norm.width(n_head, d_head), "k": norm.width(n_kv_head, d_head)}
    forms = {role: normforms.read(module, widths[role]) for role, (_, module) in norms.items()}
    q, k = forms.get("q"), forms.get("k")
    if q is None or k is None or q.kind != k.kind or q.offset != k.offset:
        return {}
    return forms


def _is_layer_norm(norm: nn.Module) -> bool:
    """nn.LayerNorm (timm's `Attention(qk_norm=True)` default, and its subclasses: timm's own LayerNorm)."""
    return isinstance(norm, nn.LayerNorm)


def run_mha(reference: nn.Module, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
            mask: torch.Tensor | None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
            position_bias: torch.Tensor | None = None) -> Trace:
    with torch.no_grad():
        trace: Trace = reference(Q, K, V, mask, cache=cache, position_bias=position_bias)
    return trace


def run_sdpa(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
             spec: Spec = Spec()) -> Trace:
    from attnscope.attention.dot_product import sdpa

    gqa = Q.dim() >= 3 and K.dim() >= 3 and Q.shape[-3] != K.shape[-3]
    with torch.no_grad():
        return sdpa(Q, K, V, mask, enable_gqa=gqa, spec=spec.attention(),
                    position_bias=spec.added(Q.shape[-1]), sinks=spec.sinks)


def run_columns(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                spec: Spec = Spec()) -> Trace:
    """The column form on inputs [.., d, n]: `attnscope sdpa --layout col`'s textbook.sdpa_columns, its mask
    ([.., n_K, n_Q], True = may attend) the file's and the causal/window mask transposed, as sdpa's build_mask
    transposes them for the column layout."""
    from attnscope import masks
    from attnscope.attention.textbook import sdpa_columns
    from attnscope.spec import AttentionSpec

    asked = AttentionSpec.asked(spec.causal, spec.window, window_side=spec.window_side)
    structural, _ = masks.structural(asked, Q.shape[-1], K.shape[-1])
    # [n_Q, n_K] -> the column form's [n_K, n_Q]
    combined = masks.combine(structural.transpose(-2, -1) if structural is not None else None, mask)
    with torch.no_grad():
        return sdpa_columns(Q, K, V, combined)


def steps(trace: Trace, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name in trace]
