"""Multi-head attention as the tutorials write it, and as today's models shape it.

Four Linear layers, split into heads, SDPA in every head (through `attention.sdpa`, so the two never
drift), merge, project. The variants are arguments: `n_kv_head` (grouped-query attention; 1 is
multi-query), `d_head` decoupled from `d_feat / n_head` (Gemma), `qk_norm` (an RMSNorm of Q and K before RoPE,
per head or over the whole projection, or per head after RoPE as nGPT's, with learned weights `q_norm.weight` and
`k_norm.weight`; qknorm.py),
`rope` (rotary embeddings after the split, transformers' `apply_rotary_pos_emb`), `causal`, `window` (and
`window_side`), `chunk`, `softcap`, `alibi`, `scale`, `temperature` (Llama 4's per-query scale, after RoPE),
`sinks` (a learned logit per head, the module's `sinks` parameter: GPT-OSS's), and a KV cache passed to
`forward`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from attnscope import masks
from attnscope.attention import dot_product as attention
from attnscope.attention import rows, stages
from attnscope.attention import sinks as sinks_
from attnscope.attention.dot_product import HeadInputs, resolve_spec
from attnscope.attention.stages import HALF, Names, RopeTables, merge_heads
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec, check_kv_heads, divisors_near
from attnscope.tensors.weight_threads import unhooked
from attnscope.trace import Trace, discard
from attnscope.variants import alibi as alibi_

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from attnscope.trace import Recorder
    from attnscope.variants.qknorm import QkNorm
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning


class MultiHeadAttention(nn.Module):
    """`forward(Q, K=None, V=None, mask=None, cache=None, position_bias=None)` returns a `Trace` whose steps are
    `Q_feat, K_feat, V_feat, Q_split, K_split, V_split, [Q_normed, K_normed], [cos, sin, Q_rot, K_rot],
    [attn_scales, Q_tuned], [K_cache, V_cache, K_cat, V_cat], [K_rep, V_rep], scores, [capped_scores],
    [alibi_bias | position_bias, biased_scores], [masked_scores], [sinks], attention, [sink_weight], x_raw,
    x_rsh1, x_rsh2, x`, so `out["x"]` is the output. Cross-attention: K (and V) are another sequence's states,
    an encoder's output (`[n_batch, n_K, d_feat]`), projected by W_k and W_v. Scores are scaled by
    `1/sqrt(d_head)` unless `scale` is given, as `torch.nn.MultiheadAttention` does. With `record=False` the
    steps are not kept and the trace holds only `x`: the attention runs as eager's does, in blocks of query rows
    (rows.py), or with `fused=True` in `F.scaled_dot_product_attention`.

    W_q projects d_feat to n_head·d_head, W_k and W_v to n_kv_head·d_head, W_o n_head·d_head back to d_feat.
    With `qk_norm`, `q_norm.weight` and `k_norm.weight` are `[d_head]` ("head") or `[n_head·d_head]` and
    `[n_kv_head·d_head]` ("proj"), ones to start with (zeros for Gemma's offsets, `(1 + w)`), as transformers
    names and initialises them, so a checkpoint's weights load into the state dict as they are; a LayerNorm
    qk-norm (`QkNorm(kind="layer")`, timm's default) adds `q_norm.bias` and `k_norm.bias`, zeros to start.
    `cache=(K_cache, V_cache)`, each `[n_batch, n_kv_head, n_cache, d_head]`, holds the keys (already
    rotated, as transformers' caches hold them) and values of earlier positions; the new queries and keys
    then sit at positions n_cache onwards, and `causal` should be "lower-right".
    With `sinks=True` the module owns `sinks` `[n_head]` (an `nn.Parameter` in its state dict, drawn N(0, 1)
    like GPT-OSS's before training: load or copy the values you want), one logit per head (sinks.py).
    `d_feat_name` names the input's width in the steps' dims and ops: d_feat, or a model's layer's d_model.
    """

    def __init__(
        self,
        d_feat: int,
        n_head: int,
        bias: bool = True,
        dropout_p: float = 0.0,
        record: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        n_kv_head: int | None = None,
        d_head: int | None = None,
        out_bias: bool | None = None,
        scale: float | None = None,
        causal: bool | str | None = False,
        window: int | None = None,
        window_side: str | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        rope: Rope | None = None,
        sinks: bool = False,
        spec: AttentionSpec | None = None,
        chunk: int | None = None,
        temperature: TemperatureTuning | None = None,
        qk_norm: str | QkNorm | None = None,
        d_kv_in: int | None = None,
        d_v: int | None = None,
        d_v_in: int | None = None,
        fused: bool = False,
        page: Callable[..., Tensor] | None = None,
        d_feat_name: str = "d_feat",
    ) -> None:
        super().__init__()
        self.fused = fused  # unrecorded: PyTorch's fused kernel (attnscope bench races it), not eager's order
        # heads made of every n_head-th feature (view(.., d_head, n_head)) and merged back so: a checkpoint's layout
        # trace reads from code (usertrace/stridedheads.py); False: BERT's split and merge
        self.strided_heads = False
        self.page = page  # a family page's attention method, run on self-attention (llama.py's attend)
        self.spec = resolve_spec(spec, n_kv_head=n_kv_head, scale=scale, causal=causal, window=window,
                                 window_side=window_side, softcap=softcap, alibi=alibi, rope=rope, sinks=sinks,
                                 chunk=chunk, temperature=temperature, qk_norm=qk_norm)
        n_kv_head = n_head if self.spec.n_kv_head is None else self.spec.n_kv_head
        _check_sizes(d_feat, n_head, n_kv_head, d_head)
        if not 0.0 <= dropout_p < 1.0:
            raise UsageError(f"dropout_p = {dropout_p} must be in [0, 1)")
        self.d_feat, self.n_head, self.n_kv_head = d_feat, n_head, n_kv_head
        self.d_kv_in = d_feat if d_kv_in is None else d_kv_in  # what K and V are read from (a context's width)
        # what V alone is read from, where it is another width than the keys' input (MobileBERT's values read the
        # full hidden_size while its queries and keys read the bottleneck's true_hidden_size; nn.MultiheadAttention's
        # vdim beside kdim)
        self.d_v_in = self.d_kv_in if d_v_in is None else d_v_in
        self.d_head = d_feat // n_head if d_head is None else d_head
        # each value head's width, d_V: d_head unless the values are narrower or wider than the keys (Perceiver IO's
        # v_channels, DeepSeek's v_head_dim beside d_nope + d_rope); W_v writes n_kv_head·d_V, W_o reads n_head·d_V
        self.d_v = self.d_head if d_v is None else d_v
        if self.d_v <= 0:
            raise UsageError(f"d_v ({self.d_v}) must be positive")
        self.n_group = n_head // n_kv_head  # query heads per key/value head
        # the names of the key/value heads' axis and of the projections' widths (stages.axes: the input's width is
        # `d_feat_name`, a model's d_model), and the qk-norm, typed
        self.d_feat_name = d_feat_name
        self.kv, self.wide_q, self.wide_kv = stages.axes(n_head, n_kv_head, self.d_head, d_feat, d_feat_name)
        self.d_v_name = "d_head" if self.d_v == self.d_head else "d_V"  # the values' per-head axis
        self.wide_v, self.wide_out = (self.wide_kv, self.wide_q) if self.d_v == self.d_head else \
            (f"{self.kv}·d_V", d_feat_name if n_head * self.d_v == d_feat else "n_head·d_V")
        self.qk_norm = self.spec.norm
        if self.spec.rope is not None:
            self.spec.rope.check(self.d_head)
        self.dropout_p, self.record = dropout_p, record
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.W_q = nn.Linear(d_feat, n_head * self.d_head, bias=bias, **factory)
        self.W_k = nn.Linear(self.d_kv_in, n_kv_head * self.d_head, bias=bias, **factory)
        self.W_v = nn.Linear(self.d_v_in, n_kv_head * self.d_v, bias=bias, **factory)
        self.W_o = nn.Linear(n_head * self.d_v, d_feat, bias=bias if out_bias is None else out_bias, **factory)
        # GPT-OSS's `sinks`: one logit per head, drawn after the projections so their seeded values stay the same
        self.sinks = nn.Parameter(torch.randn(n_head, **factory)) if self.spec.sinks else None
        norm = self.spec.norm
        if norm is not None:
            self.q_norm = NormWeight(norm.width(n_head, self.d_head), norm.offset, norm.layer, **factory)
            self.k_norm = NormWeight(norm.width(n_kv_head, self.d_head), norm.offset, norm.layer, **factory)

    def forward(self, Q: Tensor, K: Tensor | None = None, V: Tensor | None = None, mask: Tensor | None = None,
                cache: tuple[Tensor, Tensor] | None = None, position_bias: Tensor | None = None) -> Trace:
        if self.page is not None and K is None and V is None and position_bias is None:
            return self._page(Q, mask, cache)
        K = Q if K is None else K
        V = K if V is None else V
        self._check_inputs(Q, K, V, cache)
        mask = masks.for_heads(mask)  # [n_batch, 1, n_Q, n_K] from a caller's [n_batch, n_Q, n_K]
        # A decode step: the new queries come after the cached positions (causal aligns lower-right).
        spec = self.spec if cache is None else self.spec.with_cache(cache[0].shape[-2])
        trace = Trace()
        add = trace.add if self.record else discard
        tables = self.rope_tables(Q, K.shape[1], cache)
        Q_h, K_h, V_h, names = self._heads(add, Q, K, V, cache, spec, tables)
        spec = spec.after_stages()
        dropout_p = self.dropout_p if self.training else 0.0
        if self.record:
            x_raw = attend(trace, Q_h, K_h, V_h, mask, names, spec, n_group=self.n_group, dropout_p=dropout_p,
                           position_bias=position_bias, sinks=self.sinks)
            stages.merge(trace, x_raw, self.W_o, self.wide_out, self.d_v_name, self.strided_heads)
            return trace
        x_raw = self._fused(Q_h, K_h, V_h, mask, dropout_p, spec, position_bias)  # [n_batch, n_head, n_Q, d_head]
        if self.strided_heads:  # head the fastest, as a strided split laid the features
            x = self.W_o(x_raw.permute(0, 2, 3, 1).flatten(-2))  # [n_batch, n_Q, d_feat]
        else:
            x = self.W_o(merge_heads(x_raw))  # [n_batch, n_Q, d_feat]
        kernel = "F.scaled_dot_product_attention" if self.fused else "eager attention by blocks of query rows"
        trace.add("x", x, ("n_batch", "n_Q", "d_feat"), f"W_o(merge_heads({kernel}(...)))")
        return trace

    def _page(self, X: Tensor, mask: Tensor | None, cache: tuple[Tensor, Tensor] | None,
              record: bool | None = None) -> Trace:
        """The page's attention on X, each step recorded (or, with `record=False`, the output alone, as `forward`
        records it then). The mask is built here, before the attention (masks.prepare, as transformers'
        create_causal_mask before the layers), for the step's spec: after the cache, rope, temperature and qk-norm
        left to the page's stages. The page's stages set their products' threads themselves (stages.wide), so it
        runs without the per-op thread hook."""
        with unhooked():
            return self._run_page(X, mask, cache, self.record if record is None else record)

    def _run_page(self, X: Tensor, mask: Tensor | None, cache: tuple[Tensor, Tensor] | None, record: bool) -> Trace:
        self._check_inputs(X, X, X, cache)
        if self.sinks is not None:
            sinks_.checked(self.sinks, self.n_head)  # a checkpoint's sinks: one finite logit per head
        n_cache = 0 if cache is None else cache[0].shape[-2]
        built = self.call_mask(X, n_cache, mask, build=record)
        tables = self.rope_tables(X, X.shape[1], cache, built.offset)
        trace = Trace()
        assert self.page is not None
        x = self.page(self, X, trace if record else discard, cache, built, tables)  # [n_batch, n_Q, d_feat]
        if not record:
            trace.add("x", x, ("n_batch", "n_Q", "d_feat"),
                      "W_o(merge_heads(eager attention by blocks of query rows(...)))")
        return trace

    def call_mask(self, X: Tensor, n_cache: int, mask: Tensor | None = None, *, build: bool = True) -> masks.Mask:
        """The mask of a call on X `[n_batch, n_Q, d_feat]` after `n_cache` cached positions, with a caller's `mask`
        (`[n_batch, n_Q, n_K]`, or one that broadcasts to the scores), built before the attention (masks.prepare,
        as transformers' create_causal_mask before the layers) for the step's spec: after the cache, with the rope,
        temperature and qk-norm left to the page's stages. `build=False`: nothing built (an unrecorded run)."""
        n_Q = X.shape[1]
        spec = self.sdpa_spec(self.spec.with_cache(n_cache))
        mask = masks.for_heads(mask)  # [n_batch, 1, n_Q, n_K] from a caller's [n_batch, n_Q, n_K]
        acc = torch.float32 if X.dtype in HALF else X.dtype  # the scores' dtype
        return masks.prepare(spec, n_Q, n_cache + n_Q, X.device, mask, scores=(X.shape[0], self.n_head, n_Q,
                                                                              n_cache + n_Q),
                             dtype=acc, build=build)

    def rope_tables(self, X: Tensor, n_new: int, cache: tuple[Tensor, Tensor] | None,
                    offset: int | None = None) -> RopeTables | None:
        """RoPE's cos and sin for this call (stages.rope_tables; None without RoPE), made before the attention in
        every path (a page's, `forward`'s own stages, one head's inputs), as transformers' model makes
        position_embeddings before its layers: the queries of X from position `offset` (after a cache: n_cache),
        the `n_new` new keys after the cache; `offset` by default where the module's spec places them."""
        if self.spec.rope is None:
            return None
        return stages.call_tables(self.spec, X, n_new, cache, self.d_head, "d_head", offset)

    def empty_cache(self, n_batch: int = 1) -> tuple[Tensor, Tensor]:
        """A cache of no positions, `[n_batch, n_kv_head, 0, d_head]` twice: a prompt run as a decode step after
        nothing comes out with its keys and values joined (`K_cat`, `V_cat`), ready for the next step."""
        empty = torch.zeros(n_batch, self.n_kv_head, 0, self.d_head, dtype=self.W_q.weight.dtype,
                            device=self.W_q.weight.device)  # W_q: a layer reading another's keys has no W_k
        return empty, empty.new_zeros(n_batch, self.n_kv_head, 0, self.d_v)

    def cache_after(self, trace: Trace) -> tuple[Tensor, Tensor]:
        """What the cache holds after a decode step: the keys as the attention read them (rotated and normed) and
        the values, earlier positions and new (transformers' DynamicCache holds the same); nothing where the keys
        and values were another layer's (`K_shared`: Gemma 4's shared KV, transformers' DummyLayer)."""
        if "K_shared" in trace:
            return self.empty_cache(trace["x"].shape[0])
        return trace["K_cat"], trace["V_cat"]

    @staticmethod
    def sdpa_spec(spec: AttentionSpec) -> AttentionSpec:
        """What is left of `spec` for sdpa once `_heads` has run: Q and K are normed, rotated (and Q tuned) there,
        before the cache joins (forward/seq2seq_long.py reads it)."""
        return spec.after_stages()

    def head_inputs(self, X: Tensor, head: int) -> HeadInputs:
        """Self-attention's query head `head` and the key/value head that serves it, as the attention reads them
        (projected, normed, rotated, tuned), nothing recorded, with the spec of the rest: one head of `forward`,
        so a long input's blocks of query rows (models/forward/long.py) compute what the short trace does: a page's
        own attention method, stopped where it would attend (rows.heads_of), or the module's stages."""
        self._check_inputs(X, X, X, None)
        if self.page is not None:
            q, k, v = rows.heads_of(lambda: self._page(X, None, None, record=False))
        else:
            tables = self.rope_tables(X, X.shape[1], None)
            q, k, v, _ = self._heads(discard, X, X, X, None, self.spec, tables)
        g = head // self.n_group  # transformers' repeat_kv order
        sinks = None if self.sinks is None else self.sinks[head : head + 1]  # [1]
        # one query head over its own key/value head: no grouping left
        given = self.spec.alibi_slopes
        slope = (given[head] if given else float(alibi_.slopes(self.n_head)[head])) if self.spec.alibi else None
        spec = self.spec.after_stages().one_head(slope)
        return HeadInputs(q[:, head : head + 1], k[:, g : g + 1], v[:, g : g + 1], spec, sinks)  # [n_batch, 1, n, d]

    def all_head_inputs(self, X: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q from X and K, V from `keys` (X itself, or an encoder's memory across), every head, as the attention
        reads them (projected, normed, rotated, tuned), nothing recorded: `[n_batch, heads, n, d_head]` each, so
        an encoder-decoder's long input (models/forward/seq2seq_long.py) computes what the short trace does."""
        self._check_inputs(X, keys, keys, None)
        tables = self.rope_tables(X, keys.shape[1], None)
        q, k, v, _ = self._heads(discard, X, keys, keys, None, self.spec, tables)
        return q, k, v

    def width(self, heads: str) -> str:
        """The name of a projection's last axis: d_feat when it is d_feat wide, else `n_head·d_head` (`heads`:
        n_head, or the key/value heads' `kv_axis()`)."""
        return self.wide_q if heads == "n_head" else self.wide_kv

    def _heads(self, add: Any, Q: Tensor, K: Tensor, V: Tensor, cache: tuple[Tensor, Tensor] | None,
               spec: AttentionSpec, tables: RopeTables | None) -> tuple[Tensor, Tensor, Tensor, Names]:
        """Project, split, rotate (by `tables`, made before: `rope_tables`) and extend with the cache: the per-head
        Q, K, V the attention reads, and the names they go by. With a cache the new keys' axis is n_new, and
        n_K = n_cache + n_new."""
        kv_axis = self.kv_axis()
        n_key = "n_K" if cache is None else "n_new"
        plan = (("Q", self.W_q, Q, "n_Q", self.n_head, "n_head"), ("K", self.W_k, K, n_key, self.n_kv_head, kv_axis),
                ("V", self.W_v, V, n_key, self.n_kv_head, kv_axis))
        wide = {"Q": self.wide_q, "K": self.wide_kv, "V": self.wide_v}
        d_of = {"Q": "d_head", "K": "d_head", "V": self.d_v_name}
        norm = spec.norm
        late = norm is not None and norm.after_rope and spec.rope is not None  # nGPT's: on the rotated heads
        normed_clip = spec.clip_qkv if spec.clip_after_norm and norm is not None and not late else None
        feats = {name: stages.project(add, name, W, x, ("n_batch", n, wide[name]),  # [n_batch, n, heads·d_head]
                                      None if normed_clip is not None and name != "V" else spec.clip_qkv)
                 for name, W, x, n, _, axis in plan}
        made = {name: f"{name}_feat" for name in feats}
        if norm is not None and norm.over == "proj" and not late:  # OLMo 2: one mean over every head's coordinates
            widths = (self.width("n_head"), self.width(kv_axis))
            feats["Q"], feats["K"] = stages.normalize(
                add, feats["Q"], feats["K"], norm, self._norm_weights(), source=("Q_feat", "K_feat"),
                dims=(("n_batch", "n_Q", widths[0]), ("n_batch", n_key, widths[1])), axis=widths,
                names=("q_norm.weight", "k_norm.weight"), biases=self._norm_biases(), clip=normed_clip)
            made["Q"], made["K"] = "Q_normed", "K_normed"
        split = {name: stages.split(add, name, feats[name], count, ("n_batch", axis, n, d_of[name]), made[name],
                                    self.strided_heads)
                 for name, _, _, n, count, axis in plan}  # [n_batch, heads, n, d_head]
        q, k, v = split["Q"], split["K"], split["V"]
        q_name, k_name, v_name = "Q_split", "K_split", "V_split"
        per_head = (("n_batch", "n_head", "n_Q", "d_head"), ("n_batch", kv_axis, n_key, "d_head"))
        if norm is not None and norm.over == "head" and not late:  # Qwen3, Gemma 3: each head over its own d_head
            q, k = self._head_norm(add, q, k, norm, (q_name, k_name), per_head, clip=normed_clip)
            q_name, k_name = "Q_normed", "K_normed"
        if spec.v_norm is not None:  # Gemma 3n's v_norm: each value head RMS-normed, no weights
            v = stages.value_norm(add, v, spec.v_norm, source=v_name, dims=("n_batch", kv_axis, n_key, d_of["V"]))
            v_name = "V_normed"
        n_cache = cache[0].shape[-2] if cache is not None else 0
        n_Q, n_K = q.shape[-2], n_cache + k.shape[-2]
        # the new tokens sit after the cached ones whether or not the attention is causal
        q_offset = n_cache if cache is not None else spec.offset(n_Q, n_K)
        if spec.rope is not None:
            q, k = stages.rotate(add, q, k, spec.rope, q_offset=q_offset, k_offset=n_cache,
                                 source=(q_name, k_name), dims=(("n_batch", "n_head", "n_Q", "d_head"),
                                                                ("n_batch", kv_axis, n_key, "d_head")),
                                 d_name="d_head", n_keys=n_K, tables=tables)
            q_name, k_name = "Q_rot", "K_rot"
        if late and norm is not None and norm.over == "proj":  # the rotated heads of a position normed at once
            q, k = self._rotated_proj_norm(add, q, k, norm, (q_name, k_name), per_head)
            q_name, k_name = "Q_normed", "K_normed"
        elif late and norm is not None:
            q, k = self._head_norm(add, q, k, norm, (q_name, k_name), per_head)
            q_name, k_name = "Q_normed", "K_normed"
        if spec.temperature is not None:
            q = stages.tune(add, q, spec.temperature, start=q_offset, source=q_name,
                            dims=("n_batch", "n_head", "n_Q", "d_head"))
            q_name = "Q_tuned"
        if cache is not None:
            k, v = stages.join_cache(add, k, v, cache, kv_axis, (k_name, v_name))
            k_name, v_name = "K_cat", "V_cat"
        names = Names(Q=q_name, K=k_name, V=v_name, out="x_raw", d_K="d_head", d_V=self.d_v_name,
                      batch=("n_batch", "n_head"))
        return q, k, v, names

    def _head_norm(self, add: Any, q: Tensor, k: Tensor, norm: Any, source: tuple[str, str],
                   dims: tuple[tuple[str, ...], tuple[str, ...]],
                   clip: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
        """Steps `Q_normed`, `K_normed`: the qk-norm of each head over its own d_head, with the module's weights;
        clipped to `clip` where given (clip_qkv after the norm)."""
        return stages.normalize(add, q, k, norm, self._norm_weights(), source=source, dims=dims,
                                axis=("d_head", "d_head"), names=("q_norm.weight", "k_norm.weight"),
                                biases=self._norm_biases(), clip=clip)

    def _rotated_proj_norm(self, add: Any, q: Tensor, k: Tensor, norm: Any, source: tuple[str, str],
                           dims: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[Tensor, Tensor]:
        """Steps `Q_normed`, `K_normed` after RoPE over the whole projection (OLMo 2's norm moved past the rotation):
        each position's rotated heads merged, normed at once (one mean over every head's coordinates), split back."""
        normed = []
        for step, x, weight, bias, src, shape, name in zip(
                ("Q_normed", "K_normed"), (q, k), self._norm_weights(), self._norm_biases(), source, dims,
                ("q_norm.weight", "k_norm.weight"), strict=True):
            flat = merge_heads(x)  # [n_batch, heads, n, d_head] -> [n_batch, n, heads·d_head]
            y = stages.split_heads(stages.qk_norm(flat, weight, bias, norm), x.shape[-3])  # -> [.., heads, n, d_head]
            bias_name = None if bias is None else name.replace("weight", "bias")
            normed.append(add(step, y, shape, stages.norm_op(norm, f"merge_heads({src})", "heads·d_head", name,
                                                             bias_name),
                              ("rms_norm", y.shape, True, 0), inputs=(src,)))
        return normed[0], normed[1]

    def _norm_weights(self) -> tuple[Tensor, Tensor]:
        return self.q_norm.weight, self.k_norm.weight

    def _norm_biases(self) -> tuple[Tensor | None, Tensor | None]:
        """A LayerNorm qk-norm's biases (`q_norm.bias`, `k_norm.bias`); None for an RMSNorm."""
        return self.q_norm.bias, self.k_norm.bias

    def kv_axis(self) -> str:
        """The key/value heads' axis: n_head where every query head has its own, else n_kv_head."""
        return self.kv

    def _fused(self, Q_h: Tensor, K_h: Tensor, V_h: Tensor, mask: Tensor | None, dropout_p: float,
               spec: AttentionSpec, position_bias: Tensor | None = None) -> Tensor:
        """The attention unrecorded: in eager's order, in blocks of query rows (rows.py), so that a model's
        layers agree with transformers' eager ones to the last bit; with `fused=True`, through
        `F.scaled_dot_product_attention`, masks and biases made into one attn_mask (softcapping and sinks have no
        place in it, and a position bias must come before the mask's -inf, so such a module runs eager's)."""
        if not self.fused:
            return rows.eager_rows(Q_h, K_h, V_h, mask, spec, n_group=self.n_group, dropout_p=dropout_p,
                                   position_bias=position_bias, sinks=self.sinks)
        if spec.softcap is not None or spec.sinks or position_bias is not None:
            names = Names(out="x_raw", batch=("n_batch", "n_head"))
            return attention.sdpa(Q_h, K_h, V_h, mask, enable_gqa=self.n_group > 1, dropout_p=dropout_p,
                                  names=names, spec=spec, position_bias=position_bias, sinks=self.sinks)["x_raw"]
        n_Q, n_K = Q_h.shape[-2], K_h.shape[-2]
        if mask is None and not spec.alibi and spec.plain_causal and n_Q == n_K:
            # is_causal=True says the same without an [n_Q, n_K] mask: PyTorch's fused kernels then never hold
            # one, which a long input's layers need (a 32k-token mask alone is 1 GiB).
            return F.scaled_dot_product_attention(Q_h, K_h, V_h, dropout_p=dropout_p, is_causal=True,
                                                  scale=spec.scale, enable_gqa=self.n_group > 1)
        allowed, _ = masks.structural(spec, n_Q, n_K, Q_h.device)
        attn_mask = masks.combine(allowed, mask)
        if spec.alibi:
            bias = alibi_.bias(self.n_head, n_Q, n_K, spec.offset(n_Q, n_K), Q_h.device)
            attn_mask = bias if attn_mask is None else masks.to_additive(attn_mask) + bias
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(Q_h.dtype)
        return F.scaled_dot_product_attention(Q_h, K_h, V_h, attn_mask=attn_mask, dropout_p=dropout_p,
                                              scale=spec.scale, enable_gqa=self.n_group > 1)

    def _check_inputs(self, Q: Tensor, K: Tensor, V: Tensor, cache: tuple[Tensor, Tensor] | None) -> None:
        for name, t in (("Q", Q), ("K", K), ("V", V)):
            width = self.d_feat if name == "Q" else self.d_v_in if name == "V" else self.d_kv_in
            if t.dim() != 3 or t.shape[-1] != width:
                raise UsageError(
                    f"{name} is {list(t.shape)} but multi-head attention takes [n_batch, n, d_feat] "
                    f"with d_feat = {self.d_feat}" + (f" ({name}: {width} features)" if width != self.d_feat else "")
                )
        if not Q.shape[0] == K.shape[0] == V.shape[0]:
            raise UsageError(f"n_batch differs: Q {Q.shape[0]}, K {K.shape[0]}, V {V.shape[0]}")
        if K.shape[1] != V.shape[1]:
            raise UsageError(f"n_K = {K.shape[1]} but n_V = {V.shape[1]}: every key needs its value")
        if cache is not None:
            want = [Q.shape[0], self.n_kv_head, cache[0].shape[-2] if cache[0].dim() == 4 else -1, self.d_head]
            for name, t in zip(("K_cache", "V_cache"), cache, strict=True):
                d = "d_V" if name == "V_cache" and self.d_v != self.d_head else "d_head"
                want = [*want[:3], self.d_v if name == "V_cache" else self.d_head]
                if t.dim() != 4 or list(t.shape) != want:
                    same = "" if self.d_v != self.d_head else ", the same for K and V"
                    raise UsageError(f"{name} is {list(t.shape)} but the cache is [n_batch, n_kv_head, n_cache, "
                                     f"{d}] = [{want[0]}, {want[1]}, n_cache, {want[3]}]{same}")


def attend(rec: Recorder, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, names: Names, spec: AttentionSpec,
           *, n_group: int = 1, sinks: Tensor | None = None, **options: Any) -> Tensor:
    """Stage `scores ... x_raw` on per-head Q, K, V (projected, normed, rotated, the cache joined: steps called
    `names`), `spec` what is left for it (the mask, softcap, scale, sinks...): into a Trace, sdpa's steps
    (dot_product.sdpa_steps); with nothing recorded, eager attention in blocks of query rows (rows.eager_rows), as
    transformers' eager runs it. `options`: dropout_p, position_bias. Returns x_raw `[n_batch, n_head, n_Q, d_V]`."""
    if isinstance(rec, Trace):
        return attention.sdpa_steps(rec, Q, K, V, mask, names, spec, enable_gqa=n_group > 1, sinks=sinks, **options)
    return rows.eager_rows(Q, K, V, mask, spec, n_group=n_group, sinks=sinks, **options)


class NormWeight(nn.Module):
    """A qk-norm's learned weight `[width]`, kept as `<name>.weight` (`q_norm.weight`, as transformers' RMSNorm
    modules are): ones, or zeros where the weights are offsets from 1 (Gemma's `(1 + w)`), so a fresh norm
    scales by 1; a LayerNorm's (`layer`) has a bias `<name>.bias` too, zeros, as nn.LayerNorm's. The formula is
    stages.qk_norm's."""

    def __init__(self, width: int, offset: bool, layer: bool = False, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.zeros if offset else torch.ones)(width, **factory))
        self.bias = nn.Parameter(torch.zeros(width, **factory)) if layer else None


def _check_sizes(d_feat: int, n_head: int, n_kv_head: int, d_head: int | None) -> None:
    if d_feat <= 0 or n_head <= 0 or n_kv_head <= 0:
        raise UsageError(f"d_feat ({d_feat}), n_head ({n_head}) and n_kv_head ({n_kv_head}) must be positive")
    check_kv_heads(n_head, n_kv_head)
    if d_head is not None:
        if d_head <= 0:
            raise UsageError(f"d_head ({d_head}) must be positive")
        return
    if d_feat % n_head:
        near = " or ".join(str(h) for h in divisors_near(d_feat, n_head))
        raise UsageError(
            f"d_feat = {d_feat} is not divisible by n_head = {n_head}; head counts near it that divide "
            f"{d_feat}: {near} (or give d_head explicitly)"
        )
