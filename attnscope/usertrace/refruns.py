"""The reference a line-up compares with, run on the user's inputs (references): `sdpa` for a function; for a module,
attnscope's MultiHeadAttention holding its weights under each reading of its projections (a fused one can be split
several ways), identity projections on joint attention's joined q, k and v, or LatentAttention for multi-head
latent attention, under the reading that lines up the most steps. Also what the reference lets each query see, the
rows of queries that see no key (skipped_rows), and what the queries and keys are made from (given_roles,
projected_roles).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.usertrace import keytable, scoreaxes
from attnscope.usertrace.alignsteps import align_steps
from attnscope.usertrace.lined import ALIGNED

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from attnscope.trace import Trace
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.lined import Aligned
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections, Spec


def references(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], spec: Spec) -> tuple[
        Trace, tuple[str, ...], Any, Projections | None, str, list[Aligned], dict[str, torch.Tensor], dict[int, int]]:
    """The reference run on the inputs; for a module, under each reading of its projections (a fused one can
    be split several ways), the one under which most steps find their equal. Last, which axis of each of the
    code's scores holds the keys, read from its data flow under that reading (scoreaxes.key_axes)."""
    from attnscope.usertrace import headscale, outgate, outterm, pooledref
    from attnscope.usertrace import reference as ref

    Q, K, V = inputs.qkv()
    if module is None:
        keys = scoreaxes.key_axes(records, *given_roles(inputs))
        col = spec.layout == "col"
        trace = (ref.run_columns if col else ref.run_sdpa)(Q, K, V, inputs.mask, spec)
        skips = {} if col else skipped_rows(trace)  # the column form's own zero columns are compared as they are
        what = f"attnscope sdpa{' --layout col' if col else ''}: out = " + (
            "V softmax(Kᵀ Q / √d_K), softmax over keys (dim -2)" if col else "softmax(Q Kᵀ / √d_K) V")
        what += f"; {spec.describe()}" if spec.describe() else ""
        rows = align_steps(trace, ref.SDPA_STEPS, records, skips, keys)
        return trace, ref.SDPA_STEPS, None, None, what, rows, skips, keys
    from attnscope.usertrace import latent, valuegain, widerows

    refused = latent.refusal(records, type(module).__name__)  # MLA: keys and values expanded from one latent
    if refused is not None:
        found = _latent_reference(module, shapes, inputs, records, spec)
        if found is None:
            raise refused
        return found
    if spec.layout != "col":  # streams joined along the tokens (Flux, SD3): the reference starts where they meet
        from attnscope.usertrace import joint

        joined = joint.find(records, dict(module.named_parameters()))
        made = _joint_reference(module, shapes, inputs, records, spec, joined) if joined is not None else None
        if made is not None:
            return made
    if shapes.n_head is None:
        raise UsageError(shapes.why_no_heads or "cannot tell how many heads the module has; pass --heads")
    best: tuple[Any, ...] | None = None
    error: UsageError | None = None
    mask, col = inputs.mask, spec.layout == "col"
    from attnscope.usertrace import columns

    if col:  # the column form: the row form's reference on the inputs transposed, its steps transposed back
        Q, K, V, mask = columns.rows(Q, K, V, mask)  # [.., d, n] -> [.., n, d]; a mask [.., n_K, n_Q] transposed
    Q, K, V = columns.batched(Q, K, V)  # one sequence [n, d] (picoGPT's) as a batch of one, its axis merged away
    gain = valuegain.find(records, dict(module.named_parameters()))  # modded-nanogpt's lambdas[0] * v
    for projections in ref.find_projections(module, records, shapes.n_head, shapes.fixed.get("d_head"),
                                            {name: role for name, role in inputs.roles.items() if role not in
                                             inputs.own}):
        if gain is not None and projections.matched_by != "identity":
            projections = valuegain.apply(projections, gain)
        if spec.q_gain is not None and projections.matched_by != "identity" and not col:  # querygain.py
            from attnscope.usertrace import querygain

            gained = querygain.apply(projections, spec.q_gain)
            if gained is None:
                continue
            projections = gained
        if projections.matched_by != "identity":  # a projection the role reads some rows of (Qwen3-Next's q_proj)
            projections = widerows.narrowed(projections, records)
        if spec.out_ops is not None and not col and "o" in projections.linears:  # ops on the merge (outops.py)
            from attnscope.usertrace.outops import merged

            projections = merged(projections, spec.out_ops)
        try:
            try:
                reference = ref.build_mha(projections, shapes.n_head, spec, module, records)
            except UsageError:  # an output projection reading the merge beside an MLP's features (a parallel block)
                wider = ref.merge_only(projections, records)
                if wider is None:
                    raise
                projections, reference = wider, ref.build_mha(wider, shapes.n_head, spec, module, records)
            before = mask if spec.pooled is None or col else pooledref.fitting(mask, Q.shape[-2], K.shape[-2])
            trace = keytable.run_keyed(partial(ref.run_mha, reference, Q, K, V, before, inputs.cache), spec,
                                       cast(int, reference.d_head))
            if spec.pooled is not None and not col:  # the code's own pooled q, k or v (pooled.py)
                trace, reference = pooledref.combined(trace, projections, shapes.n_head, spec, module, records,
                                                      (Q, K, V), mask)
            if spec.head_scale is not None and not col:  # the code's own scale per head (headscale.py)
                trace = headscale.scaled(trace, spec.head_scale, reference,
                                         spec.scale if spec.scale is not None else cast(int, reference.d_head) ** -0.5)
            if spec.head_mix is not None and not col:  # the code mixes its heads (headmix.py: talking heads)
                from attnscope.usertrace.headmix import mixed

                trace = mixed(trace, spec.head_mix, reference)
            if spec.out_term is not None and not col:  # the code's own term on its output (outterm.py)
                trace = outterm.folded(trace, spec.out_term, reference)
            if spec.out_gate is not None and not col:  # the code's own gate on its output (outgate.py)
                trace = outgate.gated(trace, spec.out_gate, reference)
        except UsageError as exc:
            error = error or exc
            continue
        skips = skipped_rows(trace)
        if col:  # the steps and the rows of queries that see no key, in the column form
            trace, skips = columns.columns(trace), columns.columns_of(skips)
        # code handed q, k, v already projected (identity.py): its inputs are the projections, no step of its own
        wanted = tuple(s for s in ref.MHA_STEPS if not s.endswith("_feat")) if projections.matched_by == "identity" \
            else ref.MHA_STEPS
        best = _best_reading(best, records, inputs, (trace, reference, projections, skips, wanted))
    if best is None:
        raise error or UsageError(f"no reference for {type(module).__name__}")
    _, trace, reference, projections, rows, skips, wanted, keys = best
    if projections.merge_only and not col:  # the merge lined up where the code makes it, its layout checked
        from attnscope.usertrace.joint import merge_row

        merge_row(rows, trace, records)
    variants = f", {spec.describe()}" if spec.describe() else ""
    kv = f", n_kv_head={reference.n_kv_head}" if reference.n_kv_head != reference.n_head else ""
    d_v = f", d_V={reference.d_v}" if reference.d_v != reference.d_head else ""  # values of their own width
    what = (f"attnscope MultiHeadAttention (d_feat={reference.d_feat}, n_head={shapes.n_head}{kv}, d_head="
            f"{reference.d_head}{d_v}{_unscaled(spec)}{variants}) holding your weights: {projections.describe()}")
    if projections.matched_by == "identity":
        from attnscope.usertrace import identity

        what = identity.describe(reference.d_feat, shapes.n_head, reference.d_head, f"{_unscaled(spec)}{variants}")
    what += "; in the column form, your inputs transposed in and its steps transposed out" if col else ""
    return trace, wanted, reference, projections, what, rows, skips, keys


