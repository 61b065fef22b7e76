"""The reference for multi-head latent attention (usertrace/latent.py reads it off the data flow): attnscope's
LatentAttention (attention/latent.py, checked against transformers' DeepseekV3Attention) holding the module's own
weights, each layer's role read from the data flow, not its name: the latent's Linear and the one expanding keys
and values from it (latent.expansion), the queries' (one Linear, or a latent's two with a norm between), the
output's (the Linear reading what the pattern made), and the norms by the widths they norm. Sizes come from the
weights: d_rope = the latent Linear's extra outputs, d_K = the queries' width over n_head, d_nope = d_K - d_rope,
d_V the rest of the expansion's head. The rotary form is tried each way DeepSeek writes it (V2's interleaved pairs in
place, V3's rope_interleave gathering them, plain half-split); the one under which most steps line up is kept."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnscope.errors import UsageError
from attnscope.usertrace import flow
from attnscope.usertrace.latent import expansion

if TYPE_CHECKING:
    from attnscope.trace import Trace
    from attnscope.usertrace.record import Record
    from attnscope.usertrace.reference import Projections, Spec

STEPS = ("Q_latent", "Q_latent_normed", "Q_feat", "Q_split", "Q_nope", "Q_pe", "KV_feat", "KV_latent", "K_pe",
         "Q_pe_rot", "K_pe_rot", "Q_full", "Q_tuned", "KV_up", "K_nope", "V_split", "K_full", "K_cat", "V_cat",
         "scores", "masked_scores", "attention", "x_raw", "x_rsh1", "x_rsh2", "x")  # K_cat, V_cat: a decode step's

HALF_SPLIT = ("your code turns its rotary parts half-split, (i, i + d_rope/2) (MiniCPM3's form), and the reference "
              "so; DeepSeek-V2/V3's checkpoints hold interleaved pairs, which their code turns as complex numbers or "
              "gathers first: --rope-pairing interleaved checks that")


def roles(module: nn.Module, records: list[Record]) -> dict[str, str] | None:
    """{q, [q_a], kv_a, kv_b, o: Linear name}, read from the data flow (q the queries' last Linear, q_b_proj where a
    query latent q_a comes first); None where it is not MLA's."""
    found = expansion(records)
    operands = flow.operands(records)
    if found is None or operands is None:
        return None
    latent, up, _ = found
    left, _, _, _ = operands
    made, linears = flow.linears_of(records)
    first = {name: min(i for i, n in made.items() if n == name) for name in set(made.values())}
    query = sorted(linears[left] - {latent, up}, key=first.__getitem__)
    out = sorted(flow.readers(records) - {latent, up, *query})
    if len(out) != 1 or not 1 <= len(query) <= 2:
        return None
    found_roles = {"kv_a": latent, "kv_b": up, "o": out[0]}
    found_roles.update({"q": query[0]} if len(query) == 1 else {"q_a": query[0], "q": query[1]})
    modules = dict(module.named_modules())
    if not all(isinstance(modules.get(name), nn.Linear) for name in found_roles.values()):
        return None
    return found_roles


def _norm(module: nn.Module, records: list[Record], width: int, after: str) -> tuple[str, nn.Module] | None:
    """The module's norm over `width` numbers (a 1-D weight that wide, no Linear): the one whose weight the code
    reads on what the Linear `after` wrote (the latent's norm, not the query latent's of the same width); failing
    that, the first of that width."""
    found = [(name, sub) for name, sub in module.named_modules() if name and not isinstance(sub, nn.Linear)
             and isinstance(getattr(sub, "weight", None), torch.Tensor) and sub.weight.dim() == 1
             and sub.weight.numel() == width]
    _, linears = flow.linears_of(records)
    for name, sub in found:
        if any(("text", f"{name}.weight") in r.args and after in linears[r.index] for r in records):
            return name, sub
    return found[0] if found else None


def _eps(norm: nn.Module | None) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return 1e-6


