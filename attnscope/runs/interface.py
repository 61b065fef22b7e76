"""`attnscope head --text` on a family attnscope has no page for: transformers runs layers 0..L
(models/truncated.py), and where the family calls transformers' attention interface, layer L's attention is
recorded step by step from what transformers hands it (models/interface.py): `traced`, with tracer
"attention-interface". Otherwise the pattern is eager's `output_attentions`, untraced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.models.config import Config
    from attnscope.runs.head_result import HeadOptions, HeadResult, Progress
    from attnscope.trace import Trace


def run_transformers(asked: HeadOptions, folder: Path, config: Config, progress: Progress) -> HeadResult:
    from attnscope.models import SUPPORTED, tokenizer, truncated
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.family import check_position
    from attnscope.models.own_code import refuse_own_code
    from attnscope.models.run import LayerRun
    from attnscope.runs.head_result import HeadResult, ModelInfo, guard_memory, save_result

    refuse_own_code(folder, config.model_type, config.raw("auto_map"))  # before its tokenizer is read
    encoded = tokenizer.encode(folder, asked.text or "")
    n = len(encoded.ids)
    with Checkpoint.open(folder) as checkpoint:
        needed = truncated.estimate_bytes(checkpoint, asked.layer, n)
    guard_memory(needed, asked.max_memory, f"loading layers 0..{asked.layer} of this model through transformers")
    with progress(f"running {config.architecture} through transformers, layers 0 to {asked.layer}"):
        run = truncated.run(folder, encoded.ids, config.model_type, asked.layer)
    info = ModelInfo(config.architecture, config.model_type, folder, run.n_layer, run.n_head, run.n_kv_head,
                     run.d_model, run.d_head)
    check_position(run.n_layer, run.n_head, asked.layer, asked.head)
    result = HeadResult(asked, info, None, encoded)
    result.all_heads = run.attention  # [n_head, n_tokens, n_tokens]
    result.attention = run.attention[asked.head]
    own = f"model_type '{config.model_type}' is not one attnscope has a page for ({SUPPORTED})"
    if run.recorded is None:
        result.notes.append(f"{own}, and {run.module or 'its attention'} computes its attention in its own code, "
                            f"not through transformers' attention interface: this pattern is transformers' eager "
                            f"output_attentions[{asked.layer}][0, {asked.head}] on {n} tokens; the steps that made "
                            "it are not shown")
    else:
        recorded = run.recorded
        layer = recorded.layer
        layer.notes[:0] = [f"{own}: transformers ran layers 0..{asked.layer} and handed {run.module}'s Q, K, V, mask "
                           "and scaling to attnscope's attention function; the steps before Q, K, V (projections, "
                           "norms, RoPE) are the family's own code, not traced",
                           f"the mask transformers built for this layer, read from the mask itself: "
                           f"{recorded.mask.describe()}; the steps agree with {recorded.function} to "
                           f"{_TOLERANCE:g}"]
        result.run = LayerRun(layer, head_trace(layer, asked.head, run.n_head, recorded.n_kv_head), recorded.spec)
        result.tracer = "attention-interface"
        result.notes.extend(layer.notes)
    save_result(result)
    return result


_TOLERANCE = 1e-5


def head_trace(layer: Trace, head: int, n_head: int, n_kv_head: int) -> Trace:
    """Head h's own steps: its rows of every step with a head axis (its KV head's of K and V), the mask every
    head shares, its sink."""
    from attnscope.trace import Trace

    trace = Trace()
    kv = head // (n_head // n_kv_head)
    for step in layer.steps:
        if step.dims[:2] in (("n_batch", "n_head"), ("n_batch", "n_kv_head")):
            i = kv if step.dims[1] == "n_kv_head" else head
            tensor, dims, op = step.tensor[0, i], step.dims[2:], f"{step.name}[0, {i}]"
        elif step.dims[:1] == ("n_head",):
            tensor, dims, op = step.tensor[head], step.dims[1:], f"{step.name}[{head}]"
        elif step.dims[:1] == ("n_batch",):
            tensor, dims, op = step.tensor[0], step.dims[1:], f"{step.name}[0]: every head's"
        else:
            continue
        trace.add(step.name, tensor, dims, op, allocates=False)
    return trace
