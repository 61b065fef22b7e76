"""The user's code called with its mask: True = may attend first, then as its ops read a mask (masked_fill, added
to the scores, another shape, key padding, the rule beside it, a mask it makes itself, its own words), each found by
experiment. runs/trace_attempt.py calls `masked_call` for every run of the code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.runs.trace_options import TraceOptions
    from attnscope.usertrace.call import Called
    from attnscope.usertrace.feeds import Feeds
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.masking import Convention
    from attnscope.usertrace.record import Failure, Record


def masked_call(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any,
          fed: Feeds) -> tuple[Called, Convention | None]:
    """Call the user's code with the mask True = may attend; when its ops show that it reads the mask another
    way (masked_fill(mask, ...), scores + mask, ...), call it again with the mask written that way."""
    import torch

    from attnscope import masks
    from attnscope.usertrace import lengths, maskaxes, masking, maskwant
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
        inputs.notes.append(_turned_note(plan.mask))
    failure = called.failure
    # the layout of the scores the mask meets where the code raised on it: the mask is tried laid out so first
    met = _met(failure, plan.mask, list(first.shape))
    # ... or where it put axes of its own on the mask first (Transformer-XL's `attn_mask[:, :, :, None]`)
    own_axes = maskaxes.met(failure, called.records, plan.mask, list(first.shape)) if met is None else None
    if failure is not None and _on_mask(failure, called.records, plan.mask) and inputs.allowed.dim() < 4 \
            and not o.mask:
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
            r for r in sliced if r[2].failure is not None and not _on_mask(r[2].failure, r[2].records, plan.mask)]
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
        convention = masking.Convention(given, convention.line, convention.how, unread=convention.unread)
    else:
        torch.manual_seed(o.seed)  # the same dropout draws as the first call
        mask = masking.written(inputs.allowed, convention.kind, dtype, convention.line)
        raised = called.failure is not None
        called = call(target, fn, plan, inputs, module, o.max_memory, mask, fed)
        if raised and convention.kind == "float01" and called.failure is None:
            # read from the op a boolean raised in (`1 - mask`): the run on numbers says what the code does with
            # them; `scores * (1 - mask)` keeps where the mask is 0 (masking.detect: 1 = masked out)
            again = masking.detect(called.records, None, plan.mask)
            if again.kind == "float10":
                convention = again
                torch.manual_seed(o.seed)
                mask = masking.written(inputs.allowed, convention.kind, dtype, convention.line)
                called = call(target, fn, plan, inputs, module, o.max_memory, mask, fed)
        turned = _scores_turned(called, inputs, module) if o.layout == "col" and turned is None else None
        if turned is not None:  # as above, where the code ran only on the mask written as it reads it (1 - mask)
            inputs.allowed = turned
            torch.manual_seed(o.seed)
            called = call(target, fn, plan, inputs, module, o.max_memory,
                          masking.written(turned, convention.kind, dtype, convention.line), fed)
            inputs.notes.append(_turned_note(plan.mask))
    called, convention = _finite_reading(o, (target, fn, plan, inputs, module, fed), called, convention, dtype)
    grade = _grade(called, inputs, plan.mask) if called.failure is None else 0
    if (called.failure is not None or grade) and inputs.allowed.dtype == torch.bool:
        # code that takes its mask in another shape (key padding [n_batch, n_K], diffusers' [n_batch, 1, n_K], ...):
        # the first shape it runs on, by experiment, as a boolean or a float to add (diffusers' baddbmm). Code that
        # indexes the mask itself (`padding_mask[:, None, None, :]`) runs on any shape, a wrong one broadcast into
        # more axes than out has: the first shape whose output has out's axes and is finite (else out's axes alone)
        why = _misfit(called, inputs, plan.mask) if grade else None
        chosen: tuple[Any, str, Any, Called, str] | None = None
        past: tuple[Any, Called] | None = None  # the first shape the code raises on further along, not on its mask
        laid = maskwant.laid(inputs.allowed, failure, met, target.source, first, inputs.sizes, o.layout == "col") \
            if not own_axes else maskaxes.laid(inputs.allowed, own_axes, inputs.sizes, o.layout == "col")
        # the other shapes, from the mask as rows [.., n_Q, n_K] where the column form's scores may be Q Kᵀ all the
        # same (VITS: Conv1d projections [n_batch, d, n], heads turned to [.., n, d_head] before the scores): where
        # n_Q ≠ n_K, so that the shapes alone say which the code runs on (square scores: _scores_turned reads them)
        # key padding is read from the mask as rows whatever the scores' orientation: its keys are the rows' last axis
        sizes, col = inputs.sizes, o.layout == "col"
        as_rows = inputs.allowed.transpose(-1, -2) if col else inputs.allowed
        rows = as_rows if sizes.get("n_Q") != sizes.get("n_K") else inputs.allowed
        filed = inputs.mask.transpose(-1, -2) if col and inputs.mask is not None and inputs.mask.dim() >= 2 \
            else inputs.mask
        for form, words, padded in [*([laid] if laid is not None else []),
                                    *masking.forms(rows, inputs.sizes.get("n_batch", 1), filed,
                                                  inputs.sizes.get("n_Q"),
                                                  inputs.sizes.get("n_head") if plan.heads_folded else None,
                                                  as_rows if rows is not as_rows else None)]:
            ran: Called | None = None
            for kind in dict.fromkeys((convention.kind, "additive")):
                torch.manual_seed(o.seed)
                ran = call(target, fn, plan, inputs, module, o.max_memory, masking.written(form, kind, dtype), fed)
                if ran.failure is None:
                    break
            if ran is not None and past is None and _raised_past(ran, called, plan.mask):
                past = form, ran
            if ran is None or ran.failure is not None:
                continue
            better = _grade(ran, inputs, plan.mask) if grade else 0
            if better < grade or not grade:
                chosen, grade = (form, words, padded, ran, kind), better
            if not grade:
                break
        if chosen is None and past is not None:
            # no shape the code runs on, but one it gets past its mask with (Conditional DETR's `bsz, src_len =
            # mask.size()` before a second parameter it raises on): that failure is the one the readings of the
            # other parameters take up (trace_otherwise.py), each run trying the mask's shapes again
            inputs.allowed, called = past
        if chosen is not None:
            chosen = maskwant.in_fold_order(chosen, functools.partial(_with_tensors, o, (target, fn, plan, inputs,
                                                                                          module, fed)),
                                            inputs.tensors, inputs.sizes.get("n_batch", 1))
            form, words, padded, called, kind = chosen
            inputs.allowed = form
            keys_only = "key padding" in words
            if padded is not None:  # the key trace padded, padded in the reference's mask too: [n_batch, 1, 1, n_K]
                inputs.mask = masks.combine(inputs.mask, padded[:, None, :, None] if col else padded[:, None, None, :])
            axes = "n_K, n_Q" if o.layout == "col" else "n_Q, n_K"
            inputs.notes.append(f"{plan.mask}: your code raised on a [.., {axes}] mask and runs on one shaped {words}, "
                                "which it was given" if why is None else
                                f"{plan.mask}: on a mask shaped {list(first.shape)}, {why}; on one shaped {words}, "
                                "which it was given, your code's output has out's axes")
            read = masking.detect(called.records, None, plan.mask)
            agreed = masking.agreed(read, kind, convention)
            if agreed is not None:
                convention = agreed
            else:
                convention = read
                torch.manual_seed(o.seed)
                called = call(target, fn, plan, inputs, module, o.max_memory,
                              masking.written(form, read.kind, dtype, read.line), fed)
            # the form read again in the shape the code runs on (T5's `(1 - bias) * finfo.min` over [n_batch, n_K])
            called, convention = _finite_reading(o, (target, fn, plan, inputs, module, fed), called, convention,
                                                 dtype)
    apart = (o.mask and o.causal and plan.causal_mask() not in (None, plan.mask)) or plan.rule_beside
    if plan.switched is not None:  # the rule is the code's own switch's (causalflag.py): the mask is the file alone
        return _as_stated(o, target, fn, plan, inputs, module, fed, called, convention)
    if (keys_only or apart) and plan.other_masks and (o.causal or o.window) and called.failure is None:
        # the mask parameter takes key padding only (nn.MultiheadAttention's key_padding_mask), or the --mask file
        # beside a parameter named for the causal rule (CLIP's causal_attention_mask): the causal or window rule
        # goes to another one (its attn_mask [n_Q, n_K]), in the convention that one reads
        called, plan, fed = _rule_beside(o, target, fn, plan, inputs, module, fed, called, convention)
    if not keys_only:  # key padding holds no causal or window rule that could hide the code's own
        called, convention = _own_mask(o, target, fn, plan, inputs, module, fed, called, convention)
        called, plan, fed = _padding_beside(o, target, fn, plan, inputs, module, fed, called)
    # the mask parameter's words read with the other one's mask kept beside it (the plan and feeds it ran with)
    called, convention = _as_stated(o, target, fn, plan, inputs, module, fed, called, convention)
    return _alibi_merged(o, (target, fn, plan, inputs, module, fed), called, convention)


def _alibi_merged(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds], called: Called,
                  convention: Convention) -> tuple[Called, Convention]:
    """Under --alibi, code with no ALiBi parameter of its own that adds its mask to its scores, and builds no
    position bias itself: the mask handed with ALiBi's bias merged into it (alibimask.py), as Baichuan's model hands
    it, with a note. Else the run as it was."""
    from attnscope.usertrace import alibimask

    target, fn, plan, inputs, module, fed = run
    given = called.mask_given
    if not o.alibi or plan.alibi is not None or plan.bias is not None or plan.mask is None or given is None \
            or called.failure is not None:
        return called, convention
    found = alibimask.merged(called.records, plan.mask, given, convention.kind, inputs.sizes,
                             functools.partial(_with_tensors, o, run, inputs.tensors))
    if found is None:
        return called, convention
    again = _with_tensors(o, run, inputs.tensors, found[0])
    if again.failure is not None:
        return called, convention
    convention = convention if convention.kind in alibimask.ADDITIVE else dataclasses.replace(convention,
                                                                                              kind="additive")
    inputs.notes.append(alibimask.note(plan.mask, found[1], convention.line))
    fed.steps.append(("alibi", found[0], found[1], f"input: ALiBi's bias (--alibi) merged into {plan.mask} (see the "
                                                   "note)"))
    return again, convention


def _with_tensors(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds], tensors: dict[str, Any],
                  mask: Any) -> Called:
    """The code called on `tensors` in place of its inputs' and `mask`, from the same seed."""
    import torch

    from attnscope.usertrace.call import call

    target, fn, plan, inputs, module, fed = run
    torch.manual_seed(o.seed)
    return call(target, fn, plan, dataclasses.replace(inputs, tensors=tensors), module, o.max_memory, mask, fed)


