"""Any family attnscope has no page for, traced through transformers' attention interface.

transformers 5 hands every attention implementation the same things (`AttentionInterface`, modeling_utils.py):
the module, Q, K and V `[n_batch, n_head, n_tokens, d_head]` after the family's own projections, norms and
RoPE (K and V with n_kv_head heads), the mask it built for the layer (`masking_utils`, as eager takes it), the
`scaling`, and the family's extras as keywords (`softcap`, `sliding_window`, `s_aux`, `position_bias`). attnscope
registers its own implementation (`IMPLEMENTATION`, with eager's mask function) and loads the model with
`attn_implementation` set to it. For every layer it calls the family's own `eager_attention_forward` (the
module's modeling file's), so the model computes exactly what eager computes; on the layer asked it also
records the steps from those inputs (`record`): Q, K, V, K_rep, V_rep (transformers' `repeat_kv`), scores,
capped_scores, position_bias and biased_scores, mask and masked_scores, sinks and sink_weight, attention,
out, then holds them against the eager function's own pattern and output, hands the module the recorded `out`,
and once the module returns, interface_check.py holds its output against the module's own eager run on the same inputs
(a module doing more than its attention function sees, DeepSeek-V3.2's indexer, fails it: the run then shows
eager's pattern only); then it stops the model there (`Reached`): nothing after the layer runs. The steps
before Q, K, V are the family's code, not traced. For
`--all-layers` and `--generate` (forward/interface_stream.py) the recorder does not stop: it keeps every attention
layer's pattern, or layer L's steps at each decode step.

A call's layer is its module's `layer_idx`; a module with none (a vision tower's, DistilBERT's, ALBERT's one
module serving every layer) is known by the call's order in the forward, as transformers' `output_attentions`
lists it, and the self-check names the same layer (`Recorder.caller_layer`).

Families whose modules do not call the interface (`_supports_attention_backend` False: Falcon, GPT-J, BLOOM,
...) are run through eager with `output_attentions` instead (models/nopage/truncated.py), pattern only.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope import cost
from attnscope.models.nopage import positions
from attnscope.models.nopage.mask_kind import MaskKind, allowed_pairs, read_mask
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from attnscope.trace import Trace

IMPLEMENTATION = "attnscope_trace"
TOLERANCE = 1e-5  # the recorded steps against the family's eager function, float32


@dataclass(frozen=True)
class Failure:
    """Layer `layer`'s module returned something the trace does not reproduce: `step` is the first step that
    differs from the eager module's (its weights, or its output), by `diff`."""

    layer: int
    step: str
    diff: float
    path: str = ""  # the module's name in the model (named_modules), where it has no layer_idx to go by

    def note(self) -> str:
        what = "its output and attention weights differ" if self.step == "attention" else "its output differs"
        module = f"module ({self.path})" if self.path else "module"
        return (f"self-check: layer {self.layer}'s {module} does something its attention function is not handed: "
                f"the step '{self.step}' could not be reproduced ({what} from the module's own eager run, by "
                f"{self.diff:.2e}); shown is transformers' eager output_attentions, the pattern only, not traced")


@dataclass
class Recorded:
    """Layer L's attention as transformers handed it over: its steps, the mask's kind, the module's notes."""

    layer: Trace
    mask: MaskKind
    spec: AttentionSpec
    function: str  # the eager function held against: `transformers.models.gpt_neox.modeling_gpt_neox.eager_...`
    n_kv_head: int
    rotated: bool = False  # the family rotated Q and K (RoPE) before handing them over (positions.rotated)


@dataclass
class Recorder:
    """What one forward (or each forward of a decode) records: layer `layer`'s steps, and with `patterns` every
    other attention layer's pattern `[n_head, n_Q, n_K]` by layer; `stop` ends the forward at layer `layer`."""

    layer: int
    calls: int = 0
    recorded: Recorded | None = None
    notes: list[str] = field(default_factory=list)
    stop: bool = True
    patterns: dict[int, torch.Tensor] | None = None
    watched: set[Any] = field(default_factory=set)  # the modules interface_check.py hooks
    caller: Any = None  # the module whose recorded call waits for interface_check.py's check when it returns
    caller_layer: int = -1  # the layer its call was recorded as: its layer_idx, else the call's order in the forward
    failure: Failure | None = None  # the first layer whose module the trace does not reproduce
    checked: int = 0  # how many module calls were checked


class Reached(Exception):
    """Layer L's attention is recorded: the rest of the model need not run."""


_active: ContextVar[Recorder | None] = ContextVar("attnscope_recorder", default=None)