def _best_reading(best: tuple[Any, ...] | None, records: list[Record], inputs: Inputs, run: tuple[Any, ...],
                  evidence: Callable[[list[Aligned]], int] | None = None) -> tuple[Any, ...]:
    """Of the best reading so far and `run` (trace, reference, projections, skips, wanted), the one under which more
    steps find their equal, as (aligned, trace, reference, projections, rows, skips, wanted, keys); `evidence`
    corrects the count from the rows (latentref.evidence: steps every form's code holds say nothing of the form)."""
    trace, reference, projections, skips, wanted = run
    keys = scoreaxes.key_axes(records, *projected_roles(projections, inputs))
    rows = align_steps(trace, wanted, records, skips, keys)
    if not keys and inputs.layout == "col":  # q and k cut from one fused output: the tensors lined up as Q and K say
        keys = scoreaxes.key_axes(records, *scoreaxes.lined_roles(rows))
        rows = align_steps(trace, wanted, records, skips, keys) if keys else rows
    aligned = sum(row.status in ALIGNED for row in rows) + (evidence(rows) if evidence is not None else 0)
    if best is None or aligned > best[0]:
        return (aligned, trace, reference, projections, rows, skips, wanted, keys)
    return best


def _joint_reference(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], spec: Spec,
                     joined: Any) -> tuple[Trace, tuple[str, ...], Any, Projections | None, str, list[Aligned],
                                       dict[str, torch.Tensor], dict[int, int]] | None:
    """`references` for joint attention (usertrace/joint.py): attnscope's MultiHeadAttention with identity
    projections on the code's joined q, k and v, compared up to the merge of the heads; the qk-norm the options ask
    for read as the code's own before the join (each stream's norms), else as the reference's over the joined q and
    k, whichever lines up further. None where the joined tensors' layout is not read."""
    import torch

    from attnscope.usertrace import fused, joint, jointstreams
    from attnscope.usertrace import reference as ref

    n_head = joint.heads(joined, shapes.n_head)
    merged = joined.merged(n_head) if n_head else None
    if merged is None or n_head is None:
        return None
    Q, K, V = merged
    parts = {role: (f"(identity {role})", fused.Part(f"(identity {role})", torch.eye(
        int(t.shape[-1]), dtype=t.dtype, device=t.device), None)) for role, t in zip("qkvo", (Q, K, V, Q), strict=True)}
    note = joined.note(jointstreams.said(records, joined, n_head))
    projections = ref.Projections(parts, "identity", note, joint=True)
    mask = inputs.mask if inputs.mask is not None and tuple(inputs.mask.shape[-2:]) == (joined.n, joined.n) else None
    wanted = tuple(s for s in ref.MHA_STEPS if not s.endswith("_feat"))
    best: tuple[Any, ...] | None = None
    for reading in (replace(spec, qk_norm=None), *((spec,) if spec.qk_norm else ())):
        try:
            reference = ref.build_mha(projections, n_head, reading, module if reading.qk_norm else None)
            trace = keytable.run_keyed(partial(ref.run_mha, reference, Q, K, V, mask, None), reading,
                                       cast(int, reference.d_head))
        except UsageError:
            continue
        best = _best_reading(best, records, inputs, (trace, reference, projections, skipped_rows(trace), wanted))
    if best is None:
        return None
    _, trace, reference, projections, rows, skips, wanted, keys = best
    joint.merge_row(rows, trace, records)
    rest = replace(spec, qk_norm=None).describe() if reference.spec.norm is None else spec.describe()
    own = "; qk-norm: each stream's own, before the join" if spec.qk_norm and reference.spec.norm is None else ""
    kv = f", n_kv_head={reference.n_kv_head}" if reference.n_kv_head != n_head else ""
    what = (f"attnscope MultiHeadAttention (n_head={n_head}{kv}, d_head={reference.d_head}{_unscaled(spec)}"
            f"{', ' + rest if rest else ''}) with identity projections on your joined q, k and v ({joined.n} tokens), "
            f"compared up to the merge of the heads{own}")
    return trace, wanted, reference, projections, what, rows, skips, keys


