"""Record every tensor op the user's code runs: a `torch.overrides.TorchFunctionMode`.

The mode sees torch functions (`torch.matmul`, `F.softmax`, `F.linear` inside `nn.Linear`, `F.dropout`
inside `nn.Dropout`), Tensor methods (`view`, `permute`, `transpose`, `contiguous`, `masked_fill`,
`reshape`, `unsqueeze`), operators (`@` is `matmul`, `/` by a numpy float is `div`), indexing and
properties (`.T`, `.mT`). Each op called from the user's file is kept with the line it ran on (the
innermost frame in that file), a snapshot of its result (in-place ops later cannot change it), whether it
allocated or is a view of its input, its FLOPs, and the records it read. Ops that torch runs inside
another op are not seen again (the mode is off while an op runs), so one line of the user's is one op.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attnscope import cost
from attnscope.usertrace import pointwise, weightrows
from attnscope.usertrace.bindings import Binder, Statements
from attnscope.usertrace.blank import Unwritten
from attnscope.usertrace.kernels import ATTENTION_KERNELS, KERNELS
from attnscope.usertrace.kernels import hidden as kernel_steps
from attnscope.usertrace.userfolder import Folder

COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
OPERATORS = {"matmul": "@", "__matmul__": "@", "div": "/", "true_divide": "/", "__truediv__": "/", "mul": "*",
             "__mul__": "*", "add": "+", "__add__": "+", "sub": "-", "__sub__": "-", "__eq__": "==", "eq": "==",
             "__ne__": "!=", "ne": "!=", "__lt__": "<", "lt": "<", "__gt__": ">", "gt": ">", "__le__": "<=",
             "le": "<=", "__ge__": ">=", "ge": ">=", "__and__": "&", "__or__": "|", "__rtruediv__": "/r",
             "__rmul__": "*", "__radd__": "+", "__rsub__": "-r", "pow": "**", "__pow__": "**"}
UNARY = {"__invert__": "~", "bitwise_not": "~", "__neg__": "-", "neg": "-", "logical_not": "~"}
LEFT = ("side", "left")  # the last argument of a projection written W @ x (the weight on the left): no tensor
KERNEL_IN = ("side", "kernel_in")  # a 3-D kernel [d_in, n_head, d_head] (Keras EinsumDense): no tensor
KERNEL_OUT = ("side", "kernel_out")  # a 3-D output kernel [n_head, d_head, d_out]: no tensor


def _read_right(args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor a projection written W @ x reads (its second), the weight on the left."""
    tensors = list(_tensors(args, kwargs))
    return tensors[1] if len(tensors) > 1 else None


def kernel_side(out_axes: list[int], in_axes: list[int]) -> tuple[str, str]:
    """A kernel of any rank an einsum projects with: which of its axes make the output's features (in the output's
    order) and which the input's (in the input's order), as `kernel:2,1:0` (kernel_axes reads it back)."""
    return ("side", f"kernel:{','.join(map(str, out_axes))}:{','.join(map(str, in_axes))}")


def kernel_axes(side: str) -> tuple[list[int], list[int]] | None:
    """The (output, input) axes `kernel_side` wrote; None for any other side."""
    if not side.startswith("kernel:"):
        return None
    _, out, given = side.split(":")
    return [int(a) for a in out.split(",")], [int(a) for a in given.split(",")]
MATMULS = ("matmul", "__matmul__", "bmm", "mm", "baddbmm")
MULTIPLIES = ("mul", "__mul__", "__rmul__", "mul_", "__imul__")  # a product, in place (`x *= g`) or not
SOFTMAXES = ("softmax", "log_softmax", "_softmax")
ELEMENTWISE = ("div", "true_divide", "mul", "add", "sub", "masked_fill", "masked_fill_", "exp", "sqrt", "rsqrt",
               "tanh", "where", "div_", "mul_", "add_", "sub_", "__truediv__", "__mul__", "__add__", "__sub__",
               "__rtruediv__", "__rmul__", "__radd__", "__rsub__", "pow", "__pow__", *ATTENTION_KERNELS)