def _mscale(module: nn.Module, spec: Spec, d_K: int) -> tuple[float, str] | None:
    """The scores' scale DeepSeek-V2/V3's config declares with a yarn RoPE (`softmax_scale = d_K^-0.5 · mscale²`,
    mscale = 0.1 · mscale_all_dim · ln(factor) + 1, its rope_parameters' or rope_scaling's), with how it was read;
    None where the options or the module's own scale said one, or its config says no such factor."""
    import math

    from attnscope.usertrace.declared import own_value

    if spec.scale is not None:
        return None
    found = own_value(module, ("mscale_all_dim",), spec.built_with)
    factor = own_value(module, ("factor",), spec.built_with)
    if found is None or factor is None or factor[1] <= 1:
        return None
    mscale = 0.1 * found[1] * math.log(factor[1]) + 1.0
    scale = d_K ** -0.5 * mscale * mscale
    return scale, (f"scores scaled by d_K^-0.5 · mscale² = {scale:.6g} (mscale {mscale:.6g}: your config's "
                   f"mscale_all_dim = {found[1]:g}, factor = {factor[1]:g}, DeepSeek's yarn_get_mscale)")


def candidates(module: nn.Module, records: list[Record], n_head: int, spec: Spec) -> list[tuple[Any, Projections]]:
    """LatentAttention holding the module's weights, once per rotary form DeepSeek writes, with how its layers were
    read; none where the data flow is not MLA's or the widths do not make one."""
    from attnscope.attention.latent import LatentAttention
    from attnscope.spec import Latent
    from attnscope.usertrace.reference import Projections
    from attnscope.variants.rope import Rope

    found = roles(module, records)
    if found is None:
        return []
    modules = dict(module.named_modules())
    linear = {role: modules[name] for role, name in found.items()}
    kv_a, kv_b, o = linear["kv_a"], linear["kv_b"], linear["o"]
    q_out = linear["q"]
    d_latent = kv_b.in_features
    d_rope = kv_a.out_features - d_latent
    if d_rope <= 0 or d_rope % 2 or q_out.out_features % n_head or kv_b.out_features % n_head:
        return []
    d_K = q_out.out_features // n_head
    d_nope = d_K - d_rope
    d_V = kv_b.out_features // n_head - d_nope
    if d_nope <= 0 or d_V <= 0 or o.in_features != n_head * d_V:
        return []
    q_lora = q_out.in_features if "q_a" in linear else None
    kv_norm = _norm(module, records, d_latent, found["kv_a"])
    q_norm = _norm(module, records, q_lora, found["q_a"]) if q_lora else None
    base = spec.rope_base if spec.rope_base is not None else 10000.0
    scaled = _mscale(module, spec, d_K)
    out = []
    forms = [(False, "interleaved"), (True, "half-split"), (False, "half-split")]
    if spec.pairing_read:  # tables laid out for a pairing: the pairs turn so, gathered first or not
        forms = [form for form in forms if form[1] == spec.rope_pairing]
    elif spec.pairing_asked:  # --rope-pairing: interleaved is the checkpoint's pairs, turned in place or gathered
        forms = forms[:2] if spec.rope_pairing == "interleaved" else forms[2:]
    if spec.rope_base is None:  # no RoPE asked: the shared key part as it is (Kimi Linear's NoPE MLA)
        forms = [(False, "")]
    for interleave, pairing in forms:
        latent = Latent(d_latent, d_nope, d_rope, d_V, q_lora_rank=q_lora, rope_interleave=interleave,
                        rotary=bool(pairing))
        attention = replace(spec.attention(n_head), rope=Rope(base, pairing=pairing) if pairing else None,
                            latent=latent, n_kv_head=None, **({"scale": scaled[0]} if scaled else {}))
        reference = LatentAttention(kv_a.in_features, n_head, spec=attention, bias=kv_a.bias is not None,
                                    dtype=kv_a.weight.dtype, device=kv_a.weight.device)
        with torch.no_grad():
            for role, theirs in linear.items():
                mine = getattr(reference, {"q": "q_b_proj" if q_lora else "q_proj", "q_a": "q_a_proj",
                                           "kv_a": "kv_a_proj_with_mqa", "kv_b": "kv_b_proj", "o": "o_proj"}[role])
                mine.weight.copy_(theirs.weight)
                if mine.bias is not None:
                    mine.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(mine.bias))
                elif theirs.bias is not None:
                    raise UsageError(f"{found[role]} has a bias, which latent attention's {role} does not")
            for norm, mine in ((kv_norm, reference.kv_a_layernorm), (q_norm, reference.q_a_layernorm)):
                if norm is not None and mine is not None:
                    weight: torch.Tensor = norm[1].weight  # type: ignore[assignment]  # _norm found a 1-D weight
                    mine.weight.copy_(weight)
                    mine.eps = _eps(norm[1])
        form = {"interleaved": "DeepSeek-V2's interleaved pairs", "half-split": "half-split", "": ""}[pairing]
        form = "DeepSeek-V3's rope_interleave (pairs gathered, turned half-split)" if interleave else form
        form = f"RoPE base {base:g}, {form}" if pairing else "it is, unturned (no --rope: NoPE)"
        form += f"; {scaled[1]}" if scaled else ""
        said = None if spec.pairing_asked or pairing != "half-split" or interleave else HALF_SPLIT
        out.append((reference.eval(), Projections({role: (name, linear[role]) for role, name in found.items()},
                                                  f"data flow; the rotary part as {form}", said)))
    return out


