"""`attnscope trace` between parsing and rendering: import the user's callable, feed it, record every op,
run the reference on the same inputs, line the two up and explain the first divergence.

No terminal code: `run_trace` returns a `TraceRun` that attnscope.render.usertrace shows. The pieces live in
attnscope.usertrace (load, inputs, call, lineup).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.runs.memory import guard_memory
from attnscope.runs.options import ROPE_BASE, check_numbers, rope_of
from attnscope.spec import AttentionSpec
from attnscope.trace import Step
from attnscope.usertrace.inputs import InputOptions

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from attnscope.spec import WindowSide
    from attnscope.usertrace.call import Called
    from attnscope.usertrace.feeds import Feeds
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.lineup import Aligned, Divergence
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.masking import Convention
    from attnscope.usertrace.record import Failure, Record
    from attnscope.usertrace.reference import Spec
    from attnscope.usertrace.sizes import AxisNames


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
    position_bias: str | None = None  # a file: a float tensor the reference adds to the scores (T5's)
    qk_norm: str | None = None  # "head" or "proj": the reference's RMSNorm of Q and K, the user's norm weights
    scale: float | None = None  # the scores' scale, for 1/sqrt(d_head)
    softcap: float | None = None  # the scores capped, C · tanh(scores / C), before the mask (Gemma 2's 50)
    causal_asked: bool = False  # the alignment typed (`--causal upper-left`), not a bare --causal's default


@dataclass(frozen=True)
class UserStep(Step):
    """A step of the user's code: a Step with the line it ran on (None for an input), and whether attnscope
    recomputed it (a step a fused kernel computes without materializing it)."""

    line: int | None = None
    recomputed: bool = False


@dataclass
class TraceRun:
    header: list[str]
    params: dict[str, Any]
    steps: list[UserStep]
    reference: str = ""
    alignment: list[Aligned] = field(default_factory=list)
    divergence: Divergence | None = None
    failure: Failure | None = None
    failure_source: str | None = None
    no_reference: str | None = None
    notes: list[str] = field(default_factory=list)
    saved: Path | None = None
    reference_attention: Any = None  # the reference's attention step (its dims: the `attention` row's), for the page
    split_heads: bool | None = None  # code that splits heads itself: read so (True) or with its heads split (False)

    @property
    def diverged(self) -> bool:
        return self.divergence is not None


ONE_THREAD_ROWS = 64  # a run on at most this many rows (n_batch x tokens) of trace's own inputs: one torch thread


def run_trace(o: TraceOptions) -> TraceRun:
    """The run, on one torch thread where trace makes small inputs itself: its plans, reruns and experiments are
    hundreds of small operations, where a second thread only adds hand-offs and, on a busy machine, waits for a
    core (the trace tests' slowest style, 7.3-9.5 s on two threads against 5.5 s on one at a load of 8;
    docs/performance.md, tensors/threads.py). Your code and the reference run on the same count, so they sum alike."""
    from attnscope.tensors.threads import one_thread

    given = o.q or o.k or o.v
    rows = (o.batch or 2) * (max(o.nq or 0, o.nk or 0, 8) + o.cache)
    with one_thread(not given and rows <= ONE_THREAD_ROWS):
        try:
            return _run_both(o)
        except _HeadsForCache as unknown:
            return _heads_then_cache(o, unknown.name)


class _HeadsForCache(Exception):
    """A decode step asked of code whose head count only its run says: the cache, [.., n_kv_head, n_cache, d_head],
    cannot be drawn before a run has read it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _heads_then_cache(o: TraceOptions, name: str) -> TraceRun:
    """The code run without its cache first, as a prefill (every reading of trace's: time-first inputs, layouts),
    its head count read from the queries it hands the scores; then the decode step with that count, as --heads would
    give it (ChatGLM's SelfAttention keeps it as num_attention_heads_per_partition, which no rule reads)."""
    prefill = _run_both(dataclasses.replace(o, cache=0))
    heads = prefill.params.get("sizes", {}).get("n_head") if prefill.params else None
    if prefill.failure is not None or not isinstance(heads, int):
        raise UsageError(f"cannot tell how many heads {name} has, which the keys and values of --cache "
                         f"{o.cache} are drawn with; pass --heads")
    run = _run_both(dataclasses.replace(o, heads=heads))
    run.notes.insert(min(1, len(run.notes)), f"n_head = {heads}, read from a run of your code without the cache (the "
                     "queries it hands the scores), so that the cache of the decode step has its shape; nothing in "
                     "the module says it (--heads does)")
    return run


def _run_both(o: TraceOptions) -> TraceRun:
    """For code that says a head count (usertrace/identity.py), read as splitting the heads itself unless it reads,
    by its tensors, as taking them split already."""
    split = _run_trace(o, True)
    if split.split_heads is None or (split.failure is None and split.no_reference is None and (
            split.divergence is None or split.divergence.experiment is not None)):
        return split  # lined up, or a mistake of the catalog reproduced: the heads are the code's to split
    try:
        whole = _run_trace(o, False)
    except UsageError:
        return split
    from attnscope.usertrace.identity import split_better

    return split if split_better(split, whole) else whole


def _cache_parameters(plan: Plan) -> tuple[str, ...]:
    """The parameter a decode step's cache goes to, or the two its keys and values go to apart."""
    return tuple(p for p in (plan.cache, plan.cache_values) if p is not None)


