"""What the reference computes beside the weights (reference.py gathers the reference's modules): `Spec`, what the
options and the readings of the code say of the attention (--causal, --window, --rope and its pairing, base and
table, --kv-heads, --cache, qk-norm, a scale, a softcap, sinks, the code's own terms, gates and pooled tensors),
RoPE as the code computes it (`StartedRope`), and the names of the reference's steps in the order its run makes
them (`MHA_STEPS` for a module's, `SDPA_STEPS` for a function's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from attnscope.errors import UsageError
from attnscope.spec import clip_words
from attnscope.trace import Trace
from attnscope.variants.rope import Rope

if TYPE_CHECKING:
    from attnscope.spec import WindowSide


MHA_STEPS = ("Q_feat", "K_feat", "V_feat", "Q_pooled", "K_pooled", "V_pooled", "Q_split", "K_split", "V_split",
             "Q_normed", "K_normed", "V_normed", "Q_rot", "K_rot",
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
    # ALiBi's slopes where they are not 2^(-8 h / n_head): ALiBi's times the scale, read from code that adds the bias
    # before it scales (alibiorder.py: Falcon's (q · kᵀ + alibi) / √d_head); None: ALiBi's own
    alibi_slopes: tuple[float, ...] | None = None
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
    # the values RMS-normed per head without weights, this eps, read from the code (valuenorm.py: Gemma 3n's v_norm)
    v_norm: float | None = None
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
    # rope_angles and the pairing read from the code's own cos and sin tables (owntables.py), not from its rotation:
    # a rotation of the other pairing is then a mistake the reading does not undo (conventionread._undoes)
    rope_tables: bool = False
    # the RoPE scaling the module declares (declared.own_scaling: yarn's, llama3's, ...) at rope_base, where the
    # frequencies read from the code are what it gives: the reference's Rope, its attention factor with it
    rope_declared: Any = field(default=None, compare=False)
    pairing_asked: bool = False
    # the pairing fixed by the tables the code runs on (runs/trace_attempt.form_spec), not by --rope-pairing: it says
    # how pairs turn, not whether the code gathers them first (DeepSeek-V3's rope_interleave, latentref.py)
    pairing_read: bool = False
    base_from_module: bool = False  # rope_base is the module's own (its rope_theta), read where --rope-base said none
    base_where: str = ""  # where the module says rope_base, in words (declared.base_where)
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
    # ... and that term is the code's queries, head by head (the Set Transformer's `Q_ + A·V_`, MViTv2's `x + q`): a
    # rerun that changes the queries the scores read adds them changed, as the code adds the very tensor it scores
    out_queries: bool = False
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
    # The code's mixing of its heads (headmix.py: talking-heads attention), (pre, post): [n_head, n_head + 1] matrices
    # read from the code's run, out[k] = Σ_h M[k, h] · in[h] + M[k, -1] (a Conv2d's or Linear's bias), over the scores
    # before the bias and the mask and over the weights after the softmax (either None)
    head_mix: Any = field(default=None, compare=False)
    # heads made of every n_head-th feature (view(.., d_head, n_head)) and merged back so: the checkpoint's layout of
    # SuperGlue's heads, read from the code (stridedheads.py); False: BERT's split
    strided_heads: bool = False
    # The code's learned gain per coordinate on its queries (querygain.QueryGain: TimesFM's per-dimension scale), read
    # from its run: held by the reference's query projection, each head's rows times it
    q_gain: Any = field(default=None, compare=False)

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
                             alibi=self.alibi, alibi_slopes=self.alibi_slopes, rope=self.rope(),
                             softcap=self.softcap,
                             scale=self.scale, n_kv_head=n_kv_head, qk_norm=self._qk_norm(),
                             temperature=self.temperature, sinks=self.sinks is not None, clip_qkv=self.clip_qkv,
                             clip_after_norm=self.clip_after_norm, v_norm=self.v_norm)

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
                 f"after {self.cache} cached positions" if self.cache else "", self._alibi_words(),
                 f"qk-norm ({self.qk_norm}{', after RoPE' if self.qk_norm_after else ''})" if self.qk_norm else "",
                 "values RMS-normed" if self.v_norm is not None else "",
                 f"scale {self.scale:g}" if self.scale is not None
                 else "", f"softcap {self.softcap:g}" if self.softcap is not None else "",
                 clip_words(self.clip_qkv) if self.clip_qkv is not None else "",
                 "position bias" if self.position_bias is not None else "",
                 "your own term on the scores" if self.own_term is not None else "",
                 "your own term on the output" if self.out_term is not None else "",
                 "your gate on the output" if self.out_gate is not None else "",
                 f"your pooled {', '.join(self.pooled)}" if self.pooled is not None else "",
                 "your own scale per head" if self.head_scale is not None else "",
                 "your heads mixed" if self.head_mix is not None else "",
                 self.temperature.describe() if self.temperature is not None else "",
                 "attention sinks" if self.sinks is not None else "",
                 "heads strided (split and merge)" if self.strided_heads else "",
                 "your gain per coordinate on the queries" if self.q_gain is not None else ""]
        return ", ".join(p for p in parts if p)

    def _alibi_words(self) -> str:
        if not self.alibi:
            return ""
        return "ALiBi" if self.alibi_slopes is None else "ALiBi, its slopes times the scale"

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


def steps(trace: Trace, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name in trace]
