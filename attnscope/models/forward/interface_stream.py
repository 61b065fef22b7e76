"""Every layer (`--all-layers`) and greedy decoding (`--generate`) for a family attnscope has no page for, through
transformers' own forward and cache, its attention captured by attnscope's attention function
(models/nopage/interface.py) at every call: one forward, many views.

The whole model is loaded (AutoModel, or AutoModelForCausalLM to decode) with attnscope's attention
implementation. The prompt's forward records layer L's steps (the short view's trace, the same function) and,
for every layer, each attention layer's pattern; decoding then feeds one token at a time with the cache
transformers' forward made for itself (`DynamicCache(config=...)`, sliding windows and a hybrid's Mamba or
convolution states included), as `GenerationMixin.generate(do_sample=False)` does, and keeps layer L's row for
the last query at each step. A hybrid (Jamba: attention and Mamba layers; LFM2: attention and convolutions) is
shown on its attention layers; a layer with none is refused in one line naming those that have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError, UsageError
from attnscope.models.nopage.cache_names import cache_keyword, cache_of

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import torch

    from attnscope.models.forward.stream import DecodeStep
    from attnscope.models.nopage.truncated import TransformersRun


@dataclass
class Prepared:
    """The model's config (every layer), its number of layers, the layers with attention as its config says
    (None: the run finds them), and whether its attention calls the interface."""

    config: Any
    n_layer: int
    declared: list[int] | None
    traced: bool


@dataclass
class StreamRun:
    """Layer L on the prompt (`run`, as the short view gives it), every attention layer's pattern on the prompt
    (`patterns`, in the order of `layers`) where asked, and the decode steps where asked."""

    run: TransformersRun
    layers: list[int]
    patterns: list[torch.Tensor] | None = None
    steps: list[DecodeStep] | None = None
    notes: list[str] = field(default_factory=list)
    cache: str = ""  # the cache's class, `DynamicCache`


def prepare(folder: Path, model_type: str, layer: int) -> Prepared:
    """The config, with `layer` checked against it (one with no attention refused, naming those that have)."""
    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    config, n_layer = truncated.full_config(folder, model_type, layer)
    truncated.check_attention_layer(config, n_layer, layer)
    return Prepared(config, n_layer, truncated.declared_attention_layers(config, n_layer),
                    truncated.routes_through_interface(config))


def run(prepared: Prepared, folder: Path, ids: list[int], model_type: str, layer: int, n_new: int,
        every_layer: bool) -> StreamRun:
    """Layer L recorded on the prompt, with `every_layer` each attention layer's pattern, and `n_new` tokens
    decoded greedily with layer L's row at each."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from attnscope.models.nopage import interface, interface_check, truncated

    if n_new:
        model = _language_model(prepared, folder, model_type, AutoModelForCausalLM)
    else:
        model = truncated.load(AutoModel, folder, prepared.config, model_type, traced=True)
    try:
        with torch.no_grad(), interface.recording(layer, stop=False, every=every_layer) as recorder, \
                interface_check.watching(model, recorder):
            try:
                out = model(input_ids=torch.tensor([ids]), use_cache=bool(n_new))  # the prompt
            except interface.Reached:
                out = None
            first, patterns = recorder.recorded, recorder.patterns
            if first is None:  # layer L did not call the interface
                truncated.refuse_layer(prepared.config, prepared.n_layer, layer,
                                       sorted(patterns) if patterns else truncated.attention_layers(
                                           prepared.config, prepared.n_layer))
            if n_new and not first.mask.causal and len(ids) > 1:
                raise UsageError(f"{{generate}} decodes with a causal language model; layer {layer} of this "
                                 f"{type(model).__name__} attends both ways ({first.mask.describe()})", "generate")
            recorder.patterns = None

            def step(out: Any, position: int) -> DecodeStep:
                assert recorder.recorded is not None
                recorder.calls = 0  # the next forward's calls counted from its layer 0
                return decode_step(recorder.recorded, int(out.logits[0, -1].argmax()), position, cache_of(out))

            steps = greedy(model, out, ids, n_new, step)
        if recorder.failure is not None:  # interface_check.py: the trace does not reproduce a module: eager's patterns
            return _eager(model, prepared, ids, layer, n_new, every_layer, recorder.failure.note())
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"transformers could not run model_type '{model_type}' "
                            f"{'decoding' if n_new else 'on every layer'} ({truncated.first_line(exc)})") from None
    base = getattr(model, "base_model", model)
    attention = first.layer["attention"][0]  # [n_head, n_tokens, n_tokens]
    layers = sorted(patterns) if patterns is not None else []
    return StreamRun(truncated.sizes(base, first, attention, prepared.n_layer, layer), layers,
                     [patterns[i] for i in layers] if patterns is not None else None, steps or None,
                     list(recorder.notes), _cache_kind(out, n_new))