def _run_trace(o: TraceOptions, split: bool) -> TraceRun:
    import torch

    from attnscope.usertrace import (
        cachelayouts,
        headcount,
        heldcache,
        identity,
        joint,
        keyinputs,
        latentcache,
        load,
        masking,
        ownnorm,
        pairparams,
        posembed,
        prenorm,
        queries,
        sinkcols,
        tableforms,
        timefirst,
        tuning,
        weightargs,
    )
    from attnscope.usertrace.feeds import TableForm, feeds
    from attnscope.usertrace.inputs import ShapePlan, keys_of_own_queries, make_inputs, nk_refused, plan_notes
    from attnscope.usertrace.lineup import better_fit, line_up

    check_numbers(o, texts=("target", "init", "forward"))
    o = dataclasses.replace(o, causal=_causal_used(o))  # a bare --causal in a decode step: lower-right, everywhere
    target = load.find(o.target)
    spec = _check_options(o, target)
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
        module, kwargs = load.construct(target, init, o.d_feat, o.heads)
        label = f"{target.name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    else:
        module, kwargs, label = (target.obj if target.kind == "module" else None), {}, target.name
    notes: list[str] = []
    if target.kind == "function":  # its weights as arguments (W_q, W_k, ...): traced as a module holding them
        from attnscope.usertrace.weightargs import holding

        module = holding(target.obj, o.d_feat, o.seed, o.heads)
        if module is not None:
            notes.append(_weights_note(module))
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
    if o.rope:  # a parameter the code unpacks in two, (cos, sin) under a name of its own (nanochat's cos_sin)
        plan = plan.with_pairs(pairparams.unpacked_in_two(module.forward if module is not None else fn,
                                                          plan.tensors[1:] + plan.optional))
    if o.cache and plan.cache is None and module is not None and heldcache.places(module):
        plan = dataclasses.replace(plan, cache_held=True)  # a cache it holds itself, read from a run (heldcache.py)
    # what it holds before any run: the runs that read its roles move a count of positions it keeps (cache_pos)
    pristine = (heldcache.kept(module), heldcache.counts(module)) if plan.cache_held else ([], [])
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

    built = _built_with(kwargs)  # a config the __init__ read and did not keep: what the module declares is read there
    spec = _with_own_rope(dataclasses.replace(spec, built_with=built), module, plan, built, shapes.fixed.get("d_head"))
    plan, said, shapes = _read_roles(o, target, fn, plan, shapes, weighted, module, spec)
    notes += [said] if said else []
    sliced: list[str] = []  # the note, where RoPE's tables were made in the form the code runs on (tableforms.py)
    table_form: list[TableForm] = []  # that form, once read
    cache_layout = "bhnd"  # how the code keeps a decode step's cache (cachelayouts.py): trace's own, else read
    own_cache: heldcache.Held | None = None  # a cache the module holds itself, where it does: filled before each run
    latent_maker: latentcache.LatentCache | None = None  # multi-head latent attention's decode step (latentcache.py)

    def expanded(inputs: Inputs) -> None:
        """MLA's decode step: the cache as the keys and values the reference's latents expand into."""
        if latent_maker is not None and inputs.cache is not None:
            inputs.cache, inputs.latent_cache = latentcache.cache_for(latent_maker, int(inputs.cache[0].shape[0]),
                                                                      inputs.cache[0].dtype)

    def run_plan(asked: TraceOptions, tried: Plan) -> tuple[Inputs, Feeds, Called, Convention | None]:
        nonlocal spec
        # a --mask file beside a mask parameter named for the causal rule: the file alone to `tried.mask`, the rule
        # to the causal one (_rule_beside)
        apart = asked.mask and asked.causal and tried.causal_mask() not in (None, tried.mask)
        inputs = make_inputs(dataclasses.replace(asked, causal=None) if apart else asked, tried, shapes, weighted,
                             guard=lambda sizes: _guard(asked, spec, sizes, weighted is not None))
        inputs.cache_layout = cache_layout
        expanded(inputs)
        width = _table_width(spec, tried, inputs.sizes.get("d_head"))
        fed = feeds(tried, inputs, spec.rope_base, spec.rope_pairing, spec.position_bias, width,
                    table_form[0] if table_form and tried.tables else None)
        if own_cache is not None and inputs.cache is not None:
            heldcache.fill(own_cache, inputs.cache, inputs.sizes["n_Q"])
        ran = (inputs, fed, *_call(asked, target, fn, tried, inputs, module, fed))
        failed = ran[2].failure
        d_head = inputs.sizes.get("d_head")
        if failed is None or not tried.tables or not d_head or table_form or spec.rope_base is None:
            return ran
        # tables in the form the code runs on (tableforms.py: one angle a pair, a share of each head, along its own
        # axes); where several run, the one under which it lines up further
        made = []
        for form in tableforms.forms(failed, width, d_head, inputs.sizes["n_Q"]):
            inputs = make_inputs(asked, tried, shapes, weighted)
            inputs.cache_layout = cache_layout
            expanded(inputs)
            fed = feeds(tried, inputs, spec.rope_base, spec.rope_pairing, spec.position_bias, form=form)
            if own_cache is not None and inputs.cache is not None:
                heldcache.fill(own_cache, inputs.cache, inputs.sizes["n_Q"])
            again = (inputs, fed, *_call(asked, target, fn, tried, inputs, module, fed))
            if again[2].failure is None:
                made.append((form, _form_spec(spec, form, d_head), again))
        if not made:
            return ran
        if len(made) > 1 and weighted is not None:
            fits = [line_up(weighted, shapes, m[2][0], m[2][2].records, asked.train, m[1]) for m in made]
            best = 0
            for i in range(1, len(made)):
                best = i if better_fit(fits[i], fits[best]) else best
            made = [made[best]]
        form, spec, again = made[0]
        table_form[:] = [form]
        sliced[:] = [tableforms.note(form, failed, width or d_head, d_head, tried.tables)]
        return again

    def attempt(asked: TraceOptions) -> tuple[Inputs, Feeds, Called, Convention | None]:
        made = None
        candidates = [plan] + [plan.with_mask(m) for m in plan.other_masks if asked.mask or asked.causal
                               or asked.window]
        causal = plan.causal_mask(window=bool(asked.window))
        # CLIP's causal_attention_mask, ModernBERT's sliding_window_mask: the rule's own
        if causal is not None and (asked.causal or asked.window) and not asked.mask:
            candidates = [plan.with_mask(causal), *(c for c in candidates if c.mask != causal)]
        if asked.rope and plan.tables_optional:  # its own RoPE tables first (all of its code runs), else trace's
            candidates = [c for p in candidates for c in (p.with_own_tables(), p)]
        if plan.embeddings:  # position embeddings fed first (all of its code runs), else left None
            candidates += [c.without_embeddings() for c in candidates]
        unread: tuple[Plan, tuple[Any, ...]] | None = None  # the first run whose code read no op of its mask
        for tried in candidates:
            # the mask to the first mask parameter the code runs with (fairseq's key_padding_mask [n_batch, n_K]
            # for a padding file, where its attn_mask takes [n_Q, n_K]); in cross-attention, the first it reads
            # (transformers' Perceiver and BERT read inputs_mask, encoder_attention_mask with a memory, never their
            # attention_mask), else the first it runs with. A mask parameter named for the rule keeps it (a plant
            # that reads the other one is then seen)
            ran = run_plan(asked, tried)
            tried, ran = _not_weights(tried, ran, functools.partial(run_plan, asked))
            made = made or ran
            if ran[2].failure is not None:
                continue
            if ran[0].allowed is not None and tried.mask not in (None, causal) and not tried.self_attention \
                    and not masking.reads(ran[2].records, tried.mask):
                unread = unread or (tried, ran)
                continue
            return keep_run(tried, ran)
        if unread is not None:
            return keep_run(*unread)
        assert made is not None
        return made

    def keep_run(tried: Plan, ran: tuple[Any, ...]) -> tuple[Inputs, Feeds, Called, Convention | None]:
        """The run `attempt` keeps, its plan now the run's, its inputs as the run reads them (a module's own
        queries, position embeddings, a norm before its projections)."""
        nonlocal plan
        plan = tried
        own = queries.find(ran[2].records, ran[0], weighted)  # Perceiver's latents: n_Q is theirs
        if own is not None:
            queries.apply(ran[0], own)
        else:  # DETR's q_proj(x + pos), k_proj(x + pos), v_proj(x)
            held = posembed.projections(weighted, ran[2].records, shapes.n_head, shapes.fixed.get("d_head")) \
                if not ran[0].own else {}
            posembed.read(ran[2].records, ran[0], weighted, held, tried.embeddings)
            # vit-pytorch's x = self.norm(x) before to_qkv: the normed x is the projections' input
            prenorm.read(ran[2].records, ran[0], weighted, held)
            # Segformer's keys and values from LayerNorm(Conv2d(x)): that tensor is their input, n_K its length
            reduced = keyinputs.find(ran[2].records, ran[0], weighted)
            if reduced is not None:
                keyinputs.apply(ran[0], reduced)
            # CogVideoX's torch.cat([encoder_hidden_states, hidden_states], dim=1) before to_q, to_k, to_v
            joint.apply_joined(ran[2].records, ran[0])
        return cast("tuple[Inputs, Feeds, Called, Convention | None]", ran)

    def in_layouts(asked: TraceOptions, made: tuple[Any, ...]) -> tuple[tuple[Any, ...], str | None]:
        """`made`, the code run under `asked`, where it ran; else the code handed its cache in each layout real code
        keeps (cachelayouts.py; [n_batch, n_cache, n_kv_head, d_head], mistral-inference's, ...), those that meet
        the op it raised on first: the first it runs on, with the note that says so."""
        nonlocal cache_layout
        if made[2].failure is None or made[0].cache is None or plan.cache is None:
            return made, None
        failed, kept = made[2].failure, cache_layout
        for layout in cachelayouts.others(failed, made[0].cache, apart=plan.cache_values is not None):
            cache_layout = layout
            again = _attempted(attempt, asked)
            if again is not None and again[2].failure is None:
                return again, cachelayouts.note(layout, failed, _cache_parameters(plan))
        cache_layout = kept
        return made, None

    # a module holding its cache: one sequence, or as many as it holds room for, where trace's batch does not fit
    batches = dict.fromkeys((o.batch, 1, *sorted({int(n) for *_, t in heldcache.places(module, True)
                                                   for n in t.shape if 1 < n <= 16}))) if plan.cache_held else {}
    if o.cache and module is not None and (plan.cache is not None or plan.cache_held):
        # multi-head latent attention, read from a prefill's data flow: its cache drawn as latents and expanded
        for batch in batches or (o.batch,):
            heldcache.restored(*pristine)
            prefill = _attempted(attempt, dataclasses.replace(o, cache=0, batch=batch))
            heldcache.restored(*pristine)
            if prefill is not None and prefill[2].failure is None:
                latent_maker = latentcache.read(prefill[2].records, module, shapes.n_head, spec, o.cache, o.seed)
                break
    if plan.cache_held:  # the module's own cache: the tensors a first run writes the new keys and values into
        before, counts = pristine
        heldcache.restored(*pristine)
        for batch in batches:
            asked = dataclasses.replace(o, batch=batch)
            probe = attempt(asked)  # what it writes, before any op it raises on
            n_new = probe[0].sizes.get("n_Q", 0)
            counting = heldcache.moved(counts, n_new) if probe[0].cache is not None else []
            if probe[0].cache is not None:
                own_cache = heldcache.read(before, probe[0].cache, n_new)
            heldcache.restored(*pristine)
            if own_cache is None and counting:  # a count of its own positions (torchtune's cache_pos): n_cache further
                hook = module.register_forward_pre_hook(functools.partial(heldcache.before_call, counting, o.cache))
                probe = attempt(asked)
                hook.remove()
                if probe[0].cache is not None:
                    own_cache = heldcache.read(before, probe[0].cache, n_new)
                    if own_cache is not None:
                        own_cache.counters = counting
                heldcache.restored(*pristine)
            if own_cache is not None:
                break
        if own_cache is not None and own_cache.counters:  # every later call starts n_cache positions on
            module.register_forward_pre_hook(functools.partial(heldcache.before_call, own_cache.counters, o.cache))
        if own_cache is None:
            raise UsageError(f"--cache {o.cache} runs a decode step, which needs a module whose forward takes x and a "
                             "cache (kv_cache, past_key_value, layer_past, ...; or past_key and past_value), or that "
                             "holds one it writes the new keys and values into at their positions; "
                             f"{plan.signature} takes none, and a run wrote none")
        notes.append(heldcache.note(own_cache))
    if o.cache and weighted is not None and shapes.n_head is None and o.heads is None:
        raise _HeadsForCache(target.name)  # run_trace reads it from a run without the cache, then comes back
    (inputs, fed, called, convention), said = in_layouts(o, attempt(o))
    notes += [said] if said else []
    if called.failure is not None and module is not None and o.cache == 0 and not o.q:
        # code that raised with its memory None (Mllama's cross-attention then reads its cache): each parameter
        # defaulting to None given a memory in turn, kept where the key and value projections read it
        from attnscope.usertrace.roles import uses_memory

        contexts = _context_widths(weighted, shapes)
        for memory, context in ((m, c) for m in plan.memories() for c in contexts):  # at each width held (HF
            # Perceiver's `inputs=None` read by key = Linear(kv_dim, ..))
            alone, narrow, plan = plan, shapes, plan.with_memory(memory)
            shapes = shapes if context is None else \
                dataclasses.replace(shapes, fixed=shapes.fixed | {"d_kv_in": context})
            made = _attempted(attempt, o)
            if made is not None and made[2].failure is None and uses_memory(plan, made[2].records):
                notes.append(memory_note(memory, str(made[0].sizes["n_K"]), called.failure))
                inputs, fed, called, convention = made
                break
            plan, shapes = alone, narrow
    if called.failure is not None and weighted is None and o.batch is None and not o.q:
        # code written for one sequence ([n, d]: `Q @ K.T`, `softmax(dim=1)`) fails on [n_batch, n, d]: try [n, d]
        unbatched = attempt(dataclasses.replace(o, batch=0))
        if unbatched[2].failure is None:
            failed = called.failure
            inputs, fed, called, convention = unbatched
            where = f"line {failed.line}: " if failed.line else ""
            notes.append(f"your code failed on batched inputs [n_batch, ..] ({where}{failed.message}) and ran on "
                         "2-D ones, one sequence, as shown; --batch 0 asks for 2-D inputs, --batch N for batched")
    if called.failure is not None and _columns_possible(o, weighted):
        # code of the column convention (one token a column, W @ x, Kᵀ Q, softmax over dim -2) fails on rows:
        # the same code fed [.., d, n], read as that convention
        row_shapes, found = shapes, None
        for width in _widths(weighted, shapes):  # a width the weights leave open (d_feat or d_attn), tried in turn
            shapes = _with_width(row_shapes, width)
            found = _column_form(o, attempt)
            if found is not None:
                break
        shapes = shapes if found is not None else row_shapes
        if found is not None:
            failed = called.failure
            o, (inputs, fed, called, convention) = found
            spec = dataclasses.replace(spec, layout="col")
            notes.append(_column_note(failed, o, weighted is not None))
    if called.failure is not None and target.kind == "function" and weighted is not None \
            and not weightargs.square(weighted):
        # a function's weights of n_head·d_head ≠ d_feat, given as x @ W reads them: turned for F.linear(x, W)
        weightargs.transpose(weighted)
        kept = shapes
        shapes = _with_width(ShapePlan.make(o, weighted, init), shapes.fixed.get("d_feat"))  # x's width as it was
        made = _attempted(attempt, o)
        if made is not None and made[2].failure is None:
            inputs, fed, called, convention = made
            notes[notes.index(_weights_note(weighted, turned=True))] = _weights_note(weighted)
        else:
            weightargs.transpose(weighted)
            shapes = kept
    if called.failure is not None and weighted is not None and not o.q and (
            "d_kv_in" not in shapes.fixed or plan.self_attention):  # one input beside a context width: the keys'?
        # widths the weights hold but did not say: nn.Parameter weights whose d_feat is not their most common size
        # (W_q [d_feat, n_head·d_head]), K and V reading a context of another width (diffusers'
        # cross_attention_dim, nn.MultiheadAttention's kdim/vdim): each pair the weights hold, the first the code
        # runs on
        for width, context in _held_widths(weighted, shapes, plan.memory() is not None or not plan.self_attention):
            held = shapes, plan
            shapes = _with_width(shapes, width)
            if context is not None:
                shapes = dataclasses.replace(shapes, fixed=shapes.fixed | {"d_kv_in": context})
                plan = shapes.fed(plan)
            made = _attempted(attempt, o)
            if made is not None and made[2].failure is None:
                inputs, fed, called, convention = made
                break
            shapes, plan = held
    if called.failure is not None and timefirst.possible(o, inputs):
        # code written for time-first inputs (fairseq's, nn.MultiheadAttention's batch_first=False) fails on
        # [n_batch, n, d]: the same inputs fed [n, n_batch, d], read as that convention (its cache too, in turn)
        for time_o in timefirst.asked(o, inputs):
            made = _attempted(attempt, time_o)
            merged = timefirst.viewed_width(made[2].failure, made[0].sizes, o) if made is not None else None
            if merged is not None:  # heads merged into a width of the code's own (Megatron's [sq, b, hp]): hp / np
                time_o = dataclasses.replace(time_o, dk=merged[0], dv=merged[0])
                made = _attempted(attempt, time_o)
                notes += [merged[1]] if made is not None and made[2].failure is None else []
            made, said = in_layouts(time_o, made) if made is not None else (None, None)
            if made is not None and made[2].failure is None:
                failed = called.failure
                o, (inputs, fed, called, convention) = time_o, made
                notes += [timefirst.note(failed, weighted is not None, o.layout)] + ([said] if said else [])
                break
    joined = cachelayouts.read(called.records, plan.cache, cache_layout, inputs.cache) \
        if called.failure is None and inputs.cache is not None and plan.cache is not None else None
    if joined is not None:  # it ran on this layout, and its own join says another of that shape
        held_layout, cache_layout = cache_layout, joined[0]
        made = _attempted(attempt, o)
        if made is not None and made[2].failure is None:
            inputs, fed, called, convention = made
            notes.append(joined[1])
        else:
            cache_layout = held_layout
    if latent_maker is not None and called.failure is None:
        notes.append(latentcache.note(", ".join(_cache_parameters(plan)) if plan.cache else own_cache.names()
                                      if own_cache is not None else "cache"))
    if inputs.cache is not None and plan.cache is not None:  # two parameters, or a dict's keys (cacheforms.py)
        from attnscope.usertrace.cacheforms import note as form_note

        given = fed.values.get(plan.cache)
        said = form_note(_cache_parameters(plan), list(getattr(given, "asked", [])),
                         "" if cache_layout != "bhnd" else cachelayouts.words(cache_layout))  # else noted
        notes += [said] if said else []
    if o.nk is not None and o.nk != o.nq and keys_of_own_queries(o, plan, module is not None) and not (
            called.failure is None and "Q" in inputs.own and inputs.own_from == "module"):
        raise nk_refused(o, plan, True)  # --nk for a one-input forward whose queries are not its own after all
    first_notes = list(notes)  # the module's, before those of its inputs (a second run makes them again)
    notes += inputs.notes + plan_notes(plan, inputs)
    if convention is not None and (called.failure is None or convention.line is not None):
        notes.append(convention.note(plan.mask or "mask"))  # a run that raised before its mask read nothing of it
    mode = "" if module is None or target.kind == "function" else ", training mode" if o.train else ", eval() mode"
    header = _header(target, label, plan, inputs, mode, spec)
    header[-1] += "" if o.q else f"  seed={o.seed}"
    run = TraceRun(header, _params(o, target, kwargs, inputs), [], notes=notes, failure=called.failure,
                   failure_source=called.source, split_heads=split if identity.read(module) else None)
    if not called.records:
        run.notes.append(f"no tensor operation ran from {target.path.name}: only ops called from that file are "
                         "recorded (torch functions, Tensor methods and operators)")

    def again() -> tuple[Inputs, Feeds, Called, Convention | None]:
        """The code run again on sizes chosen anew (a size learnt from the first run), the run's words with it."""
        made = attempt(o)
        run.notes[:] = first_notes + made[0].notes + plan_notes(plan, made[0])
        if made[3] is not None:
            run.notes.append(made[3].note(plan.mask or "mask"))
        run.header = _header(target, label, plan, made[0], mode, spec)
        run.header[-1] += "" if o.q else f"  seed={o.seed}"
        run.params, run.failure, run.failure_source = _params(o, target, kwargs, made[0]), made[2].failure, \
            made[2].source
        return made

    if called.failure is None and weighted is not None and shapes.n_head is None and o.heads is None:
        own = inputs.own.get("Q") if inputs.own_from == "module" else None  # latents of their own width
        read = headcount.from_run(called.records, shapes.fixed.get("d_feat") if own is None else int(own.shape[-1]),
                               o.layout == "col", inputs.sizes.get("n_batch"))
        if read is not None:  # the head count only the code says (a literal in its forward): read from its q
            heads, line, laid = read
            width = shapes.fixed.get("d_feat")  # as the run found it (a width the weights left open, _widths)
            shapes = ShapePlan.make(dataclasses.replace(o, heads=heads), weighted, init)
            shapes = _with_width(shapes, width if width != shapes.fixed.get("d_feat") else None)
            d_head = headcount.queries_head(called.records, heads)
            if own is not None and d_head is not None:  # d_head as the run's queries have it, not the latents' / heads
                shapes.fixed["d_head"] = d_head
            inputs, fed, called, convention = again()
            first_notes.append(f"n_head = {heads}, read from the queries your code hands the scores (line {line}: "
                               f"{laid}); nothing else in the module says it (--heads does)")
            run.notes.insert(len(first_notes) - 1, first_notes[-1])
    if called.failure is None:
        # real tables laid out for one pairing (not freqs_cis nor llama2.c's freqs_cos, freqs_sin: one angle a pair)
        if any(name.lower() not in load.PAIR_TABLES for name in plan.tables) \
                and not (table_form and table_form[0].pairs):
            spec = dataclasses.replace(spec, pairing_asked=True)  # the code pairs as they are laid out, or errs
        spec = _with_own_fraction(spec, weighted, plan, inputs.sizes.get("d_head"), built)
        sunk = sinkcols.read(module, called.records, inputs.sizes.get("n_head"))
        if sunk is not None:  # attention sinks the module holds, joined to its scores (GPT-OSS's): its convention
            spec = dataclasses.replace(spec, sinks=sunk[0])
            first_notes.append(sinkcols.note(sunk[1], int(sunk[0].numel())))
            run.notes.append(first_notes[-1])
        lined = line_up(weighted, shapes, inputs, called.records, o.train, spec)
        kv = lined.n_kv_head
        n_head = inputs.sizes.get("n_head")
        group = n_head // kv if kv and n_head and n_head % kv == 0 else None  # n_group
        chosen = [inputs.sizes[d] for d in ("n_batch", "n_Q", "n_K") if d in inputs.sizes]
        if kv and o.batch is None and kv != n_head and kv not in shapes.extra.values() \
                and (kv in inputs.sizes.values() or group in chosen):
            # key/value heads read only from the run (a fused projection per KV group) share a size (theirs or
            # n_group's) with a dim: run again with sizes that avoid both, so no axis is named from a coincidence
            # (n_batch for n_kv_head)
            shapes.extra["n_kv_head"] = kv
            inputs, fed, called, convention = again()
            if called.failure is None:
                lined = line_up(weighted, shapes, inputs, called.records, o.train, spec)
        if timefirst.early(lined) and timefirst.possible(o, inputs):
            # time-first code that runs on batch-first inputs too (it then attends across the batch): the reading
            # under which it lines up further is kept (usertrace/timefirst.py)
            # (where --batch equals --nq the two readings share one shape: tried on a batch of another size)
            apart = timefirst.apart(o, inputs, shapes.extra.values())
            for time_o in timefirst.asked(o if apart is None else dataclasses.replace(o, batch=apart), inputs):
                made = _attempted(attempt, time_o)
                tried = line_up(weighted, shapes, made[0], made[2].records, o.train, spec) \
                    if made is not None and made[2].failure is None else None
                if made is not None and tried is not None and timefirst.better(tried, lined):
                    break
            if made is not None and tried is not None and timefirst.better(tried, lined):
                batch = o.batch
                o, (inputs, fed, called, convention), lined = time_o, made, tried
                first_notes.append(timefirst.note(None, weighted is not None, o.layout))
                if apart is not None:
                    first_notes.append(timefirst.apart_note(batch, apart))
                run.notes[:] = first_notes + inputs.notes + plan_notes(plan, inputs)
                if convention is not None:
                    run.notes.append(convention.note(plan.mask or "mask"))
                run.header = _header(target, label, plan, inputs, mode, spec)
                run.header[-1] += "" if o.q else f"  seed={o.seed}"
                run.params, run.failure, run.failure_source = _params(o, target, kwargs, inputs), None, None
        if lined.divergence is not None and _columns_possible(o, weighted):
            # code that runs on rows too (weightless self-attention: Xᵀ X is [d, d] on rows) yet lines up only on
            # columns: the column convention, read from what it computes
            found = _column_form(o, attempt)
            col_spec = dataclasses.replace(spec, layout="col")
            col_lined = line_up(weighted, shapes, found[1][0], found[1][2].records, o.train, col_spec) \
                if found is not None else None
            if found is not None and col_lined is not None and col_lined.divergence is None \
                    and col_lined.no_reference is None:
                o, (inputs, fed, called, convention), spec, lined = found[0], found[1], col_spec, col_lined
                run.notes[:] = first_notes + inputs.notes + plan_notes(plan, inputs) + [_lined_note(o)]
                if convention is not None:
                    run.notes.append(convention.note(plan.mask or "mask"))
                run.header = _header(target, label, plan, inputs, mode, spec)
                run.header[-1] += "" if o.q else f"  seed={o.seed}"
                run.params = _params(o, target, kwargs, inputs)
        if lined.divergence is not None and o.qk_norm is None and weighted is not None and o.layout != "col":
            own = ownnorm.read(weighted, shapes, inputs, called.records, o.train, spec, lined)
            if own is not None:  # the code normalizes q and k itself: its convention, read by experiment
                spec, lined = own
                run.params["qk_norm_read"] = spec.qk_norm
        if lined.divergence is not None and weighted is not None and o.layout != "col":
            tuned = tuning.read(weighted, shapes, inputs, called.records, o.train, spec, lined)
            if tuned is not None:  # Llama 4's temperature tuning, declared by the module: its convention
                spec, lined = tuned
        width = int(lined.trace["Q_split"].shape[-1]) if lined.joint and lined.trace is not None \
            and "Q_split" in lined.trace else None
        if width is not None and inputs.sizes.get("d_head") != width:
            # joint attention: the head width is the joined q's, not a width one stream's projections suggested
            # (Flux's fused qkv read as one query projection, 96 / 4 = 24): the dims named again with it
            shapes.fixed["d_head"] = width
            shapes.fixed.pop("n_kv_head", None)
            shapes.extra.pop("3·d_head", None)
            made = again()
            if made[2].failure is None:
                inputs, fed, called, convention = made
                lined = line_up(weighted, shapes, inputs, called.records, o.train, spec)
        run.reference, run.alignment, run.divergence = lined.reference, lined.rows, lined.divergence
        if lined.joint:  # streams joined along the tokens: one attention over all of them, whatever the inputs' kinds
            run.header[1] = run.header[1].replace(": cross-attention,", ": joint attention,", 1).replace(
                ": self-attention,", ": joint attention,", 1)
        if lined.trace is not None and "attention" in lined.trace:  # the page draws it beside the user's
            run.reference_attention = lined.trace["attention"]
        run.no_reference = lined.no_reference
        run.notes += lined.notes
        fraction = spec.rope_fraction if spec.fraction_from_module else None
        if sliced:
            run.notes += sliced
        elif fraction is not None and lined.spec is not None and lined.spec.rope_fraction == fraction:
            d_head = inputs.sizes.get("d_head") or 0
            run.notes.append(f"RoPE: it rotates the first {int(d_head * fraction)} of each head's "
                             f"{d_head} coordinates (a rotary fraction of {fraction:g}), read from your "
                             "module's config (its rotary_dim, rotary_pct or partial_rotary_factor); the reference "
                             "rotates so")
    run.steps = _steps(inputs, called.records, run.alignment, fed, plan)
    if o.save and called.failure is None and run.no_reference is None:
        from attnscope.tensors import save_tensors
        from attnscope.usertrace.saving import saved_steps

        tensors, meta = saved_steps(run.alignment, inputs, target)
        run.saved = save_tensors(tensors, o.save, force=o.force, metadata=meta, option="--save")
    return run


