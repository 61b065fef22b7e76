"""Gains latent attention code multiplies its LoRA outputs by, read from its run: one number the code multiplies a
part of the queries or of the latent by, where the part is the reference's own (LongCat-Flash's `q_pass *
self.mla_scale_q_lora`, `q_rot * ...`, `k_pass * self.mla_scale_kv_lora`: √(hidden_size / rank)). A product of the
code's that is c times one of the reference's parts (the query's no-RoPE or rotary part, the whole query, the normed
latent, the rotary key part), c ≠ 1, is such a gain: the module's convention. It is folded into the reference's
weights (the query projection's rows of that part, the latent's norm, the latent projection's rotary rows), so that
every step after it holds the code's numbers, and the experiments rerun that reference. A number that is the
attention's scale (or its inverse) is left alone: a scale applied twice is the catalog's to name, by experiment."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from attnscope.usertrace.baregains import MULS

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record

TOL = 1e-4  # relative: the code's product and the reference's part run in float32 apart


def parts(reference: Any, trace: Trace) -> dict[str, torch.Tensor]:
    """The reference's parts a gain may multiply, as the code holds them (the rotary parts ungathered): the query's
    no-RoPE and rotary parts, the whole query (heads split or not), the normed latent, the rotary key part."""
    L = reference.latent
    split = trace["Q_split"].detach()
    found = {"q_nope": split[..., :L.qk_nope_head_dim], "q_rope": split[..., L.qk_nope_head_dim:], "q": split,
             "q_feat": trace["Q_feat"].detach()}
    if "KV_latent" in trace and "KV_feat" in trace:
        found["latent"] = trace["KV_latent"].detach()
        found["k_rope"] = trace["KV_feat"].detach()[..., L.kv_lora_rank:]
    return found


def read(reference: Any, trace: Trace, records: list[Record]) -> dict[str, tuple[float, Record]]:
    """{part: (c, the code's product)} for each part some product of the code's is c times (c ≠ 1, not the
    attention's scale nor its inverse), the first such product."""
    if "Q_split" not in trace or "Q_feat" not in trace:
        return {}
    scale = reference.spec.scale if reference.spec.scale is not None else reference.d_K ** -0.5
    found: dict[str, tuple[float, Record]] = {}
    for name, part in parts(reference, trace).items():
        want = part.double().reshape(-1)
        norm = float(want @ want)
        if norm == 0:
            continue
        for r in records:
            if r.func not in MULS or len(r.parents) != 1 or not r.tensor.is_floating_point() \
                    or r.tensor.numel() != want.numel() or r.tensor.shape[-1] != part.shape[-1]:
                continue
            got = r.tensor.detach().double().reshape(-1)
            c = float(got @ want) / norm
            if not math.isfinite(c) or abs(c - 1) < 1e-3 or any(math.isclose(c, s, rel_tol=1e-3)
                                                                   for s in (scale, 1 / scale)):
                continue
            if (got - c * want).abs().max() <= TOL * max(float(got.abs().max()), 1.0):
                found[name] = (c, r)
                break
    if "q" in found or "q_feat" in found:  # the whole query: its parts' gains are that one
        whole = found.pop("q", None) or found.pop("q_feat")
        found = {k: v for k, v in found.items() if k not in ("q_nope", "q_rope", "q_feat")}
        found["q_nope"] = found["q_rope"] = whole
    return found


def fold(reference: Any, gains: dict[str, tuple[float, Record]]) -> str:
    """The gains folded into the reference's weights; the words for a note."""
    L, n_head = reference.latent, reference.n_head
    query = reference.q_proj if reference.q_proj is not None else reference.q_b_proj
    rows = query.weight.view(n_head, L.d_K, -1)
    with torch.no_grad():
        for name, (c, _) in gains.items():
            if name == "q_nope":
                rows[:, :L.qk_nope_head_dim] *= c
            elif name == "q_rope":
                rows[:, L.qk_nope_head_dim:] *= c
            elif name == "latent":
                reference.kv_a_layernorm.weight *= c
            elif name == "k_rope":
                reference.kv_a_proj_with_mqa.weight[L.kv_lora_rank:] *= c
                if reference.kv_a_proj_with_mqa.bias is not None:
                    reference.kv_a_proj_with_mqa.bias[L.kv_lora_rank:] *= c
    words = {"q_nope": "the query's no-RoPE part", "q_rope": "its rotary part", "latent": "the normed latent",
             "k_rope": "the rotary key part"}
    said = "; ".join(f"{words[name]} × {c:.6g} (line {r.line}: {r.label})" for name, (c, r) in gains.items())
    return (f"your code multiplies {said}: gains on its latents' outputs (LongCat-Flash's mla_scale_q_lora and "
            "mla_scale_kv_lora), read as its own convention, and the reference holds them in its weights")
