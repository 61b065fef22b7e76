"""The run so far: what `attnscope trace` has read of the user's code (its target, module, plan, shapes, the
reference's spec, the cache layout it keeps) and the one way every step runs it, `RunSoFar.attempt`: the plan and
each of its mask parameters in turn, the mask as the code reads it (trace_mask.py), RoPE's tables in the form it
runs on, the run kept with its inputs as the code reads them. runs/trace_layouts.py and runs/trace_readings.py
run it again under other readings; each reading is kept on this object, so that a later run starts from it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from attnscope.errors import UsageError
from attnscope.runs.trace_mask import masked_call, not_weights
from attnscope.runs.trace_options import guard

if TYPE_CHECKING:
    from attnscope.runs.trace_options import TraceOptions
    from attnscope.usertrace.call import Called
    from attnscope.usertrace.feeds import Feeds, TableForm
    from attnscope.usertrace.heldcache import Held
    from attnscope.usertrace.inputs import Inputs, ShapePlan
    from attnscope.usertrace.latentcache import LatentCache
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.masking import Convention
    from attnscope.usertrace.record import Failure
    from attnscope.usertrace.reference import Spec

    # a run: its inputs, what was fed, the call, the mask's reading
    Made = tuple[Inputs, Feeds, Called, Convention | None]


@dataclass
class RunSoFar:
    """What the steps of a trace share, each reading what the ones before it kept: the options (a later reading
    may replace them: time-first, the column form), the user's target and what was built of it, the plan of its
    forward, the sizes chosen, the reference's spec, and what the runs have read (RoPE's table form, the cache's
    layout, a cache the module holds, MLA's latents). `notes` are the module's; `first_notes` and `mode` are set
    once the first run is recorded (trace_readings.py)."""

    o: TraceOptions
    split: bool  # code that says a head count: read as splitting the heads itself (True) or taking them split
    target: Target
    spec: Spec
    init: Any
    module: Any
    kwargs: dict[str, Any]
    label: str
    notes: list[str]
    fn: Any
    plan: Plan
    pristine: tuple[Any, Any]  # what a module holding its cache holds before any run (heldcache.py)
    weighted: Any  # the module whose weights the reference holds; None for a function, and a module without any
    shapes: ShapePlan
    built: dict[str, Any]  # a config the __init__ read and did not keep
    sliced: list[str] = field(default_factory=list)  # the note, where RoPE's tables were made in the code's form
    # the notes of conventions read from the code into the spec (its qk-norm, its values' norm, a temperature): said
    # whatever line-up a later reading keeps, as the spec keeps them in force
    read_notes: list[str] = field(default_factory=list)
    table_form: list[TableForm] = field(default_factory=list)  # that form (tableforms.py), once read
    alibi_form: list[str] = field(default_factory=list)  # the layout ALiBi's handed bias runs in (alibifeed.py)
    cache_layout: str = "bhnd"  # how the code keeps a decode step's cache (cachelayouts.py): trace's own, else read
    empty_cache: bool = False  # no decode step, and code that cannot run with its cache None: handed an empty one
    own_cache: Held | None = None  # a cache the module holds itself, where it does: filled before each run
    latent_maker: LatentCache | None = None  # multi-head latent attention's decode step (latentcache.py)
    first_notes: list[str] = field(default_factory=list)  # the module's notes, before those of its inputs
    mode: str = ""  # ", eval() mode" or ", training mode" for a module, in the header
    # a --mask file's parameter the code raised on in every shape (refused_mask): its name, the shapes, the failure;
    # run without it only once every other reading has failed too (trace_layouts.first_run)
    refusal: tuple[str, tuple[tuple[int, ...], ...], Failure] | None = None
    # mask parameters left at their default where the code raised with trace's mask (trace_layouts._masks_at_default):
    # the plan with them, the options it raised under, the note that said so, where it raised (trace_remask.py)
    masked: tuple[Plan, TraceOptions, str, str] | None = None

    def expanded(self, inputs: Inputs) -> None:
        """A dict cache's layer keys (keyedcache.slots); MLA's decode step: the cache as the keys and values the
        reference's latents expand into."""
        from attnscope.usertrace import latentcache

        if inputs.cache is not None and self.cache_layout.startswith("dict·"):  # keyedcache.py: the layer's keys
            from attnscope.usertrace.keyedcache import slots

            inputs.cache_slots = slots(self.module)
        if self.latent_maker is not None and inputs.cache is not None:
            inputs.cache, inputs.latent_cache = latentcache.cache_for(self.latent_maker, int(inputs.cache[0].shape[0]),
                                                                      inputs.cache[0].dtype)

    def run_plan(self, asked: TraceOptions, tried: Plan) -> Made:
        """The code run on `tried` under `asked`; where it raised on RoPE's tables, on tables in the form it runs
        on (tableforms.py), the spec and the note of that form kept."""
        from attnscope.usertrace import heldcache, tableforms, tablelayouts
        from attnscope.usertrace.feeds import feeds
        from attnscope.usertrace.inputs import make_inputs
        from attnscope.usertrace.lineup import line_up
        from attnscope.usertrace.ranking import better_fit

        if tried.alibi_form:  # ALiBi's bias handed in: in the layout the code was read to run on, else each in turn
            if not self.alibi_form:
                return self._alibi_read(asked, tried)
            tried = dataclasses.replace(tried, alibi_form=self.alibi_form[0])
        # a --mask file beside a mask parameter named for the causal rule: the file alone to `tried.mask`, the rule
        # to the causal one (_rule_beside)
        apart = asked.mask and asked.causal and tried.causal_mask() not in (None, tried.mask)
        beside = tried.rule_beside and (asked.causal or asked.window)  # the key padding alone to tried.mask
        inputs = make_inputs(dataclasses.replace(asked, causal=None, window=None) if beside else
                             dataclasses.replace(asked, causal=None) if apart else asked, tried, self.shapes,
                             self.weighted,
                             guard=lambda sizes: guard(asked, self.spec, sizes, self.weighted is not None))
        inputs.cache_layout, inputs.empty_cache = self.cache_layout, self.empty_cache
        self.expanded(inputs)
        width = table_width(self.spec, tried, inputs.sizes.get("d_head"))
        fed = feeds(tried, inputs, self.spec.rope_base, self.spec.rope_pairing, self.spec.position_bias, width,
                    self.table_form[0] if self.table_form and tried.tables else None)
        if self.own_cache is not None and inputs.cache is not None:
            heldcache.fill(self.own_cache, inputs.cache, inputs.sizes["n_Q"])
        ran = (inputs, fed, *masked_call(asked, self.target, self.fn, tried, inputs, self.module, fed))
        failed = ran[2].failure
        d_head = inputs.sizes.get("d_head")
        if failed is None or not tried.tables or not d_head or self.table_form or self.spec.rope_base is None:
            return ran
        # tables in the form the code runs on (tableforms.py: one angle a pair, a share of each head, along its own
        # axes; tablelayouts.py: the pair's order and layout); where several run, the first under which it lines up
        # whole, else the one under which it lines up furthest
        found = tableforms.forms(failed, width, d_head, inputs.sizes["n_Q"])
        forms = tablelayouts.variants([*found, *tablelayouts.halves(failed, d_head, found)], tried,
                                      asked.rope_pairing) \
            + tableforms.holders(failed, tried.tables, width, d_head, read=tuple(tried.read_tables))
        made = []
        for form in forms:
            inputs = make_inputs(asked, tried, self.shapes, self.weighted)
            inputs.cache_layout, inputs.empty_cache = self.cache_layout, self.empty_cache
            self.expanded(inputs)
            fed = feeds(tried, inputs, self.spec.rope_base, self.spec.rope_pairing, self.spec.position_bias, form=form)
            if self.own_cache is not None and inputs.cache is not None:
                heldcache.fill(self.own_cache, inputs.cache, inputs.sizes["n_Q"])
            again = (inputs, fed, *masked_call(asked, self.target, self.fn, tried, inputs, self.module, fed))
            if again[2].failure is None:
                made.append((form, form_spec(self.spec, form, d_head), again))
            narrower = tableforms.narrower(again[2].failure, form) if again[2].failure is not None else None
            if narrower is not None and narrower not in forms:  # DeepSeek-V2's freqs_cis over its rotary part alone
                forms.append(narrower)
        if not made:
            return ran
        if len(made) > 1 and self.weighted is not None:
            fits = [line_up(self.weighted, self.shapes, m[2][0], m[2][2].records, asked.train, m[1]) for m in made]
            best = 0
            for i in range(1, len(made)):  # ties keep the likelier, earlier form
                best = i if fits[best].divergence is not None and better_fit(fits[i], fits[best]) else best
            made = [made[best]]
        form, self.spec, again = made[0]
        self.table_form[:] = [form]
        named = (form.swapped or form.layout or form.turned or (form.pairs and 2 * form.width < d_head)) \
            and form.holds in tablelayouts.PAIRED  # a complex table, matrices: tableforms.note says what it holds
        self.sliced[:] = [tablelayouts.note(form, tried.tables, width or d_head, d_head, failed) if named else
                          tableforms.note(form, failed, width or d_head, d_head, tried.tables)]
        return again

    def _alibi_read(self, asked: TraceOptions, tried: Plan) -> Made:
        """The code run with ALiBi's bias handed in each layout (alibifeed.FORMS); of those it runs on, the first
        under which it lines up all the way, else the one under which it lines up furthest; with a note of it. None
        run: the first's run, and none kept."""
        from attnscope.usertrace import alibifeed
        from attnscope.usertrace.lineup import line_up
        from attnscope.usertrace.ranking import better_fit

        made: list[tuple[str, Made]] = []
        first: Made | None = None
        for form in alibifeed.FORMS:
            self.alibi_form[:] = [form]
            ran = self.run_plan(asked, tried)
            first = first or ran
            if ran[2].failure is None:
                made.append((form, ran))
        if not made:  # none read: a later run (another mask parameter, another reading) tries them again
            self.alibi_form[:] = []
            assert first is not None
            return first
        best, fit = 0, None
        for i, (_, tried_ran) in enumerate(made if len(made) > 1 and self.weighted is not None else []):
            other = line_up(self.weighted, self.shapes, tried_ran[0], tried_ran[2].records, asked.train, self.spec)
            if fit is None or better_fit(other, fit):
                best, fit = i, other
            if fit.divergence is None:  # the first layout that lines up all the way (a one-row layout before rows)
                break
        form, ran = made[best]
        self.alibi_form[:] = [form]
        self.notes.append(alibifeed.note(str(tried.alibi), form))
        return ran

    def attempt(self, asked: TraceOptions) -> Made:
        """The code run under `asked`: the plan, then each of its other mask parameters (the rule's own first),
        with its own RoPE tables and position embeddings first; the first run that reads its mask is kept
        (keep_run), else the first that ran, else the first run."""
        from attnscope.usertrace import masking, maskuse

        made = None
        candidates = [self.plan] + [self.plan.with_mask(m) for m in self.plan.other_masks if asked.mask or asked.causal
                               or asked.window]
        if asked.mask and not asked.causal and not asked.window and padding_file(asked):
            # a key-padding file beside a parameter named for it (FSMT's and fairseq's key_padding_mask beside their
            # attn_mask, which an additive [n_batch, 1, 1, n_K] would run with too): that one first, by its name
            candidates.sort(key=lambda c: not (c.mask is not None and _paddings(c.mask)))
        if not self.plan.self_attention and asked.mask and not asked.causal and not asked.window:
            # cross-attention's key padding: to the memory's own mask parameter first (BLIP's, BERT's
            # encoder_attention_mask beside attention_mask), which keeps it by its name (the loop below)
            candidates.sort(key=lambda c: not (c.mask is not None and _memorys(c.mask)))
        causal = self.plan.causal_mask(window=bool(asked.window))
        # CLIP's causal_attention_mask, ModernBERT's sliding_window_mask: the rule's own
        if causal is not None and (asked.causal or asked.window) and not asked.mask:
            candidates = [self.plan.with_mask(causal), *(c for c in candidates if c.mask != causal)]
        if causal is None and (asked.causal or asked.window) and padding_file(asked) and self.plan.other_masks:
            # a key-padding file beside a rule, and two mask parameters (fairseq's, PatchTST's key_padding_mask
            # beside attn_mask): each its part, the padding to the one that takes it, the rule to the other
            candidates = [self.plan.with_rule_beside(m) for m in (*self.plan.other_masks, self.plan.mask)
                          if m is not None] + candidates
        if asked.mask and self.plan.mask is None and not self.plan.other_masks and self.plan.lengths is None:
            # no parameter named like a mask: each defaulting to None tried as the mask first (`key_padding=None`,
            # `adj=None`), kept where the code applies it to its scores or weights (maskuse.py)
            candidates = [self.plan.by_use(n) for n in self.plan.optional if n not in self.plan.given] + candidates
        if asked.rope and self.plan.tables_optional:  # its own RoPE tables first (all of its code runs), made from
            # positions where it reads them (a 4.4x layer's rotary_emb(value, position_ids)), else trace's
            candidates = [c for p in candidates for c in (
                p.with_own_tables(), *([p.with_own_tables().with_positions_given()] if p.position_ids_later else []),
                p)]
        if self.plan.embeddings:  # position embeddings fed first (all of its code runs), in the input's shape, then
            # in a relative embedding's (ESPnet's pos_emb [1, 2n-1, d]), else left None
            from attnscope.usertrace.feeds import embedding_forms

            candidates += [c.with_embedding_form(form) for form in embedding_forms(asked.layout) for c in candidates] \
                + [c.without_embeddings() for c in candidates]
        unread: tuple[Plan, tuple[Any, ...]] | None = None  # the first run whose code read no op of its mask
        handed: dict[str, list[tuple[int, ...]]] = {}  # mask parameter -> the shapes it was handed, in order
        if asked.mask:  # last, a mask per sequence folded with the heads, [n_batch·n_head, n_Q, n_K]: the 3-D
            # attn_mask nn.MultiheadAttention takes (`attn_mask=~mask` beside its key_padding_mask), where no
            # parameter runs on the mask in any other shape
            candidates += [dataclasses.replace(c, heads_folded=True) for c in candidates]
        for tried in candidates:
            # the mask to the first mask parameter the code runs with (fairseq's key_padding_mask [n_batch, n_K]
            # for a padding file, where its attn_mask takes [n_Q, n_K]); in cross-attention, the first it reads
            # (transformers' Perceiver and BERT read inputs_mask, encoder_attention_mask with a memory, never their
            # attention_mask), else the first it runs with. A mask parameter named for the rule keeps it (a plant
            # that reads the other one is then seen)
            ran = self.run_plan(asked, tried)
            tried, ran = not_weights(tried, ran, functools.partial(self.run_plan, asked))
            if tried.mask is not None:
                handed.setdefault(tried.mask, []).extend(s for s in ran[0].masks_handed
                                                         if s not in handed.get(tried.mask, []))
            trial = tried.mask_by_use and not self.plan.mask_by_use  # a parameter tried as the mask by its use
            made = made or (None if trial else ran)
            if ran[2].failure is not None:
                continue
            if trial:
                use = maskuse.applied(ran[2].records, tried.mask) if tried.mask is not None else None
                if use is None:
                    continue
                ran[0].notes.append(f"{tried.mask}: given the --mask file, as your code applies it to its scores or "
                                    f"weights (line {use.line}: {use.details.get('op', use.call)}), though it is not "
                                    "named like a mask")
            if tried.rule_beside and not (ran[0].also_masked and tried.mask
                                          and masking.reads(ran[2].records, tried.mask)):
                continue  # the padding and the rule each read by the code, else none of them split so
            if ran[0].allowed is not None and tried.mask not in (None, causal) and not tried.self_attention \
                    and not masking.reads(ran[2].records, tried.mask):
                if _memorys(tried.mask) and any(not _memorys(m) for m in self.plan.other_masks):
                    # the memory's own mask parameter beside the queries' (BLIP's, BERT's encoder_attention_mask
                    # beside attention_mask): the memory's padding is its, by its name, read or not; code that
                    # applies the queries' mask to the memory's keys instead then shows the padding unapplied
                    ran[0].notes.append(f"{tried.mask}: given the key padding of the memory, as its name says, "
                                        "though your code never reads it; your other mask parameters were given "
                                        "None")
                    return self.keep_run(tried, ran)
                unread = unread or (tried, ran)
                continue
            if asked.rope and tried.tables_unasked == [] and not tried.tables and self.plan.tables:
                tried, ran = self._own_tables_rotate(asked, tried, ran)
            return self.keep_run(tried, ran)
        if unread is not None:
            return self.keep_run(*unread)
        assert made is not None
        return self.refused_mask(asked, made, handed)

    def _own_tables_rotate(self, asked: TraceOptions, tried: Plan, ran: Made) -> tuple[Plan, Made]:
        """(plan, run) of the code given RoPE's tables by trace, where it ran given None (its own tables, as
        transformers' 4.4x layers make them) and lines up better given them: Qwen-1's `rotary_pos_emb_list=None`
        skips RoPE altogether, which is no table of its own (given None it never rotates: rope.not_applied), and
        LightGlue's `if position_embeddings is not None`. Else the run given None, as it is."""
        from attnscope.usertrace.lineup import line_up
        from attnscope.usertrace.maskranks import agree
        from attnscope.usertrace.ranking import better_fit

        if self.weighted is None:
            return tried, ran
        given = dataclasses.replace(tried, tables=list(self.plan.tables), tables_optional=True,
                                    nones=[n for n in tried.nones if n not in self.plan.tables],
                                    said={k: v for k, v in tried.said.items() if k not in self.plan.tables})
        other = self.run_plan(asked, given)
        if other[2].failure is not None:
            return tried, ran
        mine = line_up(self.weighted, self.shapes, ran[0], ran[2].records, asked.train, self.spec)
        if mine.divergence is None or not mine.divergence.names("rope.not_applied"):
            return tried, ran  # tables of its own, of another base or pairing, are its to answer for
        if not agree(ran[2].result, other[2].result):  # given None it rotates nothing, given trace's tables its
            # output changes: they are its RoPE, in whatever form of the pair it reads (LightGlue's interleaved cos
            # and sin, which trace_tables.other_layouts reads once the run is kept), never its own tables
            return given, other
        theirs = line_up(self.weighted, self.shapes, other[0], other[2].records, asked.train, self.spec)
        return (given, other) if better_fit(theirs, mine) else (tried, ran)

    def refused_mask(self, asked: TraceOptions, made: Made, handed: dict[str, list[tuple[int, ...]]]) -> Made:
        """`made`, or where the code refuses its mask itself, an assert or a raise on the line that reads its mask
        parameter (AudioCraft's `assert attn_mask is None` where its own causal=True makes the mask), the code run
        with no mask at all, its mask parameters None: kept where it runs (the code masks by itself, or not, and the
        reference's mask is compared with what it does), returned where it gets further; never "your code raised" on
        a mask trace made up."""
        from attnscope.usertrace.load import names_parameter

        failed = made[2].failure
        masks = [m for m in (self.plan.mask, *self.plan.other_masks) if m is not None]
        named = names_parameter(self.target.source, failed.line, masks) if failed is not None and not failed.op \
            else None  # an assert or a raise of its own; a tensor op that fails on the mask is read by its shapes
        if failed is None or named is None:
            return made
        if asked.mask:  # a file the code must apply: it may raise on it for reading its input otherwise (fairseq's
            # time-first `bsz`), so every reading is tried before the code is run without it (trace_layouts.first_run)
            self.refusal = named, tuple(handed.get(named, ())), failed
            return made
        return self.run_bare(asked, made, (named, (), failed))

    def run_bare(self, asked: TraceOptions, made: Made, refusal: tuple[str, tuple[tuple[int, ...], ...], Failure]
                 ) -> Made:
        """The code run with no mask at all, its mask parameters None, where it refused the parameter `refusal` names:
        kept where it runs, returned where it gets further than `made`; the plan says which shapes it refused."""
        named, shapes, failed = refusal
        bare = self.plan.without_masks()
        ran = self.run_plan(asked, bare)
        again = ran[2].failure
        if again is not None and again.line == failed.line:
            return made
        said = (f"{named} = None: your code raised on the mask trace gave it (line {failed.line}: {failed.message}) "
                "and runs without one; the reference's mask is compared with what your code does without it")
        bare = dataclasses.replace(bare, said={**bare.said, named: said}, refused=(
            named, shapes, f"line {failed.line}: {failed.message}"))
        return self.keep_run(bare, ran) if again is None else ran

    def keep_run(self, tried: Plan, ran: tuple[Any, ...]) -> Made:
        """The run `attempt` keeps, its plan now the run's, its inputs as the run reads them (a module's own
        queries, position embeddings, a norm before its projections)."""
        from attnscope.usertrace import joint, keyinputs, posembed, prefixkeys, prenorm, qkinput, queries

        self.plan = tried
        own = queries.find(ran[2].records, ran[0], self.weighted)  # Perceiver's latents: n_Q is theirs
        if own is not None:
            if queries.apply(ran[0], own) and not own.keys:  # Perceiver IO's layernorm2(inputs) before key, value
                prenorm.read(ran[2].records, ran[0], self.weighted, posembed.projections(
                    self.weighted, ran[2].records, self.shapes.n_head, self.shapes.fixed.get("d_head")))
        else:  # DETR's q_proj(x + pos), k_proj(x + pos), v_proj(x)
            held = posembed.projections(self.weighted, ran[2].records, self.shapes.n_head,
                                        self.shapes.fixed.get("d_head")) \
                if not ran[0].own else {}
            posembed.read(ran[2].records, ran[0], self.weighted, held, tried.embeddings)
            # vit-pytorch's x = self.norm(x) before to_qkv: the normed x is the projections' input
            prenorm.read(ran[2].records, ran[0], self.weighted, held)
            # Wav2Vec2-Conformer's linear_q(rotated x), linear_k(rotated x), linear_v(x)
            qkinput.read(ran[2].records, ran[0], self.weighted, held)
            # Segformer's keys and values from LayerNorm(Conv2d(x)): that tensor is their input, n_K its length
            reduced = keyinputs.find(ran[2].records, ran[0], self.weighted, held)
            if reduced is not None:
                keyinputs.apply(ran[0], reduced)
            # Idefics2's k_proj(torch.concat([context, latents], dim=-2)), the queries q_proj(latents)
            joined = queries.input_keys(ran[2].records, ran[0])
            if joined is not None:
                queries.apply_input_keys(ran[0], joined)
            else:  # Perceiver AR's torch.cat((to_kv(context)[0], to_kv(x)[0]), dim=1): joined after the projection
                parts = prefixkeys.find(ran[2].records, ran[0])
                if parts is not None:
                    prefixkeys.apply(ran[0], parts)
            # CogVideoX's torch.cat([encoder_hidden_states, hidden_states], dim=1) before to_q, to_k, to_v
            joint.apply_joined(ran[2].records, ran[0])
        return cast("Made", ran)

    def in_layouts(self, asked: TraceOptions, made: tuple[Any, ...]) -> tuple[tuple[Any, ...], str | None]:
        """`made`, the code run under `asked`, where it ran; else the code handed its cache in each layout real code
        keeps (cachelayouts.py; [n_batch, n_cache, n_kv_head, d_head], mistral-inference's, ...), those that meet
        the op it raised on first: the first it runs on, with the note that says so."""
        from attnscope.usertrace import cachelayouts

        if made[2].failure is None or made[0].cache is None or self.plan.cache is None:
            return made, None
        failed = made[2].failure
        unfed: list[Any] = []
        found = self.cache_forms(asked, made, cachelayouts.others(
            failed, made[0].cache, apart=self.plan.cache_values is not None, n_new=made[0].sizes.get("n_Q", 0)),
            unfed)
        named = any(isinstance(key, str) for path in unfed for key in path)  # the code reads its cache by names
        if found is None and unfed and self.plan.cache is not None and (named or failed.message.startswith("KeyError")):
            from attnscope.usertrace.keyedcache import unfed as unfed_words

            raise UsageError(unfed_words(self.plan.cache, unfed))  # keys of a dict cache trace cannot answer
        if found is None:
            return made, None
        again, heads = found
        return again, cachelayouts.note(self.cache_layout, failed, cache_parameters(self.plan)) + heads

    def cache_forms(self, asked: TraceOptions, made: tuple[Any, ...], layouts: list[str],
                    unfed: list[Any] | None = None) -> tuple[tuple[Any, ...], str] | None:
        """The code run on its cache handed in each of `layouts` in turn, first with the key/value heads the op it
        raised on says, where it says a count other than trace's (cachelayouts.heads_met: the new keys it writes into
        the cache hold them; a fused projection's GQA says none before a run): the first run that runs, and the
        words of the heads read (""), its layout and heads kept; None where none runs. `unfed` gets the keys a dict
        cache could not answer where the code raised on them (keyedcache.py)."""
        from attnscope.usertrace import cachelayouts
        from attnscope.usertrace.keyedcache import Keyed

        kept = self.cache_layout, self.shapes
        heads = cachelayouts.heads_met(made[2].failure, made[0].sizes)
        counts: list[tuple[int | None, Any]] = [(heads, made[2].failure)] if heads else []
        counts.append((None, None))
        for count, failed in counts:
            if count is not None:
                self.shapes = dataclasses.replace(kept[1], fixed=kept[1].fixed | {"n_kv_head": count})
            for layout in layouts:
                self.cache_layout = layout
                again = attempted(self.attempt, asked)
                if again is not None and again[2].failure is None:
                    return again, "" if count is None else (
                        f"; n_kv_head = {count}, read from the new keys your code writes into it (line {failed.line})")
                given = again[1].values.get(self.plan.cache) if again is not None else None
                if unfed is not None and isinstance(given, Keyed) and again is not None \
                        and again[2].failure.message.startswith(("KeyError", "TypeError", "AttributeError")):
                    # a probe the code raised on as an int (keyedcache.Probe): a key it reads as something else
                    raised = again[2].failure.message
                    unfed += [key for key in given.unfed("'int'" in raised) if key not in unfed]
                met = cachelayouts.heads_met(again[2].failure, again[0].sizes) if again is not None else None
                if again is not None and count is None and met and all(c != met for c, _ in counts):
                    counts.append((met, again[2].failure))  # the heads the op met: tried next
            self.shapes = kept[1]
        self.cache_layout = kept[0]
        return None