def _read_roles(o: TraceOptions, target: Target, fn: Any, plan: Plan, shapes: Any, weighted: Any, module: Any,
                spec: Spec) -> tuple[Plan, str | None, Any]:
    """`plan` with its tensors in the order the code uses them (Q, K, V: usertrace/roles.py), read from a run
    without a mask, and a note where that changed anything; with an optional memory parameter (BART's
    `key_value_states=None`) fed where keys of another length than the queries are asked for (--nk, --k) and the
    code takes its keys and values from it, at the width its key and value projections read (perceiver-pytorch's
    `to_kv = nn.Linear(context_dim, ..)` behind `context = default(context, x)`: each width the weights hold,
    `shapes` then with it as d_kv_in)."""
    from attnscope.usertrace import joint, roles

    wants_memory = plan.self_attention and (o.k is not None or (o.nk is not None and o.nk != o.nq))
    if wants_memory and module is not None and o.cache == 0:
        contexts = _context_widths(weighted, shapes) if not o.k else [None]
        for memory in plan.memories():  # each parameter defaulting to None, kept where the K/V projections read it
            tried = plan.with_memory(memory)
            for context in contexts:
                widened = shapes if context is None else \
                    dataclasses.replace(shapes, fixed=shapes.fixed | {"d_kv_in": context})
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
                                 guard=functools.partial(_sized, asked, spec, weighted is not None))
            fed = feeds(plan, inputs, spec.rope_base, spec.rope_pairing, spec.position_bias,
                        _table_width(spec, plan, inputs.sizes.get("d_head")))
        except UsageError:
            return None
        torch.manual_seed(o.seed)
        called = call(target, fn, plan, inputs, module, o.max_memory, None, fed, quiet=True)
        if operands(called.records) is not None:
            return called.records
        n, n_K = inputs.sizes.get("n_Q"), inputs.sizes.get("n_K")
        asked = dataclasses.replace(asked, nq=n, nk=n) if not o.q and n_K != n and asked.nk != n else None
    return None