def wanted(reference: Any, trace: Trace) -> tuple[str, ...]:
    """The steps to line up: all the reference made, but for rope_interleave's gathered copies of the rotary parts
    (transformers turns the even and odd coordinates where they lie, and makes no such copy), and the rotated key
    part, which code keeps with a head axis of one or none, and K_full holds for every head."""
    gathered = ("Q_pe", "K_pe") if reference.latent.rope_interleave else ()
    return tuple(step for step in STEPS if step in trace and step not in (*gathered, "K_pe_rot"))


def evidence(reference: Any, trace: Trace, records: list[Record], rows: list[Any]) -> int:
    """What a form's line-up says of the rotary form beyond its aligned steps (refruns._best_reading's count), so that
    a wrong rotation (positions, base, never applied) is read under the form the code turns its pairs in: the rotary
    parts as views of the heads (Q_pe, K_pe in place) are held by every form's code and say nothing of the form; the
    pairs gathered even then odd (rope_interleave's copies, left out of `wanted`) are held only by code that gathers
    them (transformers 4's DeepSeek-V2 views them so before rotate_half); and a tensor of the code's that is the
    form's Q_pe turned pair by pair with the form's pairing, one frequency a pair (whatever the base, from position 0
    or after the cache), is the form's rotation."""
    from attnscope.usertrace.align import best_equal

    if not reference.latent.rope_interleave:
        held = -sum(row.reference in ("Q_pe", "K_pe") and row.status in ("equal", "permuted") for row in rows)
    else:
        held = sum(best_equal(records, trace[name], None) is not None for name in ("Q_pe", "K_pe") if name in trace)
    return held + _turned_so(reference, trace, records)


def _turned_so(reference: Any, trace: Trace, records: list[Record]) -> int:
    """1 where some tensor of the code's, of Q_pe's shape, is the form's Q_pe turned as the form pairs it."""
    from attnscope.usertrace import ropefreqs

    if "Q_pe" not in trace or reference.spec.rope is None:
        return 0
    q_pe = trace["Q_pe"].double()
    pairing = "half-split" if reference.latent.rope_interleave or reference.spec.rope.pairing == "half-split" \
        else "interleaved"
    firsts = dict.fromkeys((0, int(trace["K_cache"].shape[-2]) if "K_cache" in trace else 0))
    return int(any(ropefreqs.read(q_pe, r.tensor.double(), pairing, q_pe.shape[-1], first) is not None
                   for r in records if r.tensor.is_floating_point() and r.tensor.shape == q_pe.shape
                   for first in firsts))


def run(reference: Any, Q: torch.Tensor, mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> Trace:
    """The reference on Q (after a cache of latents and rotated rotary parts: a decode step, latentcache.py)."""
    with torch.no_grad():
        trace: Trace = reference(Q, mask=mask, cache=cache)
    return trace