def padding_file(asked: TraceOptions) -> bool:
    """Whether the --mask file is key padding alone: [n_batch, n_K] (rows that are not its columns, no cache), or
    one of a single query row ([.., 1, n_K])."""
    if not asked.mask:
        return False
    from attnscope import masks
    from attnscope.tensors import load_tensor

    shape = masks.normalize(load_tensor(asked.mask)).shape
    return (len(shape) == 2 and shape[0] != shape[1] and not asked.cache) or (len(shape) >= 3 and shape[-2] == 1)


def attempted(attempt: Any, asked: TraceOptions) -> tuple[Any, ...] | None:
    """The code run under `asked`; None where those inputs cannot be made."""
    try:
        return cast("tuple[Any, ...]", attempt(asked))
    except UsageError:
        return None


def cache_parameters(plan: Plan) -> tuple[str, ...]:
    """The parameter a decode step's cache goes to, or the two its keys and values go to apart."""
    return tuple(p for p in (plan.cache, plan.cache_values) if p is not None)


def table_width(spec: Spec, plan: Plan, d_head: int | None) -> int | None:
    """How wide RoPE's tables are made: the share of each head the reference rotates, where the forward takes them
    and that share is less than the head; None for the whole head."""
    if not plan.tables or not spec.rope_fraction or not d_head:
        return None
    return int(d_head * spec.rope_fraction)