def _call(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any,
          fed: Feeds) -> tuple[Called, Convention | None]:
    """Call the user's code with the mask True = may attend; when its ops show that it reads the mask another
    way (masked_fill(mask, ...), scores + mask, ...), call it again with the mask written that way."""
    import torch

    from attnscope import masks
    from attnscope.usertrace import lengths, masking
    from attnscope.usertrace.call import call

    torch.manual_seed(o.seed)  # dropout in training mode draws the same for the same seed
    if plan.mask is None or inputs.allowed is None:
        return call(target, fn, plan, inputs, module, o.max_memory, None, fed), None
    if plan.fed_by_lengths():  # D2L's valid_lens: the mask written as lengths, [n_batch] or [n_batch, n_Q]
        counts, inputs.allowed = lengths.written(inputs.allowed, inputs.sizes.get("n_batch", 1), plan.mask)
        called = call(target, fn, plan, inputs, module, o.max_memory, counts, fed)
        inputs.notes.append(lengths.note(plan.mask, counts, lengths.compared(called.records, plan.mask,
                                                                            inputs.sizes["n_K"])))
        return called, None
    dtype = next(iter(inputs.tensors.values())).dtype
    try:
        first, given = masking.written(inputs.allowed, "attend", dtype), "attend"
    except UsageError:  # a float bias from --mask: it can only be added
        first, given = inputs.allowed.to(dtype), "additive"
    torch.manual_seed(o.seed)
    called = call(target, fn, plan, inputs, module, o.max_memory, first, fed)
    turned = _scores_turned(called, inputs, module) if o.layout == "col" else None
    if turned is not None:  # square scores Qᵀ K [n_Q, n_K]: the mask is handed as they are laid out
        inputs.allowed, first = turned, masking.written(turned, given, dtype) if given == "attend" else turned.to(dtype)
        torch.manual_seed(o.seed)
        called = call(target, fn, plan, inputs, module, o.max_memory, first, fed)
        inputs.notes.append(f"{plan.mask}: given [.., n_Q, n_K], as your scores are laid out (the queries' axis "
                            "first, read from the product that makes them), not the column form's [.., n_K, n_Q]")
    failure = called.failure
    # the layout of the scores the mask meets where the code raised on it: the mask is tried laid out so first
    met = _met(failure, plan.mask, list(first.shape))
    if failure is not None and plan.mask in failure.op and inputs.allowed.dim() < 4 and not o.mask:
        failed_at = failure.line
        # code that slices the mask as transformers' 4-D one (`attention_mask[:, :, :, :n_K]`): [n_batch, 1, n_Q, n_K];
        # in a decode step, one over all n_K positions whose last n_Q rows are the new queries' (OLMo's
        # `attention_bias[:, :, key_len - query_len:key_len, :key_len]`)
        sliced = []  # the first shape the code runs on, else the first it raises on elsewhere than on its mask
        for wide, words in masking.sliced_forms(inputs.allowed, inputs.sizes.get("n_batch", 1),
                                                inputs.sizes.get("n_cache")):
            wide_first = masking.written(wide, given, dtype)  # "additive": a float bias, as it is (.to(dtype))
            torch.manual_seed(o.seed)
            tried = call(target, fn, plan, inputs, module, o.max_memory, wide_first, fed)
            sliced.append((wide, words, tried, wide_first))
            if tried.failure is None:
                break
        fits = [r for r in sliced if r[2].failure is None] or [
            r for r in sliced if r[2].failure is not None and plan.mask not in r[2].failure.op]
        if fits:
            wide, words, tried, wide_first = fits[0]
            inputs.allowed, called, failure, first = wide, tried, tried.failure, wide_first
            if tried.failure is None:
                inputs.notes.append(f"{plan.mask}: your code slices its mask itself (line {failed_at}) and raised "
                                    f"on a [.., n_Q, n_K] mask; it runs on one shaped {words}, which it was given")
    if failure is not None and plan.mask in failure.op and inputs.allowed.dim() == 3 and inputs.allowed.shape[0] == 1:
        # code that takes [n_Q, n_K] only (nn.MultiheadAttention's attn_mask): the same mask, without its 1
        inputs.allowed = inputs.allowed[0]
        first = first[0]
        torch.manual_seed(o.seed)
        called = call(target, fn, plan, inputs, module, o.max_memory, first, fed)
    convention = masking.detect(called.records, called.failure, plan.mask)
    keys_only = False  # the mask given is key padding, [n_batch, .., n_K]: no rule of the queries to hide the code's
    if convention.kind == given or (given == "additive" and convention.line is None):
        convention = masking.Convention(given, convention.line, convention.how)
    else:
        torch.manual_seed(o.seed)  # the same dropout draws as the first call
        mask = masking.written(inputs.allowed, convention.kind, dtype, convention.line)
        called = call(target, fn, plan, inputs, module, o.max_memory, mask, fed)
    grade = _grade(called, inputs, plan.mask) if called.failure is None else 0
    if (called.failure is not None or grade) and inputs.allowed.dtype == torch.bool:
        # code that takes its mask in another shape (key padding [n_batch, n_K], diffusers' [n_batch, 1, n_K], ...):
        # the first shape it runs on, by experiment, as a boolean or a float to add (diffusers' baddbmm). Code that
        # indexes the mask itself (`padding_mask[:, None, None, :]`) runs on any shape, a wrong one broadcast into
        # more axes than out has: the first shape whose output has out's axes and is finite (else out's axes alone)
        why = _misfit(called, inputs, plan.mask) if grade else None
        chosen: tuple[Any, str, Any, Called, str] | None = None
        laid = masking.laid_like(inputs.allowed, met, inputs.sizes, o.layout == "col") if met else None
        for form, words, padded in [*([laid] if laid is not None else []),
                                    *masking.forms(inputs.allowed, inputs.sizes.get("n_batch", 1), inputs.mask,
                                                  inputs.sizes.get("n_Q"))]:
            ran: Called | None = None
            for kind in dict.fromkeys((convention.kind, "additive")):
                torch.manual_seed(o.seed)
                ran = call(target, fn, plan, inputs, module, o.max_memory, masking.written(form, kind, dtype), fed)
                if ran.failure is None:
                    break
            if ran is None or ran.failure is not None:
                continue
            better = _grade(ran, inputs, plan.mask) if grade else 0
            if better < grade or not grade:
                chosen, grade = (form, words, padded, ran, kind), better
            if not grade:
                break
        if chosen is not None:
            form, words, padded, called, kind = chosen
            inputs.allowed = form
            keys_only = "key padding" in words
            if padded is not None:  # the key trace padded, padded in the reference's mask too: [n_batch, 1, 1, n_K]
                inputs.mask = masks.combine(inputs.mask, padded[:, None, None, :])
            axes = "n_K, n_Q" if o.layout == "col" else "n_Q, n_K"
            inputs.notes.append(f"{plan.mask}: your code raised on a [.., {axes}] mask and runs on one shaped {words}, "
                                "which it was given" if why is None else
                                f"{plan.mask}: on a mask shaped {list(first.shape)}, {why}; on one shaped {words}, "
                                "which it was given, your code's output has out's axes")
            read = masking.detect(called.records, None, plan.mask)
            if read.kind == kind or read.line is None:
                convention = masking.Convention(kind, read.line, read.how)
            else:
                convention = read
                torch.manual_seed(o.seed)
                called = call(target, fn, plan, inputs, module, o.max_memory,
                              masking.written(form, read.kind, dtype, read.line), fed)
    apart = o.mask and o.causal and plan.causal_mask() not in (None, plan.mask)
    if (keys_only or apart) and plan.other_masks and (o.causal or o.window) and called.failure is None:
        # the mask parameter takes key padding only (nn.MultiheadAttention's key_padding_mask), or the --mask file
        # beside a parameter named for the causal rule (CLIP's causal_attention_mask): the causal or window rule
        # goes to another one (its attn_mask [n_Q, n_K]), in the convention that one reads
        called = _rule_beside(o, target, fn, plan, inputs, module, fed, called)
    if not keys_only:  # key padding holds no causal or window rule that could hide the code's own
        called = _own_mask(o, target, fn, plan, inputs, module, fed, called, convention)
        called = _padding_beside(o, target, fn, plan, inputs, module, fed, called)
    return _as_stated(o, target, fn, plan, inputs, module, fed, called, convention)


