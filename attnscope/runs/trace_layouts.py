"""The first run of the user's code, and the readings tried where it raises: a decode step's cache (MLA's latents,
a cache the module holds), then the code handed its cache in each layout real code keeps, a memory where it raised
without one, one sequence, the column form, a function's weights turned, the widths its weights hold, time-first
inputs, n_head slices of a width they hold; and a cache layout its own join says. Each reading is kept on the run
so far (trace_attempt.py).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.runs.trace_attempt import RunSoFar, attempted, cache_parameters
from attnscope.runs.trace_otherwise import alias_note, otherwise
from attnscope.runs.trace_relative import equal_lengths, refused, tables_asked
from attnscope.runs.trace_remask import masked_again
from attnscope.runs.trace_setup import (
    context_widths,
    held_widths,
    memory_note,
    reads_rows,
    sliced_widths,
    weights_note,
    widths,
    with_width,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.runs.trace_attempt import Made
    from attnscope.runs.trace_options import TraceOptions
    from attnscope.usertrace.load import Plan
    from attnscope.usertrace.record import Failure


def first_run(r: RunSoFar) -> Made:
    """The code's first run under the options, its decode step's cache read first; where it raised, each reading
    that may let it run, in turn; the notes that say which was kept."""
    _decode_cache(r)
    _causal_switch(r)
    made, said = r.in_layouts(r.o, r.attempt(r.o))
    r.notes += [said] if said else []
    made = _with_memory(r, made)
    made = _empty_cache(r, made)
    made = _one_input(r, made)
    made = _unread_inputs(r, made)  # before the readings a failure asks for: a mask sized by the unread key's length
    made = _position_ids(r, made)
    for retry in (equal_lengths, _at_held_batches, _unbatched, _in_columns, _weights_turned, _at_held_widths,
                  _time_first, _as_image, _joined_layout, _read_otherwise, _module_unbatched, _at_sliced_widths,
                  _masks_at_default, refused, tables_asked):
        made = retry(r, made)
    if r.refusal is not None and made[2].failure is not None and made[2].failure.line == r.refusal[2].line:
        made = r.run_bare(r.o, made, r.refusal)  # a --mask file's parameter refused in every reading: run without it
    made = _unread_inputs(r, made)
    made = masked_again(r, made)  # masks left at their default, given again under the options read since
    _cache_notes(r, made)
    return made


def _causal_switch(r: RunSoFar) -> None:
    """Under --causal, a switch of the code's own (`is_causal=False`, `causal: bool = False`) given True where its
    truth makes the code mask the future keys itself (usertrace/causalflag.py, by experiment), its mask parameters
    None, so that the mask is made once, by the code; under --window, one whose truth makes the code build a sliding
    window itself. Beside a --mask file, the mask parameter keeps the file alone, the rule the switch's, unless the
    code raises with both and runs without the switch (SDPA refuses an attn_mask beside is_causal=True in some
    versions: there trace's mask holds both and the switch keeps its default). Not where the rule masks nothing (a
    decode step of one query), nor where the code raises with the switch True (_switch_raised)."""
    import inspect

    from attnscope import masks
    from attnscope.spec import AttentionSpec
    from attnscope.usertrace import causalflag

    o = r.o
    if not (o.causal or o.window) or r.plan.switched is not None:
        return
    forward = r.module.forward if r.module is not None else r.fn  # as the plan was read (trace_setup.prepare)
    names = causalflag.candidates(forward, r.plan, r.target.obj if r.target.kind == "function" else None)
    if not names:
        return
    sizes: dict[str, int] = {}
    failed: dict[str | None, Failure | None] = {}  # each switch tried (None: none) -> where the code raised with it

    plain: list[Any] = []  # the records of the run without a switch

    def run(tried: Any) -> tuple[list[Any], bool]:
        made = attempted(functools.partial(r.run_plan, tried=tried), o)
        failed[tried.switched] = made[2].failure if made is not None else None
        if made is None:
            return [], True
        sizes.update(made[0].sizes)
        if tried.switched is None:
            plain[:] = made[2].records
        return made[2].records, made[2].failure is not None

    band = o.window is not None
    found = causalflag.read(r.plan, names, run, band)
    if found is None and not _masks_its_own(r, plain, sizes):
        _switch_raised(r, failed)
    if found is None or "n_Q" not in sizes or "n_K" not in sizes:
        return
    spec = AttentionSpec.asked(o.causal, o.window, o.cache, window_side=o.window_side)
    rule, _ = masks.structural(spec, sizes["n_Q"], sizes["n_K"])
    if rule is None or bool(rule.all()):
        return  # one query of a decode step sees every key: the switch is not what the code needs
    name, own = found
    default = False if name in r.plan.flags else inspect.signature(forward).parameters[name].default
    optional = [n for n in r.plan.optional if n != name]
    masked = [m for m in (r.plan.mask, *r.plan.other_masks) if m is not None]
    if o.mask and r.plan.mask is not None:  # the file to the mask parameter, the rule to the switch
        kept = dataclasses.replace(r.plan, switched=name, optional=optional,
                                   said={**r.plan.said, name: causalflag.note(name, default, own, [], band,
                                                                              r.plan.mask)})
        if not run(kept)[1] or run(r.plan)[1]:  # it raises with both only where it raises without them too
            r.plan = kept
        return
    bare = r.plan.without_masks()
    r.plan = dataclasses.replace(bare, switched=name, optional=optional,
                                 said={**bare.said, **dict.fromkeys(masked, ""),  # said in the switch's note
                                       name: causalflag.note(name, default, own, masked, band)})


def _masks_its_own(r: RunSoFar, records: list[Any], sizes: dict[str, int]) -> bool:
    """Whether the code, run without a switch, applies a mask of its own to its scores, weights of 0 or not (a
    block-causal tril multiplied in, Jukebox's `w * mask` without its `- 1e9 * (1 - mask)`): the rule is then
    compared with what the code makes of it, never refused as a mask the code cannot apply."""
    from attnscope.usertrace import masking

    if not records or "n_Q" not in sizes or "n_K" not in sizes:
        return False
    if masking.masks_itself(records) is not None:
        return True
    # the pattern's axes, or those of a block's pattern where the code attends within blocks (Jukebox's block_attn)
    softmaxed = [tuple(x.tensor.shape[-2:]) for x in records if masking.is_pattern(x)][:1]
    return any(masking.own_mask_op(records, set(r.plan.tensors), r.plan.mask or "", pattern) is not None
               for pattern in dict.fromkeys([(sizes["n_Q"], sizes["n_K"]), *softmaxed]))


def _switch_raised(r: RunSoFar, failed: dict[str | None, Failure | None]) -> None:
    """Refused where the code takes no mask, runs without one, and raises by a statement of its own (never in a torch
    op it handed the value: a tensor parameter given True) with a switch of its own True (a forward whose
    `is_causal=True` raises "not supported"): trace can give it the rule --causal (--window) asks for neither way,
    and its own words say why."""
    asked = f"--window {r.o.window}" if r.o.window else "--causal"
    raised = [(name, f) for name, f in failed.items() if name is not None and f is not None and not f.op
              and _raise_statement(r.target.source, f.line)]
    if not raised or None not in failed or failed[None] is not None or r.plan.mask is not None or r.plan.other_masks:
        return
    name, failure = raised[0]
    where = f" (line {failure.line})" if failure.line else ""
    raise UsageError(f"{asked} asks for a mask your code applies, but {r.plan.signature} takes no mask and masks "
                     f"nothing by itself, and with {name} = True it raised {failure.message}{where}; run it without "
                     f"{asked}, or give it a way to mask")


def _raise_statement(path: Any, line: int | None) -> bool:
    """Whether `line` of the file at `path` holds a `raise` statement of the code's own."""
    import ast
    from pathlib import Path

    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    return line is not None and any(isinstance(n, ast.Raise) and n.lineno == line for n in ast.walk(tree))


def _decode_cache(r: RunSoFar) -> None:
    """A decode step's cache read before the first run: MLA's latents from a prefill's data flow, a cache the
    module holds (the tensors a first run writes the new keys and values into); the head count asked for where only
    a run says it."""
    from attnscope.usertrace import heldcache, latentcache

    batches = dict.fromkeys((r.o.batch, 1, *sorted({int(n) for *_, t in heldcache.places(r.module, True)
                                                   for n in t.shape if 1 < n <= 16}))) if r.plan.cache_held else {}
    if r.o.cache and r.weighted is not None and r.shapes.n_head is None and r.o.heads is None:
        # before any run with a cache, whose keys and values are drawn [n_batch, n_kv_head, n_cache, d_head] (a held
        # cache's probe too: torchtune's KVCache raised KeyError 'n_head' there): run_trace reads the count from a run
        # without the cache, at a batch the module's own cache holds, then comes back
        raise HeadsForCache(r.target.name, tuple(batches))
    if r.o.cache and r.module is not None and (r.plan.cache is not None or r.plan.cache_held):
        # multi-head latent attention, read from a prefill's data flow: its cache drawn as latents and expanded
        for batch in batches or (r.o.batch,):
            heldcache.restored(*r.pristine)
            prefill = attempted(r.attempt, dataclasses.replace(r.o, cache=0, batch=batch))
            heldcache.restored(*r.pristine)
            if prefill is not None and prefill[2].failure is None:
                r.latent_maker = latentcache.read(prefill[2].records, r.module, r.shapes.n_head, r.spec, r.o.cache,
                                                  r.o.seed)
                break
    if r.plan.cache_held:  # the module's own cache: the tensors a first run writes the new keys and values into
        before, counts = r.pristine
        heldcache.restored(*r.pristine)
        for batch in batches:
            asked = dataclasses.replace(r.o, batch=batch)
            probe = r.attempt(asked)  # what it writes, before any op it raises on
            n_new = probe[0].sizes.get("n_Q", 0)
            counting = heldcache.moved(counts, n_new) if probe[0].cache is not None else []
            if probe[0].cache is not None:
                r.own_cache = heldcache.read(before, probe[0].cache, n_new)
            heldcache.restored(*r.pristine)
            # a count of its own positions (torchtune's cache_pos): n_cache further
            if r.own_cache is None and counting:
                hook = r.module.register_forward_pre_hook(functools.partial(heldcache.before_call, counting, r.o.cache))
                probe = r.attempt(asked)
                hook.remove()
                if probe[0].cache is not None:
                    r.own_cache = heldcache.read(before, probe[0].cache, n_new)
                    if r.own_cache is not None:
                        r.own_cache.counters = counting
                heldcache.restored(*r.pristine)
            if r.own_cache is not None:
                break
        if r.own_cache is not None and r.own_cache.counters:  # every later call starts n_cache positions on
            r.module.register_forward_pre_hook(functools.partial(heldcache.before_call, r.own_cache.counters,
                                                                 r.o.cache))
        if r.own_cache is None:
            raise UsageError(f"--cache {r.o.cache} runs a decode step, which needs a module whose forward takes x "
                             "and a cache (kv_cache, past_key_value, layer_past, ...; or past_key and past_value), or "
                             "that holds one it writes the new keys and values into at their positions; "
                             f"{r.plan.signature} takes none, and a run wrote none")
        r.notes.append(heldcache.note(r.own_cache))


def _empty_cache(r: RunSoFar, ran: Made) -> Made:
    """Code that raised with its cache None where no decode step was asked for (gemma_pytorch's `kv_cache`, unpacked
    and written in place at `kv_write_indices`): handed a cache of no cached positions in each layout real code
    keeps, those with room for the new positions last (cachelayouts.py); the first it runs on is kept, a prefill."""
    from attnscope.usertrace import cachelayouts
    from attnscope.usertrace.load import names_parameter

    inputs, fed, called, convention = ran
    if called.failure is None or r.o.cache or r.plan.cache is None or r.module is None:
        return ran
    failed = called.failure
    if failed.line is not None and names_parameter(r.target.source, failed.line,
                                                   list(cache_parameters(r.plan))) is None:
        return ran  # it raised elsewhere than where it reads its cache
    empty = (inputs.tensors[next(iter(inputs.tensors))].new_zeros(1, 1, 1, 1),) * 2  # the layouts in order
    layouts = ["bhnd", *cachelayouts.others(None, empty, apart=r.plan.cache_values is not None, n_new=1)]
    r.empty_cache = True
    first = r.cache_forms(r.o, ran, layouts)
    if first is None:
        r.empty_cache = False
        return ran
    made, heads = first
    where = f" (line {failed.line}: {failed.message})" if failed.line else ""
    r.notes.append(f"{', '.join(cache_parameters(r.plan))}: your code cannot run with its cache None{where}: it is "
                   f"handed one of no cached positions, {cachelayouts.words(r.cache_layout)}, a prefill (--cache N "
                   f"runs a decode step after N positions){heads}")
    return made


def _one_input(r: RunSoFar, ran: Made) -> Made:
    """Code of `forward(query, key, value)` that refuses three tensors itself, an assert or a raise of its own
    (AudioCraft's `assert query is key` in its self-attention, `assert query.shape[1] == key.shape[1]` where it is
    causal): one tensor handed to all three, the same object, n_K = n_Q, as --q alone hands it; kept where it runs,
    or gets further."""
    inputs, _, called, _ = ran
    asked = _as_one_input(r, inputs)
    if asked is None or called.failure is None or called.failure.op:
        return ran  # ran, or failed in a tensor op (scores transposed, n_Q ≠ n_K): a mistake, never a refusal
    made = attempted(r.attempt, asked)
    if made is None or (made[2].failure is not None and made[2].failure.line == called.failure.line):
        return ran
    if made[2].failure is None:
        failed = called.failure
        where = f"line {failed.line}: " if failed.line else ""
        names = ", ".join(r.plan.tensors)
        r.o = asked
        r.notes.append(f"{names}: your code raised on three tensors ({where}{failed.message}) and runs on one, handed "
                       "to all three (the same tensor: self-attention, as --q alone gives it)")
    return made


def _unread_inputs(r: RunSoFar, ran: Made) -> Made:
    """Code of `forward(query, key, value)` that never read its key and value, its queries, keys and values all from
    the first, as far as it ran (fairseq's MultiheadAttention with self_attention=True; or it raised at a mask
    trace sized by the key's length): the reference reads that one too, handed to all three as one tensor, the same
    object, as --q alone hands it; kept where it runs."""
    from attnscope.usertrace.flow import from_first_only

    inputs, _, called, _ = ran
    asked = _as_one_input(r, inputs)
    if asked is None or (called.failure is not None and not _failed_at_mask(r, called)) \
            or not from_first_only(called.records, list(r.plan.tensors)):
        return ran  # a failure elsewhere (the key's length used for the queries) is the code's to show
    made = attempted(r.attempt, asked)
    if made is None or made[2].failure is not None:
        return ran
    r.o = asked
    r.notes.append(_unread_note(r))
    return made


def _unread_note(r: RunSoFar) -> str:
    """The note for a forward(query, key, value) handed one tensor for all three, as it reads the first alone."""
    first, *rest = r.plan.tensors
    them, every = ("them", "all three") if len(rest) > 1 else ("it", "both")
    return (f"{', '.join(rest)}: your code never reads {them} (its queries, keys and values all come from {first}: "
            f"self-attention); it was handed one tensor for {every}, the same object, as --q alone gives it")


def _as_one_input(r: RunSoFar, inputs: Any, asked: TraceOptions | None = None) -> TraceOptions | None:
    """The options (`asked`, r.o where not given) that hand a module's forward(query, key, value) one tensor for all
    three (or forward(query, key) one for both: FSMT's), n_K = n_Q; None where it takes other than two or three, the
    user gave --q, it has them already, or --nq and --nk differ."""
    o = r.o if asked is None else asked
    if len(r.plan.tensors) not in (2, 3) or o.q or o.one_input or r.module is None \
            or (o.nk is not None and o.nq is not None and o.nk != o.nq):
        return None
    n_Q = inputs.sizes.get("n_K" if o.mask else "n_Q")  # a --mask file's keys: the one tensor's tokens
    return dataclasses.replace(o, one_input=True, nk=o.nk or o.nq or n_Q, nq=o.nq or n_Q)


def _unread_at_mask(r: RunSoFar, called: Any) -> bool:
    """Whether the code raised at a mask trace handed it, sized by the key's length, with its queries, keys and
    values all read from the first tensor (`from_first_only`) as far as it ran."""
    from attnscope.usertrace.flow import from_first_only

    return called.failure is not None and _failed_at_mask(r, called) \
        and from_first_only(called.records, list(r.plan.tensors))


def _failed_at_mask(r: RunSoFar, called: Any) -> bool:
    """Whether the op the code raised at reads a mask parameter trace handed it (sized by the key's length)."""
    from attnscope.usertrace.flow import inputs_of

    masks = {m for m in (r.plan.mask, *r.plan.other_masks) if m}
    if called.failure is None or not masks:
        return False
    reached = inputs_of(called.records, masks)
    for kind, value in called.failure.args or []:
        if kind == "kw":
            kind, value = value[1]
        if (kind == "text" and value in masks) or (kind == "rec" and reached.get(value)):
            return True
    return False


def _with_memory(r: RunSoFar, ran: Made) -> Made:
    """Code that raised with its memory None (Mllama's cross-attention then reads its cache): each parameter
    defaulting to None given a memory in turn, kept where the key and value projections read it."""
    inputs, fed, called, convention = ran
    if called.failure is not None and r.module is not None and r.o.cache == 0 and not r.o.q:
        # code that raised with its memory None (Mllama's cross-attention then reads its cache): each parameter
        # defaulting to None given a memory in turn, kept where the key and value projections read it
        from attnscope.usertrace.roles import uses_memory

        contexts = context_widths(r.weighted, r.shapes)
        for memory, context in ((m, c) for m in r.plan.memories() for c in contexts):  # at each width held (HF
            # Perceiver's `inputs=None` read by key = Linear(kv_dim, ..))
            alone, narrow, r.plan = r.plan, r.shapes, r.plan.with_memory(memory)
            r.shapes = r.shapes if context is None else \
                dataclasses.replace(r.shapes, fixed=r.shapes.fixed | {"d_kv_in": context})
            made = attempted(r.attempt, r.o)
            if made is not None and made[2].failure is None and uses_memory(r.plan, made[2].records):
                r.notes.append(memory_note(memory, str(made[0].sizes["n_K"]), called.failure))
                inputs, fed, called, convention = made
                break
            r.plan, r.shapes = alone, narrow
        for memory in r.plan.memories() if called.failure is not None and r.o.nk is None else ():
            # the memory handed x itself, self-attention (torchtune's `y`, which raises when None)
            alone, r.plan = r.plan, r.plan.with_alias(memory)
            made = attempted(r.attempt, r.o)
            if made is not None and made[2].failure is None:
                r.notes.append(alias_note(memory, r.plan.tensors[0], called.failure))
                inputs, fed, called, convention = made
                break
            r.plan = alone
    return inputs, fed, called, convention


def _position_ids(r: RunSoFar, ran: Made) -> Made:
    """Optional position ids (`position_ids=None`) keep their default, as correct code may make its own from None
    (Qwen2-VL's 3-row mrope ids); where the code raised, it is run again given the new tokens' positions as
    transformers' model passes them, `position_ids = cache_position.unsqueeze(0)` [1, n_Q] (RecurrentGemma's rotary
    reads `position_ids.shape[0]`), kept with a note where it then runs."""
    later = r.plan.position_ids_later
    if not later:
        return ran
    span = f"{r.o.cache}, {r.o.cache} + n_Q" if r.o.cache else "n_Q"
    tried = dataclasses.replace(r.plan, position_ids=[*r.plan.position_ids, *later], position_ids_later=[])
    return _where_raised(r, ran, tried, in_layouts=True, note=lambda where: (
        f"{', '.join(later)}: your code raised with {later[0]} = None ({where}) and runs given the new tokens' "
        f"positions, torch.arange({span})[None], as transformers' model passes them (position_ids = "
        "cache_position.unsqueeze(0))"))


def _masks_at_default(r: RunSoFar, ran: Made) -> Made:
    """Mask parameters defaulting to None that the code raised on where trace handed them its mask (a --mask file of
    the whole pattern given to an argument the code uses for another mask: TimeSformer's `mask`, the padding of its
    regrouped sequences): the code run again with each at its default, the mask the reference's alone, kept with a
    note where it then runs; the first failure where it raises at the default too."""
    import inspect

    plan = r.plan
    given = [m for m in (plan.mask, *plan.other_masks) if m is not None]
    forward = r.module.forward if r.module is not None else r.fn
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return ran
    if ran[0].allowed is None or plan.mask is None \
            or any(m not in parameters or parameters[m].default is not None for m in given):
        return ran
    what, held = (f"the --mask file {Path(r.o.mask).name}", "the file is the reference's mask alone") if r.o.mask \
        else ("trace's mask", "the mask is the reference's alone")
    them, their = ("them", "their") if len(given) > 1 else ("it", "its")
    bare = plan.without_masks()
    tried = dataclasses.replace(bare, masks_at_default=given, said={**bare.said, **dict.fromkeys(given, "")})
    failed = ran[2].failure
    if r.refusal is not None and failed is not None and failed.line == r.refusal[2].line:  # a check of the code's own
        why = f"line {failed.line}: {failed.message}"
        tried = dataclasses.replace(tried, refused=(r.refusal[0], r.refusal[1], why))
    made = _where_raised(r, ran, tried, lambda where: (
        f"{', '.join(m + ' = None' for m in given)}: your code raised with {what} given to {plan.mask} ({where}) "
        f"and runs with {them} at {their} default; {held}, compared with what your code does by itself"))
    if r.plan is tried:  # given again under a convention read later (trace_remask.py)
        r.masked = (plan, r.o, r.notes[-1], f"line {failed.line}: {failed.message}" if failed and failed.line
                    else failed.message if failed else "")
    return made


def _where_raised(r: RunSoFar, ran: Made, tried: Plan, note: Callable[[str], str], in_layouts: bool = False) -> Made:
    """`ran` where the code ran; else the code run again on `tried` (a parameter given otherwise than in `ran`),
    kept with the note `note(where it raised)` where it then runs, the plan as it was and `ran` (its failure
    reported as it is) where it raises again. `in_layouts`: a decode step's cache handed in each layout real code
    keeps too where the run on `tried` raised (RunSoFar.in_layouts: the layout and the parameter are read together,
    a DynamicCache's `update` met only once the position ids are given)."""
    failed = ran[2].failure
    if failed is None:
        return ran
    kept = r.plan
    r.plan = tried
    made = attempted(r.attempt, r.o)
    said = None
    if in_layouts and made is not None and made[2].failure is not None:
        made, said = r.in_layouts(r.o, made)
    if made is None or made[2].failure is not None:
        r.plan = kept
        return ran
    r.notes.append(note(f"line {failed.line}: {failed.message}" if failed.line else failed.message))
    r.notes += [said] if said else []
    return made


def _read_otherwise(r: RunSoFar, ran: Made) -> Made:
    """A parameter read as its use says where it raised on what trace gave it (trace_otherwise.py), each reading
    tried time-first too."""
    return otherwise(r, ran, then=(_time_first,))


def _at_held_batches(r: RunSoFar, ran: Made) -> Made:
    """Code that fails at trace's batch size and holds tensors of its own (a cache set up for a batch: torchtune's
    KVCache [batch, n_kv_head, max_len, d_head] written whole): each size of theirs up to 16 as n_batch, the first it
    runs at, with a note."""
    from attnscope.usertrace import heldcache

    inputs, fed, called, convention = ran
    if called.failure is None or r.module is None or r.o.batch is not None or r.o.q or r.o.cache:
        return ran
    held = heldcache.places(r.module, True)
    for batch in sorted({int(n) for *_, t in held for n in t.shape if 1 <= n <= 16} - {inputs.sizes.get("n_batch")}):
        made = attempted(r.attempt, dataclasses.replace(r.o, batch=batch))
        if made is not None and made[2].failure is None:
            shown = ", ".join(f"{name} {list(t.shape)}" for *_, name, t in held if batch in t.shape)
            r.notes.append(f"n_batch = {batch}: your code failed at {inputs.sizes.get('n_batch')} sequences "
                           f"({called.failure.message}) and ran on {batch}, a size of the tensors it holds ({shown}); "
                           "--batch N sets it")
            return made
    return ran


def _unbatched(r: RunSoFar, ran: Made) -> Made:
    """Code written for one sequence ([n, d]: `Q @ K.T`, `softmax(dim=1)`; picoGPT's module) that fails on
    [n_batch, n, d]: run on [n, d]. A module asked for 2-D inputs (--batch 0) that fails on them and runs batched
    is refused in one line."""
    inputs, fed, called, convention = ran
    if called.failure is not None and r.o.batch == 0 and r.module is not None and not r.o.q \
            and r.o.layout != "col":  # asked for 2-D inputs that the module cannot take, where it takes batched ones
        batched = attempted(r.attempt, dataclasses.replace(r.o, batch=None))
        if batched is not None and batched[2].failure is None:
            raise UsageError(f"--batch 0 (2-D inputs, one sequence): {r.target.name} failed on them "
                             f"({called.failure.message}) and takes [n_batch, n, d_feat]: give --batch N, N >= 1")
    if called.failure is not None and r.weighted is None and r.o.batch is None and not r.o.q:
        return _one_sequence(r, ran)
    return inputs, fed, called, convention


def _module_unbatched(r: RunSoFar, ran: Made) -> Made:
    """A module with weights written for one sequence (picoGPT's: `x @ c_attn_w`, `q @ k.T`), tried on [n, d] after
    every batched reading (time-first's, the joined layouts') failed, never in a decode step."""
    if ran[2].failure is not None and r.weighted is not None and r.o.batch is None and not r.o.q and not r.o.cache:
        return _one_sequence(r, ran)
    return ran


def _one_sequence(r: RunSoFar, ran: Made) -> Made:
    """Code written for one sequence ([n, d]: `Q @ K.T`, `softmax(dim=1)`) that failed on [n_batch, n, d], run on
    [n, d]; as it ran where it fails there too."""
    failed = ran[2].failure
    unbatched = attempted(r.attempt, dataclasses.replace(r.o, batch=0))
    if failed is None or unbatched is None or unbatched[2].failure is not None:
        return ran
    where = f"line {failed.line}: " if failed.line else ""
    r.notes.append(f"your code failed on batched inputs [n_batch, ..] ({where}{failed.message}) and ran on 2-D ones, "
                   "one sequence, as shown; --batch 0 asks for 2-D inputs, --batch N for batched")
    return unbatched


def _in_columns(r: RunSoFar, ran: Made) -> Made:
    """Code of the column convention (one token a column, W @ x, Kᵀ Q, softmax over dim -2) that fails on rows:
    the same code fed [.., d, n], read as that convention."""
    inputs, fed, called, convention = ran
    if called.failure is not None and columns_possible(r.o, r.weighted):
        # code of the column convention (one token a column, W @ x, Kᵀ Q, softmax over dim -2) fails on rows:
        # the same code fed [.., d, n], read as that convention
        row_shapes, found = r.shapes, None
        for width in widths(r.weighted, r.shapes):  # a width the weights leave open (d_feat or d_attn), tried in turn
            r.shapes = with_width(row_shapes, width)
            found = column_form(r.o, r.attempt)
            if found is not None:
                break
        r.shapes = r.shapes if found is not None else row_shapes
        if found is not None:
            failed = called.failure
            r.o, (inputs, fed, called, convention) = found
            r.spec = dataclasses.replace(r.spec, layout="col")
            r.notes.append(_column_note(failed, r.o, r.weighted is not None, called.records))
    return inputs, fed, called, convention


def _weights_turned(r: RunSoFar, ran: Made) -> Made:
    """A function's weights of n_head·d_head ≠ d_feat, given as x @ W reads them: turned for F.linear(x, W)."""
    from attnscope.usertrace import weightargs
    from attnscope.usertrace.inputs import ShapePlan

    inputs, fed, called, convention = ran
    if called.failure is not None and r.target.kind == "function" and r.weighted is not None \
            and not weightargs.square(r.weighted):
        # a function's weights of n_head·d_head ≠ d_feat, given as x @ W reads them: turned for F.linear(x, W)
        weightargs.transpose(r.weighted)
        kept = r.shapes
        # x's width as it was
        r.shapes = with_width(ShapePlan.make(r.o, r.weighted, r.init), r.shapes.fixed.get("d_feat"))
        made = attempted(r.attempt, r.o)
        if made is not None and made[2].failure is None:
            inputs, fed, called, convention = made
            r.notes[r.notes.index(weights_note(r.weighted, turned=True))] = weights_note(r.weighted)
        else:
            weightargs.transpose(r.weighted)
            r.shapes = kept
    return inputs, fed, called, convention


def _at_held_widths(r: RunSoFar, ran: Made) -> Made:
    """Code that fails on the widths chosen: each (d_feat, context width) pair its weights hold, the first
    it runs on."""
    inputs, fed, called, convention = ran
    if called.failure is not None and r.weighted is not None and not r.o.q and (
            "d_kv_in" not in r.shapes.fixed or r.plan.self_attention):  # one input beside a context width: the keys'?
        # widths the weights hold but did not say: nn.Parameter weights whose d_feat is not their most common size
        # (W_q [d_feat, n_head·d_head]), K and V reading a context of another width (diffusers'
        # cross_attention_dim, nn.MultiheadAttention's kdim/vdim): each pair the weights hold, the first the code
        # runs on
        memory = r.plan.memory() is not None or not r.plan.self_attention
        for width, context in held_widths(r.weighted, r.shapes, memory):
            held = r.shapes, r.plan
            r.shapes = with_width(r.shapes, width)
            if context is not None:
                r.shapes = dataclasses.replace(r.shapes, fixed=r.shapes.fixed | {"d_kv_in": context})
                r.plan = r.shapes.fed(r.plan)
            made = attempted(r.attempt, r.o)
            if made is not None and made[2].failure is None:
                inputs, fed, called, convention = made
                break
            r.shapes, r.plan = held
    return inputs, fed, called, convention


def _at_sliced_widths(r: RunSoFar, ran: Made) -> Made:
    """Code that fails on every other reading, whose weights each read one head's slice (no weight reads d_feat):
    d_feat n_head times each width they hold, d_head that width, the first it runs on."""
    inputs, fed, called, convention = ran
    n_head = r.shapes.n_head
    if called.failure is None or r.weighted is None or r.o.q or r.o.d_feat is not None or not n_head or n_head < 2:
        return ran
    for width in sliced_widths(r.weighted):
        held = r.shapes
        r.shapes = dataclasses.replace(r.shapes, fixed=r.shapes.fixed | {"d_feat": n_head * width, "d_head": width})
        made = attempted(r.attempt, r.o)
        if made is not None and made[2].failure is None:
            return made
        r.shapes = held
    return ran


def _time_first(r: RunSoFar, ran: Made) -> Made:
    """Code written for time-first inputs that fails on [n_batch, n, d]: the same inputs fed [n, n_batch, d],
    read as that convention (its cache too, in turn)."""
    from attnscope.usertrace import timefirst

    inputs, fed, called, convention = ran
    if called.failure is not None and timefirst.possible(r.o, inputs):
        # code written for time-first inputs (fairseq's, nn.MultiheadAttention's batch_first=False) fails on
        # [n_batch, n, d]: the same inputs fed [n, n_batch, d], read as that convention (its cache too, in turn)
        for time_o in timefirst.asked(r.o, inputs):
            made = attempted(r.attempt, time_o)
            one = _as_one_input(r, inputs, time_o) if made is not None and _unread_at_mask(r, made[2]) else None
            if one is not None:  # the readings met: a mask sized by the key it never reads, on time-first inputs
                tried = attempted(r.attempt, one)
                time_o, made = (one, tried) if tried is not None and tried[2].failure is None else (time_o, made)
            merged = timefirst.viewed_width(made[2].failure, made[0].sizes, r.o) if made is not None else None
            if merged is not None:  # heads merged into a width of the code's own (Megatron's [sq, b, hp]): hp / np
                time_o = dataclasses.replace(time_o, dk=merged[0], dv=merged[0])
                made = attempted(r.attempt, time_o)
                r.notes += [merged[1]] if made is not None and made[2].failure is None else []
            made, said = r.in_layouts(time_o, made) if made is not None else (None, None)
            if made is not None and made[2].failure is None:
                failed = called.failure
                r.o, (inputs, fed, called, convention) = time_o, made
                r.notes += [timefirst.note(failed, r.weighted is not None, r.o.layout)] + ([said] if said else []) \
                    + ([_unread_note(r)] if r.o.one_input and one is not None else [])
                break
    return inputs, fed, called, convention


def _as_image(r: RunSoFar, ran: Made) -> Made:
    """A module that takes its one input as an image, `[n_batch, n_h, n_w, d_feat]` (SAM's image encoder: `B, H, W, _
    = x.shape`; ViTDet's), that raised on `[n_batch, n, d_feat]` before any op of its own (or unpacking four sizes
    from three): the same tokens handed so, n_h·n_w of them in raster order, the reference's n_Q. A module that
    projects with pointwise Conv2d layers takes a feature map, `[n_batch, d_feat, n_h, n_w]` (latent-diffusion's
    AttnBlock): the column form's tokens handed so, tried first."""
    from attnscope.usertrace import pointwise

    inputs, fed, called, convention = ran
    failed = called.failure
    if failed is None or r.weighted is None or not r.plan.self_attention or len(r.plan.tensors) != 1 or r.o.q \
            or r.o.layout not in ("row", "col") or r.o.cache or r.o.grid is not None or r.o.batch == 0:
        return ran
    maps = pointwise.on_maps(r.weighted)
    if called.records and "expected 4" not in failed.message and not maps:
        return ran
    tries = [dataclasses.replace(r.o, layout="col", grid=(0, 0))] if maps and (
        r.o.layout == "col" or columns_possible(r.o, r.weighted)) else []
    tries += [dataclasses.replace(r.o, grid=(0, 0))] if r.o.layout == "row" else []
    if not maps and r.o.layout == "row" and columns_possible(r.o, None):
        # a map, channels first, that the code lays as rows itself for its nn.Linear layers (diffusers' early
        # AttentionBlock: a GroupNorm over [B, C, H, W], then `.view(B, C, H·W).transpose(1, 2)`)
        tries.append(dataclasses.replace(r.o, layout="col", grid=(0, 0)))
    for asked in tries:
        made = attempted(r.attempt, asked)
        if made is None or made[2].failure is not None or made[0].grid is None:
            continue
        if asked.layout != r.o.layout:  # the column form, read as _in_columns reads it
            r.spec = dataclasses.replace(r.spec, layout="col")
            r.notes.append(_column_note(failed, asked, True, made[2].records, maps))
        r.o = dataclasses.replace(asked, grid=made[0].grid)  # the image it ran on, kept for every later run
        r.notes.append(image_note(made[0].grid, failed, asked.layout == "col", maps))
        return made
    return ran


def image_note(grid: tuple[int, int], failed: Failure | None = None, columns: bool = False,
               convs: bool = True) -> str:
    """The note for a module read as taking its input as an image (`columns`: a feature map, channels first; `convs`:
    its projections pointwise Conv2d layers)."""
    where = f" (line {failed.line}: {failed.message}, on [n_batch, n, d_feat])" if failed is not None and failed.line \
        and not columns else ""
    if columns:
        how = " (its projections pointwise Conv2d layers)" if convs else ""
        return (f"your module takes its input as a feature map, [n_batch, d_feat, n_h, n_w] = [.., .., {grid[0]}, "
                f"{grid[1]}]{how}: it is handed one, its n_h·n_w positions in raster order the reference's n_Q = "
                f"{grid[0] * grid[1]} tokens; a convention, not a mistake")
    return (f"your module takes its input as an image, [n_batch, n_h, n_w, d_feat] = [.., {grid[0]}, {grid[1]}, ..]"
            f"{where}: it is handed one, its n_h·n_w tokens in raster order the reference's n_Q = {grid[0] * grid[1]} "
            "(a --q file [n_batch, n_h, n_w, d_feat] says the same); a convention, not a mistake")


def _joined_layout(r: RunSoFar, ran: Made) -> Made:
    """A run on a cache layout whose own join says another of that shape: run again on that one."""
    from attnscope.usertrace import cachelayouts

    inputs, fed, called, convention = ran
    joined = cachelayouts.read(called.records, r.plan.cache, r.cache_layout, inputs.cache) \
        if called.failure is None and inputs.cache is not None and r.plan.cache is not None else None
    if joined is not None:  # it ran on this layout, and its own join says another of that shape
        held_layout, r.cache_layout = r.cache_layout, joined[0]
        made = attempted(r.attempt, r.o)
        if made is not None and made[2].failure is None:
            inputs, fed, called, convention = made
            r.notes.append(joined[1])
        else:
            r.cache_layout = held_layout
    return inputs, fed, called, convention


def _cache_notes(r: RunSoFar, ran: Made) -> None:
    """The notes of a decode step's cache: MLA's latents, the parameters it was handed in."""
    from attnscope.usertrace import cachelayouts, latentcache

    inputs, fed, called, convention = ran
    if r.latent_maker is not None and called.failure is None:
        r.notes.append(latentcache.note(", ".join(cache_parameters(r.plan)) if r.plan.cache else r.own_cache.names()
                                      if r.own_cache is not None else "cache"))
    if inputs.cache is not None and r.plan.cache is not None:  # two parameters, or a dict's keys (cacheforms.py)
        from attnscope.usertrace.cacheforms import note as form_note
        from attnscope.usertrace.keyedcache import Keyed
        from attnscope.usertrace.keyedcache import words as keyed_words

        given = fed.values.get(r.plan.cache)
        if isinstance(given, Keyed):  # a dict read by keys of its own (keyedcache.py: XLM's "slen", layer_id)
            r.notes.append(keyed_words(r.plan.cache, given))
            return
        said = form_note(cache_parameters(r.plan), list(getattr(given, "asked", [])),
                         "" if r.cache_layout != "bhnd" else cachelayouts.words(r.cache_layout))  # else noted
        r.notes += [said] if said else []


class HeadsForCache(Exception):
    """A decode step asked of code whose head count only its run says: the cache, [.., n_kv_head, n_cache, d_head],
    cannot be drawn before a run has read it."""

    def __init__(self, name: str, batches: tuple[int | None, ...] = ()) -> None:
        super().__init__(name)
        self.name = name
        self.batches = batches  # the batch sizes a cache the module holds may take (None: trace's own), in turn


def columns_possible(o: TraceOptions, module: Any) -> bool:
    """Whether code that failed on rows may be tried in the column form: rows were not asked for by files (their
    shapes decide), no option that works only in the row layout was given, and the module (if any) projects with
    no nn.Linear, which reads rows."""
    return o.layout == "row" and not o.q and not reads_rows(module) and not (
        o.rope or o.kv_heads or o.alibi or o.position_bias or o.qk_norm or o.scale is not None or o.cache)


def column_form(o: TraceOptions, attempt: Any) -> tuple[TraceOptions, tuple[Any, ...]] | None:
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


def _column_note(failed: Failure, o: TraceOptions, weighted: bool, records: list[Any], w_x: bool = True) -> str:
    """The note for code read as the column convention; its scores as `records`, the run on columns, computes them
    (scoreform.said); `w_x`: its weights project as `W @ x` (not code that lays the columns as rows itself for its
    nn.Linear layers)."""
    from attnscope.usertrace import scoreform

    where = f"line {failed.line}: " if failed.line else ""
    shape = ("[n_batch, d_feat, n]" if weighted else "[n_batch, d, n]") if o.batch != 0 else (
        "[d_feat, n]" if weighted else "[d, n]")
    said = f"{'W @ x, ' if weighted and w_x else ''}{scoreform.said(records)}"
    return (f"your code failed on rows [.., n, d] ({where}{failed.message}) and runs on columns {shape}, one token a "
            f"column: read as the column convention ({said}), a convention, not a mistake; the reference is the row "
            "form's on your inputs transposed, its steps transposed back"
            + (" (--layout col says it)" if w_x else " (your nn.Linear layers read the rows your code lays out)"))
