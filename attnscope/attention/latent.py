"""Multi-head latent attention (MLA): DeepSeek-V2's and DeepSeek-V3's, recorded step by step.

Keys and values are not projected per head from the input: a token is first compressed into a latent of
d_latent numbers (`KV_latent`, with its RMSNorm) and a small rotary part of d_rope numbers (`K_pe`), the only
things a KV cache has to keep; every head's no-RoPE key (`K_nope`) and value (`V_split`) are expanded from the
latent by `kv_b_proj`, and the one rotary key part is shared by every head. Queries may be compressed too
(`q_a_proj` -> RMSNorm -> `q_b_proj`). A head's query and key are its no-RoPE part joined with its rotated part,
so d_K = d_nope + d_rope, while its value is d_V wide. The computation is transformers' `DeepseekV3Attention`
(models/deepseek_v3/modeling_deepseek_v3.py, the same as `DeepseekV2Attention` but for the rotation's form),
with the module's parameters named as its are, so its `state_dict()` loads here unchanged; the inner step is
`attention.sdpa`, so the two never drift. A model's layer runs the same steps written on its page
(models/families/deepseek.py's `attend`, `page=`): the module's forward then makes the Mask and the rotary parts'
cos and sin first, as MultiHeadAttention does for LLaMA's page.

Steps (`[...]` only where asked), dims named as STYLE.md's vocabulary and the names it adds for MLA:

| step | dims | what |
|---|---|---|
| Q_latent, Q_latent_normed | n_batch, n_Q, d_Q_latent | `q_a_proj(Q)`, its RMSNorm (with q_lora_rank) |
| Q_feat, Q_split | n_batch, n_Q, n_head·d_K; n_batch, n_head, n_Q, d_K | `q_b_proj(...)` or `q_proj(Q)`, split |
| Q_nope, Q_pe | n_batch, n_head, n_Q, d_nope / d_rope | the query's no-RoPE and rotary parts |
| KV_feat | n_batch, n_K, d_latent+d_rope | `kv_a_proj_with_mqa(K)`: the latent and K_pe, one tensor |
| KV_latent | n_batch, n_K, d_latent | `kv_a_layernorm(KV_feat[..., :d_latent])`: what a cache holds |
| K_pe | n_batch, n_K, d_rope | `KV_feat[..., d_latent:]`: one rotary key part for every head |
| cos, sin, Q_pe_rot, K_pe_rot | | RoPE on the rotary parts only (`stages.rotate`) |
| [KV_latent_cache, K_pe_cache, KV_latent_cat, K_pe_cat] | n_batch, n_cache / n_K, ... | a decode step |
| Q_full | n_batch, n_head, n_Q, d_K | `cat(Q_nope, Q_pe_rot)` |
| KV_up, K_nope, V_split | n_batch, n_K, n_head·(d_nope+d_V); per head d_nope, d_V | `kv_b_proj(KV_latent)`, split |
| K_full | n_batch, n_head, n_K, d_K | `cat(K_nope, K_pe_rot)`, K_pe_rot the same for every head |
| scores ... attention, x_raw | | `attention.sdpa(Q_full, K_full, V_split)`, scale 1/√d_K unless given |
| x_rsh1, x_rsh2, x | ..., n_batch, n_Q, d_feat | merge the heads, `o_proj` |

d_latent = kv_lora_rank, d_Q_latent = q_lora_rank, d_nope = qk_nope_head_dim, d_rope = qk_rope_head_dim,
d_V = v_head_dim (spec.py's `Latent`). The DeepSeek-V2 paper's names: KV_latent is c^KV, K_pe_rot k^R,
K_nope k^C, Q_pe_rot q^R, Q_nope q^C; its W^DKV, W^KR are kv_a_proj_with_mqa's rows, W^UK, W^UV kv_b_proj's.

The rotary parts: DeepSeek-V2 (transformers' complex product) pairs coordinates (2i, 2i + 1) and keeps them in
place, a `Rope` with `pairing="interleaved"`; DeepSeek-V3 with `rope_interleave` (its default) gathers the even
coordinates then the odd ones (`Q_pe`, `K_pe` are then copies, not views) and rotates half-split, so its
rotated parts come out half-split, exactly as `apply_rotary_pos_emb_interleave`; without it, half-split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnscope import masks
from attnscope.attention import stages
from attnscope.attention.dot_product import HeadInputs, resolve_spec
from attnscope.attention.stages import HALF, Names, heads_last, merge_heads, rotate, split_heads
from attnscope.errors import UsageError
from attnscope.spec import AttentionSpec, Latent
from attnscope.tensors.weight_threads import unhooked
from attnscope.trace import Trace, discard

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from attnscope.variants.rope import Rope

RMS_EPS = 1e-6  # DeepseekV3RMSNorm's default: q_a_layernorm and kv_a_layernorm are built without the config's eps
PE_NAMES = {"Q_rot": "Q_pe_rot", "K_rot": "K_pe_rot"}  # stages.rotate's names, for the rotary parts


class RMSNorm(nn.Module):
    """transformers' `DeepseekV3RMSNorm`: `weight * (x / sqrt(mean(x²) + eps))`, the normalization in float32 and
    cast back to the input's dtype before the weight multiplies it."""

    def __init__(self, width: int, eps: float = RMS_EPS, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        wide = x.to(torch.float32)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)  # [.., width]
        return self.weight * normed.to(x.dtype)