def _eager(model: Any, prepared: Prepared, ids: list[int], layer: int, n_new: int, every_layer: bool,
           note: str) -> StreamRun:
    """The same run with transformers' eager attention and `output_attentions`, patterns only (the self-check
    found a module the trace does not reproduce): every attention layer's, and layer L's row at each new token."""
    import torch

    from attnscope.models.nopage import truncated

    model.set_attn_implementation("eager")
    base = getattr(model, "base_model", model)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=bool(n_new), output_attentions=True)
        patterns = [a[0] for a in out.attentions if a is not None]  # [n_head, n, n] per attention layer
        # a pattern from every layer: no module path need name them (ALBERT's one module serves every layer)
        every = len(patterns) == prepared.n_layer
        layers = list(range(prepared.n_layer)) if every else truncated.module_layers(base)
        if layer not in layers:
            truncated.refuse_layer(prepared.config, prepared.n_layer, layer, layers)

        def step(out: Any, position: int) -> DecodeStep:
            return eager_step(out.attentions[layers.index(layer)], int(out.logits[0, -1].argmax()), position,
                              cache_of(out))

        steps = greedy(model, out, ids, n_new, step, output_attentions=True)
    found = truncated.sizes(base, None, patterns[layers.index(layer)], prepared.n_layer, layer)
    found.fallback = note
    return StreamRun(found, layers, patterns if every_layer else None, steps or None, [], _cache_kind(out, n_new))


def greedy(model: Any, out: Any, prompt: list[int], n_new: int, step: Callable[[Any, int], DecodeStep],
           positions: Callable[[int], torch.Tensor] | None = None, **more: Any) -> list[DecodeStep]:
    """Greedy decoding on from the prompt's forward `out`: `step(out, position)` makes each step from the forward
    that chose its token; then that token alone over the cache, with `positions(position)` as its position ids
    where the model needs them given (M-RoPE's) and `more`, the forward's other keywords."""
    import torch

    tokens, steps = list(prompt), []
    name = cache_keyword(model)  # the forward's name for its cache, asked once a run
    for _ in range(n_new):
        steps.append(step(out, len(tokens)))
        tokens.append(steps[-1].token_id)
        if len(steps) < n_new:
            given = {"position_ids": positions(len(tokens) - 1)} if positions is not None else {}
            out = model(input_ids=torch.tensor([[tokens[-1]]]), **{name: cache_of(out)},
                        use_cache=True, **given, **more)
    return steps


def _cache_kind(out: Any, n_new: int) -> str:
    """The class of the cache decoding ran over (transformers' DynamicCache, or a family's own), "NoneType"
    without decoding: the prompt's forward hands it over and every step updates that one in place."""
    return type(cache_of(out) if n_new else None).__name__


def _language_model(prepared: Prepared, folder: Path, model_type: str, auto: Any) -> Any:
    """The model with its language-model head (AutoModelForCausalLM), refused in one line where transformers has
    none for the family or the checkpoint holds none (a head left at its random initial values decodes noise)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from attnscope.models.nopage import truncated

    if type(prepared.config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"{{generate}} decodes with a causal language model, and transformers has none for "
                         f"model_type '{model_type}'", "generate")
    model, info = truncated.load(auto, folder, prepared.config, model_type, traced=True, output_loading_info=True)
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise UsageError(f"{{generate}} needs the model's language-model head, and {folder} holds none ({missing[0]} "
                         "is missing: it would decode from random weights); give a ...ForCausalLM checkpoint",
                         "generate")
    return model


def decode_step(recorded: Any, token_id: int, position: int, cache: Any) -> DecodeStep:
    """Layer L's row for the last query (over the keys the cache handed the attention, the oldest a sliding
    window has let go put back as zeros so the row spans every position before the new token), the keys
    before the first one the mask lets it see, and what the cache holds."""
    import torch

    step = eager_step(recorded.layer["attention"], token_id, position, cache)
    if "mask" in recorded.layer:
        mask = recorded.layer["mask"][0, -1]  # [n_held]: 0 where the query may attend
        allowed = mask > torch.finfo(mask.dtype).min / 2
        step.evicted += int(allowed.long().argmax()) if bool(allowed.any()) else 0
    return step


def eager_step(attention: torch.Tensor, token_id: int, position: int, cache: Any) -> DecodeStep:
    """A decode step from layer L's attention `[1, n_head, n_Q, n_held]` (eager's `output_attentions`, or the
    recorded step): the last query's row, the keys a sliding cache no longer holds put back as zeros (counted in
    `evicted`), and what the cache holds."""
    import torch

    from attnscope.models.forward.stream import DecodeStep

    row = attention[0, :, -1]  # [n_head, n_held]
    gone = position - row.shape[-1]  # what a sliding cache no longer holds, put back as zeros
    if gone > 0:
        row = torch.cat([row.new_zeros(row.shape[0], gone), row], dim=-1)  # [n_head, position]
    return DecodeStep(token_id, position, row, max(0, gone), cache_bytes(cache))


def cache_bytes(cache: Any) -> int:
    """What transformers' cache holds: every attention layer's keys and values (a hybrid's Mamba or convolution
    states are not keys and values, and are not counted)."""
    import torch

    held = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                held += tensor.numel() * tensor.element_size()
    return held
