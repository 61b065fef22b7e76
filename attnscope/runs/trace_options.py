"""`attnscope trace`'s options: what they are, their own sense, what they say the reference computes, and the
memory they allow (the inputs and the reference's traced run must fit, as for sdpa/mha).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from attnscope.errors import UsageError
from attnscope.runs.memory import guard_memory
from attnscope.runs.options import rope_of
from attnscope.spec import AttentionSpec
from attnscope.usertrace.inputs import InputOptions

if TYPE_CHECKING:
    from attnscope.spec import WindowSide
    from attnscope.usertrace.load import Target
    from attnscope.usertrace.reference import Spec


@dataclass
class TraceOptions(InputOptions):
    target: str = ""
    init: str | None = None
    forward: str | None = None  # extra arguments of the forward, read as --init is
    train: bool = False
    max_memory: int | None = None
    save: str | None = None
    force: bool = False
    rope_pairing: str | None = None  # "half-split" (default) or "interleaved" (Meta's view_as_complex, GPT-J)
    alibi: bool = False  # the reference adds ALiBi's bias (BLOOM's)
    qk_norm: str | None = None  # "head" or "proj": the reference's RMSNorm of Q and K, the user's norm weights
    scale: float | None = None  # the scores' scale, for 1/sqrt(d_head)
    softcap: float | None = None  # the scores capped, C · tanh(scores / C), before the mask (Gemma 2's 50)
    causal_asked: bool = False  # the alignment typed (`--causal upper-left`), not a bare --causal's default


def causal_used(o: TraceOptions) -> str | None:
    """The causal alignment the reference uses: a bare --causal's is the run's, lower-right in a decode step
    (--cache N); one typed is as typed."""
    return "lower-right" if o.cache and o.causal == "upper-left" and not o.causal_asked else o.causal


def check_options(o: TraceOptions, target: Target) -> Spec:
    """The options' own sense, and what they say the reference computes."""
    from attnscope.usertrace.identity import says_heads
    from attnscope.usertrace.reference import Spec
    from attnscope.usertrace.weightargs import weight_names

    if target.kind != "class" and o.init:
        raise UsageError(f"--init builds a class; {target.name} is a {target.kind}, so drop --init")
    if target.kind == "function":
        if o.train:
            raise UsageError("--train sets a module's training mode; a function has none (its dropout parameters, "
                             "if any, are passed as documented)")
        if o.d_feat is not None and not weight_names(target.obj) and not says_heads(target.obj):
            raise UsageError("--d-feat is a module's width (or that of a function's weight arguments); for a "
                             "function give --dk (and --dv)")
    # a bare --causal leaves the alignment to the run: a decode step's (--cache N) is lower-right; only an
    # upper-left typed is refused there
    causal = causal_used(o)
    asked = AttentionSpec.asked(causal, o.window, o.cache, rope=rope_of(o), alibi=o.alibi, scale=o.scale,
                                qk_norm=o.qk_norm, window_side=o.window_side,
                                softcap=o.softcap)  # checked as sdpa/mha check them
    if o.alibi and o.position_bias:
        raise UsageError("--alibi and --position-bias are two position biases; give one")
    if o.scale is not None and not math.isfinite(o.scale):
        raise UsageError(f"--scale {o.scale}: give a finite number")
    if o.scale is not None and o.scale <= 0:  # the experiments divide by it and take its root (kvtrials, scales)
        raise UsageError(f"--scale {o.scale:g}: the scores' scale must be positive (1/√d_head = 0.125 for d_head 64)")
    if o.scale is not None and not 1.2e-38 <= o.scale <= 3.4e38:  # float32's normal range: the experiments square
        # it and divide by it (scaletrials), and the scores hold it
        raise UsageError(f"--scale {o.scale:g}: the scores' scale must lie in float32's range, 1.2e-38 to 3.4e38 "
                         "(1/√d_head = 0.125 for d_head 64)")
    if o.layout == "col" and (o.alibi or o.position_bias or o.qk_norm or o.scale is not None
                              or o.softcap is not None):
        raise UsageError("--layout col traces the textbook column form, out = V softmax(Kᵀ Q / √d_K); --alibi, "
                         "--position-bias, --qk-norm, --scale and --softcap work in the row layout: drop --layout col")
    if o.qk_norm == "proj" and target.kind == "function":
        raise UsageError("--qk-norm proj normalizes a module's whole projection before the split; a function gets "
                         "its q and k split already: use --qk-norm head")
    from attnscope.runs.inputs import load as load_tensor

    bias = load_tensor(o.position_bias)
    if bias is not None and not bias.is_floating_point():
        raise UsageError(f"--position-bias {o.position_bias}: a {str(bias.dtype).removeprefix('torch.')} tensor; "
                         "give a float tensor: an additive bias [.., n_Q, n_K] or a relative key table "
                         "[n_Q, n_K, d_head]")
    if o.layout not in ("row", "col", "time", "bthd", "tbhd"):
        raise UsageError(f"--layout {o.layout}: use row or col")
    if o.layout == "col" and (o.rope or o.kv_heads):  # as sdpa refuses variants in the column layout
        raise UsageError(f"--layout col traces the textbook column form; {'--rope' if o.rope else '--kv-heads'} "
                         "works in the row layout: drop --layout col")
    return Spec(asked.align, asked.window, asked.rope.base if asked.rope is not None else None, asked.cache,
                o.layout, asked.rope.pairing if asked.rope is not None else "half-split", alibi=o.alibi,
                qk_norm=o.qk_norm, scale=o.scale, position_bias=bias, pairing_asked=o.rope_pairing is not None,
                softcap=o.softcap, softcap_asked=o.softcap is not None,
                window_side=o.window_side, base_asked=o.rope_base is not None,
                align_asked=o.causal is not None and o.causal_asked)


def sized(o: TraceOptions, spec: Spec, is_module: bool, sizes: dict[str, int]) -> None:
    """_guard with the sizes last (a partial's argument)."""
    guard(o, spec, sizes, is_module)


def guard(o: TraceOptions, spec: Spec, sizes: dict[str, int], is_module: bool) -> None:
    """Before the user's code runs on them: the inputs and the reference's traced run must fit, as they must
    for sdpa/mha (the same estimates, the same refusal)."""
    from attnscope import cost
    from attnscope.spec import AttentionSpec

    n_batch, n_Q, n_K = sizes.get("n_batch", 1), sizes["n_Q"], sizes["n_K"]
    asked = AttentionSpec(causal=spec.causal, window=spec.window, window_side=cast("WindowSide", spec.window_side),
                          n_kv_head=sizes.get("n_kv_head"),
                          rope=spec.rope(), cache=spec.cache)
    if is_module:
        d_feat, n_head = sizes.get("d_feat", 1), sizes.get("n_head", 1)
        reference = cost.mha_bytes(n_batch, n_Q, n_K, d_feat, n_head, asked, cross=n_Q != n_K,
                                   user_mask=bool(o.mask), d_head=sizes.get("d_head"))
    else:
        reference = cost.sdpa_bytes(n_batch * sizes.get("n_head", 1), n_Q, n_K, sizes["d_K"], sizes["d_V"],
                                    asked, user_mask=bool(o.mask))
    guard_memory(2 * reference, o.max_memory, what="tracing these sizes needs",
                 advice="shrink the sizes (--batch, --nq, --nk)")