class LatentAttention(nn.Module):
    """`forward(Q, K=None, mask=None, cache=None)` returns a `Trace` of the steps in the module docstring, so
    `out["x"]` is the output. `latent` gives the sizes (`Latent(kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, q_lora_rank=None, rope_interleave=False)`); `rope` defaults to base 10000.
    `bias` is transformers' `attention_bias`: on q_a_proj, kv_a_proj_with_mqa and o_proj (never on q_b_proj,
    q_proj or kv_b_proj). With `record=False` only `x` is kept.

    Keys and values come from one input, K (Q's by default: self-attention). `cache=(KV_latent_cache,
    K_pe_cache)`, `[n_batch, n_cache, d_latent]` and `[n_batch, n_cache, d_rope]`, holds earlier positions'
    normalized latents and rotated rotary parts, as transformers' cache holds them; the new tokens then sit at
    positions n_cache onwards and causal aligns lower-right."""

    mask_name = "mask"  # what the masked_scores op calls a caller's mask (indexer.py's: selected)

    def __init__(
        self,
        d_feat: int,
        n_head: int,
        latent: Latent | None = None,
        *,
        bias: bool = False,
        dropout_p: float = 0.0,
        record: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        scale: float | None = None,
        causal: bool | str | None = False,
        window: int | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        rope: Rope | None = None,
        spec: AttentionSpec | None = None,
        page: Callable[..., Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.page = page  # a family page's attention method, run on self-attention (deepseek.py's attend)
        if spec is None:
            from attnscope.variants.rope import Rope

            if latent is None:
                raise UsageError("{latent} is missing: give the sizes as Latent(kv_lora_rank, qk_nope_head_dim, "
                                 "qk_rope_head_dim, v_head_dim)", "latent")
            spec = AttentionSpec(causal=causal, window=window, softcap=softcap, alibi=alibi, scale=scale,
                                 rope=Rope() if rope is None and latent.rotary else rope, latent=latent)
        else:
            resolve_spec(spec, latent=latent, scale=scale, causal=causal, window=window, softcap=softcap,
                         alibi=alibi, rope=rope)
            if spec.latent is None:
                raise UsageError("spec=AttentionSpec(...) has no {latent}: latent attention needs its sizes", "latent")
        assert spec.latent is not None  # AttentionSpec checked a rope is there where the latent rotates
        self.spec, self.latent = spec, spec.latent
        if d_feat <= 0 or n_head <= 0:
            raise UsageError(f"d_feat ({d_feat}) and n_head ({n_head}) must be positive")
        if not 0.0 <= dropout_p < 1.0:
            raise UsageError(f"dropout_p = {dropout_p} must be in [0, 1)")
        if spec.rope is not None:
            _check_rope(spec.rope, spec.latent)
        self.d_feat, self.n_head, self.dropout_p, self.record = d_feat, n_head, dropout_p, record
        L, factory = spec.latent, {"device": device, "dtype": dtype}
        norm: dict[str, Any] = factory
        self.d_K, self.d_V = L.d_K, L.v_head_dim
        q_width, kv_width = n_head * L.d_K, n_head * (L.qk_nope_head_dim + L.v_head_dim)
        if L.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(d_feat, q_width, bias=False, **factory)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d_feat, L.q_lora_rank, bias=bias, **factory)
            self.q_a_layernorm = RMSNorm(L.q_lora_rank, **norm)
            self.q_b_proj = nn.Linear(L.q_lora_rank, q_width, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(d_feat, L.kv_lora_rank + L.qk_rope_head_dim, bias=bias, **factory)
        self.kv_a_layernorm = RMSNorm(L.kv_lora_rank, **norm)
        self.kv_b_proj = nn.Linear(L.kv_lora_rank, kv_width, bias=False, **factory)
        self.o_proj = nn.Linear(n_head * L.v_head_dim, d_feat, bias=bias, **factory)

    def forward(self, Q: Tensor, K: Tensor | None = None, V: Tensor | None = None, mask: Tensor | None = None,
                cache: tuple[Tensor, Tensor] | None = None) -> Trace:
        with unhooked():  # its products with weights set their threads themselves (stages.wide)
            if self.page is not None and K is None and V is None:
                return self._run_page(Q, mask, cache)
            return self._attend(Q, K, V, mask, cache)

    def _run_page(self, X: Tensor, mask: Tensor | None, cache: tuple[Tensor, ...] | None) -> Trace:
        """The page's attention on X, each step recorded (or, with `record=False`, the output alone, as `_attend`
        records it then). Its mask (masks.prepare: causal after the cache, a caller's mask folded in) and RoPE's cos
        and sin for the rotary parts (stages.rope_tables) are made here, before the attention, as MultiHeadAttention's
        forward makes them for LLaMA's page (multihead.py) and transformers' model before its layers."""
        self._check_inputs(X, X, cache)
        mask = masks.for_heads(mask)  # [n_batch, 1, n_Q, n_K] from a caller's [n_batch, n_Q, n_K]
        n_batch, n_Q = X.shape[0], X.shape[1]
        n_cache = 0 if cache is None else cache[0].shape[-2]
        n_K = n_cache + n_Q
        spec = self.spec if cache is None else self.spec.with_cache(n_cache)
        acc = torch.float32 if X.dtype in HALF else X.dtype  # the scores' dtype
        built = masks.prepare(self._sdpa_spec(spec), n_Q, n_K, X.device, mask, scores=(n_batch, self.n_head, n_Q, n_K),
                              dtype=acc, name=self.mask_name)
        tables = self.rope_tables(X, n_Q, cache, spec.offset(n_Q, n_K))
        trace = Trace()
        assert self.page is not None
        x = self.page(self, X, trace if self.record else discard, cache, built, tables)  # [n_batch, n_Q, d_feat]
        if not self.record:
            trace.add("x", x, ("n_batch", "n_Q", "d_feat"), "o_proj(merge_heads(x_raw))")
        return trace

    def _attend(self, Q: Tensor, K: Tensor | None, V: Tensor | None, mask: Tensor | None,
                cache: tuple[Tensor, Tensor] | None) -> Trace:
        K = Q if K is None else K
        if V is not None and V is not K:
            raise UsageError("latent attention makes keys and values from one input, K: give K only (V is "
                             "expanded from the same latent as the keys)")
        self._check_inputs(Q, K, cache)
        mask = masks.for_heads(mask)  # [n_batch, 1, n_Q, n_K] from a caller's [n_batch, n_Q, n_K]
        spec = self.spec if cache is None else self.spec.with_cache(cache[0].shape[-2])
        trace = Trace()
        add = trace.add if self.record else discard
        tables = self.rope_tables(Q, K.shape[1], cache)
        q, k, v = self._heads(add, Q, K, cache, spec, tables)
        names = Names(Q="Q_full", K="K_full", V="V_split", out="x_raw", batch=("n_batch", "n_head"))
        n_batch, n_Q, n_K = Q.shape[0], Q.shape[1], k.shape[-2]
        acc = torch.float32 if q.dtype in HALF else q.dtype  # the scores' dtype
        built = masks.prepare(self._sdpa_spec(spec), n_Q, n_K, Q.device, mask,
                              scores=(n_batch, self.n_head, n_Q, n_K), dtype=acc, name=self.mask_name)
        # scores ... x_raw, into the trace (unrecorded: into one that is dropped)
        x_raw = stages.attend(trace if self.record else Trace(), q, k, v, built, names,
                              dropout_p=self.dropout_p if self.training else 0.0)  # [n_batch, n_head, n_Q, d_V]
        if not self.record:
            x = stages.wide(self.o_proj, merge_heads(x_raw))  # [n_batch, n_Q, d_feat]
            trace.add("x", x, ("n_batch", "n_Q", "d_feat"), "o_proj(merge_heads(x_raw))")
            return trace
        x_rsh1 = trace.add("x_rsh1", heads_last(x_raw), ("n_batch", "n_Q", "n_head", "d_V"),
                           "x_raw.permute(0, 2, 1, 3).contiguous()")
        x_rsh2 = trace.add("x_rsh2", x_rsh1.view(n_batch, n_Q, self.n_head * self.d_V),  # [n_batch, n_Q, n_head·d_V]
                           ("n_batch", "n_Q", "n_head·d_V"), "x_rsh1.view(n_batch, -1, n_head·d_V)", allocates=False)
        x = stages.wide(self.o_proj, x_rsh2)  # [n_batch, n_Q, d_feat]
        trace.add("x", x, ("n_batch", "n_Q", "d_feat"), "o_proj(x_rsh2)", _linear_flops(self.o_proj, x_rsh2))
        return trace

    def rope_tables(self, X: Tensor, n_new: int, cache: tuple[Tensor, ...] | None,
                    offset: int | None = None) -> stages.RopeTables | None:
        """The rotary parts' cos and sin for this call (stages.rope_tables), made before the attention in every path
        (a page's, the module's own steps, one head's inputs), as transformers' model makes position_embeddings
        before its layers: the queries of X from position `offset` (after a cache: n_cache), the `n_new` new keys
        after the cache; `offset` by default where the module's spec places them. None where nothing turns (NoPE)."""
        if self.spec.rope is None:
            return None
        return stages.call_tables(self.spec, X, n_new, cache, self.latent.qk_rope_head_dim, "d_rope", offset)

    def empty_cache(self, n_batch: int = 1) -> tuple[Tensor, Tensor]:
        """A cache of no positions, `[n_batch, 0, d_latent]` and `[n_batch, 0, d_rope]`: a prompt run as a decode
        step after nothing comes out with its latents and rotary key parts joined."""
        weight = self.kv_b_proj.weight
        return (torch.zeros(n_batch, 0, self.latent.kv_lora_rank, dtype=weight.dtype, device=weight.device),
                torch.zeros(n_batch, 0, self.latent.qk_rope_head_dim, dtype=weight.dtype, device=weight.device))

    @staticmethod
    def cache_after(trace: Trace) -> tuple[Tensor, Tensor]:
        """What the cache holds after a decode step: the normed latents and the rotated rotary key parts, earlier
        positions and new (what transformers 5's DeepseekV3Attention passes to `past_key_values.update`)."""
        return trace["KV_latent_cat"], trace["K_pe_cat"]

    @staticmethod
    def _sdpa_spec(spec: AttentionSpec) -> AttentionSpec:
        """What is left of `spec` for sdpa once `_heads` has run: the rotary parts are rotated there, and the
        latent expanded into every head's K_full and V_split."""
        return spec.after_latent()

    def head_inputs(self, X: Tensor, head: int) -> HeadInputs:
        """Self-attention's head `head` as the attention reads it (Q_full, K_full, V_split), nothing recorded,
        with the spec of the rest: one head of `forward` (models/forward/long.py's blocks of rows)."""
        self._check_inputs(X, X, None)
        tables = self.rope_tables(X, X.shape[1], None)
        q, k, v = self._heads(discard, X, X, None, self.spec, tables)  # [n_batch, n_head, n, d_K | d_V]
        one = slice(head, head + 1)
        return HeadInputs(q[:, one], k[:, one], v[:, one], self._sdpa_spec(self.spec))  # [n_batch, 1, n, d]

    def _heads(self, add: Any, Q: Tensor, K: Tensor, cache: tuple[Tensor, Tensor] | None,
               spec: AttentionSpec, tables: stages.RopeTables | None) -> tuple[Tensor, Tensor, Tensor]:
        """The per-head Q_full, K_full and V_split the attention reads, in transformers' order: the query, the
        latent and the rotary key part, the rotation (by `tables`, made before: `rope_tables`), the cache, then the
        expansion of the latent."""
        L, n_head = self.latent, self.n_head
        d_nope, d_latent = L.qk_nope_head_dim, L.kv_lora_rank
        n_key = "n_K" if cache is None else "n_new"
        Q_split = self._query(add, Q)  # [n_batch, n_head, n_Q, d_K]
        Q_nope = add("Q_nope", Q_split[..., :d_nope], ("n_batch", "n_head", "n_Q", "d_nope"), "Q_split[..., :d_nope]",
                     allocates=False)
        Q_pe = self._pe(add, "Q_pe", Q_split[..., d_nope:], ("n_batch", "n_head", "n_Q", "d_rope"),
                        "Q_split[..., d_nope:]")
        KV_feat = add("KV_feat", stages.wide(self.kv_a_proj_with_mqa, K), ("n_batch", n_key, "d_latent+d_rope"),
                      "kv_a_proj_with_mqa(K)", _linear_flops(self.kv_a_proj_with_mqa, K), inputs=("K",))
        latent = add("KV_latent", self.kv_a_layernorm(KV_feat[..., :d_latent]), ("n_batch", n_key, "d_latent"),
                     f"kv_a_layernorm(KV_feat[..., :d_latent]): RMSNorm over d_latent, eps {RMS_EPS:g}",
                     4 * K.shape[0] * K.shape[1] * d_latent)
        K_pe = self._pe(add, "K_pe", KV_feat[..., d_latent:], ("n_batch", n_key, "d_rope"), "KV_feat[..., d_latent:]")
        n_cache = cache[0].shape[-2] if cache is not None else 0
        n_Q, n_K = Q.shape[1], n_cache + K.shape[1]
        q_offset = n_cache if cache is not None else spec.offset(n_Q, n_K)
        Q_pe_rot, K_pe_rot = Q_pe, K_pe  # NoPE (rotary=False): the shared part as it is
        if spec.rope is not None:
            Q_pe_rot, K_pe_rot = rotate(
                lambda name, *args, **kwargs: add(PE_NAMES.get(name, name), *args, **kwargs), Q_pe, K_pe, spec.rope,
                q_offset=q_offset, k_offset=n_cache, source=("Q_pe", "K_pe"),
                dims=(("n_batch", "n_head", "n_Q", "d_rope"), ("n_batch", n_key, "d_rope")), d_name="d_rope",
                n_keys=n_K, tables=tables)
        if cache is not None:
            cached = add("KV_latent_cache", cache[0].to(latent.dtype), ("n_batch", "n_cache", "d_latent"),
                         "input: cached KV_latent (normed, as transformers' cache holds it)")
            pe_cached = add("K_pe_cache", cache[1].to(K_pe_rot.dtype), ("n_batch", "n_cache", "d_rope"),
                            "input: cached K_pe_rot (already rotated)")
            latent = add("KV_latent_cat", torch.cat([cached, latent], dim=-2), ("n_batch", "n_K", "d_latent"),
                         "torch.cat([KV_latent_cache, KV_latent], dim=-2)")
            K_pe_rot = add("K_pe_cat", torch.cat([pe_cached, K_pe_rot], dim=-2), ("n_batch", "n_K", "d_rope"),
                           "torch.cat([K_pe_cache, K_pe_rot], dim=-2)")
        latent_name = "KV_latent" if cache is None else "KV_latent_cat"
        pe_name = "K_pe_rot" if cache is None else "K_pe_cat"
        Q_full = add("Q_full", torch.cat([Q_nope, Q_pe_rot], dim=-1), ("n_batch", "n_head", "n_Q", "d_K"),
                     "torch.cat([Q_nope, Q_pe_rot], dim=-1)")  # [n_batch, n_head, n_Q, d_K]
        if spec.temperature is not None:  # each query scaled by its position's factor (Mistral 4's, after the cat)
            Q_full = stages.tune(add, Q_full, spec.temperature, start=q_offset, source="Q_full",
                                 dims=("n_batch", "n_head", "n_Q", "d_K"))
        KV_up = add("KV_up", stages.wide(self.kv_b_proj, latent), ("n_batch", "n_K", "n_head·(d_nope+d_V)"),
                    f"kv_b_proj({latent_name})", _linear_flops(self.kv_b_proj, latent))  # [n_batch, n_K, n_head·(..)]
        per_head = split_heads(KV_up, n_head)  # [n_batch, n_head, n_K, d_nope + d_V], a view
        split_op = "KV_up.view(n_batch, -1, n_head, d_nope+d_V).transpose(1, 2)"
        K_nope = add("K_nope", per_head[..., :d_nope], ("n_batch", "n_head", "n_K", "d_nope"),
                     f"{split_op}[..., :d_nope]", allocates=False)
        V_split = add("V_split", per_head[..., d_nope:], ("n_batch", "n_head", "n_K", "d_V"),
                      f"{split_op}[..., d_nope:]", allocates=False)
        shared = K_pe_rot[:, None].expand(-1, n_head, -1, -1)  # [n_batch, n_head, n_K, d_rope], a view
        K_full = add("K_full", torch.cat([K_nope, shared], dim=-1), ("n_batch", "n_head", "n_K", "d_K"),
                     f"torch.cat([K_nope, shared], dim=-1), shared = {pe_name}[:, None].expand(-1, n_head, -1, -1): "
                     "one rotary part for every head")  # [n_batch, n_head, n_K, d_K]
        return Q_full, K_full, V_split

    def _query(self, add: Any, Q: Tensor) -> Tensor:
        """Q_latent, Q_latent_normed (with a query latent), Q_feat and Q_split `[n_batch, n_head, n_Q, d_K]`."""
        width = ("n_batch", "n_Q", "n_head·d_K")
        if self.q_proj is not None:
            Q_feat = add("Q_feat", stages.wide(self.q_proj, Q), width, "q_proj(Q)", _linear_flops(self.q_proj, Q),
                         inputs=("Q",))
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            dims = ("n_batch", "n_Q", "d_Q_latent")
            compressed = add("Q_latent", stages.wide(self.q_a_proj, Q), dims, "q_a_proj(Q)",
                             _linear_flops(self.q_a_proj, Q), inputs=("Q",))
            normed = add("Q_latent_normed", self.q_a_layernorm(compressed), dims,
                         f"q_a_layernorm(Q_latent): RMSNorm over d_Q_latent, eps {RMS_EPS:g}", 4 * compressed.numel())
            Q_feat = add("Q_feat", stages.wide(self.q_b_proj, normed), width, "q_b_proj(Q_latent_normed)",
                         _linear_flops(self.q_b_proj, normed))  # [n_batch, n_Q, n_head·d_K]
        return add("Q_split", split_heads(Q_feat, self.n_head), ("n_batch", "n_head", "n_Q", "d_K"),
                   "Q_feat.view(n_batch, -1, n_head, d_K).transpose(1, 2)", allocates=False)

    def _pe(self, add: Any, name: str, part: Tensor, dims: tuple[str, ...], op: str) -> Tensor:
        """A rotary part as it is rotated: a view, or with `rope_interleave` its even coordinates then its odd
        ones (a copy), which the half-split rotation then turns as pairs (2i, 2i + 1) of the checkpoint."""
        if not self.latent.rope_interleave:
            return add(name, part, dims, op, allocates=False)  # type: ignore[no-any-return]
        gathered = torch.cat([part[..., 0::2], part[..., 1::2]], dim=-1)  # [.., d_rope]
        return add(name, gathered, dims, f"cat({op}[..., 0::2], {op}[..., 1::2]): de-interleaved "  # type: ignore[no-any-return]
                   "(rope_interleave)")

    def _check_inputs(self, Q: Tensor, K: Tensor, cache: tuple[Tensor, ...] | None) -> None:
        for name, t in (("Q", Q), ("K", K)):
            if t.dim() != 3 or t.shape[-1] != self.d_feat:
                raise UsageError(f"{name} is {list(t.shape)} but latent attention takes [n_batch, n, d_feat] "
                                 f"with d_feat = {self.d_feat}")
        if Q.shape[0] != K.shape[0]:
            raise UsageError(f"n_batch differs: Q {Q.shape[0]}, K {K.shape[0]}")
        if cache is None:
            return
        L = self.latent
        for name, t, width, d in (("KV_latent_cache", cache[0], L.kv_lora_rank, "d_latent"),
                                  ("K_pe_cache", cache[1], L.qk_rope_head_dim, "d_rope")):
            if t.dim() != 3 or t.shape[0] != Q.shape[0] or t.shape[-1] != width or t.shape[1] != cache[0].shape[1]:
                raise UsageError(f"{name} is {list(t.shape)} but the latent cache is [n_batch, n_cache, {d}] = "
                                 f"[{Q.shape[0]}, n_cache, {width}], n_cache the same for both parts")


def _check_rope(rope: Rope, latent: Latent) -> None:
    """The rotary part turns whole; rope_interleave gathers the pairs itself and rotates them half-split."""
    rope.check(latent.qk_rope_head_dim)
    if rope.rotary_dim(latent.qk_rope_head_dim) != latent.qk_rope_head_dim:
        raise UsageError(f"{{rope}} turns {rope.rotary_dim(latent.qk_rope_head_dim)} of the {latent.qk_rope_head_dim} "
                         "rotary coordinates; latent attention rotates its whole Q_pe and K_pe (drop "
                         "partial_rotary_factor)", "rope")
    if latent.rope_interleave and rope.pairing != "half-split":
        raise UsageError("{rope_interleave} gathers the interleaved pairs and rotates them half-split; give a "
                         "half-split {rope} (DeepSeek-V2's interleaved rotation is rope_interleave=False with "
                         "pairing='interleaved')", "rope_interleave", "rope")


def _linear_flops(layer: nn.Linear, x: Tensor) -> tuple[str, tuple[int, ...], int, int]:
    """The FLOPs of `layer(x)`, as data (trace.Cost)."""
    return "linear", (*x.shape[:-1], layer.out_features), layer.in_features, layer.bias is not None
