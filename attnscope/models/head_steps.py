"""Head h's own steps: views into layer L's traced attention (run.py traces the layer), its query rows and the
rows of the KV head that serves it, named as sdpa's (X, Q, K, V, ..., out). Family.head_trace calls it; a family
whose steps differ (MLA's deepseek.py) says its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnscope.trace import Trace


# Head h's steps, taken in the layer's own order (qk-norm runs before RoPE in Qwen3 and Gemma 3, after it in
# Llama 4): the layer step each is a slice of -> (its name, which head index: query head or KV head).
HEAD_STEPS = {"Q_split": ("Q", "q"), "K_split": ("K", "kv"), "V_split": ("V", "kv"), "Q_normed": ("Q_normed", "q"),
              "K_normed": ("K_normed", "kv"), "Q_rot": ("Q_rot", "q"), "K_rot": ("K_rot", "kv"),
              "Q_tuned": ("Q_tuned", "q"), "scores": ("scores", "q"), "capped_scores": ("capped_scores", "q"),
              "masked_scores": ("masked_scores", "q"), "sinks": ("sinks", "q"), "attention": ("attention", "q"),
              "sink_weight": ("sink_weight", "q"), "x_raw": ("out", "q")}


def head_trace(layer: Trace, head: int, kv_head: int, bias: bool, keys: str = "X") -> Trace:
    """Head h's own computation, as views into the layer's steps: its query rows, the keys and values of the
    KV head that serves it (`kv_head`), its scores, pattern and output. Names as sdpa's (X, Q, K, V, ..., out).
    `keys`: the step K and V are projected from (a cross-attention's `memory`), X's where not said."""
    from attnscope.trace import Trace

    trace = Trace()
    X = layer.step("X")
    trace.add("X", X.tensor[0], X.dims[1:], f"{X.op} (n_batch 0)", allocates=False)
    index = {"q": head, "kv": kv_head}
    formulas = {name: f" = {'X' if name == 'Q' else keys} @ W_{name}.T" + (f" + b_{name}" if bias else "")
                for name in ("Q", "K", "V")}
    formulas["out"] = f" = attention @ {'V_rep' if 'V_rep' in layer else 'V_split'}[0, {head}]"
    over_projection = "Q_normed" in layer and layer.step("Q_normed").dims[1] == "n_tokens"
    if over_projection:  # OLMo 2: the split is of the normed projection, and the norm saw every head
        for name in ("Q", "K"):
            formulas[name] = f" = RMSNorm(X @ W_{name}.T{f' + b_{name}' if bias else ''}) over every head, then split"
    for step in layer.steps:
        if step.name not in HEAD_STEPS:
            continue
        source, (name, which) = step.name, HEAD_STEPS[step.name]
        if over_projection and name in ("Q_normed", "K_normed"):
            continue
        i = index[which]
        if step.dims[0] == "n_head":  # sinks [n_head]: head h's own logit
            trace.add(name, step.tensor[i], step.dims[1:], f"{source}[{i}]", 0, allocates=False)
            continue
        op = f"{source}[0, {i}]{formulas.get(name, '')}"
        trace.add(name, step.tensor[0, i], step.dims[2:], op, 0, allocates=False)
    return trace