# ops that hand a tensor's every value on, reshaped, laid out anew or cast: applied to a weight, what they make is
# that weight as the code uses it
WEIGHT_VIEWS = ("flatten", "unflatten", "view", "reshape", "type_as", "to", "contiguous", "float", "double", "half",
                "bfloat16", "squeeze", "unsqueeze", "t", "transpose", "permute", "T", "mT", "clone", "detach",
                "view_as", "reshape_as")


# Tensor methods whose output holds the first tensor's values alone, the others lending only a dtype and a device
# (Flux's QKNorm returns `q.to(v), k.to(v)`): v is no parent of the queries they make
DTYPE_ONLY = ("to", "type_as")
# Tensor methods that lay out the first tensor's values in the shape of the second, which lends no values: SAM's
# `decomposed_rel_pos.reshape_as(attn_weights)` is made from the queries and the tables, not from the scores
SHAPE_ONLY = ("reshape_as", "view_as", "expand_as")


FOREIGN_MOST = 1 << 20  # values kept of a tensor the run never made: a bias table's, never an input's


class RecordingTooLarge(Exception):
    """The snapshots would pass the memory budget; raised through the user's code, turned into a ResourceError."""


@dataclass
class Failure:
    """The op the user's code failed in: its text, line, the shapes that met, and the message."""

    op: str
    line: int | None
    shapes: list[list[int]]
    message: str
    exception: BaseException | None = None
    func: str = ""  # the op's short name, as a record's
    args: list[tuple[str, Any]] = field(default_factory=list)  # its arguments, as a record's


@dataclass
class Record:
    index: int
    func: str  # the op's short name: matmul, view, linear, softmax, dropout, ...
    call: str  # how to write it: torch.matmul, F.softmax, view, ...
    tensor: torch.Tensor
    line: int
    args: list[tuple[str, Any]]  # ("rec", index) | ("text", label): how to write each argument
    style: str  # "method", "property", "function", "operator", "linear"
    allocates: bool
    flops: int
    parents: tuple[int, ...]
    names: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.names[0] if self.names else f"#{self.index}"