def _as_stated(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
               called: Called, convention: Convention) -> tuple[Called, Convention]:
    """Where the code's own words give its boolean mask the polarity its ops do not (statedmask.py: "True =
    masked" over a `masked_fill(~mask, ..)`), the mask as the words say, so that the run shows what the code does
    with it; else the run as it was."""
    import torch

    from attnscope.usertrace import masking, statedmask
    from attnscope.usertrace.call import call

    allowed = inputs.allowed
    if called.failure is not None or convention.kind not in ("attend", "masked") or allowed is None \
            or allowed.dtype != torch.bool or bool(allowed.all()) or inputs.also_masked or plan.mask is None:
        return called, convention
    traced = tuple(c.__name__ for c in type(module).__mro__) if module is not None else (target.name.split(".")[-1],)
    said = statedmask.read(target.path, convention.line, plan.mask, tuple(plan.other_masks), traced)
    if said is None or said.kind == convention.kind:
        return called, convention
    torch.manual_seed(o.seed)
    dtype = next(iter(inputs.tensors.values())).dtype
    again = call(target, fn, plan, inputs, module, o.max_memory, masking.written(allowed, said.kind, dtype), fed)
    if again.failure is not None:
        return called, convention
    words = said.words if len(said.words) <= 60 else said.words[:57] + "..."
    return again, dataclasses.replace(convention, kind=said.kind, stated=f'line {said.line}: "{words}"')


def _not_weights(tried: Plan, ran: tuple[Inputs, Feeds, Called, Convention | None],
                 rerun: Callable[[Plan], tuple[Inputs, Feeds, Called, Convention | None]]
                 ) -> tuple[Plan, tuple[Inputs, Feeds, Called, Convention | None]]:
    """(plan, run) with the mask taken from a parameter the code multiplies its attention weights by after the
    softmax (transformers' `head_mask`: a weight per head, no mask; masking.weighs), given None instead, where the
    code then runs, and another parameter takes the mask, or the code masks by itself, or the parameter is named for
    heads. Otherwise (a plain `mask` multiplied after the softmax, the code's only mask) it keeps the mask: that is
    the `mask.after_softmax` mistake, named by experiment."""
    from attnscope.usertrace import masking

    inputs, called = ran[0], ran[2]
    if tried.mask is None or inputs.allowed is None or tried.fed_by_lengths():
        return tried, ran
    line = masking.weighs(called.records, tried.mask, called.failure)
    if line is None:
        return tried, ran
    other = tried.without_mask()
    again = rerun(other)
    if again[2].failure is not None:
        return tried, ran
    if other.mask is None and masking.masks_itself(again[2].records) is None and "head" not in tried.mask.lower():
        return tried, ran
    said = (f"{tried.mask}: your code multiplies its attention weights by it after the softmax (line {line}), a "
            f"weight per head and no mask, so it was given None (--forward \"{tried.mask}=...\" gives it a value)")
    return dataclasses.replace(other, said={**other.said, tried.mask: said}), again


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
                             guard=lambda sizes: _guard(unmasked, spec, sizes, weighted is not None))
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