def _latent_reference(module: Any, shapes: ShapePlan, inputs: Inputs, records: list[Record], spec: Spec) -> tuple[
        Trace, tuple[str, ...], Any, Projections | None, str, list[Aligned], dict[str, torch.Tensor], dict[int, int]
        ] | None:
    """`references` for multi-head latent attention (usertrace/latentref.py): attnscope's LatentAttention holding
    the module's weights, under the rotary form that lines up best; None where none can be built."""
    from attnscope.usertrace import latentcache, latentgains, latentref

    if shapes.n_head is None or (inputs.cache is not None and inputs.latent_cache is None) or spec.layout == "col":
        return None
    Q, _, _ = inputs.qkv()
    held = inputs.latent_cache  # a decode step's: the latents the code's expanded cache was made from
    best: tuple[Any, ...] | None = None
    for reference, projections in latentref.candidates(module, records, shapes.n_head, spec):
        try:
            trace = latentref.run(reference, Q, inputs.mask, held)
        except UsageError:
            continue
        gains = latentgains.read(reference, trace, records) if held is None else {}
        if gains:  # LoRA outputs the code multiplies by numbers of its own: folded into the reference's weights
            projections = replace(projections, note="; ".join(filter(None, (projections.note,
                                                                            latentgains.fold(reference, gains)))))
            trace = latentref.run(reference, Q, inputs.mask, held)
        if held is not None:
            trace = latentcache.decoded(trace, int(held[0].shape[-2]))
        wanted = latentref.wanted(reference, trace)
        best = _best_reading(best, records, inputs, (trace, reference, projections, skipped_rows(trace), wanted),
                             partial(latentref.evidence, reference, trace, records))
    if best is None:
        return None
    _, trace, reference, projections, rows, skips, wanted, keys = best
    L = reference.latent
    rest = replace(spec, rope_base=None).describe()  # the rotary form is said with the layers' reading
    variants = f", {rest}" if rest else ""
    declared = spec.scale is None and reference.spec.scale is not None  # DeepSeek's mscale (latentref._mscale)
    scaled = f"scores · {reference.spec.scale:.6g}" if declared else "scores / √d_K"
    what = (f"attnscope LatentAttention (multi-head latent attention: d_feat={reference.d_feat}, n_head="
            f"{reference.n_head}, kv_lora_rank={L.kv_lora_rank}, q_lora_rank={L.q_lora_rank}, d_nope="
            f"{L.qk_nope_head_dim}, d_rope={L.qk_rope_head_dim}, d_V={L.v_head_dim}, {scaled}{variants}) "
            f"holding your weights: {projections.describe()}")
    return trace, wanted, reference, projections, what, rows, skips, keys


