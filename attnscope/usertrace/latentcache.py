"""A decode step of multi-head latent attention (usertrace/latent.py, latentref.py): the cache code keeps, every
head's keys and values expanded, from latents the reference holds.

MLA's reference (attnscope's LatentAttention) caches what transformers 5's DeepseekV3Attention caches: the normed
latents `[n_batch, n_cache, d_latent]` and the rotated rotary key parts `[n_batch, n_cache, d_rope]`, expanded into
every head's keys and values with the new ones. Code as transformers 4 and DeepSeek's naive inference write it keeps
the expanded keys `[n_batch, n_head, n_cache, d_K]` (no-RoPE part and rotated part joined) and values `[n_batch,
n_head, n_cache, d_V]`: random keys of that shape could come from no latent. So the reference draws the latents
(`cache_for`), and the code is handed the keys and values the module's own kv_b_proj and norm expand them into (the
reference run on them, its cached positions' K_full and V_split), in the layout and form it keeps (cachelayouts.py,
cacheforms.py, heldcache.py), as it would be handed any cache. The reference's trace is then said as a decode step of
expanded keys (`decoded`): the new positions' K_full and V_split, the cache as K_cache and V_cache, joined as K_cat and
V_cat, so the line-up and the catalog's experiments (cache.order, mask.upper_left, ...) read it as any decode step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Spec

# the reference's latent steps the code, holding expanded keys, never makes
LATENT_ONLY = ("KV_latent_cache", "K_pe_cache", "KV_latent_cat", "K_pe_cat")
# its steps over the joined positions, said for the new ones alone, as the code computes them
JOINED = ("KV_up", "K_nope", "V_split", "K_full")
STEPS = ("K_cache", "V_cache", "K_cat", "V_cat")


@dataclass
class LatentCache:
    reference: Any  # LatentAttention holding the module's weights
    n_cache: int
    seed: int
    made: dict[tuple[int, Any], tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = \
        field(default_factory=dict)


def read(records: list[Record], module: Any, n_head: int | None, spec: Spec, n_cache: int,
         seed: int) -> LatentCache | None:
    """The reference's latent cache maker, where a prefill's data flow (`records`) is MLA's; None otherwise."""
    from attnscope.errors import UsageError
    from attnscope.usertrace import latent, latentref

    if n_head is None or latent.expansion(records) is None:
        return None
    try:
        found = latentref.candidates(module, records, n_head, spec)
    except UsageError:
        return None
    return LatentCache(found[0][0], n_cache, seed) if found else None


def cache_for(maker: LatentCache, n_batch: int, dtype: Any) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                                     tuple[torch.Tensor, torch.Tensor]]:
    """(the keys and values the code is handed, [n_batch, n_head, n_cache, d_K] and [.., d_V]; the latents and
    rotated rotary parts the reference holds, [n_batch, n_cache, d_latent] and [.., d_rope]), drawn once a batch."""
    key = (n_batch, dtype)
    if key not in maker.made:
        reference, n = maker.reference, maker.n_cache
        weight = reference.kv_b_proj.weight
        g = torch.Generator().manual_seed(maker.seed + 4049)
        L = reference.latent
        held = (torch.randn(n_batch, n, L.kv_lora_rank, generator=g).to(weight.dtype),
                torch.randn(n_batch, n, L.qk_rope_head_dim, generator=g).to(weight.dtype))
        with torch.no_grad():
            trace = reference(torch.zeros(n_batch, 1, reference.d_feat, dtype=weight.dtype), cache=held)
        expanded = (trace["K_full"][..., :n, :].contiguous().to(dtype), trace["V_split"][..., :n, :].contiguous()
                    .to(dtype))
        maker.made[key] = (expanded, held)
    return maker.made[key]


def decoded(trace: Trace, n_cache: int) -> Trace:
    """The reference's decode step said as one of expanded keys: the latent cache's steps dropped, the joined
    positions' KV_up, K_nope, V_split and K_full cut to the new ones, and K_cache, V_cache, K_cat, V_cat added after
    K_full."""
    from dataclasses import replace

    from attnscope.trace import Trace

    out = Trace(notes=list(trace.notes))
    for step in trace.steps:
        if step.name in LATENT_ONLY:
            continue
        if step.name not in JOINED:
            out.add_step(step)
            continue
        axis = step.dims.index("n_K")
        new = step.tensor.narrow(axis, n_cache, step.tensor.shape[axis] - n_cache)
        dims = tuple("n_new" if d == "n_K" else d for d in step.dims)
        out.add_step(replace(step, tensor=new, dims=dims))
        if step.name == "K_full":
            keys, values = step.tensor, trace["V_split"]
            out.add("K_cache", keys[..., :n_cache, :], ("n_batch", "n_head", "n_cache", "d_K"),
                    "kv_b_proj(KV_latent_cache) joined with K_pe_cache: the cached keys, expanded")
            out.add("V_cache", values[..., :n_cache, :], ("n_batch", "n_head", "n_cache", "d_V"),
                    "kv_b_proj(KV_latent_cache): the cached values, expanded")
            out.add("K_cat", keys, ("n_batch", "n_head", "n_K", "d_K"), "torch.cat([K_cache, K_full], dim=-2)")
            out.add("V_cat", values, ("n_batch", "n_head", "n_K", "d_V"), "torch.cat([V_cache, V_split], dim=-2)")
    return out


def note(parameters: str) -> str:
    return (f"{parameters}: multi-head latent attention in a decode step: your code keeps every head's keys and "
            "values expanded ([n_batch, n_head, n_cache, d_K] and [.., d_V], or the layout it keeps), where the "
            "reference keeps the normed latents and rotated rotary key parts; it is handed the keys and values "
            "your kv_b_proj and norm expand the reference's random latents into. A convention, not a mistake: both "
            "attend to the same keys and values")