def _scores_turned(called: Called, inputs: Inputs, module: Any) -> Any:
    """The mask (True = may attend) the column form hands as `[.., n_K, n_Q]`, turned to `[.., n_Q, n_K]`, where the
    code's scores are square and hold the queries' axis first (`Qᵀ K`), as the data flow of the product that makes
    them says (scoreaxes.py: which input, or which projection's weight, each operand comes from); None where the
    scores hold the keys first, the flow says nothing, or turning changes nothing."""
    from attnscope.usertrace import scoreaxes
    from attnscope.usertrace.lineup import given_roles, projected_roles
    from attnscope.usertrace.reference import find_projections

    allowed = inputs.allowed
    if called.failure is not None or allowed is None or allowed.dim() < 2 \
            or allowed.shape[-1] != allowed.shape[-2] or bool((allowed == allowed.transpose(-1, -2)).all()):
        return None
    roles = given_roles(inputs)
    if module is not None:
        try:
            read = find_projections(module, called.records, inputs.sizes.get("n_head"), inputs.sizes.get("d_head"))
        except UsageError:
            read = []
        roles = projected_roles(read[0], inputs) if read else roles
    keys_last = scoreaxes.keys_last(scoreaxes.key_axes(called.records, *roles))
    return allowed.transpose(-1, -2) if keys_last else None


def _met(failure: Failure | None, label: str, given: list[int]) -> list[int] | None:
    """The shape of what the mask met in the op the code raised on (the scores): of the shapes that met there, the
    largest that is not the mask's own; None where the op is not the mask's."""
    if failure is None or label not in failure.op:
        return None
    others = [list(shape) for shape in failure.shapes if list(shape) != given and len(shape) >= 2]
    return max(others, key=lambda shape: math.prod(shape)) if others else None


def _misfit(called: Called, inputs: Inputs, label: str) -> str | None:
    """What is wrong with a call's output, where it cannot be out (a mask of the wrong shape broadcast into the
    scores' axes): the mask widened what it was applied to (`scores.masked_fill(mask[:, None, None, :], ..)` on a
    4-D mask: 6 axes, or a batch of batches), more axes than the queries have, or values that are not finite; None
    where none of these."""
    import torch

    widened = _widened(called.records, label, set(inputs.tensors))
    if widened is not None:
        return widened
    found = called.result if isinstance(called.result, (tuple, list)) else [called.result]  # (out, weights)
    tensors = [t for t in found if isinstance(t, torch.Tensor) and t.is_floating_point()]
    queries = [t for name, t in inputs.tensors.items() if inputs.roles.get(name) == "Q"]
    if not tensors or not queries:
        return None
    out, rank = tensors[0], queries[0].dim()
    if out.dim() > rank:
        return f"your code's output was {list(out.shape)}, {out.dim()} axes where your queries have {rank}"
    if not bool(torch.isfinite(out).all()):
        return f"your code's output was {list(out.shape)}, with values that are not finite"
    return None


def _widened(records: list[Record], label: str, inputs: set[str]) -> str | None:
    """The first op where the mask (or what the code made of it) meets a tensor computed from the inputs (the
    scores) and makes it larger: the mask broadcast into axes the scores do not have; None where it never does."""
    derived: set[int] = set()
    computed: set[int] = set()  # records whose values come from the forward's inputs
    for r in records:
        reads = [value for kind, value in r.args if kind == "rec"] + [
            value[1][1] for kind, value in r.args if kind == "kw" and value[1][0] == "rec"]
        texts = [value for kind, value in r.args if kind == "text"] + [
            value[1][1] for kind, value in r.args if kind == "kw" and value[1][0] == "text"]
        if any(t in inputs for t in texts) or computed & set(reads):
            computed.add(r.index)
        if label not in texts and not derived & set(reads):
            continue
        others = [records[i].tensor for i in reads if i not in derived and i in computed]
        if others and r.tensor.numel() > max(t.numel() for t in others) and r.tensor.dim() >= max(
                t.dim() for t in others):
            widest = max(others, key=lambda t: t.numel())
            return (f"the mask widened {list(widest.shape)} to {list(r.tensor.shape)} at line {r.line} "
                    f"({r.details.get('op', r.func)})")
        derived.add(r.index)
    return None


def _grade(called: Called, inputs: Inputs, label: str) -> int:
    """How far a call's output is from being out: 0 where it may be, 1 with values that are not finite although the
    mask leaves every query a key, 2 where the mask widened the scores or the output has more axes than the
    queries (a mask of the wrong shape broadcast into the scores' axes)."""
    import torch

    why = _misfit(called, inputs, label)
    if why is None:
        return 0
    if "not finite" not in why:
        return 2
    allowed = inputs.allowed
    # a mask that leaves a query no key: hand-written code gives it NaN, no mistake of the mask's shape
    return 1 if allowed is not None and allowed.dtype == torch.bool and bool(allowed.any(-1).all()) else 0


def _rule_beside(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
                 called: Called) -> Called:
    """The code called again with the causal or window rule, `[n_Q, n_K]`, given to the first other mask parameter
    it runs with, beside the key padding `plan.mask` takes (the reference's mask holds both); `called` where none
    runs."""

    from attnscope import masks
    from attnscope.spec import AttentionSpec
    from attnscope.usertrace import masking

    rule, _ = masks.structural(AttentionSpec.asked(o.causal, o.window, o.cache, window_side=o.window_side),
                               inputs.sizes["n_Q"], inputs.sizes["n_K"])
    if rule is None:
        return called
    dtype = next(iter(inputs.tensors.values())).dtype
    causal = plan.causal_mask()
    for other in sorted(plan.other_masks, key=lambda m: m != causal):  # one named for the rule first
        ran = _given_beside(o, (target, fn, plan, inputs, module, fed, called), other, rule, dtype)
        if ran is not None:
            held = "the --mask file" if o.mask and other == causal else "the key padding"
            inputs.notes.append(f"{other}: given the {'causal' if o.causal else 'window'} rule [n_Q, n_K] beside "
                                f"{held} {plan.mask} takes, {masking.WORDS[ran[1]]}")
            inputs.also_masked.append(other)
            return ran[0]
    return called


