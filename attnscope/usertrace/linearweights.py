"""The code's weights as the reference holds them: each projection's role by its name (`role_of`: `W_q`, `q_proj`,
`query`, `to_out.0`), the weights the code projects with that are no nn.Linear read as a Linear would hold them
(`parameter_projections`: TransformerLens' `W_Q`, Flax's `query.kernel`, Keras' EinsumDense kernels), with the bias
the code adds or hands F.linear (`called_bias`), and which parameters a record is computed from (`parameters_read`).
reference.py gathers the reference's modules."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnscope.usertrace.record import mentioned

if TYPE_CHECKING:
    from attnscope.usertrace.record import Record


ROLES = ("q", "k", "v", "o")
ROLE_WORDS = {
    "q": {"q", "query", "queries", "wq"},
    "k": {"k", "key", "keys", "wk"},
    "v": {"v", "value", "values", "wv"},
    "o": {"o", "out", "output", "wo"},
}
ANY_ROLE = set().union(*ROLE_WORDS.values())  # every role's words
LAYER_WORDS = {"dense"}  # a layer's own word: o alone (BERT's output.dense), else noise (Keras' _key_dense)
NOISE = {"w", "proj", "projection", "linear", "lin", "to", "fc", "layer", "weight", "in", "attn", "attention",
         "self", "l", "dense_layer", "c"}
GLUED = ("to", "proj", "projection", "linear", "lin", "fc")  # a projection's words a role's may be glued to
WEIGHT_WORDS = {"kernel", "weight", "w", "bias"}  # a projection's tensor in its module (Flax's query.kernel)
# a projection of the positions, never of the tokens' q, k or v, whatever role word its name holds beside (transformers'
# ParakeetEncoderAttention's `relative_k_proj`, Transformer-XL's `r_net`, wav2vec2-conformer's `linear_pos`)
POSITION_WORDS = {"relative", "rel", "pos", "position", "positional", "r"}


def role_of(name: str) -> str | None:
    """`W_q` -> q, `out_proj` -> o, `to_out.0` -> o, `dense` -> o, `_key_dense` -> k, `linears.2` -> None."""
    parts = name.lower().split(".")
    while parts and (parts[-1].isdigit() or parts[-1] in WEIGHT_WORDS):  # query.kernel, heads.0, W_q.weight
        parts.pop()
    if not parts:
        return None
    words = [_unglued(w) for w in re.split(r"[_\-]", parts[-1]) if w and w not in NOISE]
    if any(w in POSITION_WORDS for w in words):  # a projection of the positions (Parakeet's relative_k_proj)
        return None
    found = {role for role, vocabulary in ROLE_WORDS.items() if any(w in vocabulary for w in words)}
    if not found and any(w in LAYER_WORDS for w in words):
        found = {"o"}
    return found.pop() if len(found) == 1 else None


def _unglued(word: str) -> str:
    """A role's word written glued to a projection's (Peter Bloem's `tokeys`, `toqueries`; `qproj`, `keylinear`):
    the role's word; any other word as it is."""
    if word in ANY_ROLE:
        return word
    for glue in GLUED:
        for rest in (word[len(glue):] if word.startswith(glue) else "", word[:-len(glue)] if word.endswith(glue)
                     else ""):
            if rest in ANY_ROLE:
                return rest
    return word


def parameter_projections(module: nn.Module, records: list[Record], spare: bool = False) -> list[tuple[str, Any]]:
    """2-D nn.Parameter weights the code projects with, each read as a Linear would hold it: `x @ W` with W
    `[d_in, d_out]` (TransformerLens' W_Q, the from-scratch ports') as the weight `Wᵀ`, `F.linear(x, W)` as `W`.
    `spare`: instead, the weights the code never uses, of the shape and kind of one it does, whose name says no role
    left to them (unused.py reads theirs from the data flow)."""
    from attnscope.usertrace import fused
    from attnscope.usertrace.record import LEFT

    params = dict(module.named_parameters())
    held = {f"{name}.weight" for name, _ in linears(module)}  # nn.Linear, and 1x1 Conv1d layers
    out: dict[str, Any] = {}
    recipes: dict[str, tuple[bool, bool, str | None]] = {}
    for r in records:
        if r.style != "linear" or not r.args or r.args[0][0] != "text":
            continue
        name = r.args[0][1]
        used = r.details.get("weight")  # as the code reshaped it (qkv_w [3, hdim, dim] flattened), else itself
        cut = name not in params and f"{name}.weight" not in held and used is not None  # rows cut (weightrows.py)
        if name not in out and (cut or name in params and name not in held and params[name].dim() >= 2):
            recipes[name] = (r.func == "matmul", LEFT in r.args,
                             next((a[1] for a in r.args if a[0] == "side" and a[1].startswith("kernel")), None))
            weight = _as_linear(params[name].detach() if used is None else used, *recipes[name])
            if weight is not None:
                out[name] = fused.Part(name, weight, _added_bias(r, records, params, weight.shape[0]))
    said = {role_of(name) for name in out}
    spare_out: dict[str, Any] = {}
    for name, p in params.items():  # a weight the code never used (Flax's value.kernel where it projects with
        # key.kernel twice), read as its sibling of the same shape and kind (key.kernel) is: a role of its own
        # where its name says one no other weight holds; else spare (unused.py reads its role from the flow)
        used = next((u for u in out if u in params and params[u].shape == p.shape and _same_kind(u, name)), None)
        role = role_of(name)
        if name in out or name in held or used is None or mentioned(name, records):
            continue
        weight = _as_linear(p.detach(), *recipes[used])
        bias = params.get(name.rsplit(".", 1)[0] + ".bias") if "." in name else None
        if weight is not None:
            fit = bias is not None and bias.numel() == weight.shape[0]
            part = fused.Part(name, weight, bias.detach().reshape(-1) if fit and bias is not None else None)
            if role is None or role in said:
                spare_out[name] = part
            else:
                out[name] = part
                said.add(role)
    return list((spare_out if spare else out).items())


def pointwise_layers(module: Any) -> list[tuple[str, Any]]:
    """The module's pointwise Conv1d layers, each as the Linear it is (fused.Part: its weight `[d_out, d_in]`, its
    bias), by its name in the module."""
    from attnscope.usertrace.fused import Part
    from attnscope.usertrace.pointwise import as_matrix, is_pointwise

    return [(name, Part(name, as_matrix(m.weight, m.groups), m.bias.detach().clone() if m.bias is not None else None))
            for name, m in module.named_modules() if is_pointwise(m)]


def linears(module: Any) -> list[tuple[str, Any]]:
    """The module's nn.Linear layers and its pointwise Conv1d layers read as Linear ones, in registration order."""
    pointwise = dict(pointwise_layers(module))
    return [(name, pointwise.get(name, m)) for name, m in module.named_modules()
            if isinstance(m, nn.Linear) or name in pointwise]


def _same_kind(used: str, name: str) -> bool:
    """Two parameters of one kind: held under the same name by two modules (query.kernel, value.kernel), or both
    the attention module's own (W_K, W_V)."""
    return used.split(".")[-1] == name.split(".")[-1] if "." in used or "." in name else True


def _as_linear(weight: torch.Tensor, matmul: bool, left: bool, kernel: str | None = None) -> torch.Tensor | None:
    """A weight as a Linear holds it, [d_out, d_in]: `x @ W` (W [d_in, d_out]) transposed, `W @ x` (the column
    form) and `F.linear(x, W)` as they are; per-head stacks with their heads outer, `W @ x` of [n_head, d_head,
    d_in] and `x @ W` of [n_head, d_in, d_head] as [n_head·d_head, d_in]; Keras' EinsumDense kernels, [d_in, n_head,
    d_head] ("kernel_in") and the output's [n_head, d_head, d_out] ("kernel_out"), likewise. None for a 3-D F.linear
    weight."""
    from attnscope.usertrace.record import kernel_axes

    axes = kernel_axes(kernel) if kernel else None
    if axes is not None and sorted(axes[0] + axes[1]) == list(range(weight.dim())):
        out, given = axes  # an einsum's kernel of any rank: its output's axes as rows, its input's as columns
        rows, columns = [weight.shape[a] for a in out], [weight.shape[a] for a in given]
        return weight.permute(*out, *given).reshape(math.prod(rows), math.prod(columns))
    if weight.dim() > 3 or axes is not None:
        return None
    if weight.dim() == 3 and kernel == "kernel_in":
        return weight.permute(1, 2, 0).reshape(-1, weight.shape[0])  # -> [n_head·d_head, d_in]
    if weight.dim() == 3 and kernel == "kernel_out":
        return weight.reshape(-1, weight.shape[-1]).t()  # -> [d_out, n_head·d_head]
    if weight.dim() == 3:
        if not matmul:
            return None
        heads = weight if left else weight.transpose(1, 2)  # -> [n_head, d_head, d_in]
        return heads.reshape(-1, heads.shape[-1])  # [n_head, d_head, d_in] -> [n_head·d_head, d_in]
    return weight.t() if matmul and not left else weight


COLUMN_VIEWS = ("__getitem__", "unsqueeze", "view", "reshape", "expand")  # a bias made a column, [d_out, 1]


def _added_bias(projection: Record, records: list[Record], params: dict[str, Any], width: int) -> Any:
    """The 1-D nn.Parameter the code adds to a projection's output (`x @ W + b`, `b + x @ W`, `.add(b)`: GPT-2's
    Conv1D written out, the from-scratch ports' W/b pairs; the column form's `W @ x + b[:, None]` or a `[d_out, 1]`
    one), read as that projection's bias; None where none is added or the same bias meets other tensors too.
    `F.linear(x, W, b)`'s own b is its bias."""
    given = called_bias(projection, records, params, width)
    if given is not None:  # F.linear(x, W, b): ("kw", ("bias", ("text", name) or ("rec", i)))
        return given
    for r in records:
        if r.func not in ("add", "__add__", "__radd__", "add_") or ("rec", projection.index) not in r.args:
            continue
        for kind, value in r.args:
            if kind == "rec" and value != projection.index and records[value].func in COLUMN_VIEWS \
                    and records[value].args and records[value].args[0][0] == "text":
                kind, value = records[value].args[0]  # the column form's b[:, None], b.unsqueeze(-1): b as a column
            if kind == "text" and value in params and params[value].numel() == width \
                    and (params[value].dim() - list(params[value].shape).count(1) <= 1
                         or params[value].shape == projection.tensor.shape[-params[value].dim():]):
                # [d_out], [d_out, 1], or laid out as the projection's output ends (Flax's [n_head, d_head])
                return params[value].detach().reshape(width)  # [d_out], [d_out, 1] -> [d_out]
            if kind == "rec" and value != projection.index and records[value].tensor.numel() == width \
                    and records[value].tensor.is_floating_point() and _from_parameters(value, records, params):
                return records[value].tensor.detach().reshape(width)  # x @ W + cat((q_bias, zeros, v_bias))
    return None


def _from_parameters(index: int, records: list[Record], params: dict[str, Any]) -> bool:
    """Whether record `index` is computed from the module's parameters and constants alone (no input reaches it:
    every name its ops read, all the way up, is a parameter), as a bias the code builds is."""
    return parameters_read(index, records, params) is not None


def parameters_read(index: int, records: list[Record], params: dict[str, Any]) -> set[str] | None:
    """The module's parameters record `index` is computed from, all the way up; None where anything else reaches it
    (an input, a name that is no parameter): constants alone read none."""
    seen, stack, read = set(), [index], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for kind, value in records[i].args:
            if kind == "kw":
                kind, value = value[1]
            named = [value] if kind == "text" else [v for k, v in value if k == "text"] if kind == "list" else []
            if kind == "rec":
                stack.append(value)
            elif kind == "list":
                stack.extend(v for k, v in value if k == "rec")
            for name in named:
                if name in params:
                    read.add(name)
                elif isinstance(name, str) and name.replace(".", "_").isidentifier() \
                        and (kind == "list" or name not in ("True", "False", "None")):
                    return None
    return read


def called_bias(projection: Record, records: list[Record], params: dict[str, Any], width: int) -> Any:
    """The bias a projection's `F.linear(x, W, b)` was handed, `width` values: a parameter by name, or any tensor
    the code computed (BEiT's, EVA's and Swin v2's `torch.cat((q_bias, torch.zeros_like(v_bias), v_bias))`), as it
    was at the call; None where none was handed."""
    for kind, value in projection.args:
        if kind != "kw" or value[0] != "bias":
            continue
        source, what = value[1]
        if source == "text" and what in params and params[what].numel() == width:
            return params[what].detach().reshape(width)
        if source == "rec" and records[what].tensor.numel() == width and records[what].tensor.is_floating_point():
            return records[what].tensor.detach().reshape(width)
    return None


def as_called(name: str, linear: nn.Linear, records: list[Record], params: dict[str, Any]) -> Any:
    """`linear`, or where the code calls its weight through F.linear with a bias of its own making (every call the
    same), its weight with that bias (fused.Part, which reads like an nn.Linear)."""
    from attnscope.usertrace import fused

    calls = [r for r in records if r.style == "linear" and r.func == "linear" and r.args
             and r.args[0] == ("text", name)]
    given = [called_bias(r, records, params, linear.out_features) for r in calls]
    if not given or any(b is None for b in given) or any(not torch.equal(b, given[0]) for b in given[1:]):
        return linear
    if linear.bias is not None and torch.equal(given[0], linear.bias.detach()):
        return linear
    return fused.Part(name, linear.weight.detach(), given[0])

