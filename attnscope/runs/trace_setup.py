"""Before `attnscope trace` runs the user's code: the target found and built (a class with --init, a module, a
function, its weights as arguments, a module with no weights that says a head count), the plan of its forward, the
sizes its weights hold, its inputs' roles; what it declares (a RoPE base, a rotary share) read into the reference's
spec. `prepare` hands all of it on as a `RunSoFar`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.runs.memory import guard_memory
from attnscope.runs.options import check_numbers
from attnscope.runs.trace_attempt import RunSoFar, table_width
from attnscope.runs.trace_options import causal_used, check_options, guard, sized

if TYPE_CHECKING:
    from attnscope.runs.trace_options import TraceOptions
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.record import Failure, Record
    from attnscope.usertrace.reference import Spec


def prepare(o: TraceOptions, split: bool) -> RunSoFar:
    """The options checked, the target built and its forward planned: the run so far, before any run of it."""
    import torch

    from attnscope.usertrace import (
        alibifeed,
        emptyparams,
        flags,
        headcount,
        heldcache,
        identity,
        load,
        maskroles,
        pairparams,
        unitgains,
        zerotables,
    )
    from attnscope.usertrace.inputs import ShapePlan

    check_numbers(o, texts=("target", "init", "forward"))
    o = dataclasses.replace(o, causal=causal_used(o))  # a bare --causal in a decode step: lower-right, everywhere
    target = load.find(o.target)
    spec = check_options(o, target)
    if o.save:
        from attnscope.tensors import check_writable

        check_writable(o.save, o.force)
    init = load.parse_init(o.init, target)
    torch.manual_seed(o.seed)  # the module's weights, as the user's own init draws them
    if target.kind == "class":
        width = load.width_hint(init, o.d_feat)
        if width:  # its projections, about four d_feat x d_feat matrices, before its __init__ allocates them
            guard_memory(4 * width * width * 4, o.max_memory, what=f"a module {width} wide needs",
                         advice="choose a smaller width")
        module, kwargs, blank = load.construct(target, init, o.d_feat, o.heads)
        label = f"{target.name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    else:
        module, kwargs, label, blank = (target.obj if target.kind == "module" else None), {}, target.name, {}
    notes: list[str] = []
    if target.unscripted:
        from attnscope.usertrace.scripted import note

        notes.append(note(list(target.unscripted)))
    filled = emptyparams.fill(module, blank, o.seed) if isinstance(module, torch.nn.Module) else []
    if filled:  # GPT-OSS's sinks, torch.empty in __init__: whatever memory held, another each run
        notes.append(emptyparams.note(filled))
    tables = zerotables.fill(module, o.seed) if isinstance(module, torch.nn.Module) else []
    if tables:  # EfficientFormer's attention_biases, torch.zeros until training: blind to where it is added
        notes.append(zerotables.note(tables))
    moved = unitgains.move(module, o.seed) if isinstance(module, torch.nn.Module) else []
    if moved:  # Qwen3's q_norm and k_norm at 1: blind to where they sit against RoPE
        notes.append(unitgains.note(moved))
    if target.kind == "function":  # its weights as arguments (W_q, W_k, ...): traced as a module holding them
        from attnscope.usertrace.weightargs import holding

        module = holding(target.obj, o.d_feat, o.seed, o.heads)
        if module is not None:
            notes.append(weights_note(module))
        elif identity.says_heads(target.obj):  # q, k, v of the model's width and a head count: it splits them
            module, heads_note = identity.holding(target.obj, target.name, o.heads, o.d_feat or o.dk,
                                                  projected=split, given_forward=load.forward_values(o.forward, target))
            o = o if split else identity.whole_options(o, module)
            notes.append(heads_note)
    if module is not None and target.kind != "function":
        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"{target.name} built a {type(module).__name__}, not a torch.nn.Module")
        lazy = _materialize_lazy(module, o.d_feat)
        if lazy is not None:
            notes.append(lazy)
        heads_said = identity.weightless(module, init, o.heads)
        if heads_said is not None:  # a module with no weights that says a head count (its n_head): it splits them
            module, heads_note = identity.holding(module.forward, target.name, o.heads, o.d_feat, *heads_said,
                                                  inner=module, projected=split,
                                                  given_forward=load.forward_values(o.forward, target))
            o = o if split else identity.whole_options(o, module)
            notes.append(heads_note)
        load.guarded(target, "train()", lambda: module.train(o.train))
        notes.append("the module ran in training mode (--train): dropout is on, and random" if o.train else
                     "the module ran in eval() mode: dropout is off (--train runs it in training mode, where "
                     "dropout zeroes attention weights at random)")
    fn = module if module is not None else target.obj
    plan = load.plan(module.forward if module is not None else fn,
                     f"{target.name}.forward" if module is not None and target.kind != "function" else target.name,
                     o.train)
    plan = load.forward_args(o.forward, target, plan, module.forward if module is not None else fn)
    if o.alibi:  # ALiBi's bias handed in: the reference's, in the code's layout (alibifeed.py)
        plan = alibifeed.told(plan, module.forward if module is not None else fn)
    else:  # Falcon's `alibi`, None where its model uses RoPE
        plan = alibifeed.untold(plan, module.forward if module is not None else fn)
    if o.position_bias:  # no parameter named for it: the one position embedding the code cannot run without
        plan = plan.with_embedding_as_bias()
    plan = maskroles.with_masks(plan, module.forward if module is not None else fn)  # a required `keep` it adds
    plan = maskroles.with_residuals(plan, module.forward if module is not None else fn)  # `shortcut + proj(out)`
    plan = flags.as_flags(plan, module.forward if module is not None else fn)  # output_attentions with no default
    if o.rope:  # a parameter the code unpacks in two, (cos, sin) under a name of its own (nanochat's cos_sin)
        plan = plan.with_pairs(pairparams.unpacked_in_two(module.forward if module is not None else fn,
                                                          plan.tensors[1:] + plan.optional + plan.embeddings))
    if not o.rope and plan.tables and plan.tables_optional:  # RoPE's tables defaulting to None, no --rope: the code
        plan = plan.with_own_tables(rope=False)  # runs without them, else the run asks for --rope (tables_asked)
    if o.cache and plan.cache is None and module is not None and heldcache.places(module):
        plan = dataclasses.replace(plan, cache_held=True)  # a cache it holds itself, read from a run (heldcache.py)
    # what it holds before any run: the runs that read its roles move a count of positions it keeps (cache_pos)
    pristine = (heldcache.kept(module), heldcache.counts(module)) if plan.cache_held else ([], [])
    if module is not None and not plan.cache_held:
        _runs_from_its_state(module)
    weighted = _weighted(o, module, plan, target)  # None for a function, and a module with no weights
    if module is not None and weighted is None and not identity.read(module):
        notes.append(f"{target.name} has no weights: it is traced as a function is, its inputs sized by --dk, --dv "
                     "and --heads")
    shapes = ShapePlan.make(o, weighted, init)
    stacked = headcount.from_weights(weighted) if shapes.n_head is None and o.heads is None else None
    if stacked is not None:  # per-head weight stacks [n_head, d_head, d_feat]: their first axis is the head count
        shapes = ShapePlan.make(dataclasses.replace(o, heads=stacked[0]), weighted, init)
        shown = f"[n_head, .., ..] = {list(stacked[2])}" if stacked[2][0] == stacked[0] else list(stacked[2])
        notes.append(f"n_head = {stacked[0]}, read from your per-head weights ({stacked[1]}: "
                     f"{shown}); --heads says it otherwise")
    plan = shapes.fed(plan)  # a memory of K's own width to `context=None` (Stable Diffusion's CrossAttention)
    if plan.lengths is not None:  # D2L's valid_lens: lengths where the code compares them with an arange of keys
        plan = _read_lengths(o, target, fn, plan, shapes, weighted, module, spec)
    plan.check_fed()

    built = _built_with(kwargs, target.obj if target.kind == "class" else None)  # what the __init__ read, not kept
    spec = _with_own_rope(dataclasses.replace(spec, built_with=built), module, plan, built, shapes.fixed.get("d_head"))
    decode = bool(o.cache) and module is not None and plan.cache is not None and len(plan.tensors) == 3 and not o.q
    # a decode step of forward(query, key, value, .., cache) (CTRL's forward(v, k, q, mask, layer_past)): the roles
    # read as without a cache, then self-attention's one input handed to all three
    plan, said, shapes = _read_roles(dataclasses.replace(o, cache=0) if decode else o, target, fn, plan, shapes,
                                     weighted, module, spec)
    notes += [said] if said else []
    if decode and _three_roles(o, target, fn, plan, shapes, weighted, module, spec):
        first, *rest = plan.tensors
        plan = plan.decoded_alone()
        notes.append(f"{', '.join(rest)}: handed {first}'s tensor, the new tokens (--cache {o.cache} runs a decode "
                     f"step of self-attention, its keys and values from the same input as its queries, the cached "
                     f"ones from {plan.cache})")
    return RunSoFar(o, split, target, spec, init, module, kwargs, label, notes, fn, plan, pristine, weighted, shapes,
                    built)


def _runs_from_its_state(module: Any) -> None:
    """Each run of a module that keeps state between its calls (a cache it writes into, torchtune's KVCache and its
    cache_pos moved by every call; a count of its own) starts from the state it was built in, as the first does:
    trace runs the code many times (a prefill of torchtune's attention with its cache set up raised its own
    AssertionError at the third run, its positions past max_seq_len). A decode step's held cache is filled before
    each run instead (heldcache.py)."""
    from attnscope.usertrace import heldcache

    built = (heldcache.kept(module), heldcache.counts(module))
    if built[0] or built[1]:
        module.register_forward_pre_hook(lambda *_: heldcache.restored(*built))


def _read_roles(o: TraceOptions, target: Target, fn: Any, plan: Plan, shapes: Any, weighted: Any, module: Any,
                spec: Spec) -> tuple[Plan, str | None, Any]:
    """`plan` with its tensors in the order the code uses them (Q, K, V: usertrace/roles.py), read from a run
    without a mask, and a note where that changed anything; with an optional memory parameter (BART's
    `key_value_states=None`) fed where keys are asked for (--nk, even as long as --nq; --k) and the
    code takes its keys and values from it, at the width its key and value projections read (perceiver-pytorch's
    `to_kv = nn.Linear(context_dim, ..)` behind `context = default(context, x)`: each width the weights hold,
    `shapes` then with it as d_kv_in)."""
    from attnscope.usertrace import joint, roles

    wants_memory = plan.self_attention and (o.k is not None or o.nk is not None)
    if wants_memory and module is not None and o.cache == 0:
        pairs: list[tuple[int | None, int | None]] = [
            (None, context) for context in (context_widths(weighted, shapes) if not o.k else [None])]
        if not o.k and o.d_feat is None and "d_kv_in" not in shapes.fixed:
            # the queries' width read off another layer than the queries' own (TrOCR's k_proj = Linear(kdim, ..),
            # made before its q_proj): each other width the weights hold as d_feat, beside each as the memory's
            pairs += [(width, context) for width, context in held_widths(weighted, shapes, True) if width is not None]
        for memory in plan.memories():  # each parameter defaulting to None, kept where the K/V projections read it
            tried = plan.with_memory(memory)
            for width, context in pairs:
                widened = dataclasses.replace(shapes, fixed=shapes.fixed | ({} if width is None else {"d_feat": width})
                                              | ({} if context is None else {"d_kv_in": context}))
                records = _probe(o, target, fn, tried, widened, weighted, module, spec)
                if records is not None and roles.uses_memory(tried, records):
                    return tried, memory_note(memory, "the --k file" if o.k else str(o.nk)), widened
                if records is not None and joint.streams(records, dict(module.named_parameters()),
                                                         tried.tensors[:2]):
                    return tried, joint.memory_note(memory, tried.tensors[0], "the --k file" if o.k else str(o.nk)), \
                        widened
        return plan, None, shapes
    if len(plan.tensors) not in (2, 3) or roles.by_names(plan.tensors) is not None:
        return (*roles.read(plan, []), shapes) if len(plan.tensors) in (2, 3) else (plan, None, shapes)
    records = _probe(o, target, fn, plan, shapes, weighted, module, spec)
    return (*roles.read(plan, records or []), shapes)


def _three_roles(o: TraceOptions, target: Target, fn: Any, plan: Plan, shapes: Any, weighted: Any, module: Any,
                 spec: Spec) -> bool:
    """Whether the three tensor parameters are the queries', the keys' and the values' inputs, in that order, as
    their names or a run without a cache say (never a fourth input of another kind: vLLM's slot_mapping)."""
    from attnscope.usertrace import roles
    from attnscope.usertrace.flow import input_roles

    said = roles.by_names(plan.tensors)
    if said is None:
        records = _probe(dataclasses.replace(o, cache=0), target, fn, plan, shapes, weighted, module, spec)
        said = input_roles(records, list(plan.tensors)) if records is not None else None
    return said is not None and [said.get(n) for n in plan.tensors] == list(roles.ORDER)


def memory_note(memory: str, n_K: str, failed: Failure | None = None) -> str:
    """The note for a memory parameter read from the data flow (fed where asked for, or where the code raised
    without it)."""
    said = f"{memory}: the memory your code takes its keys and values from (cross-attention, n_K = {n_K}), read " \
           "from its data flow"
    if failed is None:
        return f"{said}; None makes it self-attention"
    where = f"line {failed.line}: " if failed.line else ""
    return f"{said}; your code raised with {memory} = None ({where}{failed.message})"


def _probe(o: TraceOptions, target: Target, fn: Any, plan: Plan, shapes: Any, weighted: Any, module: Any,
           spec: Spec) -> list[Record] | None:
    """The records of a run without a mask (a mask shaped for inputs in the wrong roles stops code before its
    scores), on the inputs as asked, else with keys as long as the queries (inputs in the wrong roles then meet
    in every product); None where neither reaches the pattern's product with V."""
    import torch

    from attnscope.usertrace.call import call
    from attnscope.usertrace.feeds import feeds
    from attnscope.usertrace.flow import operands
    from attnscope.usertrace.inputs import make_inputs

    asked: TraceOptions | None = dataclasses.replace(o, mask=None)
    while asked is not None:
        try:
            inputs = make_inputs(asked, plan, shapes, weighted,
                                 guard=functools.partial(sized, asked, spec, weighted is not None))
            fed = feeds(plan, inputs, spec.rope_base, spec.rope_pairing, spec.position_bias,
                        table_width(spec, plan, inputs.sizes.get("d_head")))
        except UsageError:
            return None
        torch.manual_seed(o.seed)
        called = call(target, fn, plan, inputs, module, o.max_memory, None, fed, quiet=True)
        if operands(called.records) is not None:
            return called.records
        n, n_K = inputs.sizes.get("n_Q"), inputs.sizes.get("n_K")
        asked = dataclasses.replace(asked, nq=n, nk=n) if not o.q and n_K != n and asked.nk != n else None
    return None


def _materialize_lazy(module: Any, d_feat: int | None) -> str | None:
    """A module's lazy layers (D2L's `nn.LazyLinear(num_hiddens)`, whose input width the first call fixes) made
    concrete before anything reads their weights: each lazy Linear called once on zeros `--d-feat` wide, else as
    wide as it writes (a square projection); a note says the width. None where it has none."""
    import torch
    from torch.nn.modules.lazy import LazyModuleMixin

    lazy = [(name, m) for name, m in module.named_modules()
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]  # type: ignore[misc]
    if not lazy:
        return None
    widths = set()
    for _, layer in lazy:
        width = d_feat or getattr(layer, "out_features", None)
        if not width:
            raise UsageError(f"{type(module).__name__} has lazy layers whose input width its first call fixes; pass "
                             "--d-feat")
        with torch.no_grad():
            cast(Any, layer)(torch.zeros(1, 1, int(width)))
        widths.add(int(width))
    said = ", ".join(name for name, _ in lazy)
    return (f"lazy layers ({said}) made to read {'/'.join(map(str, sorted(widths)))} features"
            f"{' (--d-feat)' if d_feat else ', as many as they write (--d-feat sets another width)'}")


def _read_lengths(o: TraceOptions, target: Target, fn: Any, plan: Plan, shapes: Any, weighted: Any, module: Any,
                  spec: Spec) -> Plan:
    """`plan` with its lengths candidate (D2L's `valid_lens`) as the mask parameter, where the code, given lengths
    that pad nothing, compares them with an arange over the keys (usertrace/lengths.py); else the candidate is an
    input where it has no default (so that four tensors are refused as such), left at its default otherwise."""
    import inspect

    from attnscope.usertrace import lengths
    from attnscope.usertrace.call import call
    from attnscope.usertrace.feeds import feeds
    from attnscope.usertrace.inputs import make_inputs

    assert plan.lengths is not None
    try:
        required = inspect.signature(fn).parameters[plan.lengths].default is inspect.Parameter.empty
    except (TypeError, ValueError, KeyError):
        required = True
    if not (o.mask or o.causal or o.window or required):
        return plan.lengths_dropped(required)  # nothing to mask: it keeps its default
    probe = dataclasses.replace(plan, mask=plan.lengths)
    unmasked = dataclasses.replace(o, mask=None, causal=None, window=None)
    try:
        inputs = make_inputs(unmasked, probe, shapes, weighted,
                             guard=lambda sizes: guard(unmasked, spec, sizes, weighted is not None))
        fed = feeds(probe, inputs, spec.rope_base, spec.rope_pairing, spec.position_bias)
    except UsageError:
        return plan.lengths_dropped(required)
    if "n_batch" not in inputs.sizes:
        return plan.lengths_dropped(required)
    given = lengths.full(inputs.sizes["n_batch"], inputs.sizes["n_K"])
    called = call(target, fn, probe, inputs, module, o.max_memory, given, fed)
    if called.failure is not None or lengths.compared(called.records, plan.lengths, inputs.sizes["n_K"]) is None:
        return plan.lengths_dropped(required)
    return probe


def weights_note(module: Any, turned: bool = False) -> str:
    """What a function's weight arguments were given (`turned`: as they were before the holder turned them)."""
    shapes = ", ".join(f"{name} {list(p.shape)[::-1] if turned else list(p.shape)}"
                       for name, p in module.named_parameters())
    return (f"your function takes its weights as arguments: each got a random weight drawn from the seed ({shapes}; "
            "--d-feat sizes them), and which side of a matmul each stands on says how it projects")


def _built_with(kwargs: dict[str, Any], cls: Any = None) -> dict[str, Any]:
    """What the module's __init__ was given, as values to read what it declares from (declared.py: a RoPE base or
    share, a softcap, a scale): --init's configs
    (`ModelArgs(rope_base=500000)`, `GPTJConfig()`) made again, dicts and numbers as they are; and the numbers its
    __init__'s signature gives by default to what --init does not say (gemma_pytorch's `query_pre_attn_scalar: int =
    ...`, read into `self.scaling` and not kept), as Python binds them (_init_defaults)."""
    import torch

    from attnscope.usertrace.initargs import ClassCall, build, has_calls

    made: dict[str, Any] = {}
    for name, default in _init_defaults(cls).items():
        if name not in kwargs and isinstance(default, (int, float)) and not isinstance(default, bool):
            made[name] = default
    for name, value in kwargs.items():
        if isinstance(value, dict) and not has_calls(value):
            made[name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            made[name] = value
        elif isinstance(value, ClassCall) and not issubclass(value.cls, torch.nn.Module):
            try:
                with torch.random.fork_rng():
                    made[name] = build(value)
            except Exception:  # noqa: BLE001 (a config that will not build twice says nothing)
                continue
    return made


def _init_defaults(cls: Any) -> dict[str, Any]:
    """The defaults of a module class's __init__ parameters, and where it hands on **kwargs (a subclass's
    `super().__init__(*args, **kwargs)`), its parents' in turn, the nearest first: what Python binds to a
    parameter --init does not name. Nothing for torch's own classes."""
    import inspect

    import torch

    found: dict[str, Any] = {}
    for klass in getattr(cls, "__mro__", ()):
        if klass in (torch.nn.Module, object) or "__init__" not in vars(klass):
            continue
        try:
            params = inspect.signature(vars(klass)["__init__"]).parameters
        except (TypeError, ValueError):  # a builtin's __init__ says no signature
            break
        for name, param in params.items():
            if param.default is not inspect.Parameter.empty:
                found.setdefault(name, param.default)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return found


def _with_own_rope(spec: Spec, module: Any, plan: Plan, made: dict[str, Any], d_head: int | None) -> Spec:
    """The spec with the RoPE base the module says (its rope_theta, on itself, a config it keeps, or the config
    --init hands its __init__ and it does not keep: gpt-fast's `ModelArgs(rope_base=...)`), where --rope asks for
    RoPE and --rope-base does not say the base; and, where its forward takes RoPE's tables, the share of each head
    its config says it rotates (StableLM's partial_rotary_factor), so that the tables trace makes are as wide as
    that share and of that base. Code that rotates with another base or share is then a bug, named by experiment."""
    from attnscope.usertrace.conventions import DEFAULT_BASE, own_base
    from attnscope.usertrace.declared import base_where, with_share

    if spec.rope_base is None:
        return spec
    declared = own_base(module, made)
    if declared is not None and not spec.base_asked and spec.rope_base == DEFAULT_BASE and declared != DEFAULT_BASE:
        spec = dataclasses.replace(spec, rope_base=declared, base_from_module=True,
                                   base_where=base_where(module, made) or "")
    return with_share(spec, module, d_head, made) if plan.tables and spec.rope_fraction is None else spec


def _weighted(o: TraceOptions, module: Any, plan: Plan, target: Target) -> Any:
    """The module whose weights the reference holds; None for a function, and for a module with no weights (a
    tutorial's `ScaledDotProductAttention`, whose forward takes q, k, v): traced as a function is, its inputs
    sized by --dk/--dv/--heads."""
    from attnscope.usertrace import identity

    if module is None:
        return None
    if not any(True for _ in module.parameters()):
        if o.d_feat is not None:
            raise UsageError(f"--d-feat is a projection's width; {target.name} has no weights and is traced as a "
                             "function is: size its inputs with --dk (and --dv)")
        return None
    if (o.dk is not None or o.dv is not None) and not identity.is_holder(module):
        raise UsageError("--dk/--dv size a function's inputs (or a module's with no weights); a module's width is "
                         "--d-feat")
    if o.layout == "col" and reads_rows(module):
        raise UsageError(f"--layout col is for code that takes one token a column, [.., d, n] (W @ x); "
                         f"{target.name} projects with nn.Linear layers, which read [n_batch, n, d_feat]: drop "
                         "--layout col")
    return module


def reads_rows(module: Any) -> bool:
    """Whether the module projects with nn.Linear layers alone (they read the last axis: one token a row). One that
    holds a pointwise convolution beside them (q, k, v 1x1 convs over [n_batch, d_feat, n], an nn.Linear over the
    tokens it lays as rows) takes columns: its Linear layers read what it turned, and it may run on either form."""
    from torch import nn

    from attnscope.usertrace import pointwise

    layers = list(module.modules()) if module is not None else []
    return any(isinstance(m, nn.Linear) for m in layers) and not any(pointwise.is_pointwise(m) for m in layers)


def widths(module: Any, shapes: Any) -> list[int | None]:
    """The widths d_feat may be, the one chosen first: a module holding nn.Parameter weights alone (no Linear) whose
    dims leave it open, W_q [d_attn, d_feat] and W_o [d_feat, d_attn] counting both sizes alike (which one the
    input has is known only once the code runs); one None (the width as chosen) for a function or another module."""
    from collections import Counter

    from torch import nn

    chosen = shapes.fixed.get("d_feat")
    if module is None or chosen is None or any(isinstance(m, nn.Linear) for m in module.modules()):
        return [None]
    counts = Counter(n for p in module.parameters() if p.dim() == 2 for n in p.shape)
    tied = [n for n, c in counts.items() if c == counts.get(chosen) and n != chosen]
    return [None, *tied]


def with_width(shapes: Any, width: int | None) -> Any:
    """`shapes` with d_feat = width (None: as they are); a d_head read from the other width is dropped (the
    reference reads it from the query projection's width)."""
    if width is None:
        return shapes
    fixed = {k: v for k, v in shapes.fixed.items() if k != "d_head"} | {"d_feat": width}
    return dataclasses.replace(shapes, fixed=fixed)


def held_widths(module: Any, shapes: Any, memory: bool) -> list[tuple[int | None, int | None]]:
    """(d_feat, the context's width) pairs to try where the code failed on the widths chosen: every size the module's
    2-D weights hold, most held first, as d_feat (None: as chosen) and, where the forward takes a memory, as the
    context's; the chosen pair itself left out. A module of nn.Linear layers: d_feat each width one of them reads
    (a latents wrapper's data, read by the keys' projection alone: perceiver-pytorch's to_kv of input_dim)."""
    from collections import Counter

    from attnscope.usertrace.inputs import linear_widths

    counts = Counter(n for p in module.parameters() if p.dim() >= 2 for n in p.shape)  # kernels of any rank too
    held = [n for n, _ in counts.most_common()]
    chosen = shapes.fixed.get("d_feat")
    read = linear_widths(module)
    widths: list[int | None] = [None] + [n for n in (read or held) if n != chosen]
    pairs: list[tuple[int | None, int | None]] = []
    for width in widths:
        d = chosen if width is None else width
        pairs += [(width, context) for context in ([None] if width is not None else []) +
                  ([n for n in held if n != d] if memory else [])]
    return pairs


def sliced_widths(module: Any) -> list[int]:
    """The widths one head's slice may have where the code failed on every other reading: each width the module's
    Linear layers read, else each size its weights hold, most held first (weights each head applies to its own
    slice after the split, a shared `Linear(d_head, d_head)` or blocks `[n_head, d_head, d_head]`: blockheads.py)."""
    from collections import Counter

    from attnscope.usertrace.inputs import linear_widths

    counts = Counter(n for p in module.parameters() if p.dim() >= 2 for n in p.shape)
    return linear_widths(module) or [n for n, _ in counts.most_common()]


def context_widths(module: Any, shapes: Any) -> list[int | None]:
    """The widths a memory is given in turn: as chosen (None: the queries' width, or the d_kv_in the projections
    said), then, where nothing said it, each other width the module's weights hold (a fused to_kv of its own)."""
    if module is None or "d_kv_in" in shapes.fixed:
        return [None]
    return [None] + [context for width, context in held_widths(module, shapes, True) if width is None]