def _given_beside(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds, Called], other: str,
                  mask: Any, dtype: Any) -> tuple[Called, str] | None:
    """The code called again with `mask` (True = may attend) given to the mask parameter `other` as well, as a
    boolean, then in the convention the code reads it: (the call, that convention), None where it raises."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.call import call

    target, fn, plan, inputs, module, fed, called = run
    beside = dataclasses.replace(plan, nones=[n for n in plan.nones if n != other])
    kind, line = "attend", None
    for _ in range(2):
        given = masking.written(mask, kind, dtype, line)
        more = dataclasses.replace(fed, values={**fed.values, other: given}, labels={**fed.labels, id(given): other})
        torch.manual_seed(o.seed)
        tried = call(target, fn, beside, inputs, module, o.max_memory, called.mask_given, more)
        if tried.failure is not None:
            return None
        read = masking.detect(tried.records, None, other)
        if read.kind == kind or read.line is None:
            return tried, kind
        kind, line = read.kind, read.line
    return None


def _padding_beside(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
                    called: Called) -> Called:
    """Where the mask parameter took the rule (causal, a window) and the forward takes key padding as well
    (fairseq's key_padding_mask beside its attn_mask), the padding parameter gets keys of trace's own padded
    (masking.padded_keys), the reference's mask padding the same keys, so that its branch runs and is compared;
    `called` where the code does not run so, or nothing could be padded."""
    import torch

    from attnscope import masks
    from attnscope.usertrace import masking

    allowed = inputs.allowed
    others = [m for m in plan.other_masks if "padding" in m.lower() and m not in inputs.also_masked]
    if called.failure is not None or not others or allowed is None or allowed.dtype != torch.bool \
            or o.mask or "n_batch" not in inputs.sizes:
        return called
    grid = allowed.reshape(-1, *allowed.shape[-2:])
    if grid.shape[0] != 1:
        return called
    keys, padded, _ = masking.padded_keys(grid.expand(inputs.sizes["n_batch"], *grid.shape[1:]))
    if padded is None:
        return called
    dtype = next(iter(inputs.tensors.values())).dtype
    other = others[0]
    # [n_batch, n_K] (fairseq's key_padding_mask), else [n_batch, 1, 1, n_K] (a 4-D additive attention_mask)
    for shaped, words in ((keys, "[n_batch, n_K]"), (keys[:, None, None, :], "[n_batch, 1, 1, n_K]")):
        ran = _given_beside(o, (target, fn, plan, inputs, module, fed, called), other, shaped, dtype)
        if ran is not None:
            inputs.mask = masks.combine(inputs.mask, padded[:, None, None, :])
            which = ", ".join(str(int(k)) for k in torch.nonzero(~padded[0]).flatten())
            inputs.notes.append(f"{other}: keys {which} of the first sequence padded by trace ({words}), "
                                f"{masking.WORDS[ran[1]]}, so that your code's padding runs; the reference's mask "
                                "pads the same keys")
            inputs.also_masked.append(other)
            return ran[0]
    return called


def _own_mask(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
              called: Called, convention: Convention) -> Called:
    """A code that masks by itself (a causal buffer, a tril of any diagonal, is_causal) and takes a mask as well
    gets one that masks nothing, so that trace's mask never hides the code's own: the reference's mask is then
    compared with the code's alone. Found by experiment: the code run with nothing masked still has weights of
    exactly 0."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.call import call

    allowed = inputs.allowed
    if called.failure is not None or allowed is None or allowed.dtype != torch.bool or bool(allowed.all()):
        return called
    dtype = next(iter(inputs.tensors.values())).dtype
    everything = torch.ones_like(allowed)
    torch.manual_seed(o.seed)
    tried = call(target, fn, plan, inputs, module, o.max_memory,
                 masking.written(everything, convention.kind, dtype, convention.line), fed)
    own = masking.masks_by_itself(tried.records) if tried.failure is None else None
    if own is None:
        return called
    rest = _rule_left_over(o, inputs, own)
    if rest is not None:  # the code masks one part of the rule itself and merges it into the mask it is given
        given, mine, theirs = rest
        torch.manual_seed(o.seed)
        again = call(target, fn, plan, inputs, module, o.max_memory,
                     masking.written(given, convention.kind, dtype, convention.line), fed)
        if again.failure is None:
            inputs.allowed = given
            inputs.notes.append(f"your code masks {mine} by itself (line {own.line}: weights of exactly 0 with nothing "
                                f"masked by {plan.mask}) and takes the rest of the rule from {plan.mask}: it was "
                                f"given {theirs} alone, so that trace's mask never hides yours; the reference's mask "
                                "is compared with the two together")
            return again
    inputs.allowed = everything
    inputs.notes.append(f"your code masks by itself (line {own.line}: weights of exactly 0 with nothing masked by "
                        f"{plan.mask}): {plan.mask} was given a mask that masks nothing, so that trace's mask never "
                        "hides yours; the reference's mask is compared with your code's own")
    return tried


def _rule_left_over(o: TraceOptions, inputs: Inputs, own: Record) -> tuple[Any, str, str] | None:
    """Where the rule is a sliding window (causal, on the left) and the code, given a mask that masks nothing,
    masks one of its two parts alone (the window's far keys, which Gemma 2 merges into the causal mask it is given;
    or the causal part, a window coming from the caller): the mask with the other part only (and any key padding),
    with both parts in words; None otherwise (it masks both, or cells of neither part)."""
    from attnscope import masks

    n_Q, n_K = inputs.sizes["n_Q"], inputs.sizes["n_K"]
    allowed = inputs.allowed
    if allowed is None or o.window is None or o.window_side == "both" or tuple(own.tensor.shape[-2:]) != (n_Q, n_K):
        return None
    forbids = (own.tensor == 0).reshape(-1, n_Q, n_K).all(0)  # [n_Q, n_K]: masked in every sequence and head
    spec = AttentionSpec.asked(o.causal, o.window, o.cache, window_side=o.window_side)
    whole, _ = masks.structural(spec, n_Q, n_K)
    causal, _ = masks.structural(AttentionSpec.asked(spec.align, None, o.cache), n_Q, n_K)
    if whole is None or causal is None:
        return None
    future, far = ~causal, causal & ~whole  # the causal part, the window's far keys
    on_future, on_far = bool((forbids & future).any()), bool((forbids & far).any())
    if on_far and not on_future:
        return allowed | far, f"the window's far keys ({o.window} or more back)", "the causal mask"
    if on_future and not on_far:
        return allowed | future, "the causal part", f"the window's far keys ({o.window} or more back)"
    return None


def _lined_note(o: TraceOptions) -> str:
    """The note for code that runs on rows but lines up only on columns."""
    shape = "[n_batch, d, n]" if o.batch != 0 else "[d, n]"
    return ("your code runs on rows [.., n, d] but lines up with the reference only on columns "
            f"{shape}, one token a column: read as the column convention (scores Kᵀ Q [.., n_K, n_Q], softmax over "
            "the keys, dim -2), a convention, not a mistake (--layout col says it)")


def _weights_note(module: Any, turned: bool = False) -> str:
    """What a function's weight arguments were given (`turned`: as they were before the holder turned them)."""
    shapes = ", ".join(f"{name} {list(p.shape)[::-1] if turned else list(p.shape)}"
                       for name, p in module.named_parameters())
    return (f"your function takes its weights as arguments: each got a random weight drawn from the seed ({shapes}; "
            "--d-feat sizes them), and which side of a matmul each stands on says how it projects")


def _columns_possible(o: TraceOptions, module: Any) -> bool:
    """Whether code that failed on rows may be tried in the column form: rows were not asked for by files (their
    shapes decide), no option that works only in the row layout was given, and the module (if any) projects with
    no nn.Linear, which reads rows."""
    return o.layout == "row" and not o.q and not _reads_rows(module) and not (
        o.rope or o.kv_heads or o.alibi or o.position_bias or o.qk_norm or o.scale is not None or o.cache)


def _reads_rows(module: Any) -> bool:
    """Whether the module projects with nn.Linear layers (they read the last axis: one token a row)."""
    from torch import nn

    return module is not None and any(isinstance(m, nn.Linear) for m in module.modules())


def _widths(module: Any, shapes: Any) -> list[int | None]:
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


def _with_width(shapes: Any, width: int | None) -> Any:
    """`shapes` with d_feat = width (None: as they are); a d_head read from the other width is dropped (the
    reference reads it from the query projection's width)."""
    if width is None:
        return shapes
    fixed = {k: v for k, v in shapes.fixed.items() if k != "d_head"} | {"d_feat": width}
    return dataclasses.replace(shapes, fixed=fixed)


def _column_form(o: TraceOptions, attempt: Any) -> tuple[TraceOptions, tuple[Any, ...]] | None:
    """The code run on column-form inputs, [.., d, n] (then [d, n], one sequence, where no --batch was given): the
    options it ran under and the run, or None where it fails on those too (the row run's failure is then the one
    reported)."""
    tries = [dataclasses.replace(o, layout="col")]
    if o.batch is None:
        tries.append(dataclasses.replace(o, layout="col", batch=0))
    for asked in tries:
        try:
            made = attempt(asked)
        except UsageError:
            continue
        if made[2].failure is None:
            return asked, made
    return None


def _held_widths(module: Any, shapes: Any, memory: bool) -> list[tuple[int | None, int | None]]:
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


def _context_widths(module: Any, shapes: Any) -> list[int | None]:
    """The widths a memory is given in turn: as chosen (None: the queries' width, or the d_kv_in the projections
    said), then, where nothing said it, each other width the module's weights hold (a fused to_kv of its own)."""
    if module is None or "d_kv_in" in shapes.fixed:
        return [None]
    return [None] + [context for width, context in _held_widths(module, shapes, True) if width is None]


def _attempted(attempt: Any, asked: TraceOptions) -> tuple[Any, ...] | None:
    """The code run under `asked`; None where those inputs cannot be made."""
    try:
        return cast("tuple[Any, ...]", attempt(asked))
    except UsageError:
        return None


def _column_note(failed: Failure, o: TraceOptions, weighted: bool) -> str:
    """The note for code read as the column convention."""
    where = f"line {failed.line}: " if failed.line else ""
    shape = ("[n_batch, d_feat, n]" if weighted else "[n_batch, d, n]") if o.batch != 0 else (
        "[d_feat, n]" if weighted else "[d, n]")
    return (f"your code failed on rows [.., n, d] ({where}{failed.message}) and runs on columns {shape}, one token a "
            f"column: read as the column convention ({'W @ x, ' if weighted else ''}scores Kᵀ Q [.., n_K, n_Q], "
            "softmax over the keys, dim "
            "-2), a convention, not a mistake; the reference is the row form's on your inputs transposed, its steps "
            "transposed back (--layout col says it)")


def _sized(o: TraceOptions, spec: Spec, is_module: bool, sizes: dict[str, int]) -> None:
    """_guard with the sizes last (a partial's argument)."""
    _guard(o, spec, sizes, is_module)


def _guard(o: TraceOptions, spec: Spec, sizes: dict[str, int], is_module: bool) -> None:
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


def _check_options(o: TraceOptions, target: Target) -> Spec:
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
    causal = _causal_used(o)
    asked = AttentionSpec.asked(causal, o.window, o.cache, rope=rope_of(o), alibi=o.alibi, scale=o.scale,
                                qk_norm=o.qk_norm, window_side=o.window_side,
                                softcap=o.softcap)  # checked as sdpa/mha check them
    if o.alibi and o.position_bias:
        raise UsageError("--alibi and --position-bias are two position biases; give one")
    if o.scale is not None and not math.isfinite(o.scale):
        raise UsageError(f"--scale {o.scale}: give a finite number")
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
                         "the bias added to the scores is a float tensor [.., n_Q, n_K]")
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