def form_spec(spec: Spec, form: Any, d_head: int) -> Spec:
    """The reference for code that runs on RoPE's tables in `form` (tableforms.py): a share of each head turned where
    they are narrower than the head and laid out for a pairing; one angle a pair leaves the pairing to the code, where
    --rope-pairing does not ask for one (then checked)."""
    if form.pairs:  # GPT-J's half-width tables over its rotary_dim: that share turned
        share = 2 * form.width
        return spec if share >= d_head else dataclasses.replace(spec, rope_fraction=share / d_head,
                                                                fraction_from_module=True)
    if form.layout or form.turned:  # the pair laid out for another pairing (Cohere's interleaved tables), or
        # half-split ones the code lays out for the one it turns in (GLM's): the reference pairs so
        spec = dataclasses.replace(spec, rope_pairing=form.layout or form.turned)
    read = spec.pairing_read or not spec.pairing_asked  # the tables', not --rope-pairing's
    if form.width < d_head:
        return dataclasses.replace(spec, rope_fraction=form.width / d_head, fraction_from_module=True,
                                   pairing_asked=True, pairing_read=read)
    return dataclasses.replace(spec, pairing_asked=True, pairing_read=read)


def _paddings(name: str) -> bool:
    """Whether a mask parameter is named for key padding (`key_padding_mask`, `padding_mask`, `src_pad_mask`)."""
    words = set(name.lower().split("_"))
    return bool(words & {"padding", "pad"}) and "mask" in words


def _memorys(name: str) -> bool:
    """Whether a mask parameter is named for a memory's keys (`encoder_attention_mask`, `memory_key_padding_mask`,
    `encoder_mask`), not the queries' own sequence."""
    words = set(name.lower().split("_"))
    return bool(words & {"encoder", "memory", "enc", "context", "cross"}) and bool(words & {"mask", "padding"})