# a boolean mask, or one of 0/1 numbers, given the other way round
OTHER_WAY = {"attend": "masked", "masked": "attend", "float01": "float10", "float10": "float01"}
POLARITY = {"attend": "attend", "masked": "masked", "float01": "attend", "float10": "masked"}  # what 1 (True) means


def _finite_reading(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds], called: Called,
                    convention: Convention, dtype: Any) -> tuple[Called, Convention]:
    """Where the boolean mask, written as the code's ops were read, leaves a query a key and the code's output is still
    not finite there, or that query of its pattern saw no key (a polarity the data flow hid from trace: an inversion on
    the way that its reading does not follow), or its pattern keeps weight on a key the mask forbids while the zeros it
    has fall on keys the mask allows (`scores + mask * -1e9`, the TensorFlow tutorial's 1 = masked, read as a bias built
    from 1 = may attend), the other reading of the mask, kept where the run then looks fed well (fed_well) and, in the
    last case, its pattern holds the mask (masking.holds), with a note: that run came from trace's feed failing, not
    from the code. Else the run as it was. A query the mask leaves no key is read in none of these (maskrows.keyless):
    what the code makes of it is its convention (NaN under -inf, uniform under finfo.min)."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.call import call
    from attnscope.usertrace.maskrows import keyless

    target, fn, plan, inputs, module, fed = run
    allowed = inputs.allowed
    other = OTHER_WAY.get(convention.kind)
    if called.failure is not None or allowed is None or allowed.dtype != torch.bool:
        return called, convention
    rows = keyless(allowed, inputs.sizes)  # queries left no key: their rows are the code's convention, not read
    if rows is None and not bool(allowed.any(-1).all()):  # some are, and where they lie cannot be read
        return called, convention
    if other is None:  # a bias to add (0 / -inf, finfo.min) or subtract: the code's other forms
        return _other_form(o, run, called, convention, dtype, rows)
    starved = not fed_well(called, rows)
    if not starved and masking.holds(called.records, allowed, inputs.sizes) is not False:
        return called, convention
    torch.manual_seed(o.seed)
    again = call(target, fn, plan, inputs, module, o.max_memory, masking.written(allowed, other, dtype), fed)
    if again.failure is not None or not fed_well(again, rows) or (
            not starved and not masking.holds(again.records, allowed, inputs.sizes)):
        return called, convention
    why = ("left a query no key (or its output not finite) although the mask leaves it a key" if starved
           else "kept weight on keys the mask forbids and gave none to keys it allows")
    inputs.notes.append(f"{plan.mask}: given {masking.WORDS[convention.kind]} as your code's ops were read, your "
                        f"code {why}; given the other way round, it does not, and is read so")
    how = "the bias it builds from the mask" if convention.how == "converted" else convention.how or "its ops"
    return again, masking.Convention(other, convention.line, f"{how}, read the other way round")


def _other_form(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds], called: Called,
                convention: Convention, dtype: Any, rows: Any = None) -> tuple[Called, Convention]:
    """Where the mask, given as the bias the code's ops were read to add, leaves every query a key and the code's
    output is not finite or a query saw no key (HF Pix2Struct's `1 - mask` position bias, filled with finfo.min where
    it is 1: 0 / -inf turns every kept key masked and the padded ones +inf), or the scores it softmaxes mask every key
    of a query (maskforms.drowned: T5's `(1 - bias) * finfo.min`), the mask in the code's other forms
    (maskforms.FORMS: 0/1 numbers, a boolean, another bias), the first whose run is fed well and whose pattern keeps
    to the mask (maskforms.keeps_to), with a note. Else the run as it was. `rows`: the queries the mask leaves no key
    (maskrows.keyless), read in none of these."""
    import torch

    from attnscope.usertrace import maskforms, masking
    from attnscope.usertrace.call import call

    target, fn, plan, inputs, module, fed = run
    allowed = inputs.allowed
    if allowed is None or plan.mask is None or (
            fed_well(called, rows) and not maskforms.drowned(called.records, plan.mask, rows=rows)):
        return called, convention
    for kind in maskforms.FORMS:
        if kind == convention.kind:
            continue
        torch.manual_seed(o.seed)
        again = call(target, fn, plan, inputs, module, o.max_memory, masking.written(allowed, kind, dtype), fed)
        if again.failure is not None or not fed_well(again, rows) or maskforms.drowned(again.records, plan.mask,
                                                                                    rows=rows) \
                or not maskforms.keeps_to(again.records, allowed, inputs.sizes):
            continue
        inputs.notes.append(f"{plan.mask}: given {masking.WORDS[convention.kind]} as your code's ops were read, "
                            "your code left a query no key (or its output not finite) although the mask leaves it "
                            f"a key; given {masking.WORDS[kind]}, it does not, and is read so")
        how = "its use of the mask, found by experiment"
        return again, masking.Convention(kind, convention.line, how)
    return called, convention


def fed_well(called: Called, rows: Any = None) -> bool:
    """Whether a run given a mask looks so on every query the mask leaves a key: no floating tensor the code returned
    holds NaN or +inf, and no query of its pattern saw no key (masking.starved). Else the mask was given the wrong way
    round for the code, and nothing is read off the run. -inf is allowed: masked scores the code returns beside its
    output hold it where the mask is (OpenAI whisper's `qkv_attention` returns `qk` after `qk + mask`). `rows`
    [n_batch, n_Q]: the queries the mask leaves no key (maskrows.keyless), not read: what the code makes of them is
    its convention (NaN under -inf, a uniform row under finfo.min)."""
    from attnscope.usertrace import masking
    from attnscope.usertrace.maskranks import returned
    from attnscope.usertrace.maskrows import finite

    return all(finite(t, rows) for t in returned(called.result)) and masking.starved(called.records, rows) is None


def _as_stated(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
               called: Called, convention: Convention) -> tuple[Called, Convention]:
    """Where the code's own words give its boolean mask the polarity its ops do not (statedmask.py: "True =
    masked" over a `masked_fill(~mask, ..)`), the mask as the words say, so that the run shows what the code does
    with it; else the run as it was."""
    import torch

    from attnscope.usertrace import masking, statedmask
    from attnscope.usertrace.call import call

    allowed = inputs.allowed
    reads = POLARITY.get(convention.kind)  # 0/1 numbers as the boolean of their polarity: 1 = may attend, or masked
    if called.failure is not None or reads is None or allowed is None \
            or allowed.dtype != torch.bool or bool(allowed.all()) or plan.mask is None \
            or (inputs.also_masked and not o.mask):  # the rule's parameter, trace's padding beside it (its own words)
        return called, convention
    traced = tuple(c.__name__ for c in type(module).__mro__) if module is not None else (target.name.split(".")[-1],)
    said = statedmask.read(target.source, convention.line, plan.mask, tuple(plan.other_masks), traced,
                           masking.flow(called.records, plan.mask), reads)
    if said is None and convention.kind in ("attend", "masked"):
        return _as_defaulted(o, (target, fn, plan, inputs, module, fed), called, convention)
    if said is None or said.kind == reads:
        return called, convention
    kind = said.kind if reads == convention.kind else OTHER_WAY[convention.kind]
    torch.manual_seed(o.seed)
    dtype = next(iter(inputs.tensors.values())).dtype
    again = call(target, fn, plan, inputs, module, o.max_memory, masking.written(allowed, kind, dtype), fed)
    if again.failure is not None:
        return called, convention
    words = said.words if len(said.words) <= 60 else said.words[:57] + "..."
    turned = ", said of it turned round on its way there" if said.turned else ""
    return again, dataclasses.replace(convention, kind=kind, stated=f'line {said.line}: "{words}"{turned}')


def _as_defaulted(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds], called: Called,
                  convention: Convention) -> tuple[Called, Convention]:
    """Where the module's own default for its mask (`inputs.new_ones(batch, T)` when given none) would mask every
    key under the polarity its ops read (defaultmask.py), the mask given the other way round, so that the run shows
    what the code does with it; else the run as it was."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.call import call
    from attnscope.usertrace.defaultmask import default_masks_all

    target, fn, plan, inputs, module, fed = run
    torch.manual_seed(o.seed)
    bare = call(target, fn, plan, inputs, module, o.max_memory, None, fed, quiet=True)
    made = default_masks_all(bare.records, convention.line, convention.kind) if bare.failure is None else None
    if made is None or inputs.allowed is None:
        return called, convention
    kind = OTHER_WAY[convention.kind]
    torch.manual_seed(o.seed)
    dtype = next(iter(inputs.tensors.values())).dtype
    again = call(target, fn, plan, inputs, module, o.max_memory, masking.written(inputs.allowed, kind, dtype), fed)
    if again.failure is not None:
        return called, convention
    op = made.details.get("op", made.call)
    return again, dataclasses.replace(convention, kind=kind, defaulted=f"line {made.line}: {op}")


def not_weights(tried: Plan, ran: tuple[Inputs, Feeds, Called, Convention | None],
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
    if "head" not in tried.mask.lower() and ("causal" in tried.mask.lower() or masking.tested(called.records,
                                                                                              tried.mask)):
        return tried, ran  # a mask by its name or its use (`causal_attention_mask == 0`): the weights it multiplies
        # after the softmax are mask.after_softmax, no head_mask's weights
    said = (f"{tried.mask}: your code multiplies its attention weights by it after the softmax (line {line}), a "
            f"weight per head and no mask, so it was given None (--forward \"{tried.mask}=...\" gives it a value)")
    return dataclasses.replace(other, said={**other.said, tried.mask: said}), again


def _scores_turned(called: Called, inputs: Inputs, module: Any) -> Any:
    """The mask (True = may attend) the column form hands as `[.., n_K, n_Q]`, turned to `[.., n_Q, n_K]`, where the
    code's scores are square and hold the keys' axis last (`Qᵀ K`), as the data flow of the product that makes them
    says (scoreaxes.py: which input, or which projection's weight, each operand comes from), else where the queries
    and the keys come from one projection the roles the line-up reads (scoreform: the operand whose tokens the
    product with the values contracts is the keys', so a fused 1x1 Conv1d cut in three is read as well as three
    projections; only there, since a plant that meets the values with the pattern transposed misleads it); None where
    the scores hold the keys first, neither says, or turning changes nothing."""
    from attnscope.usertrace import scoreaxes, scoreform
    from attnscope.usertrace.cutnames import one_layer
    from attnscope.usertrace.reference import find_projections
    from attnscope.usertrace.refruns import given_roles, projected_roles

    allowed = inputs.allowed
    if called.failure is not None or allowed is None or allowed.dim() < 2 \
            or 1 not in allowed.shape[-2:] and allowed.shape[-1] != allowed.shape[-2] \
            or bool((allowed == allowed.transpose(-1, -2)).all()):
        return None
    roles = given_roles(inputs)
    if module is not None:
        try:
            read = find_projections(module, called.records, inputs.sizes.get("n_head"), inputs.sizes.get("d_head"))
        except UsageError:
            read = []
        roles = projected_roles(read[0], inputs) if read else roles
    query, key = (set(r) for r in roles)
    if not query or not key or one_layer(query, key):
        # q and k cut from one fused projection (`qkv[0:32]`, `qkv[32:64]`), which the data flow cannot tell apart:
        laid = scoreform.written(called.records)  # the roles the line-up reads
        return allowed.transpose(-1, -2) if laid is not None and laid[1].endswith("n_K]") else None
    keys_last = scoreaxes.keys_last(scoreaxes.key_axes(called.records, query, key))
    return allowed.transpose(-1, -2) if keys_last else None


def _raised_past(ran: Called, first: Called, label: str) -> bool:
    """Whether `ran` raised elsewhere than `first` did, and not on the mask `label`: past the mask, on another line."""
    failed, before = ran.failure, first.failure
    return failed is not None and before is not None and failed.line != before.line \
        and not _on_mask(failed, ran.records, label)


def _on_mask(failure: Failure | None, records: list[Record], label: str) -> bool:
    """Whether the code raised on its mask: in an op that names the mask parameter `label`, or one that reads what
    the code cut out of it (CTRL's `scores += mask[ns - nd:ns, :ns] * -1e4`, GPT-2's causal square sliced by the
    past and new tokens: the op names the scores alone)."""
    from attnscope.usertrace.paramuse import derived

    if failure is None:
        return False
    if label in failure.op:
        return True
    made = derived(records, label)
    cut = any(r.index in made and r.func == "__getitem__" for r in records)
    return cut and any(kind == "rec" and value in made for kind, value in failure.args)


def _turned_note(name: str) -> str:
    return (f"{name}: given [.., n_Q, n_K], as your scores are laid out (the queries' axis first, read from the "
            "product that makes them), not the column form's [.., n_K, n_Q]")


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
    scores) and makes it larger or gives it more axes: the mask broadcast into axes the scores do not have; None
    where it never does."""
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
        # larger, or of more axes (a mask of one sequence [1, n_Q, n_K] indexed as key padding, `[:, None, None, :]`,
        # puts an axis of 1 before the scores' own)
        if others and (r.tensor.numel() > max(t.numel() for t in others) or r.tensor.dim() > max(
                t.dim() for t in others)) and r.tensor.dim() >= max(t.dim() for t in others):
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
                 called: Called, convention: Convention) -> tuple[Called, Plan, Feeds]:
    """The code called again with the causal or window rule, `[n_Q, n_K]`, given to the first other mask parameter
    it runs with, beside the key padding `plan.mask` takes (the reference's mask holds both), with the plan and
    feeds it ran with; `called` (and those given) where none runs, or where the code masks by itself (lucidrains'
    chunked attention, causal=True): the rule given too would hide the code's own."""

    from attnscope import masks
    from attnscope.spec import AttentionSpec
    from attnscope.usertrace import masking

    own = _masks_alone(o, (target, fn, plan, inputs, module, fed), called, convention)
    if own is not None:
        inputs.notes.append(f"your code masks by itself (line {own.line}: weights of exactly 0 with nothing masked "
                            f"by {plan.mask}): the {'causal' if o.causal else 'window'} rule was given to no other "
                            "mask parameter, so that trace's mask never hides yours; the reference's mask is compared "
                            "with your code's own")
        return called, plan, fed
    rule, _ = masks.structural(AttentionSpec.asked(o.causal, o.window, o.cache, window_side=o.window_side),
                               inputs.sizes["n_Q"], inputs.sizes["n_K"])
    if rule is None:
        return called, plan, fed
    dtype = next(iter(inputs.tensors.values())).dtype
    causal = plan.causal_mask()
    n_batch = inputs.sizes.get("n_batch", 1)
    # [n_Q, n_K], else the 4-D shape transformers' callers build (CLIP's and OWL-ViT's causal_attention_mask from
    # _create_4d_causal_attention_mask, [n_batch, 1, n_Q, n_K], which their size check asks for)
    shapes = ((rule, "[n_Q, n_K]"), (rule.expand(n_batch, 1, *rule.shape), "[n_batch, 1, n_Q, n_K]"))
    for other in sorted(plan.other_masks, key=lambda m: m != causal):  # one named for the rule first
        ran, words = next(((ran, words) for shaped, words in shapes if (ran := _given_beside(
            o, (target, fn, plan, inputs, module, fed, called), other, shaped, dtype)) is not None), (None, ""))
        if ran is not None and masking.weighs(ran[0].records, other) is not None:
            continue  # multiplied into the softmax's output (XLM's head_mask): a weight per head, no mask of scores
        if ran is not None and not masking.reads(ran[0].records, other):
            continue  # never read (a layer_head_mask the code keeps for its signature): the rule would be lost
        if ran is not None:
            held = "the --mask file" if o.mask and other == causal else "the key padding"
            inputs.notes.append(f"{other}: given the {'causal' if o.causal else 'window'} rule {words} beside "
                                f"{held} {plan.mask} takes, {masking.WORDS[ran[1]]}")
            inputs.also_masked.append(other)
            return ran[0], ran[2], ran[3]
    return called, plan, fed


def _masks_alone(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds], called: Called,
                 convention: Convention) -> Record | None:
    """The code's pattern (or, in online softmax, a block's exponentials) where, given a key padding that masks
    nothing and no rule, it still has weights of exactly 0 (masking.masks_by_itself); None where it has none."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.call import call

    target, fn, plan, inputs, module, fed = run
    allowed = inputs.allowed
    if called.failure is not None or allowed is None or allowed.dtype != torch.bool:
        return None
    dtype = next(iter(inputs.tensors.values())).dtype
    torch.manual_seed(o.seed)
    tried = call(target, fn, plan, inputs, module, o.max_memory,
                 masking.written(torch.ones_like(allowed), convention.kind, dtype, convention.line), fed)
    return masking.masks_by_itself(tried.records) if tried.failure is None and fed_well(tried) else None


def _given_beside(o: TraceOptions, run: tuple[Target, Any, Plan, Inputs, Any, Feeds, Called], other: str,
                  mask: Any, dtype: Any) -> tuple[Called, str, Plan, Feeds] | None:
    """The code called again with `mask` (True = may attend) given to the mask parameter `other` as well, as a
    boolean, then in the convention the code reads it: (the call, that convention, the plan and feeds it ran
    with), None where it raises."""
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
            return tried, kind, beside, more
        kind, line = read.kind, read.line
    return None


def _padding_beside(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
                    called: Called) -> tuple[Called, Plan, Feeds]:
    """Where the mask parameter took the rule (causal, a window) and the forward takes key padding as well
    (fairseq's key_padding_mask beside its attn_mask), the padding parameter gets keys of trace's own padded
    (masking.padded_keys), the reference's mask padding the same keys, so that its branch runs and is compared,
    written as the code's own words say where they give it the other polarity than its ops (_padding_as_stated);
    with the plan and feeds it ran with. `called` (and those given) where the code does not run so, or nothing could
    be padded."""
    import torch

    from attnscope import masks
    from attnscope.usertrace import masking

    allowed = inputs.allowed
    others = [m for m in plan.other_masks if "padding" in m.lower() and m not in inputs.also_masked]
    if called.failure is not None or not others or allowed is None or allowed.dtype != torch.bool \
            or o.mask or "n_batch" not in inputs.sizes:
        return called, plan, fed
    col = o.layout == "col"  # the mask [.., n_K, n_Q]: its keys are its rows'
    grid = (allowed.transpose(-1, -2) if col else allowed).reshape(-1, *allowed.shape[-2:][::-1 if col else 1])
    if grid.shape[0] != 1:
        return called, plan, fed
    keys, padded, _ = masking.padded_keys(grid.expand(inputs.sizes["n_batch"], *grid.shape[1:]))
    if padded is None:
        return called, plan, fed
    dtype = next(iter(inputs.tensors.values())).dtype
    other = others[0]
    # [n_batch, n_K] (fairseq's key_padding_mask), else [n_batch, 1, 1, n_K] (a 4-D additive attention_mask)
    for shaped, words in ((keys, "[n_batch, n_K]"), (keys[:, None, None, :], "[n_batch, 1, 1, n_K]")):
        ran = _given_beside(o, (target, fn, plan, inputs, module, fed, called), other, shaped, dtype)
        if ran is not None:
            inputs.mask = masks.combine(inputs.mask, padded[:, None, :, None] if col else padded[:, None, None, :])
            which = ", ".join(str(int(k)) for k in torch.nonzero(~padded[0]).flatten())
            stated = _padding_as_stated(o, (target, fn, inputs, module), ran, other, shaped, dtype)
            kind = ran[1] if stated is None else stated[1]
            inputs.notes.append(f"{other}: keys {which} of the first sequence padded by trace ({words}), "
                                f"{masking.WORDS[kind]}, so that your code's padding runs; the reference's mask "
                                "pads the same keys" + ("" if stated is None else stated[2]))
            inputs.also_masked.append(other)
            return (ran[0] if stated is None else stated[0]), ran[2], ran[3]
    return called, plan, fed


def _padding_as_stated(o: TraceOptions, run: tuple[Target, Any, Inputs, Any], ran: tuple[Called, str, Plan, Feeds],
                       other: str, keys: Any, dtype: Any) -> tuple[Called, str, str] | None:
    """Where the code's own words give the padding parameter `other` the other polarity than its ops read
    (statedmask.py: "key_padding_mask: True marks a padding key" over a `masked_fill(~key_padding_mask, ..)`), the
    code called again with trace's padded keys written as the words say, so that the run shows what the code does
    with them: (the call, that convention, the words for the note); None where the words agree or say nothing."""
    import torch

    from attnscope.usertrace import masking, statedmask
    from attnscope.usertrace.call import call

    target, fn, inputs, module = run
    tried, kind, beside, more = ran
    reads = POLARITY.get(kind)
    read = masking.detect(tried.records, None, other)
    if reads is None or read.line is None:
        return None
    traced = tuple(c.__name__ for c in type(module).__mro__) if module is not None else (target.name.split(".")[-1],)
    others = tuple(m for m in (beside.mask, *beside.other_masks) if m is not None and m != other)
    said = statedmask.read(target.source, read.line, other, others, traced, masking.flow(tried.records, other), reads)
    if said is None or said.kind == reads:
        return None
    turned = OTHER_WAY[kind]
    given = masking.written(keys, turned, dtype)
    feeds = dataclasses.replace(more, values={**more.values, other: given}, labels={**more.labels, id(given): other})
    torch.manual_seed(o.seed)
    again = call(target, fn, beside, inputs, module, o.max_memory, tried.mask_given, feeds)
    if again.failure is not None:
        return None
    words = said.words if len(said.words) <= 60 else said.words[:57] + "..."
    return again, turned, (f""", as your code's own words say it is (line {said.line}: "{words}"); your code """
                           f"reads it the other way round (line {read.line})")


def _own_mask(o: TraceOptions, target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, fed: Feeds,
              called: Called, convention: Convention) -> tuple[Called, Convention]:
    """A code that masks by itself (a causal buffer, a tril of any diagonal, is_causal) and takes a mask as well
    gets one that masks nothing (the key padding alone, where the reference's mask pads keys no query may see: a
    --mask file's), so that trace's mask never hides the code's own: the reference's mask is then compared with the
    code's alone. Found by experiment: the code run with nothing masked still has weights of
    exactly 0, or its scores still meet a boolean or 0/1 mask of the positions alone (masking.own_mask_op: GPT-Neo's
    buffer multiplied into them, or filled with 0, which trace's rule would mask again). Where it masks the window's
    far keys alone it takes the causal part from its caller (_rule_left_over); where it masks the causal part, the
    window is its own to mask too; where it masks by itself only on a mask given as key padding (_keys_form), it is
    given the key padding in that shape, in the convention that run kept to."""
    import torch

    from attnscope.usertrace import masking
    from attnscope.usertrace.call import call

    allowed = inputs.allowed
    if called.failure is not None or allowed is None or allowed.dtype != torch.bool or bool(allowed.all()):
        return called, convention
    dtype = next(iter(inputs.tensors.values())).dtype

    def given(mask: Any, kind: str | None = None) -> Called:
        """The code run again, from the same seed, handed `mask` written in its own convention (or `kind`)."""
        torch.manual_seed(o.seed)
        return call(target, fn, plan, inputs, module, o.max_memory,
                    masking.written(mask, kind or convention.kind, dtype, convention.line), fed)

    everything = torch.ones_like(allowed)
    tried = given(everything)
    # a mask that masks nothing leaves every query its keys: a query with none is trace's feed read the wrong way
    well = tried.failure is None and fed_well(tried)
    own = masking.masks_by_itself(tried.records) if well else None
    # a mask of its own whose weights keep no 0 (its scores multiplied by a causal buffer): fed the rule, the code
    # would hide it under trace's mask
    pattern = (inputs.sizes.get("n_Q", 0), inputs.sizes.get("n_K", 0))
    applied = masking.own_mask_op(tried.records, set(inputs.tensors), plan.mask or "", pattern) \
        if own is None and well else None
    flat = _keys_form(o, inputs, called, given, convention.kind, plan.mask or "mask") \
        if own is None and applied is None else None
    if flat is not None:  # its own rule on another branch, reached by the key padding's shape alone
        allowed, everything, tried, own, kind = flat
        if kind != convention.kind:  # at the op that run's reading ends at
            read = masking.detect(tried.records, None, plan.mask or "mask")
            convention = masking.Convention(kind, read.line, "given key padding [n_batch, n_K], found by experiment")
            given = functools.partial(given, kind=kind)
    if own is None and applied is None:
        return (_unapplied(tried, called, module, pattern, plan.mask or "", inputs, given) if well else called,
                convention)
    rest = _rule_left_over(o, inputs, own) if own is not None and flat is None else None
    if own is not None and rest is not None:  # it masks one part of the rule itself, merged into the mask it is given
        part, mine, theirs = rest
        again = given(part)
        if again.failure is None:
            inputs.allowed = part
            inputs.notes.append(f"your code masks {mine} by itself (line {own.line}: weights of exactly 0 with nothing "
                                f"masked by {plan.mask}) and takes the rest of the rule from {plan.mask}: it was "
                                f"given {theirs} alone, so that trace's mask never hides yours; the reference's mask "
                                "is compared with the two together")
            return again, convention
    how = f"masks by itself (line {own.line}: weights of exactly 0" if own is not None else \
        f"applies a mask of its own to its scores (line {cast('Record', applied).line}: a boolean or 0/1 tensor of " \
        "the positions alone,"
    # the keys no query may see (a --mask file's padding) are no rule of the positions: they stay the caller's
    keys = allowed if flat is not None else allowed.any(-2, keepdim=True).expand_as(allowed)
    if not bool(keys.all()):
        padded = given(keys)
        if padded.failure is None:
            inputs.allowed = keys
            inputs.notes.append(f"your code {how} with nothing masked by {plan.mask}): {plan.mask} was given the key "
                                "padding alone, so that trace's mask never hides yours; the reference's mask is "
                                "compared with your code's own and the padding")
            return padded, convention
    inputs.allowed = everything
    inputs.notes.append(f"your code {how} with nothing masked by {plan.mask}): {plan.mask} was given a mask that masks "
                        "nothing, so that trace's mask never hides yours; the reference's mask is compared with your "
                        "code's own")
    return tried, convention


def _keys_form(o: TraceOptions, inputs: Inputs, called: Called, given: Callable[..., Called], kind: str,
               label: str) -> tuple[Any, Any, Called, Record, str] | None:
    """Where the code, handed a mask that masks nothing in the shape it was first given, masks nothing by itself,
    but handed one as key padding `[n_batch, n_K]` does (transformers' Mistral and Llama before 4.48:
    `_prepare_4d_causal_attention_mask_with_cache_position` passes a 4-D mask through as it is and builds the causal
    rule, and the sliding window, from a 2-D one of 0/1): the key padding the reference's mask holds, `[n_batch,
    n_K]`, the mask that masks nothing in that shape, the code's run on it, its pattern and the convention it was
    written in (`kind`, the one read, first; then maskforms.FORMS), so that the code's own rule, which the first
    form never runs, is the one compared; None where the first mask is already key padding, its axes cannot be
    read (maskrows.laid), or in no convention the code runs on key padding, reads it into the first run's shapes,
    and masks by itself with no query left every key."""
    import torch

    from attnscope.usertrace import maskforms, masking
    from attnscope.usertrace.maskranks import shaped_alike
    from attnscope.usertrace.maskrows import laid

    allowed = inputs.allowed
    grid = laid(allowed, inputs.sizes) if allowed is not None and o.layout == "row" else None
    if allowed is None or grid is None or allowed.dim() == 2 or bool((grid == grid[:, :1, :]).all()):
        return None  # key padding already, or no rule of the queries in it
    keys = grid.any(-2)  # [n_batch, n_K]: the keys some query may see
    nothing = torch.ones_like(keys)
    raised = 0
    for each in maskforms.in_turn(kind):
        try:
            tried = given(nothing, kind=each)
        except UsageError:
            continue
        raised += tried.failure is not None
        if raised >= 2:  # key padding's shape, not a convention, is what the code raises on (a 4-D mask's code)
            return None
        if tried.failure is not None or not fed_well(tried) or not shaped_alike(called, tried):
            continue
        own = masking.masks_by_itself(tried.records)
        if own is not None and not maskforms.drowned(tried.records, label):
            return keys, nothing, tried, own, each
    return None


def _unapplied(tried: Called, called: Called, module: Any, pattern: tuple[int, int], label: str, inputs: Inputs,
               given: Callable[[Any], Called]) -> Called:
    """`called` as it is, unless the code reads a mask of its own module's (a causal buffer's slice) and never uses
    it (masking.unapplied_own_mask: CodeGen's `self.causal_mask[...]` with the `torch.where` that applies it left
    out): its mask parameter, meant for the caller's padding, then gets what masks no position (the key padding
    alone, where a --mask file pads keys), so that trace's rule never stands in for the step the code left out; the
    line-up then shows it missing."""
    import torch

    from attnscope.usertrace import masking

    buffers = {name for name, _ in module.named_buffers()} if hasattr(module, "named_buffers") else set()
    unused = masking.unapplied_own_mask(tried.records, buffers, pattern) if buffers else None
    if unused is None or inputs.allowed is None:
        return called
    allowed = inputs.allowed
    keys = allowed.any(-2, keepdim=True).expand_as(allowed)
    fed = keys if not bool(keys.all()) else torch.ones_like(allowed)
    again = given(fed)
    if again.failure is not None:
        return called
    inputs.allowed = fed
    op = unused.details.get("op", unused.call)
    inputs.notes.append(f"your code reads a mask of its own (line {unused.line}: {op}, a boolean or 0/1 tensor of "
                        f"the positions alone) and never applies it: {label} was given "
                        f"{'the key padding alone' if fed is keys else 'a mask that masks nothing'}, so that trace's "
                        "rule never stands in for yours; the reference's mask is compared with what your code does")
    return again


def _rule_left_over(o: TraceOptions, inputs: Inputs, own: Record) -> tuple[Any, str, str] | None:
    """Where the rule is a sliding window (causal, on the left) and the code, given a mask that masks nothing,
    masks the window's far keys alone (Gemma 2 merges them into the causal mask it is given), or a band on both
    sides: the causal mask only (and any key padding), with both parts in words; None otherwise (it masks both, the
    causal part alone, a code whose window is missing (GPT-Neo's local layer without its band), or cells of neither
    part)."""
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
    if on_far and _band(forbids, far, future, o.window):
        return (allowed | far, f"a band on both sides (the window's far keys, {o.window} or more back, and the keys "
                f"{o.window} or more ahead, which the causal mask hides too)", "the causal mask")
    return None


def _band(forbids: Any, far: Any, future: Any, window: int) -> bool:
    """Whether the code's own mask `forbids` [n_Q, n_K] reads as a band it builds on both sides (Gemma's
    `triu(ones, -W + 1) * tril(ones, W - 1)`, merged into the causal mask it is given) rather than the causal part
    and the window both its own: it is nearer, cell for cell, to the band of the reference's width, |i - j| >= W,
    than to the whole rule's complement (every later key and the far ones); a width off by one stays a band."""
    import torch

    n_Q, n_K = forbids.shape
    ahead = torch.arange(n_K)[None, :] - torch.arange(n_Q)[:, None] - (n_K - n_Q)  # > 0 for a later key
    band = far | (future & (ahead >= window))
    return int((forbids ^ band).sum()) < int((forbids ^ (far | future)).sum())
