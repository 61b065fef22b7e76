"""Sparse indexer attention: DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention) and GLM-5's, recorded.

Before the latent attention (latent.py) runs, a small indexer scores every query against every key with its own
weights and keeps each query's `index_topk` best keys; the attention's softmax then sees only those (transformers'
`DeepseekV32Indexer` and `DeepseekV32Attention`, models/deepseek_v32/modeling_deepseek_v32.py; GLM-5's
`GlmMoeDsaIndexer` rotates interleaved and may reuse the previous layer's choice, `indexer_types` "shared").

| step | dims | what |
|---|---|---|
| index_q | n_batch, n_Q, n_index_head, d_index | `wq_b(Q_latent_normed)`, its first d_rope coordinates rotated |
| index_k | n_batch, n_K, d_index | `k_norm(wk(X))` (a LayerNorm), rotated alike: one key for every index head |
| index_weights | n_batch, n_Q, n_index_head | `weights_proj(X) · n_index_head^-½`: how much each index head counts |
| index_scores | n_batch, n_Q, n_K | `Σ_h index_weights · relu(index_q · index_k · d_index^-½)` |
| selected | n_batch, n_Q, n_K | the top-k keys per query (as `index_scores + mask` picks them), True = kept |
| ... the MLA steps, `masked_scores` hiding every key not selected, then, with `dense`: | | |
| dense_attention | n_batch, n_head, n_Q, n_K | the softmax of `scores` under the causal mask alone |
| selected_share | n_batch, n_head, n_Q | the share of the dense softmax's weight on the selected keys |

A query with fewer causal keys than index_topk keeps all of them (transformers' top-k then also picks keys the
causal mask hides, which never count: `selected` shows only keys the query may see). The indexer's RoPE is the
attention's (the same cos and sin); DeepSeek-V3.2 turns index_q and index_k half-split, GLM-5 interleaved (as
`apply_rotary_pos_emb_interleave`: even coordinates then odd ones, out half-split). The indexer's keys are cached
rotated, as transformers' `update_indexer` holds them; a decode step's index_k is the cache joined with the new.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnscope.attention import stages
from attnscope.attention.latent import LatentAttention
from attnscope.tensors.weight_threads import unhooked
from attnscope.trace import Trace, discard
from attnscope.variants.rope import apply_rope

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.variants.rope import Rope

K_NORM_EPS = 1e-6  # DeepseekV32Indexer's k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)


@dataclass(frozen=True)
class IndexSpec:
    """An indexer's sizes: `n_head` (index_n_heads), `d_head` (index_head_dim), `topk` (index_topk), the
    rotary width `d_rope` (qk_rope_head_dim), `interleave` (GLM-5's rotation), and `shared`: the layer has no
    indexer of its own and keeps what the previous full layer selected (GLM-5's `indexer_types` "shared")."""

    n_head: int
    d_head: int
    topk: int
    d_rope: int
    interleave: bool = False
    shared: bool = False


class Selections:
    """What the last full indexer layer selected, `[n_batch, n_Q, n_K]`, for the shared layers after it: the
    layers run in order (a forward, or one decode step), so the latest is the previous full layer's."""

    def __init__(self) -> None:
        self.latest: Tensor | None = None


class Indexer(nn.Module):
    """transformers' `DeepseekV32Indexer`, its parameters named as its are (`wq_b`, `wk`, `k_norm`,
    `weights_proj`), recorded through `add`."""

    def __init__(self, d_feat: int, q_rank: int, spec: IndexSpec, device: Any = None) -> None:
        super().__init__()
        self.spec = spec
        self.wq_b = nn.Linear(q_rank, spec.n_head * spec.d_head, bias=False, device=device)
        self.wk = nn.Linear(d_feat, spec.d_head, bias=False, device=device)
        self.k_norm = nn.LayerNorm(spec.d_head, eps=K_NORM_EPS, device=device)
        self.weights_proj = nn.Linear(d_feat, spec.n_head, bias=False, device=device)

    def forward(self, add: Any, X: Tensor, q_latent: Tensor, rope: Rope, cached: Tensor | None) -> Tensor:
        """Steps index_q ... selected; returns `selected` `[n_batch, n_Q, n_K]`. `cached`: earlier positions'
        rotated index_k `[n_batch, n_cache, d_index]` (None: no cache)."""
        s = self.spec
        n_batch, n_new = X.shape[0], X.shape[1]
        n_cache = 0 if cached is None else cached.shape[1]
        n_K = n_cache + n_new
        cos, sin = rope.cos_sin(n_K, s.d_rope, X.dtype, X.device)  # [n_K, d_rope]: the attention's table
        cos, sin = cos[n_cache:], sin[n_cache:]  # the new tokens' positions
        turn = "interleaved, as apply_rotary_pos_emb_interleave" if s.interleave else "half-split"
        q_flat = stages.wide(self.wq_b, q_latent)  # [n_batch, n_Q, n_index_head·d_index]
        q = q_flat.view(n_batch, n_new, s.n_head, s.d_head)  # [n_batch, n_Q, n_index_head, d_index]
        index_q = add("index_q", self._rotate(q, cos[:, None], sin[:, None]),
                      ("n_batch", "n_Q", "n_index_head", "d_index"), f"wq_b(Q_latent_normed).view(n_batch, n_Q, "
                      f"n_index_head, d_index), its first {s.d_rope} coordinates rotated {turn}",
                      ("linear", q_flat.shape, q_latent.shape[-1], False))
        k_new = self._rotate(self.k_norm(stages.wide(self.wk, X)), cos, sin)  # [n_batch, n_new, d_index]
        k_op = f"k_norm(wk(X)): LayerNorm eps {K_NORM_EPS:g}, its first {s.d_rope} coordinates rotated {turn}"
        if cached is not None:
            k_new = torch.cat([cached.to(k_new.dtype), k_new], dim=1)  # [n_batch, n_K, d_index]
            k_op = f"torch.cat([index_k cache, {k_op}], dim=1)"
        index_k = add("index_k", k_new, ("n_batch", "n_K", "d_index"), k_op,
                      ("linear", (n_batch, n_new, s.d_head), X.shape[-1], False))
        weights = stages.wide(self.weights_proj, X.to(self.weights_proj.weight.dtype)).float() * s.n_head ** -0.5
        weights = add("index_weights", weights, ("n_batch", "n_Q", "n_index_head"),
                      f"weights_proj(X) * n_index_head^-0.5 ({s.n_head ** -0.5:.6g})",
                      ("linear", weights.shape, X.shape[-1], False))
        # transformers' order, for the same float32 numbers (a top-k tie breaks alike):
        per_head = torch.matmul(index_q.float(), index_k.transpose(-1, -2).float().unsqueeze(1))  # [n_batch, n_Q,
        per_head = torch.relu(per_head * s.d_head ** -0.5)  # n_index_head, n_K]
        scores = torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)  # [n_batch, n_Q, n_K]
        index_scores = add("index_scores", scores, ("n_batch", "n_Q", "n_K"),
                           f"Σ_h index_weights · relu(index_q @ index_k.T * {s.d_head ** -0.5:.6g})",
                           ("matmul", per_head.shape, 2 * s.d_head, 0))  # two products, each over d_index
        allowed = torch.ones(n_new, n_K, dtype=torch.bool, device=X.device).tril(n_cache)  # [n_Q, n_K]: causal
        hidden = torch.zeros(n_new, n_K, device=X.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
        top = (index_scores + hidden).topk(min(s.topk, n_K), dim=-1).indices  # [n_batch, n_Q, topk]
        picked = torch.zeros_like(index_scores, dtype=torch.bool).scatter(-1, top, True)  # [n_batch, n_Q, n_K]
        return add("selected", picked & allowed, ("n_batch", "n_Q", "n_K"),  # type: ignore[no-any-return]
                   f"(index_scores + causal mask).topk({s.topk}) as a mask, True = kept (keys the causal mask "
                   "hides never count)")

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The first d_rope coordinates turned (GLM-5: their even coordinates then their odd ones, half-split, as
        apply_rotary_pos_emb_interleave lays them out), the rest passed."""
        d = self.spec.d_rope
        if self.spec.interleave:
            x = torch.cat([x[..., 0:d:2], x[..., 1:d:2], x[..., d:]], dim=-1)  # [.., d_index]
        return apply_rope(x, cos, sin)


class IndexedLatentAttention(LatentAttention):
    """Latent attention behind a sparse indexer: `forward(X, cache=None)` records the indexer's steps, then the
    latent attention's with `masked_scores` restricted to `selected`; with `dense`, the dense softmax beside it.
    `cache` is `(KV_latent_cache, K_pe_cache, index_k cache)`. A shared layer (`index.shared`) has no indexer
    and keeps `selections.latest`; a full one writes it."""

    mask_name = "selected"  # masked_scores hides what the indexer did not select: `(causal(lower-right) & selected)`

    def __init__(self, d_feat: int, n_head: int, *, index: IndexSpec, selections: Selections, dense: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(d_feat, n_head, **kwargs)
        assert self.q_a_proj is not None and self.latent.q_lora_rank is not None  # transformers' always compresses
        self.index, self.selections, self.dense = index, selections, dense
        device = kwargs.get("device")
        self.indexer = None if index.shared else Indexer(d_feat, self.latent.q_lora_rank, index, device=device)

    def forward(self, Q: Tensor, K: Tensor | None = None, V: Tensor | None = None, mask: Tensor | None = None,
                cache: tuple[Tensor, ...] | None = None) -> Trace:
        with unhooked():  # its products with weights set their threads themselves (stages.wide)
            return self._indexed(Q, cache)

    def _indexed(self, Q: Tensor, cache: tuple[Tensor, ...] | None) -> Trace:
        trace = Trace()
        add = trace.add if self.record else discard
        selected = self._select(add, Q, cache)
        inner = super().forward(Q, mask=selected[:, None], cache=None if cache is None else (cache[0], cache[1]))
        if not self.record:
            return inner
        for step in inner.steps:
            trace.add_step(step)
        trace.notes.extend(inner.notes)
        if self.dense:
            self._dense(trace)
        return trace

    def _select(self, add: Any, X: Tensor, cache: tuple[Tensor, ...] | None) -> Tensor:
        """`selected` `[n_batch, n_Q, n_K]`: this layer's indexer's, or the previous full layer's."""
        if self.indexer is None:
            chosen = self.selections.latest
            n_K = X.shape[1] + (0 if cache is None else cache[0].shape[1])
            if chosen is None or chosen.shape[-1] != n_K or chosen.shape[-2] != X.shape[1]:
                raise ValueError("a shared indexer layer runs after a full one, on the same tokens")
            return add("selected", chosen, ("n_batch", "n_Q", "n_K"),  # type: ignore[no-any-return]
                       "the previous full indexer layer's selected (indexer_types 'shared')", allocates=False)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.spec.rope is not None
        q_latent = self.q_a_layernorm(stages.wide(self.q_a_proj, X))  # [n_batch, n_Q, d_Q_latent], as Q_latent_normed
        selected = self.indexer(add, X, q_latent, self.spec.rope, None if cache is None else cache[2])
        self.selections.latest = selected
        return selected  # type: ignore[no-any-return]

    def _dense(self, trace: Trace) -> None:
        """dense_attention (the softmax of scores under the causal mask alone) and selected_share."""
        scores = trace["scores"]  # [n_batch, n_head, n_Q, n_K]
        n_Q, n_K = scores.shape[-2], scores.shape[-1]
        allowed = torch.ones(n_Q, n_K, dtype=torch.bool, device=scores.device).tril(n_K - n_Q)
        dense = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # [n_batch, n_head, n_Q, n_K]
        dims = trace.step("scores").dims
        trace.add("dense_attention", dense, dims, "softmax(scores.masked_fill(~causal, -inf), dim=-1): no selection",
                  ("softmax", dense.shape, 0, 0))
        share = (dense * trace["selected"][:, None]).sum(-1)  # [n_batch, n_head, n_Q]
        trace.add("selected_share", share, dims[:-1], "(dense_attention * selected).sum(-1): the dense weight the "
                  "selected keys hold", 2 * dense.numel())

    def empty_cache(self, n_batch: int = 1) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        latent, pe = super().empty_cache(n_batch)
        return latent, pe, latent.new_zeros(n_batch, 0, self.index.d_head)

    @staticmethod
    def cache_after(trace: Trace) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        """The latent cache, and the indexer's keys (a shared layer keeps none: an empty placeholder)."""
        latent, pe = LatentAttention.cache_after(trace)
        keys = trace["index_k"] if "index_k" in trace else latent.new_zeros(latent.shape[0], 0, 1)
        return latent, pe, keys

    def head_inputs(self, X: Tensor, head: int) -> Any:
        raise ValueError("a sparse indexer's attention is not computed in blocks of rows")
