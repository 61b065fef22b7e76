"""The catalog of mistakes `trace` names by experiment: each entry a named transformation of the reference's run
(rerun.replay with one change) and the words that say what the rerun reproduced.

After the first divergence, diagnose.py runs the reference again with each entry applied; an entry names the
cause only where its run gives the user's own tensors back to tolerance (rerun.reproduces: the user's output, and
the tensor where the line-up diverged). Where two entries compute the same numbers (scores multiplied by the mask
or filled with 0; the heads tiled or a grouped einsum in the wrong order), the user's own op decides which words.
The catalog in words, with an example of each message, is docs/trace.md's "The catalog of mistakes".
"""

from __future__ import annotations

from itertools import chain

from attnscope.usertrace.biastrials import (
    trials_alibi_after_softmax,
    trials_alibi_queries,
    trials_alibi_sign,
    trials_alibi_slopes,
    trials_softcap_after_mask,
    trials_softcap_form,
    trials_softcap_missing,
    trials_softcap_untold,
    trials_softcap_value,
    trials_t5_after_softmax,
    trials_t5_transposed,
)
from attnscope.usertrace.headtrials import trials_merge, trials_merge_permuted, trials_split
from attnscope.usertrace.inputtrials import (
    inputs_swapped,
    keys_from_value_input,
    projections_swapped,
    values_from_key_input,
)
from attnscope.usertrace.keytrials import trials_keys_from_values
from attnscope.usertrace.kvtrials import trials_swapped, trials_tiled, trials_values_from_keys
from attnscope.usertrace.maskmirror import trials_transposed
from attnscope.usertrace.masktrials import (
    trials_after_softmax,
    trials_no_window,
    trials_off_by_one,
    trials_on_queries,
    trials_polarity,
    trials_unmasked,
    trials_upper_left,
    trials_window_untold,
    trials_zero,
)
from attnscope.usertrace.normtrials import trials_axis, trials_missing, trials_place, trials_values_normed
from attnscope.usertrace.patterntrials import trials_pattern_transposed
from attnscope.usertrace.queryorder import trials_query_order, trials_split_transposed
from attnscope.usertrace.ropetrials import (
    trials_base,
    trials_fraction,
    trials_not_applied,
    trials_on_values,
    trials_pairing,
    trials_positions,
    trials_untold,
)
from attnscope.usertrace.runtrials import trials_cache_order, trials_dropout, trials_float16
from attnscope.usertrace.scaletrials import (
    trials_scale_d,
    trials_scale_d_model,
    trials_scale_half,
    trials_scale_multiplied,
    trials_scale_n,
    trials_scale_none,
    trials_scale_other,
    trials_scale_twice,
    trials_softmax_axis,
)
from attnscope.usertrace.trials import Experiment

