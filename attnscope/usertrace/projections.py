"""Which of the code's layers the reference holds as its q, k, v and output projections (`find_projections`: every
reading worth lining up, the likeliest first): the data flow (flow.py) first, names and the order of registration
only breaking its ties; a wrapped nn.MultiheadAttention, a fused q/k/v or k/v projection split (fused.py), per-head
projections (perhead.py), projections by the inputs they read where the forward takes them apart, an identity
output where the code has none. reference.py gathers the reference's modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnscope.errors import UsageError
from attnscope.usertrace.fused import NONE
from attnscope.usertrace.linearweights import ROLES, as_called, mentioned, parameter_projections, role_of
from attnscope.usertrace.linearweights import linears as linear_layers

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


@dataclass
class Projections:
    """The user's projections by role (nn.Linear layers, or rows of a fused weight: fused.Part), and how
    they were matched."""

    linears: dict[str, tuple[str, Any]]
    matched_by: str  # "data flow ...", "name", "registration order", "a fused projection, ...", ...
    note: str | None = None  # a convention the reading holds (a fused projection's rows in the order k after v)
    merge_only: bool = False  # an identity output projection where the code's reads more (merge_only)
    joint: bool = False  # identity projections on the code's q, k, v joined from streams (joint.py)

    def describe(self) -> str:
        pairs = ", ".join(f"{role}={name}" for role, (name, _) in self.linears.items())
        how = self.matched_by if self.matched_by.startswith(("a fused", "the nn.")) else f"matched by {self.matched_by}"
        return f"{pairs} ({how})"


SHARED_KV = ("data flow: one projection makes both your keys and your values, K = V (Linformer's share_kv), a "
             "convention, not a mistake: your module holds no other projection for the values")


def find_projections(module: nn.Module, records: list[Record] | None = None, n_head: int | None = None,
                     d_head: int | None = None, inputs: dict[str, str] | None = None) -> list[Projections]:
    """Every reading of the module's projections worth lining up, the likeliest first: four Linear layers by
    name, a wrapped nn.MultiheadAttention, a fused q/k/v projection (one candidate per way of splitting it),
    exactly four Linear layers in registration order. `inputs`: the forward's tensor parameters by role (Q, K,
    V), where it takes them apart: each projection's role is then the role of the input it reads. A projection
    applied to each head's slice (blockheads.py) is held block-diagonal, said in the reading's note."""
    from attnscope.usertrace import blockheads, cutroles, fused

    found = _find_projections(module, records, n_head, d_head, inputs)
    for projections in found:
        cut = None if fused.USED_SWAPPED in projections.matched_by else cutroles.order_note(projections.linears)
        if cut is not None and "'s rows hold" not in (projections.note or ""):
            # q, k, v cut from one packed parameter in another order than q, k, v (cutroles.py)
            projections.note = f"{projections.note}; {cut}" if projections.note else cut
        said = blockheads.note(projections.linears)
        if said is not None:
            projections.note = f"{projections.note}; {said}" if projections.note else said
    return found


def _find_projections(module: nn.Module, records: list[Record] | None, n_head: int | None, d_head: int | None,
                      inputs: dict[str, str] | None) -> list[Projections]:
    from attnscope.usertrace import (
        blockheads,
        cutroles,
        flow,
        fused,
        identity,
        keybias,
        laterbias,
        normfold,
        perhead,
        unused,
    )
    from attnscope.usertrace.adapters import fold

    if identity.is_holder(module):  # q, k, v given already projected, the heads split by the code (identity.py)
        return [Projections(identity.projections(module), "identity")]
    records = records or []
    params = dict(module.named_parameters())
    # nn.Linear layers, and pointwise Conv1d ones read as the Linear they are (pointwise.py)
    linears = [(name, as_called(name, m, records, params)) for name, m in linear_layers(module)]
    linears += parameter_projections(module, records)
    # a weight the code mixes the projected tokens by (Linformer's proj_k, rtdl's key_compression): a pooling
    mixers = flow.token_mixers(records)
    linears = [(name, m) for name, m in linears if name not in mixers]
    # a bias the code adds once it has cut the output apart (q = q + self.q_bias after the chunk): laterbias.py
    linears = [(name, laterbias.added(name, m, records, params)) for name, m in linears]
    linears = fold(linears, records)  # LoRA's q_proj(x) + B(A(x)): one weight W + W_B·W_A (adapters.py)
    if records is not None:  # a Linear then an eval-mode BatchNorm1d (LeViT's MLPLayerWithBN): one projection
        linears = [(name, normfold.folded(name, m, records)) for name, m in linears]
    # one projection every head applies to its own slice, after the split (Persson's Linear(head_dim, head_dim))
    linears = [(name, blockheads.spread(name, m, records, n_head)) for name, m in linears]
    modules, names = dict(linears), [name for name, _ in linears]
    heads = perhead.find(records)
    if heads is not None and all(name in modules for roles in heads.roles for name in roles.values()):
        return [Projections(perhead.projections(heads, modules, names, role_of),
                            f"data flow, per head: {len(heads.roles)} softmaxes, each with q, k and v projections of "
                            "its own, stacked by head in the order your code merges their outputs"
                            + (f"; {NO_OUTPUT}" if heads.o is None else ""))]
    read = flow.roles(records, names, role_of)
    named = {role: [n for n in names if role_of(n) == role] for role in ROLES}
    if read is not None:  # the Linear layers the run called (diffusers' Attention holds add_q_proj beside to_q)
        ran = {role: [n for n in held if mentioned(n, records)] for role, held in named.items()}
        named = ran if all(len(ran[role]) == 1 for role in ROLES) else named
    if read is not None and all(len(named[role]) == 1 for role in ROLES) and any(
            read[0][role] != named[role][0] for role in ROLES):
        # four Linear layers named one role each, used in other roles (k_proj's output multiplied by the pattern,
        # v_proj's making the scores): a swap, never a convention. The reference holds the weights by their names
        # and the line-up shows where the code parts from it (the catalog names the swap by experiment).
        used = ", ".join(f"{read[0][role]} as {role.upper()}" for role in ROLES if read[0][role] != named[role][0])
        return [Projections({role: (named[role][0], modules[named[role][0]]) for role in ROLES},
                            f"name; your code uses {used}")]
    if read is not None and all(len(named[role]) == 1 for role in "qkv") and read[0]["q"] == named["q"][0] \
            and (read[0]["k"], read[0]["v"]) == (named["v"][0], named["k"][0]) and read[0].get("o") in modules \
            and read[0]["o"] not in (named[r][0] for r in "qkv"):
        # the same where only q, k and v are named, the output projection the flow's (`dense`, `proj`), and the
        # keys and values are each other's: k_proj's output multiplied by the pattern and v_proj's rotated as keys
        # is `k, v = v, k` before RoPE, which no flow can tell from correct code (minGPT's `k @ qᵀ`, the query and
        # key weights' roles exchanged, stays the flow's reading: the transposed scores of a correct attention)
        used = ", ".join(f"{read[0][role]} as {role.upper()}" for role in "kv")
        return [Projections({**{role: (named[role][0], modules[named[role][0]]) for role in "qkv"},
                             "o": (read[0]["o"], modules[read[0]["o"]])}, f"name; your code uses {used}")]
    apart = _by_inputs(records, names, inputs, named) if read is None and inputs and len(inputs) > 1 else None
    if apart is not None:
        found_roles, how = apart
        return [Projections({role: (name, modules[name]) for role, name in found_roles.items()}, how)]
    if read is not None:  # the data flow decides; names and order only break its ties
        found_roles, tie = read
        how = "name" if all(role_of(name) == role for role, name in found_roles.items()) else (
            "data flow: Q makes the scores' left operand, K the right, V what the pattern multiplies"
            + (f"; {tie} broke a tie" if tie else ""))
        biased = keybias.biased_swap(found_roles, modules, role_of)
        if biased is not None:  # no bias on the Linear used as V, one on K's: the keys' is the one left out
            found_roles, how = biased
        said = cutroles.swapped(records, found_roles)
        if said is not None:  # rows cut from a packed weight, named k and used as V: held by the words
            found_roles = {**found_roles, "k": found_roles["v"], "v": found_roles["k"]}
            how = f"{how}{said}"
        return [Projections({role: (name, modules[name]) for role, name in found_roles.items()}, how)]
    # before the names and the order: a Linear the run never calls, or calls on something other than the merge
    # (an out_proj behind a flag that is off), is no output projection
    alone = flow.without_output(records, names)
    if alone is not None:  # no output projection (HF's BertSelfAttention): the reference's is the identity, so its
        # x is the merge (of any width: n_head·d_head need not be d_feat)
        how = "data flow"
        if all(len(named[role]) == 1 for role in "qkv") and any(alone[role] != named[role][0] for role in "qkv"):
            # three named one role each, used in others: a swap, held by the names as with an output projection
            how = "name; your code uses " + ", ".join(f"{alone[role]} as {role.upper()}" for role in "qkv"
                                                      if alone[role] != named[role][0])
            alone = {role: named[role][0] for role in "qkv"}
        return [Projections({**{role: (name, modules[name]) for role, name in alone.items()},
                             "o": (NONE, _identity(modules[alone["q"]]))}, f"{how}; {NO_OUTPUT}")]
    by_role: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, linear in linears:
        role = role_of(name)
        if role:
            by_role.setdefault(role, []).append((name, linear))
    by_role = {role: _one_by_name(held, records) for role, held in by_role.items()}
    if all(len(by_role.get(role, [])) == 1 for role in ROLES):
        return [Projections({role: by_role[role][0] for role in ROLES}, "name")]
    inner = fused.inner_mha(module)
    if inner is not None:
        return [Projections(fused.mha_parts(*inner), f"the nn.MultiheadAttention {inner[0] or 'it is'}")]
    called = fused.call_parts(module, records)
    if called is not None:  # F.multi_head_attention_forward called with the module's own parameters
        return [Projections(*called)]
    found = fused.fused_linear(linears)
    out = fused.output_linear(linears, found, role_of) if found is not None else None
    shared = flow.shared(records, names)
    thrown = unused.discarded(records)  # called, its product thrown away (`v = self.Wv(x)`, then `@ k`)
    if shared is not None and len(set(shared.values())) < 4:  # one weight writes two roles, beside unused ones
        spare = [n for n in names if not mentioned(n, records) or n in thrown]
        spare_parts = dict(parameter_projections(module, records, spare=True))
        siblings = unused.sibling_reading(shared, modules | spare_parts, spare + list(spare_parts), role_of,
                                          thrown)
        if siblings is not None:
            return [Projections({role: (name, (modules | spare_parts)[name]) for role, name in siblings[0].items()},
                                siblings[1])]
    lone = flow.shared_without_output(records, names) if shared is None else None
    if lone is not None:  # no output projection, and a weight the run never calls (`self.key(x)` for the values)
        spare = [n for n in names if not mentioned(n, records) or n in thrown]
        siblings = unused.sibling_reading(lone, modules, spare, role_of, thrown)
        if siblings is not None:
            return [Projections({**{role: (name, modules[name]) for role, name in siblings[0].items()},
                                 "o": (NONE, _identity(modules[lone["q"]]))}, f"{siblings[1]}; {NO_OUTPUT}")]
        if len(set(lone.values())) == 1:  # q, k and v from one fused Linear and no output projection (Swin V2's
            # window attention without its proj, a block whose projection lives in the next module): each way of
            # splitting it, the reference's output the identity, so its x is the merge of the heads
            name = lone["q"]
            return [Projections({**{role: (part.name, part) for role, part in parts.items()},
                                 "o": (NONE, _identity(parts["v"]))}, f"a fused projection, {how}; {NO_OUTPUT}",
                                fused.order_note(name, parts))
                    for how, parts in fused.split_layouts(name, modules[name], records, n_head, d_head,
                                                          keybias.zero_rows(module, records, name))]
    if shared is not None and shared["q"] != shared["k"] == shared["v"] and flow.keys_are_values(records):
        # one projection's whole output for the keys and the values (Linformer's share_kv), no spare one beside it;
        # beside one the code never uses (a value weight of another kind: a parameter beside Linear layers), that
        # one is the values' and the code's `v = k` the mistake the line-up shows (kv.values_from_keys)
        left = unused.left_value(module, records, modules[shared["k"]], thrown, mentioned)
        if left is not None:
            return [Projections({"q": (shared["q"], modules[shared["q"]]), "k": (shared["k"], modules[shared["k"]]),
                                 "v": left, "o": (shared["o"], modules[shared["o"]])},
                                f"data flow, with a weight your code never uses: {shared['k']} makes your K, V; "
                                f"the reference holds {left[0]}, which fits as the values' projection, as V")]
        return [Projections({"q": (shared["q"], modules[shared["q"]]), "k": (shared["k"], modules[shared["k"]]),
                             "v": (shared["k"], modules[shared["k"]]), "o": (shared["o"], modules[shared["o"]])},
                            SHARED_KV)]
    rows = unused.left_rows(module, names, modules[shared["k"]]) \
        if shared is not None and shared["q"] != shared["k"] == shared["v"] else None
    if shared is not None and rows is not None:  # one block of a parameter's rows for K and V, the next one unread
        return [Projections({"q": (shared["q"], modules[shared["q"]]), "k": (shared["k"], modules[shared["k"]]),
                             "v": rows, "o": (shared["o"], modules[shared["o"]])},
                            f"data flow, with rows your code never reads: {shared['k']} makes your K, V; the "
                            f"reference holds {rows[0]}, the rows left, which fit as the values' projection, as V")]
    if shared is not None and shared["q"] != shared["k"] == shared["v"]:  # a fused K/V projection (to_kv)
        return [Projections({"q": (shared["q"], modules[shared["q"]]),
                             **{role: (part.name, part) for role, part in parts.items()},
                             "o": (shared["o"], modules[shared["o"]])}, f"a fused K/V projection, {how}",
                            fused.order_note(shared["k"], parts))
                for how, parts in fused.kv_layouts(shared["k"], modules[shared["k"]], records,
                                                   keybias.zero_rows(module, records, shared["k"]))]
    if shared is not None and len(set(shared.values())) == 2 and (found is None or out is None):
        # q, k, v from one Linear the flow names, whatever its name
        found, out = (shared["q"], modules[shared["q"]]), (shared["o"], modules[shared["o"]])
    if found is not None and out is not None:
        candidates = [Projections({**{role: (part.name, part) for role, part in parts.items()}, "o": out},
                                  f"a fused projection, {how}", fused.order_note(found[0], parts))
                      for how, parts in fused.split_layouts(found[0], found[1], records, n_head, d_head,
                                                            keybias.zero_rows(module, records, found[0]))]
        if candidates:
            return candidates
    if len(linears) == 4:
        return [Projections(dict(zip(ROLES, linears, strict=True)), "registration order")]
    listed = ", ".join(f"{n} [{m.in_features} → {m.out_features}]" for n, m in linears) or "none"
    raise UsageError(f"no reference for {type(module).__name__}: trace copies q, k, v and output projections (four "
                     "Linear layers named like W_q/q_proj/query and W_o/out_proj, or exactly four in that order; a "
                     "fused q/k/v Linear such as nanoGPT's c_attn with its output projection; a fused k/v "
                     "Linear such as x-transformers' to_kv beside a q one; or an "
                     f"nn.MultiheadAttention) into attnscope's MultiHeadAttention; its Linear layers are {listed}")


def _one_by_name(held: list[tuple[str, Any]], records: list[Record] | None) -> list[tuple[str, Any]]:
    """The Linear layers named for one role, narrowed to one where the names alone leave several: the one the run
    called, else the one of full rank where the rest are low-rank (LoRA adapters left unfolded, `linear_v_adapter`
    [64 -> 4] and [4 -> 64] beside v_proj [64 -> 64], in code that never calls v_proj); `held` as it is otherwise."""
    if len(held) < 2:
        return held
    called = [(n, m) for n, m in held if records is not None and mentioned(n, records)]
    if len(called) == 1:
        return called
    weights = [getattr(m, "weight", None) for _, m in held]
    ranks = [min(w.shape) if isinstance(w, torch.Tensor) and w.dim() == 2 else 0 for w in weights]
    top = max(ranks)
    full = [h for h, rank in zip(held, ranks, strict=True) if rank == top]
    return full if len(full) == 1 and sorted(ranks)[-2] < top else held


def merge_only(found: Projections, records: list[Record] | None = None) -> Projections | None:
    """`found` with an identity output projection where its own reads more features than the heads write: the merge
    of the heads joined with other features before it (Flux's single-stream block, PaLM's and GPT-J's parallel
    blocks: `linear2(cat(attention, mlp(x)))`), or a Linear named like one that the run calls on something the
    pattern did not make (ConvBERT's `conv_out_layer`, over the module's input for its convolution branch), so that
    the reference is compared up to the merge. None otherwise."""
    from attnscope.usertrace import flow

    (_, q), (name, o) = found.linears["q"], found.linears["o"]
    if o.in_features <= q.out_features:
        return None
    apart = records is not None and flow.before_any_pattern(records, name)
    why = (f"your {name} reads {o.in_features} features, none of them made by the attention (a branch of its own): "
           "your code has no output projection" if apart else
           f"your {name} reads {o.in_features} features, the {q.out_features} of the merged heads beside others (an "
           "MLP's, as in a parallel block)")
    return Projections({**found.linears, "o": (NONE, _identity(q))},
                       f"{found.matched_by}; {why}, so the reference's output projection is the identity and it is "
                       "compared up to the merge of the heads", found.note, True)


NO_OUTPUT = "your code has no output projection, so the reference's is the identity and it is compared up to the " \
    "merge of the heads"


def _identity(query: Any) -> Any:
    """The output projection of a module that has none (HF's BertSelfAttention): the identity over the queries'
    width, so the reference's x is the merge of its heads."""
    from attnscope.usertrace import fused

    width, weight = query.out_features, query.weight
    return fused.Part(NONE, torch.eye(width, dtype=weight.dtype, device=weight.device), None)


def _by_inputs(records: list[Record], names: list[str], inputs: dict[str, str], named: dict[str, list[str]]
               ) -> tuple[dict[str, str], str] | None:
    """{role: Linear name} where the forward takes its queries apart from its keys (and values): each projection's
    role is that of the input it reads (a memory's two, K and V, told apart by the flow: the scores' right operand,
    the pattern's partner), the output projection the one reading what the pattern made; and how they were matched.
    Where three Linear layers are named one of q, k, v each and the inputs say otherwise (`value =
    self.linear_keys(key)` used as the values), the names hold the weights: a swap is a mistake, which the line-up
    then shows and the catalog names. None where the flow does not say it."""
    from attnscope.usertrace import cutroles, flow

    said = None
    fed = flow.projection_inputs(records, list(inputs))
    by_role: dict[str, list[str]] = {}
    for name, params in fed.items():
        roles = {inputs[p] for p in params}
        if name in names and len(roles) == 1:
            by_role.setdefault(roles.pop().lower(), []).append(name)
    if "v" not in by_role and len(by_role.get("k", [])) == 2:  # x and a memory: its two projections by their use
        sides = flow.sources(records)
        if sides is None:
            return None
        keys = [n for n in by_role["k"] if n in sides[1] and n not in sides[2]]
        values = [n for n in by_role["k"] if n in sides[2] and n not in sides[1]]
        if len(keys) != 1 or len(values) != 1:
            return None
        by_role["k"], by_role["v"] = keys, values
        said = cutroles.swapped(records, {"k": keys[0], "v": values[0]})
        if said is not None:  # rows cut from a packed weight, named k and used as V: held by the words
            by_role["k"], by_role["v"] = values, keys
    if any(len(by_role.get(role, [])) != 1 for role in "qkv"):
        return None
    found = {role: by_role[role][0] for role in "qkv"}
    out = [n for n in flow.readers(records) if n not in found.values()]
    if len(out) != 1:
        return None
    found["o"] = out[0]
    how = "name" if all(role_of(found[role]) == role for role in ROLES) else \
        "data flow: each projection's role is the input it reads, the output's what the pattern made"
    if all(len(named[role]) == 1 for role in "qkv") and any(found[role] != named[role][0] for role in "qkv"):
        used = ", ".join(f"{found[role]} on your {role.upper()} input" for role in "qkv"
                         if found[role] != named[role][0])
        return {**{role: named[role][0] for role in "qkv"}, "o": found["o"]}, f"name; your code uses {used}"
    return found, how if said is None else f"data flow, the memory's two projections by your code's words{said}"