def register() -> None:
    """attnscope's attention function and eager's mask function under IMPLEMENTATION (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, eager_mask)


def eager_function(module: Any) -> Any:
    """The family's own eager attention (its modeling file's `eager_attention_forward`), else LLaMA's."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is not None:
        return own
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What transformers calls in every attention module: the family's eager attention, and on the layer asked
    the steps recorded from the same inputs."""
    eager = eager_function(module)
    out, weights = eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    recorder = _active.get()
    if recorder is None:
        return out, weights
    index = getattr(module, "layer_idx", None)
    index = recorder.calls if not isinstance(index, int) else index
    recorder.calls += 1
    if index != recorder.layer and recorder.patterns is None:
        return out, weights
    recorded = record(module, query, key, value, attention_mask, scaling, kwargs, (out, weights), eager)
    if recorder.patterns is not None:
        recorder.patterns[index] = recorded.layer["attention"][0]  # [n_head, n_Q, n_K]
        recorder.notes.extend(f"layer {index}: {note}" for note in recorded.layer.notes if "differ" in note)
    if index == recorder.layer:
        recorder.recorded = recorded
    if module in recorder.watched:  # interface_check.py checks the module's output as it returns (and stops there)
        recorder.caller, recorder.caller_layer = module, index
        steps = recorded.layer  # the module's output made from the recorded steps: [n_batch, n_tokens, n_head, d]
        # [n_batch, n_head, n_Q, d_head] -> [n_batch, n_Q, n_head, d_head]
        return steps["out"].transpose(1, 2).contiguous(), steps["attention"]
    if index == recorder.layer and recorder.stop:
        raise Reached
    return out, weights


def record(module: Any, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
           scaling: float | None, extras: dict[str, Any], eager_result: tuple[torch.Tensor, torch.Tensor | None],
           eager: Any) -> Recorded:
    """The steps from transformers' inputs, held against the eager function's own pattern and output."""
    import torch

    from attnscope.trace import Trace

    n_head, n_kv_head, n_Q, n_K, d_head = Q.shape[1], K.shape[1], Q.shape[2], K.shape[2], Q.shape[3]
    source = f"{type(module).__module__.rsplit('.', 1)[-1]}.{type(module).__name__}"
    trace = Trace()
    kv = "n_head" if n_kv_head == n_head else "n_kv_head"
    handed = f"handed to the attention function by {source} {positions.before(module, extras)}"
    trace.add("Q", Q, ("n_batch", "n_head", "n_tokens", "d_head"), f"query_states {handed}")
    trace.add("K", K, ("n_batch", kv, "n_tokens", "d_head"), "key_states, as Q")
    trace.add("V", V, ("n_batch", kv, "n_tokens", "d_head"), "value_states, as Q")
    k_name, v_name = "K", "V"
    if n_kv_head != n_head:
        group = n_head // n_kv_head
        K_rep = K.repeat_interleave(group, dim=1)  # [n_batch, n_kv_head, n, d_head] -> [n_batch, n_head, n, d_head]
        V_rep = V.repeat_interleave(group, dim=1)
        K = trace.add("K_rep", K_rep, ("n_batch", "n_head", "n_tokens", "d_head"), f"repeat_kv(K, n_group={group})")
        V = trace.add("V_rep", V_rep, ("n_batch", "n_head", "n_tokens", "d_head"), f"repeat_kv(V, n_group={group})")
        k_name, v_name = "K_rep", "V_rep"
    scale = d_head ** -0.5 if scaling is None else float(scaling)
    dims = ("n_batch", "n_head", "n_tokens", "n_tokens")
    logits = torch.matmul(Q, K.transpose(2, 3)) * scale  # [n_batch, n_head, n_Q, n_K]
    trace.add("scores", logits, dims, f"Q @ {k_name}.transpose(2, 3) * {scale:.6g} (scaling)",
              cost.matmul_flops(logits.shape, d_head) + logits.numel())
    last = "scores"
    softcap = extras.get("softcap")
    if softcap is not None:
        logits = trace.add("capped_scores", torch.tanh(logits / softcap) * softcap, dims,
                           f"{softcap:g} * tanh(scores / {softcap:g})", 3 * logits.numel())
        last = "capped_scores"
    bias = extras.get("position_bias")
    if bias is not None:
        trace.add("position_bias", bias, dims[4 - bias.dim():], "position_bias, handed as a keyword")
        logits = trace.add("biased_scores", logits + bias, dims, f"{last} + position_bias", logits.numel())
        last = "biased_scores"
    kind = read_mask(allowed_pairs(mask, n_Q, n_K))
    window = extras.get("sliding_window", getattr(module, "sliding_window", None))
    if isinstance(window, int) and kind.kind == "causal" and window >= n_K:
        trace.notes.append(f"this layer's sliding window ({window}) reaches past the text's {n_K} tokens, so its "
                           "mask is causal")
    if mask is not None:
        grid = mask[:, 0, :, :n_K].to(logits.dtype)  # [n_batch, n_tokens, n_tokens]: one mask for every head
        trace.add("mask", grid, ("n_batch", "n_tokens", "n_tokens"),
                  f"attention_mask transformers built for this layer ({kind.describe()}): 0 where a query may "
                  "attend, the dtype's minimum where not")
        logits = trace.add("masked_scores", logits + grid[:, None], dims, f"{last} + mask", logits.numel())
        last = "masked_scores"
    sinks = getattr(module, "sinks", None)
    _attention(trace, logits, last, sinks, V, v_name, eager_result)
    spec = AttentionSpec(causal=kind.causal, window=kind.size if kind.kind == "sliding" else None,
                         chunk=kind.size if kind.kind == "chunked" else None, softcap=softcap,
                         scale=None if abs(scale - d_head ** -0.5) < 1e-12 else scale)
    return Recorded(trace, kind, spec, f"{eager.__module__}.{eager.__name__}", n_kv_head, positions.rotated(module))


def _attention(trace: Trace, logits: torch.Tensor, last: str, sinks: torch.Tensor | None, V: torch.Tensor,
               v_name: str, eager_result: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """softmax and out, with sinks where the module has them, in whichever of the two forms its eager function
    takes: GPT-OSS's (a sink column joins the softmax and is dropped: rows sum to less than 1) or the one that
    keeps the softmax whole and scales the output by the mass the sink would take (granite_swa's)."""
    import torch

    dims = trace.step(last).dims
    eager_out, eager_weights = eager_result
    attention, op = torch.softmax(logits, dim=-1), f"softmax({last}, dim=-1)"
    out, out_op = attention @ V, f"attention @ {v_name}"  # [n_batch, n_head, n_Q, n_K] @ [.., n_K, d_head]
    if sinks is not None:
        n_head = logits.shape[1]
        trace.add("sinks", sinks.reshape(n_head).to(logits.dtype), ("n_head",),  # [n_head]
                  "module.sinks: a learned logit per head, joining every softmax row")
        # [n_head] -> [1, n_head, 1, 1] -> [n_batch, n_head, n_Q, 1]
        sink = sinks.reshape(1, n_head, 1, 1).to(logits.dtype).expand(*logits.shape[:-1], 1)
        joined = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)  # [.., n_tokens + 1]
        weight = trace.add("sink_weight", joined[..., -1], dims[:-1], "the softmax's share on the sink column")
        if eager_weights is not None and _close(attention, eager_weights):  # the sink scales the output only
            op += ": rows sum to 1"
            out, out_op = out * (1 - weight)[..., None], f"(attention @ {v_name}) * (1 - sink_weight)"
        else:
            attention, op = joined[..., :-1], f"softmax([{last}, sinks], dim=-1)[..., :-1]: rows sum to 1 - sink_weight"
            out = attention @ V  # [n_batch, n_head, n_Q, d_head]
    if eager_weights is not None and not _close(attention, eager_weights):
        diff = float((attention - eager_weights).abs().max())
        trace.notes.append(f"these steps differ from the family's eager attention by {diff:.2e}: the pattern shown "
                           "is its own (output_attentions)")
        attention, op = eager_weights, "the family's eager_attention_forward's weights (output_attentions)"
    # eager_out: [n_batch, n_Q, n_head, d_head] -> [n_batch, n_head, n_Q, d_head], as out
    elif not _close(out, eager_out.transpose(1, 2)):
        # [n_batch, n_Q, n_head, d_head] -> [n_batch, n_head, n_Q, d_head]
        diff = float((out - eager_out.transpose(1, 2)).abs().max())
        trace.notes.append(f"out differs from the family's eager attention output by {diff:.2e}")
    trace.add("attention", attention, dims, op, cost.softmax_flops(attention.shape))
    trace.add("out", out, ("n_batch", "n_head", "n_tokens", "d_head"), out_op,
              cost.matmul_flops(out.shape, attention.shape[-1]))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b.to(a.dtype)).abs().max() <= TOLERANCE)


@contextmanager
def pause() -> Iterator[None]:
    """No recording inside (interface_check.py's eager re-run of a module)."""
    token = _active.set(None)
    try:
        yield
    finally:
        _active.reset(token)


def recording(layer: int, stop: bool = True, every: bool = False) -> Any:
    """A context in which the model's attention calls record layer `layer` (and stop the forward there with
    `stop`), and with `every` every attention layer's pattern."""
    @contextmanager
    def active() -> Any:
        recorder = Recorder(layer, stop=stop, patterns={} if every else None)
        token = _active.set(recorder)
        try:
            yield recorder
        finally:
            _active.reset(token)

    return active()