class Recorder(TorchFunctionMode):
    """Use as `with Recorder(path, labels): user_callable(...)`; then `records`, `failure`."""

    def __init__(self, path: Path, labels: dict[int, str], linears: dict[int, str], budget: int | None) -> None:
        super().__init__()
        self.path = str(path)
        self._folder = Folder(self.path)  # helper files beside it (userfolder.py)
        self._helper: tuple[str, int] | None = None  # where in such a helper the op being recorded ran
        self.statements = Statements(path)
        self.records: list[Record] = []
        self.failure: Failure | None = None
        self._labels = dict(labels)  # id(tensor) -> input or parameter name
        self._linears = dict(linears)  # id(weight) -> the Linear's name in the module (or the parameter's)
        self._derived: dict[int, torch.Tensor] = {}  # id -> a weight as the code reshaped or cast it (WEIGHT_VIEWS)
        self._rows: dict[int, weightrows.Origin] = {}  # id(weight) -> where its values lie in its parameter
        self._produced: dict[int, int] = {}  # id(result) -> its latest record
        self._unwritten = Unwritten()  # uninitialised tensors' cells the code has not written yet
        self._changed: dict[int, int] = {}  # id(tensor) -> the in-place op that last changed it through a view of it
        self._alive: list[Any] = []  # keep results alive so their ids stay theirs
        self._budget, self._bytes = budget, 0
        self._binder = Binder(self.statements, self._bind)
        self.swap: tuple[int, torch.Tensor] | None = None  # (record, tensor): the op's result replaced (aftermerge.py)
        self.swapped = False

    # -- the mode ------------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _transformed():  # inside torch.vmap or torch.func's grad: per-sample values, none of the code's steps
            return func(*args, **kwargs)
        frames = self._user_frames()
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if frames:
                self._binder.finish()  # name what came before, so the failure reads in the user's names
                op, described, _, name = self._describe(func, list(args), kwargs)
                self.failure = Failure(op, frames[0].f_lineno, [list(a.shape) for a in _tensors(args, kwargs)],
                                       _one_line(exc), exc, name, described)
            raise
        if frames:
            out = self._swapped(out)
            self._record(func, list(args), kwargs, out, frames)
        return out

    def _swapped(self, out: Any) -> Any:
        """`out`, or the tensor `swap` hands the code in its place where this op is the record it names (the same
        shape): the rest of the code then runs on it (aftermerge.py replays the code's ops after its merge so)."""
        if self.swap is None or len(self.records) != self.swap[0] or not isinstance(out, torch.Tensor) \
                or tuple(out.shape) != tuple(self.swap[1].shape):
            return out
        self.swapped = True
        return self.swap[1].to(dtype=out.dtype, device=out.device).clone()

    def whole(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A function torch writes in Python, called by the user's code (flex.py: flex_attention,
        create_block_mask): run with the recording off, as torch runs it (its vmap and torch.compile inside are
        torch's), and recorded as one op, as the mode records a torch function."""
        frames = self._user_frames()
        if not frames or _transformed() or not _on_top(self):
            return func(*args, **kwargs)
        with torch.overrides._pop_mode_temporarily():
            try:
                out = func(*args, **kwargs)
            except Exception as exc:
                self._binder.finish()
                self.failure = Failure(self._describe(func, list(args), kwargs)[0], frames[0].f_lineno,
                                       [list(a.shape) for a in _tensors(args, kwargs)], _one_line(exc), exc)
                raise
            self._record(func, list(args), kwargs, out, frames)
        return out

    def finish(self, result: Any = None) -> None:
        """After the call: name what is still pending, and the returned tensors that have no name yet."""
        self._binder.finish()
        for position, (key, value) in enumerate(_returned(result)):
            index = self._produced.get(id(value))
            if index is not None and not self.records[index].names:
                self.records[index].names.append(key)
            if index is not None:  # what the call handed back, in order: the line-up compares it (firststep.py)
                self.records[index].details.setdefault("returned", position)

    # -- internals -----------------------------------------------------------------------------------
    def _user_frames(self) -> list[FrameType]:
        """The frames of the user's file on the stack, innermost first (a helper of theirs, then forward)."""
        frames: list[FrameType] = []
        frame: FrameType | None = sys._getframe(2)
        caller = frame
        while frame is not None:
            if frame.f_code.co_filename == self.path:
                frames.append(frame)
            frame = frame.f_back
        self._helper = self._folder.helper_at(caller) if frames else None
        return frames

    def _record(self, func: Any, args: list[Any], kwargs: dict[str, Any], out: Any, frames: list[FrameType]) -> None:
        results = [out] if isinstance(out, torch.Tensor) else (
            [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (tuple, list)) else [])
        if out is None and getattr(func, "__name__", "") == "__setitem__" and isinstance(args[0], torch.Tensor):
            results = [args[0]]  # `scores[~mask] = -inf` changes scores in place and returns nothing
        if not results:
            return
        _, text_args, style, call = self._describe(func, args, kwargs)
        name = call.removeprefix("F.").removeprefix("torch.")
        given = _tensors(args, kwargs)
        # `q.to(v)`, `x.type_as(y)`, `t.reshape_as(s)`: the second lends a dtype, a device or a shape, no values; a
        # parameter cast to an input's dtype (`self.rel.to(x)`) has no parent, not x
        given = given[:1] if name in SHAPE_ONLY or name in DTYPE_ONLY else given
        parents = tuple(max(self._produced[id(t)], self._changed.get(id(t), -1)) for t in given
                        if id(t) in self._produced)
        first = next(iter(_tensors(args, kwargs)), None)
        # float tensors the run never made and no label names (a module's cached copy of a parameter, LeViT's
        # attention_bias_cache): their values, which no record holds (ownbias._kept_copy reads them)
        foreign = [t.detach().clone() for t in given if id(t) not in self._produced and id(t) not in self._labels
                   and t.is_floating_point() and t.dim() >= 2 and t.numel() <= FOREIGN_MOST]
        for snapshot in foreign:
            self._keep(snapshot)
        asked: dict[str, Any] = {}
        if name in KERNELS:  # what it computes without materializing: recomputed, marked so, before its output
            hidden, asked = kernel_steps(name, func, tuple(args), kwargs, out)
            for step, tensor, how in hidden:
                snapshot = tensor.detach().clone()
                self._keep(snapshot)
                self.records.append(Record(
                    len(self.records), "recomputed", f"recomputed: {how}, inside {call}", snapshot,
                    frames[0].f_lineno, [], "recomputed", False, 0, parents, [f"({step})"], {"recomputed": call}))
                self._alive.append(None)  # indexed as the records are; a recomputed step is bound to no name
        for position, tensor in enumerate(results):
            snapshot = tensor.detach().clone()
            self._keep(snapshot)
            index = len(self.records)
            shares = first is not None and _shares_memory(tensor, first)
            details: dict[str, Any] = {}
            if first is not None and tensor is first:  # masked_fill_ in place, or dropout in eval() handing x back
                details["same"] = "in place" if name.endswith("_") else "returns its input"
            if name == "dropout":
                details.update(_dropout_details(args, kwargs))
            self._unwritten.made(name, tensor)
            if details.get("same") == "in place" or (name == "__setitem__" and out is None):
                self._unwritten.written(name, args, tensor)
            if self._unwritten.blank(tensor):
                details["unwritten"] = True  # a step's stand-in never (align.candidates)
            if len(results) > 1:
                details["part"] = position
            if foreign:
                details["foreign"] = foreign
            if asked:
                details["kernel"] = asked
            if self._helper is not None:
                details["helper"] = self._helper  # (file, line) of a helper file beside the traced one it ran in
            if style == "linear" and (used := next((self._derived[id(t)] for t in _tensors(args, kwargs)
                                                     if id(t) in self._derived), None)) is not None:
                details["weight"] = used  # the weight as the code handed it (qkv_w.flatten(end_dim=1))
            if style == "linear" and (axis := self._contracted(getattr(func, "__name__", ""), args, text_args)) \
                    is not None:
                details["contracts"] = axis  # the input's axis the weight contracts, from its end (flow.mixes_tokens)
            if style == "linear" and (made := next((self._produced[id(t)] for t in _tensors(args, kwargs)
                                                    if id(t) in self._linears and id(t) in self._produced),
                                                   None)) is not None:
                details["weight_record"] = made  # the op that made that weight: rows cut (weightrows.py), a view
            if (bound := self.statements.bound(frames[0].f_lineno)) is not None:
                details["bound"] = bound  # the names its statement binds, as written (words.py reads them)
            if first is not None and not parents:  # what an input (or a parameter) was: no record says its shape
                details["source_shape"] = tuple(first.shape)
            if style == "linear" and LEFT in text_args and (read := _read_right(args, kwargs)) is not None \
                    and id(read) not in self._produced:  # `E.t() @ x` of the input: x's shape, not the weight's
                details["source_shape"] = tuple(read.shape)
            self.records.append(Record(index, name, call, snapshot, frames[0].f_lineno, text_args, style, not shares,
                                       _flops(getattr(func, "__name__", "") if getattr(func, "__name__", "") in
                                              pointwise.FUNCS else name, args, tensor), parents, details=details))
            self._produced[id(tensor)] = index
            if details.get("same") == "in place" or (name == "__setitem__" and out is None):
                # `scores.view(..).masked_fill_(..)` changes scores too: what later reads scores comes from this op
                base = tensor._base
                if base is not None and id(base) in self._produced:
                    self._changed[id(base)] = index
            self._alive.append(tensor)
            if name in WEIGHT_VIEWS and first is not None and id(first) in self._linears and tensor is not first \
                    and tensor.numel() == first.numel():
                # a weight reshaped or cast whole (modded-nanogpt's F.linear(x, qkv_w.flatten(end_dim=1))): still
                # that parameter's, read as the code uses it
                self._linears[id(tensor)] = self._linears[id(first)]
                self._derived[id(tensor)] = snapshot
                self._rows.update(weightrows.whole(self._rows.get(id(first)), first, tensor, self._linears[id(first)]))
            elif first is not None and id(first) in self._linears and tensor.numel() < first.numel() \
                    and (held := weightrows.part(self._rows.get(id(first)), first, tensor,
                                             self._linears[id(first)])) is not None:
                # rows of a packed weight the code cuts itself (torch's _in_projection: in_proj_weight.chunk(3),
                # [E:2 * E], split([dq, dk, dv]), a stacked [3, E, E] parameter's W[i]): a weight of its own, named
                # by the rows of the parameter it holds (`in_proj_weight[32:64]`), read as the code uses it
                self._linears[id(tensor)], self._rows[id(tensor)] = held
                self._derived[id(tensor)] = snapshot
            # every frame of the user's binds names: `Q_split = split(Q_feat)` names what the helper returned;
            # a comprehension binds nothing itself, the statement around it does
            for frame in frames:
                if frame.f_code.co_name not in COMPREHENSIONS:
                    self._binder.add(frame, frame.f_lineno, index)

    def _keep(self, snapshot: torch.Tensor) -> None:
        self._bytes += snapshot.numel() * snapshot.element_size()
        if self._budget is not None and self._bytes > self._budget:
            raise RecordingTooLarge(self._bytes)

    def _bind(self, index: int, value: Any, name: str) -> bool:
        if self._alive[index] is not value:
            return False
        if name not in self.records[index].names:
            self.records[index].names.append(name)
        return True

    def _describe(self, func: Any, args: list[Any],
                  kwargs: dict[str, Any]) -> tuple[str, list[tuple[str, Any]], str, str]:
        """(op text now, the arguments as ("rec", i) / ("text", s), the style, the name to write)."""
        name = getattr(func, "__name__", None) or type(func).__name__
        owner = getattr(func, "__qualname__", "")
        described = [self._arg(a) for a in args] + [("text", f"{k}={_literal(v)}") for k, v in kwargs.items()
                                                    if not isinstance(v, torch.Tensor) and _shown(k, v)]
        described += [("kw", (k, self._arg(v))) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if name == "__get__" and hasattr(func, "__self__"):  # a property: Tensor.T, Tensor.mT
            name, style = getattr(func.__self__, "__name__", "attribute"), "property"
        elif name == "linear" and (given := _linear_args(args, kwargs)) is not None \
                and id(given[1]) in self._linears:
            style = "linear"
            x, weight, bias = given
            # F.linear(x, W, b) with nn.Parameters W and b (fairseq's in_proj_weight, in_proj_bias): b its bias; a b
            # computed from parameters (BEiT's cat(q_bias, zeros, v_bias)) too, and every argument by keyword
            described = [("text", self._linears[id(weight)]), self._arg(x),
                         *([("kw", ("bias", self._arg(bias)))] if isinstance(bias, torch.Tensor) else [])]
        elif name in pointwise.FUNCS and (conv := pointwise.conv_args(args, kwargs, pointwise.FUNCS[name])) \
                is not None and id(conv[1]) in self._linears:
            # a pointwise Conv1d over [n_batch, d_in, n] (guided-diffusion's qkv, proj_out), a Conv2d over a map
            # [n_batch, d_in, n_h, n_w] (latent-diffusion's q, k, v): W[:, :, 0] @ x + b, the column form's
            # projection, its weight read as [d_out, d_in] (pointwise.py)
            x, weight, bias, groups = conv
            self._derived.setdefault(id(weight), pointwise.as_matrix(weight, groups))
            name, style = "matmul", "linear"
            described = [("text", self._linears[id(weight)]), self._arg(x), LEFT,
                         *([("kw", ("bias", self._arg(bias)))] if bias is not None else [])]
        elif name == "addmm" and len(args) >= 3 and id(args[2]) in self._linears and id(args[1]) not in self._linears:
            # torch.addmm(b, x, W): GPT-2's Conv1D, x @ W + b with W [d_in, d_out], b its bias
            name, style = "matmul", "linear"
            described = [("text", self._linears[id(args[2])]), self._arg(args[1]), ("kw", ("bias", self._arg(args[0])))]
        elif name in ("matmul", "__matmul__") and len(args) == 2 and id(args[1]) in self._linears \
                and id(args[0]) not in self._linears:  # x @ W with an nn.Parameter W [d_in, d_out]: a projection
            name, style = "matmul", "linear"
            described = [("text", self._linears[id(args[1])]), described[0]]
        elif name in ("matmul", "__matmul__") and len(args) == 2 and id(args[0]) in self._linears \
                and id(args[1]) not in self._linears:
            # W @ x, the column form's projection (W [d_out, d_in], or per-head stacks [n_head, d_head, d_in], x one
            # token a column): the weight held as it is, its side said by the argument LEFT
            name, style = "matmul", "linear"
            described = [("text", self._linears[id(args[0])]), described[1], LEFT]
        elif name == "einsum" and (side := self._einsum_weight(args)) is not None:
            # torch.einsum("ij,bjn->bin", W, x): a projection, W on the side its contracted index says
            weight, left = side
            name, style = "matmul", "linear"
            others = [self._arg(a) for a in _tensors(args, {}) if a is not weight]
            described = [("text", self._linears[id(weight)]), others[0],
                         *([left] if isinstance(left, tuple) else [LEFT] if left else [])]
            axis = self._contracted("einsum", args, described)
            if axis is not None and axis != (-2 if LEFT in described else -1):
                # the weight contracts another axis than a projection's features (Linformer's 'bnd,nk->bkd' mixes
                # the tokens): written as the code wrote it, never as `x @ W`
                described.append(("einsum", (args[0], _tensors(args, {})[0] is weight)))
        elif owner.startswith(("TensorBase.", "Tensor.")):
            style = "operator" if (name in OPERATORS and len(args) == 2) or (name in UNARY and len(args) == 1) \
                else "method"
        else:
            module = getattr(func, "__module__", "") or ""
            prefix = "F." if "nn" in module else "torch."
            style, name = "function", f"{prefix}{name}" if not name.startswith(("F.", "torch.")) else name
        return render_op(name, style, described, self._text), described, style, name

    def _contracted(self, name: str, args: list[Any], described: list[tuple[str, Any]]) -> int | None:
        """The axis of a projection's input its weight contracts, counted from the input's end: -1 for F.linear and
        `x @ W`, -2 for the column form's `W @ x`, an einsum's by its contracted index (Linformer's 'bnd,nk->bkd':
        -2); None where the einsum contracts more than one index of the input."""
        if name != "einsum":
            return -2 if LEFT in described else -1
        operands = _tensors(args, {})
        weights = [i for i, t in enumerate(operands) if id(t) in self._linears]
        parts = str(args[0]).replace(" ", "").split("->")[0].split(",")
        if len(weights) != 1 or len(parts) != 2:
            return None
        other, subscripts = parts[1 - weights[0]], parts[weights[0]]
        given = operands[1 - weights[0]]
        letters = other.split("...")
        if len(letters) == 2:  # the leading axes `...` stands for: the letters after it count from the end
            other = letters[0] + "." * (given.dim() - len(letters[0]) - len(letters[1])) + letters[1]
        shared = [i for i, letter in enumerate(other) if letter != "." and letter in subscripts]
        output = str(args[0]).split("->")[1]
        contracted = [i for i in shared if other[i] not in output]
        return contracted[0] - len(other) if len(contracted) == 1 else None

    def _einsum_weight(self, args: list[Any]) -> tuple[torch.Tensor, bool | tuple[str, str]] | None:
        """The weight of an einsum that projects with one (two operands, one of them a weight, one index of the
        weight's contracted): the weight, and whether it stands on the left as the column form's W @ x does (its last
        index contracted: [d_out, d_in], [n_head, d_head, d_in]) rather than as x @ W (its first, or for per-head
        stacks [n_head, d_in, d_head] its middle). A 3-D kernel whose uncontracted indices stay side by side in the
        output, in their order, is Keras' EinsumDense: its first contracted ("btd,dhk->bthk", [d_in, n_head, d_head]:
        KERNEL_IN) or its first two ("bthk,hkd->btd", [n_head, d_head, d_out]: KERNEL_OUT), the head axis the kernel's
        own; a kernel of any other rank or layout (kernel_side) by which of its axes the output keeps and which it
        contracts. The input's `...` (Flax's '...d,dhk->...hk') is its leading axes. None for any other einsum."""
        operands = _tensors(args, {})
        if not args or not isinstance(args[0], str) or len(operands) != 2 or "->" not in args[0]:
            return None
        weights = [i for i, t in enumerate(operands) if id(t) in self._linears]
        if len(weights) != 1:
            return None
        inputs, output = args[0].replace(" ", "").split("->")
        parts = inputs.split(",")
        if len(parts) != 2 or "." in parts[weights[0]]:
            return None
        subscripts, other = parts[weights[0]], parts[1 - weights[0]].replace("...", "")
        output = output.replace("...", "")  # the input's leading axes (Flax's '...d,dhk->...hk'): no weight's
        contracted = [i for i, letter in enumerate(subscripts) if letter not in output]
        kept = "".join(letter for letter in subscripts if letter in output)
        if len(subscripts) == 3 and kept and kept in output and len(set(subscripts)) == 3:
            if contracted == [0] and output.endswith(kept):  # [d_in, n_head, d_head] -> [.., n_head, d_head]
                return operands[weights[0]], KERNEL_IN
            if contracted == [0, 1]:  # [n_head, d_head, d_out] -> [.., d_out]
                return operands[weights[0]], KERNEL_OUT
        if len(contracted) == 1 and len(subscripts) in (2, 3) and contracted[0] >= len(subscripts) - 2:
            return operands[weights[0]], contracted[0] == len(subscripts) - 1
        if len(subscripts) < 3 or len(set(subscripts)) != len(subscripts) or not kept or not contracted \
                or any(subscripts[i] not in other for i in contracted):
            return None
        # any other kernel ([n_head, d_in, d_head] read 'bnd,hde->bnhe', a fused [d_in, 3, n_head, d_head]): rows
        # its kept axes in the output's order, columns its contracted ones in the input's
        out_axes = sorted((i for i, letter in enumerate(subscripts) if letter in output),
                          key=lambda i: output.index(subscripts[i]))
        in_axes = sorted(contracted, key=lambda i: other.index(subscripts[i]))
        return operands[weights[0]], kernel_side(out_axes, in_axes)

    def _arg(self, value: Any) -> tuple[str, Any]:
        if isinstance(value, torch.Tensor):
            if id(value) in self._produced:
                return ("rec", self._produced[id(value)])
            if id(value) in self._labels:
                return ("text", self._labels[id(value)])
            return ("text", f"tensor{list(value.shape)}" if value.dim() or _transformed() else _literal(value.item()))
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return ("list", [self._arg(v) for v in value])
        return ("text", _literal(value))

    def _text(self, index: int) -> str:
        return self.records[index].label

    def op_text(self, record: Record) -> str:
        text = render_op(record.call, record.style, record.args, self._text)
        return f"{text}[{record.details['part']}]" if "part" in record.details else text


def render_op(name: str, style: str, args: list[tuple[str, Any]], text: Any) -> str:
    def one(arg: tuple[str, Any]) -> str:
        kind, value = arg
        if kind == "rec":
            return str(text(value))
        if kind == "list":
            return "[" + ", ".join(one(v) for v in value) + "]"
        if kind == "kw":
            return f"{value[0]}={one(value[1])}"
        return str(value)

    written = next((value for kind, value in args if kind == "einsum"), None)
    parts = [one(a) for a in args if a[0] != "einsum"]
    if style == "linear" and written is not None:  # an einsum whose weight mixes the tokens, as the code wrote it
        operands = (parts[0], parts[1]) if written[1] else (parts[1], parts[0])
        return f"torch.einsum({written[0]!r}, {operands[0]}, {operands[1]})"
    if style == "recomputed":
        return name
    if style == "property":
        return f"{parts[0]}.{name}"
    if style == "linear" and LEFT in args:
        return f"{parts[0]} @ {parts[1]}"
    if style == "linear":
        return f"{parts[1]} @ {parts[0]}" if name == "matmul" else f"{parts[0]}({parts[1]})"
    if style == "operator" and name in UNARY:
        return f"{UNARY[name]}{parts[0]}"
    if style == "operator":
        symbol = OPERATORS[name]
        if symbol.endswith("r"):  # reflected: 2 / x arrives as x.__rtruediv__(2)
            return f"{parts[1]} {symbol[:-1]} {parts[0]}"
        return f"{parts[0]} {symbol} {parts[1]}"
    if style == "method":
        if name == "__getitem__":
            return f"{parts[0]}[{parts[1] if len(parts) > 1 else ''}]"
        if name == "__setitem__" and len(parts) == 3:
            return f"{parts[0]}[{parts[1]}] = {parts[2]}"
        return f"{parts[0]}.{name}({', '.join(parts[1:])})"
    return f"{name}({', '.join(parts)})"


QUIET = {"inplace": False, "dropout_p": 0, "is_causal": False, "enable_gqa": False}  # defaults not worth writing


def _linear_args(args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """F.linear's (input, weight, bias), given by position or by keyword (`F.linear(input=x, weight=W, bias=b)`);
    None without an input and a weight."""
    given = dict(zip(("input", "weight", "bias"), args, strict=False))
    given.update({k: v for k, v in kwargs.items() if k in ("input", "weight", "bias")})
    if "input" not in given or "weight" not in given:
        return None
    return given["input"], given["weight"], given.get("bias")


def _shown(key: str, value: Any) -> bool:
    """Keyword arguments worth writing: not torch's plumbing (`_stacklevel`), not None, not a default that
    changes nothing (`inplace=False`, `dropout_p=0`)."""
    return not key.startswith("_") and value is not None and not (
        key in QUIET and isinstance(value, (bool, int, float)) and value == QUIET[key])


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _transformed() -> bool:
    """Inside a functorch transform (torch.vmap, torch.func.grad): its tensors are wrapped per level, and an op
    such as `.item()` on them raises."""
    return torch._C._functorch.maybe_current_level() is not None


def _on_top(mode: TorchFunctionMode) -> bool:
    """`mode` is the innermost torch function mode (the one a pop takes off)."""
    depth = torch._C._len_torch_function_stack()
    return depth > 0 and torch._C._get_function_stack_at(depth - 1) is mode


def _shares_memory(result: torch.Tensor, source: torch.Tensor) -> bool:
    """A view (or an in-place op) writes no new memory: its storage is its input's."""
    try:
        return bool(result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
                    and result.untyped_storage().data_ptr() != 0)
    except (RuntimeError, NotImplementedError):
        return False


def _dropout_details(args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """F.dropout(input, p=0.5, training=True, inplace=False): what it was asked to do."""
    names = ("input", "p", "training", "inplace")
    given = dict(zip(names, args, strict=False)) | kwargs
    return {"p": float(given.get("p", 0.5)), "training": bool(given.get("training", True))}


def _flops(name: str, args: list[Any], out: torch.Tensor) -> int:
    shape = tuple(out.shape)
    if name in pointwise.FUNCS and (conv := pointwise.conv_args(args, {}, pointwise.FUNCS[name])) is not None:
        return cost.linear_flops(shape, int(conv[1].shape[1]), conv[2] is not None)  # a pointwise convolution
    if name in MATMULS and args and isinstance(args[0], torch.Tensor) and args[0].dim():
        return cost.matmul_flops(shape, int(args[0].shape[-1]))
    if name == "linear" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        bias = len(args) > 2 and isinstance(args[2], torch.Tensor)
        return cost.linear_flops(shape, int(args[1].shape[-1]), bias)
    if name in SOFTMAXES:
        return cost.softmax_flops(shape)
    if name in ELEMENTWISE:
        return math.prod(shape)
    return 0


def _literal(value: Any) -> str:
    if isinstance(value, float) or type(value).__module__ == "numpy":
        try:
            return f"{float(value):.6g}"
        except (TypeError, ValueError):
            pass
    if isinstance(value, slice):
        parts = ["" if v is None else str(v) for v in (value.start, value.stop, value.step)]
        return ":".join(parts[:2] if value.step is None else parts)
    if value is Ellipsis:
        return "..."
    if isinstance(value, tuple):
        return ", ".join(_literal(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value) and isinstance(getattr(value, "__name__", None), str):  # flex_attention's score_mod
        return value.__name__
    text = repr(value)
    if "\n" in text:  # flex_attention's BlockMask(\n kv_num_blocks=...)
        return f"{type(value).__name__}(…)"
    return text if len(text) <= 24 else text[:23] + "…"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _returned(result: Any, key: str = "return") -> list[tuple[str, torch.Tensor]]:
    """The tensors a call returned, each with a name: the dict key, or return / return[i]."""
    if isinstance(result, torch.Tensor):
        return [(key, result)]
    if isinstance(result, dict):
        return [(str(k), v) for k, v in result.items() if isinstance(v, torch.Tensor)]
    if isinstance(result, (tuple, list)):
        return [(f"{key}[{i}]", v) for i, v in enumerate(result) if isinstance(v, torch.Tensor)]
    return []


def mentioned(name: str, records: list[Record]) -> bool:
    """Whether any op the code ran read the weight `name` (an nn.Linear by its name, a parameter)."""
    return any(("text", name) in r.args or ("kw", ("weight", ("text", name))) in r.args for r in records)