def given_roles(inputs: Inputs) -> tuple[set[str], set[str]]:
    """The labels of the inputs the queries and the keys are (a function's Q and K; none where one input is
    both)."""
    query = {name for name, role in inputs.roles.items() if role == "Q"}
    key = {name for name, role in inputs.roles.items() if role == "K"}
    return (query, key) if key else (set(), set())


def projected_roles(projections: Projections, inputs: Inputs) -> tuple[set[str], set[str]]:
    """What a module's queries and keys are computed from: its q and k projections' names under this reading (and
    the inputs they read, where query and key are given apart)."""
    query, key = given_roles(inputs)
    for role, names in (("q", query), ("k", key)):
        if role in projections.linears:
            names.add(projections.linears[role][0])
    return query, key


def reference_allowed(trace: Trace) -> torch.Tensor | None:
    """What the reference lets each query see (True = may attend), read off its masked scores."""
    import torch

    if "masked_scores" not in trace:
        return None
    return ~torch.isneginf(trace["masked_scores"])


def skipped_rows(trace: Trace) -> dict[str, torch.Tensor]:
    """Per step from the masked scores on, the rows of queries that may attend to no key, shaped to
    broadcast against the step: attnscope gives them zeros where hand-written code differs, so they are
    left out of the comparison. Empty when there are none."""
    if "masked_scores" not in trace:
        return {}
    import torch

    scores = trace.step("masked_scores")
    empty = torch.isneginf(scores.tensor).all(-1)  # [.., n_Q], dims scores.dims[:-1]
    if not bool(empty.any()):
        return {}
    row_dims = scores.dims[:-1]
    skips: dict[str, torch.Tensor] = {}
    after = False
    for step in trace.steps:
        after = after or step.name == "masked_scores"
        if not after or "n_Q" not in step.dims:
            continue
        rows = empty
        for axis in reversed(range(len(row_dims))):  # fold the axes the step does not have (n_head after the merge)
            if row_dims[axis] not in step.dims:
                rows = rows.any(axis)
        kept = [d for d in row_dims if d in step.dims]
        if tuple(step.dims[: len(kept)]) == tuple(kept):
            # [kept.., 1, ..]: broadcasts over the step
            skips[step.name] = rows.reshape(*rows.shape, *[1] * (len(step.dims) - len(kept)))
    return skips


def _unscaled(spec: Spec) -> str:
    """The reference's scale in its words: `, scores / √d_head`, or nothing where --scale (or the module's config)
    gives another, which the spec's words say (`scale 0.12`): not both."""
    return ", scores / √d_head" if spec.scale is None else ""