CATALOG: tuple[Experiment, ...] = (
    Experiment("heads.split_without_permute", "heads", "heads split by a view without the transpose", trials_split),
    Experiment("rope.pairing", "RoPE", "the other pairing, or tables of one pairing with the other's rotation",
               trials_pairing),
    Experiment("rope.positions", "RoPE", "a decode step's new tokens rotated from position 0", trials_positions),
    # rope.fraction before rope.base: frequencies over the whole head turn as base^fraction over the rotated part
    Experiment("rope.fraction", "RoPE", "only a fraction of each head rotated (rotary_pct)", trials_fraction),
    Experiment("rope.base", "RoPE", "another base (rope_theta)", trials_base),
    Experiment("rope.not_applied", "RoPE", "queries and keys never rotated", trials_not_applied),
    Experiment("rope.untold", "RoPE", "RoPE the reference was not told of (--rope)", trials_untold),
    Experiment("rope.on_values", "RoPE", "the values rotated as the keys are", trials_on_values),
    Experiment("kv.swapped", "keys and values", "K and V swapped (the projections' roles, or their inputs)",
               lambda b: chain(trials_swapped(b), inputs_swapped(b), projections_swapped(b))),
    Experiment("kv.values_from_keys", "keys and values", "the values taken from the keys (or the key input)",
               lambda b: chain(trials_values_from_keys(b), values_from_key_input(b))),
    Experiment("kv.keys_from_values", "keys and values", "the keys taken from the values (the value projection "
               "making the keys, or the key projection fed the value input)",
               lambda b: chain(trials_keys_from_values(b), keys_from_value_input(b))),
    Experiment("qknorm.missing", "qk-norm", "q or k (or both) never normalized where the reference normalizes both",
               trials_missing),
    Experiment("qknorm.place", "qk-norm", "the qk-norm on the other side of RoPE (after it where the reference norms "
               "before, or before it)", trials_place),
    Experiment("qknorm.axis", "qk-norm", "the qk-norm over each head where the reference norms the whole projection, "
               "or the other way round", trials_axis),
    Experiment("qknorm.on_values", "qk-norm", "the values normalized by the keys' norm too", trials_values_normed),
    Experiment("cache.order", "cache", "the cache joined after the new keys", trials_cache_order),
    Experiment("gqa.tiled", "grouped-query",
               "key/value heads tiled (.repeat, an expand's new axis before the heads') instead of interleaved",
               lambda b: trials_tiled(b, True)),
    Experiment("gqa.group_order", "grouped-query", "a grouped einsum with the query heads in the wrong order",
               lambda b: trials_tiled(b, False)),
    Experiment("gqa.query_order", "query heads", "the query heads laid in another order than the checkpoint's (q "
               "viewed [.., n_group, n_kv_head, ..] for [.., n_kv_head, n_group, ..], then flattened)",
               trials_query_order),
    Experiment("heads.split_transposed", "query heads", "the queries' projection split (d_head, n_head) for (n_head, "
               "d_head): view(.., d, h).transpose for view(.., h, d)", trials_split_transposed),
    Experiment("scale.none", "scale", "scores not scaled (or 1/√d_head where --scale gives the model's own)",
               trials_scale_none),
    Experiment("scale.twice", "scale", "scores scaled twice", trials_scale_twice),
    Experiment("scale.half", "scale", "one share of a split scale left out (q · d_head^-0.25 without k's)",
               trials_scale_half),
    Experiment("scale.d_head", "scale", "scores divided by d_head, not √d_head", trials_scale_d),
    Experiment("scale.d_model", "scale", "scores divided by √d_model, not √d_head", trials_scale_d_model),
    Experiment("scale.n", "scale", "scores divided by another size (n_Q, n_K, n_head, d_model, d_V, ...) or its "
               "root", trials_scale_n),
    Experiment("scale.multiplied", "scale", "scores multiplied by √d_head", trials_scale_multiplied),
    Experiment("scale.other", "scale", "scores scaled by a number no size of the run gives, solved from your "
               "scores", trials_scale_other),
    Experiment("softcap.value", "softcap", "the scores capped at another C than the reference's", trials_softcap_value),
    Experiment("softcap.missing", "softcap", "the scores never capped where the reference caps them",
               trials_softcap_missing),
    Experiment("softcap.after_mask", "softcap", "the cap applied after the mask (masked scores capped to -C)",
               trials_softcap_after_mask),
    Experiment("softcap.form", "softcap", "tanh(s / C) without · C, or C · tanh(s) without / C, or the cap before "
               "the scale", trials_softcap_form),
    Experiment("softcap.untold", "softcap", "a cap of the code's own the reference was not told of (--softcap)",
               trials_softcap_untold),
    Experiment("float16.overflow", "precision", "q @ kᵀ in float16, past 65504", trials_float16),
    Experiment("alibi.sign", "ALiBi", "ALiBi's bias with its sign flipped", trials_alibi_sign),
    Experiment("alibi.slopes", "ALiBi", "other slopes than 2^(-8 h / n_head)", trials_alibi_slopes),
    Experiment("alibi.query_positions", "ALiBi", "a bias symmetric in i and j", trials_alibi_queries),
    Experiment("alibi.after_softmax", "ALiBi", "ALiBi's bias added after the softmax", trials_alibi_after_softmax),
    Experiment("t5.transposed", "T5 bias", "the position bias transposed", trials_t5_transposed),
    Experiment("t5.after_softmax", "T5 bias", "the position bias added after the softmax", trials_t5_after_softmax),
    Experiment("mask.polarity", "mask", "the mask read the other way round", trials_polarity),
    Experiment("mask.after_softmax", "mask", "the mask applied after the softmax", trials_after_softmax),
    Experiment("mask.multiplied", "mask", "the scores multiplied by the mask", lambda b: trials_zero(b, True)),
    Experiment("mask.filled_with_0", "mask", "masked scores filled with 0", lambda b: trials_zero(b, False)),
    Experiment("mask.off_by_one", "mask", "the causal band one key wider or narrower", trials_off_by_one),
    Experiment("mask.no_window", "mask", "the rule's sliding window left out (its causal mask kept)", trials_no_window),
    Experiment("mask.not_applied", "mask", "the mask never applied (a mask the code builds, slices or is given, "
               "left out)", trials_unmasked),
    Experiment("mask.window_untold", "mask", "a window of the code's own the reference was not told of (--window)",
               trials_window_untold),
    Experiment("mask.on_queries", "mask", "a key-padding mask applied on the queries", trials_on_queries),
    Experiment("mask.transposed", "mask", "the mask (or its causal rule) transposed: the queries' and keys' axes "
               "exchanged", trials_transposed),
    Experiment("mask.upper_left", "mask", "is_causal=True (upper-left) in a decode step", trials_upper_left),
    Experiment("softmax.axis", "softmax", "the softmax over another axis than the keys", trials_softmax_axis),
    Experiment("pattern.transposed", "pattern", "the attention weights transposed before they meet the values "
               "(`attn.transpose(-2, -1) @ v`, n_Q = n_K)", trials_pattern_transposed),
    Experiment("heads.merge_without_transpose", "heads", "heads merged by a view before the permute", trials_merge),
    Experiment("heads.merge_wrong_permute", "heads", "heads merged after another permute than (0, 2, 1, 3)",
               trials_merge_permuted),
    Experiment("dropout.left_on", "dropout", "dropout active in eval() mode", trials_dropout),
)
