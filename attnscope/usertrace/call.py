"""Call the user's callable under the recorder, with its inputs, mask and the None/0.0 its signature asks for.

An exception inside it is the user's (a shape error, most often): it is kept with the op it failed in and
the line of the user's traceback, never raised as attnscope's.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError

if TYPE_CHECKING:
    from attnscope.usertrace.feeds import Feeds
    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.load import Plan, Target
    from attnscope.usertrace.record import Failure, Record

# Snapshots of every op are kept: refuse to grow past this share of the memory the machine has.
MEMORY_SHARE = 0.5


@dataclass
class Called:
    records: list[Record]
    failure: Failure | None
    source: str | None  # the user's traceback line, `File "x.py", line 9, in forward: ...`
    result: Any
    mask_given: Any = None  # what the mask parameter was given, in the convention the code reads
    swapped: bool = False  # the op `swap` named ran, its result replaced
    entered: frozenset[int] = frozenset()  # the id of each nn.Module whose forward the call entered (idlenorms.py)


def call(target: Target, fn: Any, plan: Plan, inputs: Inputs, module: Any, max_memory: int | None = None,
         mask: Any = None, fed: Feeds | None = None, quiet: bool = False, swap: tuple[int, Any] | None = None
         ) -> Called:
    """Call the user's callable with the inputs, `mask` (in the convention its code reads) for its mask
    parameter and `fed` for the others (a cache, a start position, RoPE's tables); `quiet`: its prints dropped (a
    run that only reads the code's data flow); `swap` (record, tensor): that op's result replaced by the tensor, the
    rest of the code run on it (Called.swapped says whether it was)."""
    import torch

    from attnscope.cost import available_memory
    from attnscope.usertrace import flex, load, normfold, perhead, pointwise
    from attnscope.usertrace.record import Failure, Recorder, RecordingTooLarge

    labels = {id(t): name for name, t in inputs.handed().items()}
    if mask is not None:
        labels[id(mask)] = plan.mask or "mask"
        if hasattr(mask, "shape") and tuple(mask.shape) not in inputs.masks_handed:
            inputs.masks_handed.append(tuple(mask.shape))
    if fed is not None:
        labels.update(fed.labels)
    linears: dict[int, str] = {}
    if module is not None:
        labels.update({id(p): name for name, p in module.named_parameters()})
        labels.update({id(b): name for name, b in module.named_buffers()})
        linears = {id(m.weight): name for name, m in module.named_modules()
                   if isinstance(m, torch.nn.Linear) or pointwise.is_pointwise(m)}  # a 1x1 Conv1d: a Linear
        for name, p in module.named_parameters():  # nn.Parameter weights used as x @ W, W @ x or F.linear(x, W)
            if p.dim() >= 2 and id(p) not in linears:  # 3: per-head stacks [n_head, d_head, d_in] (W @ x), kernels
                linears[id(p)] = name
    args, kwargs = arguments(plan, inputs, mask, fed)
    grouped = {id(inputs.tensors[name]): name for name in plan.grouped if name in inputs.tensors}
    for value in [*args, *kwargs.values()]:  # a memory handed as one group (plan.grouped): a view, its name kept
        if isinstance(value, torch.Tensor) and value._base is not None and id(value._base) in grouped:
            labels[id(value)] = grouped[id(value._base)]
    available = available_memory()
    budgets = [b for b in (int(available * MEMORY_SHARE) if available else None, max_memory) if b is not None]
    recorder = Recorder(target.source, labels, linears, min(budgets) if budgets else None)
    recorder.swap = swap
    # what the code is handed, as it was: code that changes an input in place (`q *= scale`, `mask.masked_fill_`)
    # gets it back unchanged after the call, so the reference (and the next call) read the inputs trace drew
    handed = [(t, t.clone()) for t in _tensors_in([*args, *kwargs.values()])]
    result, failure, source = None, None, None
    entered: set[int] = set()  # the modules the code calls, by a forward hook removed after the call
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, _: entered.add(id(m)))
    try:
        places: list[Any] = [vars(target.module)] if target.module is not None else []
        places += list(module.modules()) if isinstance(module, torch.nn.Module) else []
        with load.user_code(target.path, quiet), torch.no_grad(), recorder, flex.standing_in(recorder.whole, places):
            result = fn(*args, **kwargs)
    except RecordingTooLarge:
        limit = "--max-memory" if max_memory is not None else "the memory this machine has"
        raise ResourceError(f"the recorded steps outgrow {limit}; trace smaller inputs (--batch, --nq, --nk)") \
            from None
    except BaseException as exc:  # SystemExit, GeneratorExit, their own BaseException: theirs too
        if not load.users(exc):
            raise
        failure = recorder.failure if recorder.failure and recorder.failure.exception is exc else None
        if failure is None:  # not a tensor op: the user's own raise, an assert, a typo
            failure = Failure("", load.user_line(exc, target.source), [], load.one_line(exc), exc)
        source = traceback_line(exc, target)
    finally:
        hook.remove()
    recorder.finish(result)
    with torch.no_grad():
        for tensor, kept in handed:
            if tensor.shape == kept.shape and not torch.equal(tensor, kept):
                tensor.copy_(kept)
    for record in recorder.records:
        record.details["op"] = recorder.op_text(record)
    records = perhead.stacked(recorder.records) if failure is None else recorder.records
    records = normfold.merged(records)  # LeViT's Linear then BatchNorm1d: one projection (normfold.py)
    return Called(records, failure, source, result, mask, recorder.swapped, frozenset(entered))


def arguments(plan: Plan, inputs: Inputs, mask: Any, fed: Feeds | None) -> tuple[list[Any], dict[str, Any]]:
    values: dict[str, Any] = dict(inputs.handed())
    if plan.mask:
        values[plan.mask] = mask
    values.update(fed.values if fed is not None else {})
    values.update({name: None for name in plan.nones})
    values.update({name: 0.0 for name in plan.zeros})
    values.update(dict.fromkeys(plan.flags, False))  # required flags (flags.py): the output alone
    if plan.switched is not None:  # the code's own causal switch, under --causal
        values[plan.switched] = True
    values.update(plan.given)  # --forward's, as the user wrote them
    first = values.get(plan.tensors[0]) if plan.tensors else None
    values.update({name: first for name in plan.aliases})  # torchtune's `y`: x itself
    values.update({name: [values[name]] * count for name, count in plan.listed.items()})  # `inputs` = [q, k, v]
    values.update({name: values[name].unsqueeze(-3) for name in plan.grouped if name in values})  # one group
    args = [values.pop(name) for name in plan.order if name in plan.positional_only and name in values]
    return args, values


def _tensors_in(values: list[Any]) -> list[Any]:
    """The tensors among a call's arguments, in tuples and lists too (a cache `(K_cache, V_cache)`), each once."""
    import torch

    found: dict[int, Any] = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, (tuple, list)):
            found.update((id(t), t) for t in _tensors_in(list(value)) if id(t) not in found)
    return list(found.values())


def traceback_line(exc: BaseException, target: Target) -> str | None:
    """The last frame of the traceback in the user's file, as one line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(target.source)]
    if not frames:
        return None
    f = frames[-1]
    return f'File "{target.source.name}", line {f.lineno}, in {f.name}: {(f.line or "").strip()}'