def _built_with(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the module's __init__ was given, as values to read what it declares from (declared.py: a RoPE base or
    share, a softcap, a scale): --init's configs
    (`ModelArgs(rope_base=500000)`, `GPTJConfig()`) made again, dicts and numbers as they are."""
    import torch

    from attnscope.usertrace.initargs import ClassCall, build, has_calls

    made: dict[str, Any] = {}
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


def _with_own_rope(spec: Spec, module: Any, plan: Plan, made: dict[str, Any], d_head: int | None) -> Spec:
    """The spec with the RoPE base the module says (its rope_theta, on itself, a config it keeps, or the config
    --init hands its __init__ and it does not keep: gpt-fast's `ModelArgs(rope_base=...)`), where --rope asks for
    RoPE and --rope-base does not say the base; and, where its forward takes RoPE's tables, the share of each head
    its config says it rotates (StableLM's partial_rotary_factor), so that the tables trace makes are as wide as
    that share and of that base. Code that rotates with another base or share is then a bug, named by experiment."""
    from attnscope.usertrace.conventions import DEFAULT_BASE, own_base, own_fraction

    if spec.rope_base is None:
        return spec
    declared = own_base(module, made)
    if declared is not None and not spec.base_asked and spec.rope_base == DEFAULT_BASE and declared != DEFAULT_BASE:
        spec = dataclasses.replace(spec, rope_base=declared, base_from_module=True)
    fraction = own_fraction(module, d_head, made) if plan.tables and spec.rope_fraction is None else None
    if fraction is not None:
        spec = dataclasses.replace(spec, rope_fraction=fraction, fraction_from_module=True)
    return spec


def _with_own_fraction(spec: Spec, module: Any, plan: Plan, d_head: int | None, made: dict[str, Any]) -> Spec:
    """The spec rotating the share of each head the module's config says RoPE turns (its rotary_dim,
    partial_rotary_factor), where --rope asks for RoPE and the module was given no tables by trace (those it was are
    read before the call, _with_own_rope); as the base read from its rope_theta, code that rotates another share
    then has a bug, named by experiment."""
    from attnscope.usertrace.conventions import own_fraction

    if spec.rope_base is None or spec.rope_fraction is not None or plan.tables:
        return spec
    fraction = own_fraction(module, d_head, made)
    return spec if fraction is None else dataclasses.replace(spec, rope_fraction=fraction, fraction_from_module=True)


def _table_width(spec: Spec, plan: Plan, d_head: int | None) -> int | None:
    """How wide RoPE's tables are made: the share of each head the reference rotates, where the forward takes them
    and that share is less than the head; None for the whole head."""
    if not plan.tables or not spec.rope_fraction or not d_head:
        return None
    return int(d_head * spec.rope_fraction)


def _form_spec(spec: Spec, form: Any, d_head: int) -> Spec:
    """The reference for code that runs on RoPE's tables in `form` (tableforms.py): a share of each head turned where
    they are narrower than the head and laid out for a pairing; one angle a pair leaves the pairing to the code."""
    if form.pairs:
        return dataclasses.replace(spec, pairing_asked=False)
    if form.width < d_head:
        return dataclasses.replace(spec, rope_fraction=form.width / d_head, fraction_from_module=True,
                                   pairing_asked=True)
    return dataclasses.replace(spec, pairing_asked=True)


def _causal_used(o: TraceOptions) -> str | None:
    """The causal alignment the reference uses: a bare --causal's is the run's, lower-right in a decode step
    (--cache N); one typed is as typed."""
    return "lower-right" if o.cache and o.causal == "upper-left" and not o.causal_asked else o.causal


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
    if o.layout == "col" and _reads_rows(module):
        raise UsageError(f"--layout col is for code that takes one token a column, [.., d, n] (W @ x); "
                         f"{target.name} projects with nn.Linear layers, which read [n_batch, n, d_feat]: drop "
                         "--layout col")
    if o.batch == 0 and o.layout != "col":  # the column form's [d_feat, n] are run on a batch of one (columns.py)
        raise UsageError(f"--batch 0 (2-D inputs) is for a function; {target.name} takes [n_batch, n, d_feat]: "
                         "give --batch N, N >= 1")
    return module


def _steps(inputs: Inputs, records: list[Record], rows: list[Aligned], fed: Feeds, plan: Plan) -> list[UserStep]:
    """The inputs and every recorded op, each with named dims (dims.py: from its size, the reference step
    it lines up with, or where it comes from)."""
    from attnscope.usertrace.dims import name_records
    from attnscope.usertrace.sizes import AxisNames

    names = AxisNames(inputs.sizes, _extra_names(inputs))
    dims_of = {name: _input_dims(inputs, name, names) for name in inputs.tensors}
    steps = [UserStep(name, t, dims_of[name], f"input: {inputs.ops[name]}", allocates=True)
             for name, t in inputs.tensors.items()]
    given = {name: (dims_of[name], t) for name, t in inputs.tensors.items()}
    for name, tensor, dims, op in fed.steps:
        steps.append(UserStep(name, tensor, dims, op))
        given[fed.labels.get(id(tensor), name)] = (dims, tensor)
    if inputs.allowed is not None and plan.mask:
        dims = _mask_dims(inputs.allowed.shape, inputs.sizes, names, inputs.layout)
        said = "additive, 0 = may attend" if inputs.allowed.is_floating_point() else "True = may attend"
        steps.append(UserStep("mask", inputs.allowed, dims, f"input: {plan.mask}, {said} (given to your code as it "
                                                            "reads it: see the note)"))
        given[plan.mask] = (dims, inputs.allowed)
    named = name_records(records, rows, names, given)
    for r in (r for r in records if "stacked" not in r.details):  # the heads' tensors stacked: for the line-up
        op = f"line {r.line}: {r.details['op']}" + (f" ({r.details['same']})" if "same" in r.details else "")
        steps.append(UserStep(r.label, r.tensor, named[r.index], op, r.flops, r.allocates, r.line,
                              recomputed="recomputed" in r.details))
    return steps


def _mask_dims(shape: tuple[int, ...], sizes: dict[str, int], names: AxisNames, layout: str) -> tuple[str, ...]:
    """The mask's dims: its last two axes are n_Q and n_K (n_K and n_Q in the column layout) where they have
    those sizes (in self-attention they share one), a broadcast axis of 1 stays 1 (a padding mask
    [n_batch, 1, 1, n_K])."""
    dims = list(names.dims(shape))
    for axis, name in ((-2, "n_K"), (-1, "n_Q")) if layout == "col" else ((-2, "n_Q"), (-1, "n_K")):
        if len(shape) >= -axis and shape[axis] == sizes.get(name) and shape[axis] != 1:
            dims[axis] = name
    return tuple(dims)


def _input_dims(inputs: Inputs, name: str, names: AxisNames) -> tuple[str, ...]:
    """An input's dims, by its role: the queries' axis is n_Q, the keys' n_K (by their sizes when a file gave
    another rank)."""
    from attnscope.usertrace.inputs import role_dims

    dims = role_dims(inputs.side(name), inputs.sizes, "d_feat" in inputs.sizes, inputs.layout)
    tensor = inputs.tensors[name]
    return dims if tensor.dim() == len(dims) else names.dims(tensor.shape)


def _extra_names(inputs: Inputs) -> dict[str, int]:
    """Sizes a user's tensor may have that are no dim: a fused projection's width, heads per group, half a head."""
    sizes = inputs.sizes
    extra = dict(inputs.extra_names)
    if "n_kv_head" in sizes and sizes["n_kv_head"]:
        extra["n_group"] = sizes["n_head"] // sizes["n_kv_head"]
    d = sizes.get("d_head", sizes.get("d_K"))
    if d and d % 2 == 0:
        extra["d_head/2" if "d_head" in sizes else "d_K/2"] = d // 2
    return extra


def _header(target: Target, label: str, plan: Plan, inputs: Inputs, mode: str, spec: Spec) -> list[str]:
    order = ["n_batch", "n_Q", "n_K", "n_cache", "d_K", "d_V", "d_feat", "n_head", "n_kv_head", "d_head"]
    sizes = "  ".join(f"{k}={inputs.sizes[k]}" for k in sorted(inputs.sizes, key=lambda k: (
        order.index(k) if k in order else len(order), k)))
    kind = "self-attention" if plan.self_attention else (
        "cross-attention" if inputs.sizes.get("n_Q") != inputs.sizes.get("n_K") else "attention")
    kind = "cross-attention, the queries from your module's own tensors" if inputs.own and \
        inputs.own_from == "module" else kind
    kind = "joint attention" if inputs.own and inputs.own_from == "joined" else kind
    kind += "" if not spec.cache else ", a decode step"
    described = ", ".join(part for part in (spec.describe(), "column layout" if spec.layout == "col" else "") if part)
    variants = f"; reference: {described}" if described else ""
    return [f"trace {target.path.name}:{label}", f"{plan.signature}: {kind}{mode}{variants}", sizes]


def _params(o: TraceOptions, target: Target, kwargs: dict[str, Any], inputs: Inputs) -> dict[str, Any]:
    files = {role: spec for role, spec in (("Q", o.q), ("K", o.k), ("V", o.v)) if spec}
    return {"target": o.target, "file": str(target.path), "name": target.name, "kind": target.kind,
            "init": {k: _jsonable(v) for k, v in kwargs.items()}, "train": o.train, "sizes": dict(inputs.sizes),
            "seed": o.seed, "inputs": files or "random", "mask": o.mask, "causal": _causal_used(o), "window": o.window,
            "rope": o.rope, "rope_base": (o.rope_base or ROPE_BASE) if o.rope else None,
            "rope_pairing": (o.rope_pairing or "half-split") if o.rope else None,
            "kv_heads": o.kv_heads, "cache": o.cache, "save": o.save, "alibi": o.alibi,
            "position_bias": o.position_bias, "qk_norm": o.qk_norm, "scale": o.scale, "forward": o.forward,
            "rope_base_asked": o.rope_base is not None, "causal_asked": o.causal is not None and o.causal_asked,
            "layout": o.layout}


def _jsonable(value: Any) -> Any:
    """--init values are literals (or calls of the file's classes, written as text); those JSON has no word
    for (tuples, sets, bytes, complex) become lists or text."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
