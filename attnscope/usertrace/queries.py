"""Queries (and keys) the module makes itself: Perceiver's learned latents (`q = self.to_q(self.latents.expand(b, -1,
-1))`), a pooling attention's learned query tokens, DETR's object queries, Flamingo's resampler whose keys and values
read the input and the latents together (`to_kv(torch.cat((x, latents), dim=-2))`). The forward takes x, but its
query projection reads a Parameter (or buffer) of its own, so n_Q is that tensor's length, not x's.

Read from the run, never from names: the projection whose output becomes the scores' left operand (flow.operands)
reads a tensor that comes from none of the forward's inputs and from at least one of the module's parameters or
buffers. The reference then reads that tensor as its query input (`Inputs.own`), as cross-attention does. Where the
keys' (values') projection then reads a tensor of another length than the input's, made from it and the module's own
tensors (the latents joined to x), that tensor is the reference's key (value) input, n_K its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.record import Record


@dataclass
class OwnQueries:
    tensor: torch.Tensor  # [n_batch, n_Q, d_feat], as the query projection reads it
    held: list[str]  # the module's parameters or buffers it comes from
    line: int
    projection: str  # the Linear (or weight) that reads it
    keys: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # K, V: [n_batch, n_K, d], its line


def find(records: list[Record], inputs: Inputs, module: Any) -> OwnQueries | None:
    """The query projection's input, where it comes from the module's own tensors alone (with the keys' and values'
    where they join those to the input); None where it reads the forward's inputs (or no query projection is
    seen)."""
    from attnscope.usertrace.flow import operands

    if module is None or inputs.layout != "row" or inputs.cache is not None or "d_feat" not in inputs.sizes:
        return None
    own = dict((*module.named_parameters(), *module.named_buffers()))
    kernel = next((r for r in records if r.func.endswith("multi_head_attention_forward")), None)
    if kernel is not None:  # nn.MultiheadAttention(latents, x, x): its query argument, [L, N, E] as the kernel takes it
        return _kernel_queries(records, kernel, inputs, own)
    found = operands(records)
    if found is None:
        return None
    read = _read(records, found[0], own)
    if read is None:
        return None
    tensor, texts, line, projection = read
    if texts & set(inputs.tensors):
        return None
    held = sorted(texts & set(own))
    batched = _batched(tensor, inputs.sizes.get("n_batch"), None)  # of their own width (latent_dim) where the input
    # is of another (perceiver-pytorch's data of input_dim, read by to_kv alone)
    if not held or batched is None:
        return None
    queries = OwnQueries(batched, held, line, projection)
    n_input = next(t for name, t in inputs.tensors.items() if inputs.roles.get(name) == "Q").shape[-2]
    for role, index in (("K", found[1]), ("V", found[2])):
        other = _read(records, index, own)
        if other is None or not other[1] & set(inputs.tensors) or not other[1] & set(own):
            continue
        joined = _batched(other[0], inputs.sizes.get("n_batch"), None)
        if joined is not None and joined.shape[-2] != n_input:  # the input joined to the module's own tensors
            queries.keys[role] = (joined, other[2])
    return queries


def _kernel_queries(records: list[Record], kernel: Record, inputs: Inputs, own: dict[str, Any]) -> OwnQueries | None:
    """The query argument of F.multi_head_attention_forward (nn.MultiheadAttention's kernel), where it comes from the
    module's own tensors alone: batch-first again (the kernel takes [n_Q, n_batch, d_feat])."""
    from attnscope.usertrace.align import ancestors

    if not kernel.args or kernel.args[0][0] != "rec":
        return None
    source = records[kernel.args[0][1]]
    history = [records[i] for i in ancestors(source, records) | {source.index}]
    texts = {text for r in history for k, text in r.args if k == "text" and isinstance(text, str)}
    held = sorted(texts & set(own))
    if texts & set(inputs.tensors) or not held:
        return None
    tensor = source.tensor.transpose(0, 1) if source.tensor.dim() == 3 else source.tensor
    batched = _batched(tensor, inputs.sizes.get("n_batch"), None)  # the latents' own width (kdim beside them)
    return OwnQueries(batched, held, source.line, "the nn.MultiheadAttention") if batched is not None else None


def _read(records: list[Record], index: int, own: dict[str, Any]
          ) -> tuple[torch.Tensor, set[str], int, str] | None:
    """What the projection behind record `index` reads: the tensor, the names its history reads (inputs,
    parameters), its line and the projection's name; None where no projection is seen."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import projection_above

    projection = projection_above(records, index)
    if projection is None:
        return None
    kind, value = projection.args[1]
    if kind == "rec":
        source = records[value]
        history = [records[i] for i in ancestors(source, records) | {source.index}]
        texts = {text for r in history for k, text in r.args if k == "text" and isinstance(text, str)}
        return source.tensor, texts, source.line, str(projection.args[0][1])
    if kind == "text" and value in own:  # `self.to_q(self.latents)`: the parameter itself
        return own[value].detach(), {value}, projection.line, str(projection.args[0][1])
    return None


def _batched(tensor: torch.Tensor, n_batch: int | None, width: int | None) -> torch.Tensor | None:
    """`tensor` as `[n_batch, n, d]` (one set for the whole batch expanded), or None where it is no such input."""
    if not tensor.is_floating_point() or (width is not None and tensor.shape[-1] != width):
        return None
    if tensor.dim() == 2 and n_batch is not None:  # `self.to_q(self.latents)`: one set for the whole batch
        tensor = tensor.unsqueeze(0).expand(n_batch, *tensor.shape)
    if tensor.dim() != (3 if n_batch is not None else 2) or (n_batch is not None and tensor.shape[0] != n_batch):
        return None
    return tensor


def apply(inputs: Inputs, queries: OwnQueries) -> bool:
    """`inputs` with the module's own queries as the reference's query input, n_Q their length (and keys and values
    joined to them, n_K theirs); False (nothing changed) where the reference's mask does not fit those counts (a
    causal rule over x's tokens)."""
    n_Q = int(queries.tensor.shape[-2])
    n_K = int(queries.keys["K"][0].shape[-2]) if "K" in queries.keys else inputs.sizes["n_K"]
    if "V" in queries.keys and int(queries.keys["V"][0].shape[-2]) != n_K:
        return False
    mask = inputs.mask
    if mask is not None and mask.dim() >= 2 and (mask.shape[-2] not in (1, n_Q) or mask.shape[-1] not in (1, n_K)):
        return False
    inputs.own = {"Q": queries.tensor, **{role: t for role, (t, _) in queries.keys.items()}}
    inputs.sizes["n_Q"], inputs.sizes["n_K"] = n_Q, n_K
    held = " and ".join(queries.held)
    width, fed = int(queries.tensor.shape[-1]), inputs.sizes["d_feat"]
    keys = "the keys and values from the input"
    if width != fed:  # perceiver-pytorch's data of input_dim beside latents of latent_dim: the input is d_kv_in wide
        inputs.sizes["d_feat"], inputs.sizes["d_kv_in"] = width, fed
        keys += f" (d_kv_in = {fed}, the width their projections read; d_feat = {width}, your {held}')"
    from attnscope.usertrace.inputs import role_dims

    for name, op in inputs.ops.items():  # the input is the keys' side: [n_batch, n_K, d_kv_in]
        if op.startswith("torch.randn("):
            inputs.ops[name] = f"torch.randn({', '.join(role_dims('K', inputs.sizes, True, inputs.layout))})"
    if "K" in queries.keys:
        keys = (f"the keys and values from your input joined to your own tensors (line {queries.keys['K'][1]}), "
                f"n_K = {n_K}")
    inputs.notes.append(f"your queries come from your module's own {held} (line {queries.line}, read by "
                        f"{queries.projection}), not from the forward's input: read as cross-attention, n_Q = {n_Q} "
                        f"(their length), {keys}; the reference reads them as its inputs")
    return True


def input_keys(records: list[Record], inputs: Inputs) -> OwnQueries | None:
    """The keys' and values' input where their projections read the forward's inputs joined along the tokens with
    what the query projection reads among them (Idefics2's perceiver `k_proj(torch.concat([context, latents],
    dim=-2))`, lucidrains' `to_kv(torch.cat((x, latents), dim=-2))` with the latents an argument, either order, any
    dim spelling): the queries stay the forward's own, the joined tensor is the reference's key (value) input, n_K
    its length. Read from the data flow (the join's parts), never from names; None otherwise."""
    from attnscope.usertrace.align import ancestors
    from attnscope.usertrace.flow import projection_above
    from attnscope.usertrace.joint import JOINS

    if inputs.own or inputs.layout != "row" or inputs.cache is not None or len(inputs.tensors) < 2:
        return None
    projected = query_projection(records)
    if projected is None:
        return None
    found, q_proj = projected
    read = q_proj.args[1]
    names = set(inputs.tensors)
    tensor = records[read[1]].tensor if read[0] == "rec" else inputs.tensors.get(str(read[1]))
    if tensor is None:
        return None
    queries = OwnQueries(tensor, [], q_proj.line, str(q_proj.args[0][1]))
    own = _texts(records, [read])  # the inputs the queries read: the join must hold another
    for role, index in (("K", found[1]), ("V", found[2])):
        proj = projection_above(records, index)
        if proj is None or proj.args[1][0] != "rec":
            return None
        source = records[proj.args[1][1]]
        joins = [records[i] for i in sorted(ancestors(source, records) | {source.index})
                 if records[i].func.split(".")[-1] in JOINS]
        for join in joins:
            parts: list[tuple[str, Any]] = next((value for kind, value in join.args if kind == "list"), [])
            if read not in parts or not (_texts(records, parts) & names) - own \
                    or join.tensor.shape[-2] != source.tensor.shape[-2] or source.tensor.dim() != 3:
                continue
            queries.keys[role] = (source.tensor.detach(), join.line)
            break
        else:
            return None
    return queries


def query_projection(records: list[Record]) -> tuple[tuple[int, int, int, int | None], Record] | None:
    """(the scores' operands, flow.operands, and the projection nearest above the queries'); None where either is
    not seen."""
    from attnscope.usertrace.flow import operands, projection_above

    found = operands(records)
    q_proj = projection_above(records, found[0]) if found is not None else None
    return (found, q_proj) if found is not None and q_proj is not None else None


def _texts(records: list[Record], parts: list[tuple[str, Any]]) -> set[str]:
    """The names (inputs, parameters) `parts` ((kind, value) arguments) read, themselves or in their history."""
    from attnscope.usertrace.align import ancestors

    above = {i for kind, value in parts if kind == "rec" for i in ancestors(records[value], records) | {value}}
    return {value for kind, value in parts if kind == "text"} | {
        value for i in above for kind, value in records[i].args if kind == "text" and isinstance(value, str)}


def apply_input_keys(inputs: Inputs, queries: OwnQueries) -> bool:
    """`inputs` with the keys' and values' input the joined tensor (input_keys), n_K its length, and the note that
    says so; False (nothing changed) where the values' length differs or the reference's mask does not fit n_K."""
    n_K = int(queries.keys["K"][0].shape[-2])
    mask = inputs.mask
    if int(queries.keys["V"][0].shape[-2]) != n_K or mask is not None and mask.dim() >= 1 \
            and mask.shape[-1] not in (1, n_K):
        return False
    n_input = inputs.sizes.get("n_K")
    inputs.own = {role: t for role, (t, _) in queries.keys.items()}
    given = next(t for name, t in inputs.tensors.items() if inputs.roles.get(name) == "Q")
    swapped = queries.tensor is not given  # `forward(x, latents)`: the queries read the second input
    if swapped:
        inputs.own["Q"] = queries.tensor
        inputs.sizes["n_Q"] = int(queries.tensor.shape[-2])
    inputs.own_from = "keys"
    inputs.sizes["n_K"] = n_K
    inputs.notes.append(f"your keys and values are projected from your inputs joined along the tokens (line "
                        f"{queries.keys['K'][1]}), the tensor your {queries.projection} reads for the queries among "
                        f"them: n_K = {n_K} where your keys' input has {n_input}; a convention (a perceiver "
                        "resampler's latents attending to themselves beside the context), not a mistake: the "
                        "reference's key and value projections read the same joined tensor"
                        + (f"; the queries are the input your {queries.projection} reads, n_Q = "
                           f"{inputs.sizes['n_Q']}" if swapped else ""))
    return True
