"""The inputs of a traced call: sizes (sizes.py), random or file tensors by the callable's signature, the masks,
a decode step's cache.

A module's inputs are `[n_batch, n, d_feat]` (its width read from its projections); a function's are
`[n_batch, n, d_K]` and `[n_batch, n_K, d_V]`, or `[n_batch, n_head, n, d]` with --heads (K and V with
--kv-heads heads). One tensor parameter is self-attention (n_K = n_Q, or n_cache + n_Q in a decode step);
three are query, key and value.

Two masks: the reference's (`mask`: the --mask file under the mask rule; --causal and --window are the
reference's own options, reference.Spec) and the one the user's mask parameter gets (`allowed`: causal,
window and file combined, True = may attend, given to their code in the convention it reads, masking.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.usertrace.sizes import choose_sizes

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.load import Plan
    from attnscope.usertrace.reference import Projections


@dataclass
class InputOptions:
    """What shapes the inputs and what the reference computes: sizes (None: chosen), files, masks, variants."""

    batch: int | None = None
    nq: int | None = None
    nk: int | None = None
    d_feat: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    dk: int | None = None
    dv: int | None = None
    seed: int = 0
    q: str | None = None
    k: str | None = None
    v: str | None = None
    mask: str | None = None
    # a file: a float tensor the reference adds to the scores (T5's), or a relative key table (biasfile.py)
    position_bias: str | None = None
    causal: str | None = None
    window: int | None = None
    window_side: str = "left"  # "both": |i - j| <= window // 2, no causal mask (a bidirectional local window)
    rope: bool = False
    rope_base: float | None = None
    cache: int = 0
    # a module's one input handed as an image, [n_batch, n_h, n_w, d_feat] (SAM's, ViTDet's): (n_h, n_w), (0, 0)
    # for sizes chosen (image_grid); None: as rows
    grid: tuple[int, int] | None = None
    layout: str = "row"  # "col": a function's inputs [.., d, n], one token a column (sdpa --layout col); "time":
    # time-first [n, n_batch, d] (fairseq's, nn.MultiheadAttention's batch_first=False); "bthd": a function's
    # heads behind the tokens, [n_batch, n, n_head, d] (flash-attn's, JAX's); the last two read from the run only
    # query, key and value given one tensor, the same object, as --q alone gives it (self-attention through a
    # forward of three: AudioCraft's `assert query is key`); read from the run only
    one_input: bool = False


@dataclass
class ShapePlan:
    """The sizes known before the inputs: a module's width and heads (read from it), or what was asked for;
    `extra` names sizes that are no dim (a fused projection's `3·d_feat`), so no dim is given one of them."""

    fixed: dict[str, int]
    n_head: int | None
    why_no_heads: str | None = None
    extra: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def make(o: InputOptions, module: Any, init: dict[str, Any]) -> ShapePlan:
        from attnscope.usertrace import gatedwidth, load, perhead

        if module is None:
            fixed = {"n_head": o.heads} if o.heads else {}
            if o.heads and o.kv_heads and o.kv_heads != o.heads:
                if o.heads % o.kv_heads:
                    raise UsageError(f"--heads {o.heads} is not a multiple of --kv-heads {o.kv_heads}: each key/value "
                                     "head serves a whole group of query heads")
                fixed["n_kv_head"] = o.kv_heads
            elif o.kv_heads and not o.heads:
                raise UsageError("--kv-heads gives K and V fewer heads than Q; add --heads for the query heads")
            return ShapePlan(fixed, o.heads)
        width = module_width(module)
        read = linear_widths(module)
        if o.d_feat is not None and width is not None and read and o.d_feat not in read:
            widths = " or ".join(str(n) for n in sorted(read))
            raise UsageError(f"--d-feat {o.d_feat} but the module's Linear layers read {widths} features; drop "
                             "--d-feat")
        d_feat = o.d_feat if o.d_feat is not None else width  # nn.Parameter weights only: their sizes leave it open
        if d_feat is None:
            raise UsageError("cannot tell the module's width d_feat (no Linear layer found); pass --d-feat")
        n_head = load.head_count(module, init, o.heads)
        hint = load.head_size(module, init)
        if n_head is None and hint:  # Meta's Attention keeps head_dim: n_head is the query width over it
            found = _projections(module, None, hint)
            out = found.linears.get("o") if found else None
            n_head = gatedwidth.head_count(found.linears["q"][1].out_features, found.linears["k"][1].out_features,
                                           out[1].in_features if out else None, hint) if found else None
        fixed, extra = {"d_feat": d_feat}, {}
        if n_head:
            fixed["n_head"] = n_head
            projections = _projections(module, n_head, hint or (d_feat // n_head if d_feat % n_head == 0 else None))
            if projections and projections.linears["q"][1].in_features != d_feat:
                projections = None  # a reading whose queries read no input (MLA's q_b_proj, fed by q_a_proj)
            kernels = kernel_heads(module) if projections is None else None  # Keras' [d_feat, n_head, d_head]
            per_head = perhead.head_width(module, n_head, d_feat) if projections is None else None
            q_width = gatedwidth.query_width(projections.linears["q"][1].out_features,
                                             projections.linears["k"][1].out_features, n_head, hint) \
                if projections else \
                n_head * per_head if per_head else \
                kernels[0] * kernels[1] if kernels is not None and kernels[0] == n_head else \
                n_head * hint if hint else d_feat  # the head width the module says (a function's d_head=10)
            if projections and projections.linears["k"][1].in_features != d_feat:  # K, V read a context's width
                fixed["d_kv_in"] = projections.linears["k"][1].in_features
            v_in = _values_width(module, projections)
            if v_in is not None:
                fixed["d_v_in"] = v_in  # MobileBERT's values: the full hidden_size beside the bottleneck's q and k
            if q_width % n_head == 0:
                fixed["d_head"] = q_width // n_head
                k_width = projections.linears["k"][1].out_features if projections else q_width
                if k_width != q_width and k_width % fixed["d_head"] == 0:
                    fixed["n_kv_head"] = k_width // fixed["d_head"]  # grouped-query attention
                v_width = projections.linears["v"][1].out_features if projections else k_width
                kv_heads = fixed.get("n_kv_head", n_head)
                if v_width % kv_heads == 0 and v_width // kv_heads != fixed["d_head"]:
                    fixed["d_V"] = v_width // kv_heads  # values of their own width per head (Perceiver IO's)
            kv_found = fixed.get("n_kv_head", n_head)
            if o.kv_heads is not None and o.kv_heads != kv_found:
                raise UsageError(f"--kv-heads {o.kv_heads} but the module's key projection makes {kv_found} key/value "
                                 "heads; drop --kv-heads")
            fused = _fused_width(module) or next(  # fairseq's in_proj_weight [3·d_feat, d_feat], an nn.Parameter
                (3 * d_feat for p in module.parameters() if p.dim() == 2 and 3 * d_feat in p.shape), None)
            if fused:
                extra["3·d_feat" if fused == 3 * d_feat else "(n_head+2·n_kv_head)·d_head"] = fused
                if "d_head" in fixed:
                    extra["3·d_head"] = 3 * fixed["d_head"]  # a per-head fused layout (GPT-NeoX)
        why = None if n_head else f"cannot tell how many heads {type(module).__name__} has; pass --heads"
        return ShapePlan(fixed, n_head, why, extra)

    def fed(self, plan: Plan) -> Plan:
        """`plan`, with its memory parameter fed where the keys read another width than the queries: Stable
        Diffusion's `forward(x, context=None)` run alone would give its d_kv_in-wide to_k the queries' x."""
        memory = plan.memory() if "d_kv_in" in self.fixed else None
        return plan.with_memory(memory) if memory is not None else plan


def _projections(module: Any, n_head: int | None = None, d_head: int | None = None) -> Projections | None:
    from attnscope.usertrace.reference import find_projections

    try:
        return find_projections(module, None, n_head, d_head)[0]
    except UsageError:
        return None


def _values_width(module: Any, projections: Projections | None) -> int | None:
    """The width the values' projection reads where it is not the keys' (MobileBERT's `value` reads hidden_size, its
    `query` and `key` true_hidden_size; nn.MultiheadAttention's vdim beside kdim): from the projections found, or,
    before any run (a module without an output projection is read from its run's data flow), from one Linear named
    for each of q, k and v. None where the values read the keys' width."""
    from attnscope.usertrace.linearweights import linears, role_of

    if projections is not None:
        k, v = projections.linears["k"][1], projections.linears["v"][1]
    else:
        named = {role: [m for name, m in linears(module) if role_of(name) == role] for role in "qkv"}
        if any(len(held) != 1 for held in named.values()):
            return None
        k, v = named["k"][0], named["v"][0]
    k_in, v_in = getattr(k, "in_features", None), getattr(v, "in_features", None)
    return int(v_in) if k_in is not None and v_in is not None and v_in != k_in else None


def _fused_width(module: Any) -> int | None:
    from attnscope.usertrace import fused
    from attnscope.usertrace.linearweights import linears

    found = fused.fused_linear(linears(module))
    return found[1].out_features if found is not None else None


def module_width(module: Any) -> int | None:
    """d_feat: what the query projection reads (else the first Linear layer, a pointwise Conv1d too)."""
    from attnscope.usertrace import pointwise
    from attnscope.usertrace.inputwidth import fed_width
    from attnscope.usertrace.linearweights import linears as linear_layers

    projections = _projections(module)
    if projections is not None:  # what the query projection reads, or what the layers feeding it do (MLA's q_a_proj)
        name, layer = projections.linears["q"]
        return fed_width(module, name, int(layer.in_features), int(layer.out_features))
    linears = [m for _, m in linear_layers(module)]  # a 1x1 Conv1d reads its channels as a Linear its features
    if linears:
        return linears[0].in_features
    kernel = pointwise.kernel_width(module)  # F.conv1d kernels [d_out, d_in, 1] alone: what they read
    if kernel is not None:
        return kernel
    kernel = _kernel_width(module)  # 3-D kernels beside 2-D biases of [n_head, d_head] (Flax's DenseGeneral)
    if kernel is not None:
        return kernel
    # nn.Parameter weights only (x @ W): the size their dims share most, d_feat (W_Q [d_feat, n_head·d_head], ...)
    sizes = Counter(n for p in module.parameters() if p.dim() == 2 for n in p.shape)
    if not sizes:  # per-head stacks alone ([n_head, d_feat, d_head] and [n_head, d_head, d_feat]): their other sizes
        stacks = [tuple(p.shape) for p in module.parameters() if p.dim() >= 3]
        shared = len({s[0] for s in stacks}) == 1
        sizes = Counter(n for s in stacks for n in (s[1:] if shared else s))
    return sizes.most_common(1)[0][0] if sizes else None  # a guess the run confirms (trace tries the others)


def linear_widths(module: Any) -> list[int]:
    """The widths the module's nn.Linear layers (and nn.MultiheadAttention's query, key and value: embed_dim, kdim,
    vdim) read, in the order they are registered, each once: those its inputs may have (the queries' d_feat; a
    context's, or a latents wrapper's data, of another width); none where it holds nn.Parameter weights alone
    (their sizes leave the width open)."""
    from torch import nn

    from attnscope.usertrace import pointwise

    read = [w for m in module.modules() for w in ((m.embed_dim, m.kdim, m.vdim) if isinstance(m, nn.MultiheadAttention)
                                                 else (m.in_features,) if isinstance(m, nn.Linear)
                                                 else (m.in_channels,) if pointwise.is_pointwise(m) else ())]
    return list(dict.fromkeys(int(w) for w in read))


def _kernel_width(module: Any) -> int | None:
    """d_feat of 3-D kernels only (Keras' EinsumDense: [d_feat, n_head, d_head] in, [n_head, d_head, d_feat] out):
    the one adjacent pair of sizes every kernel holds in the same order is (n_head, d_head); d_feat the size left.
    None where no pair, or more than one, is common to them all."""
    pair = kernel_heads(module)
    if pair is None:
        return None
    first = next(tuple(p.shape) for p in module.parameters() if p.dim() == 3)
    return int(first[2] if first[0:2] == pair else first[0])


def kernel_heads(module: Any) -> tuple[int, int] | None:
    """(n_head, d_head) of 3-D kernels that disagree on their first axis (EinsumDense's [d_feat, n_head, d_head] and
    [n_head, d_head, d_feat]): the one adjacent pair of sizes they all hold in the same order; None otherwise."""
    kernels = [tuple(p.shape) for p in module.parameters() if p.dim() == 3]
    if len(kernels) < 2 or len({k[0] for k in kernels}) == 1 or all(k[-1] == 1 for k in kernels):
        return None  # every kernel [d_out, d_in, 1]: pointwise Conv1d kernels (pointwise.py), no heads of theirs
    common = set.intersection(*({k[0:2], k[1:3]} for k in kernels))
    return (int(common.copy().pop()[0]), int(common.pop()[1])) if len(common) == 1 else None


@dataclass
class Inputs:
    tensors: dict[str, torch.Tensor]  # parameter name -> tensor, in signature order
    roles: dict[str, str]  # parameter name -> Q, K or V (self-attention: Q only)
    mask: torch.Tensor | None  # the reference's: the --mask file under the mask rule
    sizes: dict[str, int]
    ops: dict[str, str]  # parameter name -> how it was made
    notes: list[str] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # what the user's mask parameter stands for: True = may attend
    cache: tuple[torch.Tensor, torch.Tensor] | None = None  # K_cache, V_cache [n_batch, n_kv_head, n_cache, d_head]
    cache_layout: str = "bhnd"  # how the code is handed the cache (cachelayouts.py); the reference reads `cache`
    # a run without a decode step whose code cannot run with its cache None (gemma_pytorch's kv_cache, written in
    # place): handed one of no cached positions, in `cache_layout` (feeds.py); the reference reads none
    empty_cache: bool = False
    cache_slots: dict[int, str] = field(default_factory=dict)  # a dict cache's layer keys (keyedcache.slots)
    # multi-head latent attention's (latentcache.py): the latents and rotary parts `cache` was expanded from, which
    # the reference reads instead
    latent_cache: tuple[torch.Tensor, torch.Tensor] | None = None
    extra_names: dict[str, int] = field(default_factory=dict)
    layout: str = "row"
    also_masked: list[str] = field(default_factory=list)  # mask parameters given a rule beside `mask`'s (not None)
    masks_handed: list[tuple[int, ...]] = field(default_factory=list)  # the shapes `mask` was handed in, in order
    own: dict[str, torch.Tensor] = field(default_factory=dict)  # Q (K, V): the module's own inputs (Perceiver's
    # latents; keys joined to them), read from the run (usertrace/queries.py)
    own_from: str = "module"  # "position": `own` holds the inputs plus a position embedding (usertrace/posembed.py)
    # (n_h, n_w): the one input is handed to the code as an image `[n_batch, n_h, n_w, d_feat]` (in the column form a
    # feature map `[n_batch, d_feat, n_h, n_w]`: latent-diffusion's AttnBlock), its tokens the
    # reference's n_Q = n_h·n_w in raster order (`tensors` holds them as the reference reads them); None: as it is
    grid: tuple[int, int] | None = None
    # handed(): each input's view, by the input's id, with the input it views
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    def handed(self) -> dict[str, torch.Tensor]:
        """The inputs as the code is handed them: an image `[n_batch, n_h, n_w, d_feat]` where `grid` says one, a
        view of the tokens the reference reads (the same view each time it is asked for)."""
        if self.grid is None:
            return self.tensors
        out = {}
        for name, t in self.tensors.items():
            if self.roles[name] == "Q" and t.dim() == 3:
                if id(t) not in self.views or self.views[id(t)][0] is not t:  # columns: a map [.., d_feat, n_h, n_w]
                    self.views[id(t)] = (t, t.unflatten(-1 if self.layout == "col" else -2, self.grid))
                t = self.views[id(t)][1]
            out[name] = t
        return out

    def side(self, name: str) -> str:
        """The role an input's dims are named by: its own, or K where the module's own tensors are the queries
        (Perceiver's latents: the forward's input is what the keys and values read, [n_batch, n_K, d_kv_in])."""
        role = self.roles[name]
        return "K" if role == "Q" and "Q" in self.own and self.own_from in ("module", "selected") else role

    def qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs as the reference reads them: [n_batch, n, d] (time-first ones [n, n_batch, d] transposed)."""
        by_role = {role: self.tensors[name] for name, role in self.roles.items()}
        if self.layout == "time":
            by_role = {role: t.transpose(0, 1) for role, t in by_role.items()}  # [n, n_batch, d] -> [n_batch, n, d]
        elif self.layout == "bthd":  # [n_batch, n, n_head, d] -> [n_batch, n_head, n, d]
            by_role = {role: t.transpose(1, 2) for role, t in by_role.items()}
        elif self.layout == "tbhd":  # [n, n_batch, n_head, d] -> [n_batch, n_head, n, d]
            by_role = {role: t.permute(1, 2, 0, 3) for role, t in by_role.items()}
        Q = by_role["Q"]
        K = by_role.get("K", Q)
        V = by_role.get("V", K)
        return self.own.get("Q", Q), self.own.get("K", K), self.own.get("V", V)


# The roles of the forward's tensors, by their count: x; x and the memory keys and values come from (the
# encoder-decoder tutorial's cross-attention `forward(x, memory)`); query, key, value.
ROLES = {1: ("Q",), 2: ("Q", "K"), 3: ("Q", "K", "V")}


def make_inputs(o: InputOptions, plan: Plan, shapes: ShapePlan, module: Any,
                guard: Callable[[dict[str, int]], None] | None = None) -> Inputs:
    """The inputs; `guard` sees the sizes before anything is drawn (the memory guard)."""
    import torch

    self_attention, is_module = plan.self_attention, module is not None
    _check(o, plan, is_module)
    sized = [flag for flag, value in (("--batch", o.batch), ("--nq", o.nq), ("--nk", o.nk), ("--dk", o.dk),
                                      ("--dv", o.dv)) if value is not None]
    if o.q and sized:
        raise UsageError(f"{' and '.join(sized)} size random inputs; with --q the files' shapes decide, so drop "
                         f"{' and '.join(sized)}")
    loaded = load_files(o, self_attention)
    notes: list[str] = []
    grid = None
    if loaded and is_module and self_attention and loaded["Q"].dim() == 4 and o.layout == "row" and not o.cache:
        # an image [n_batch, n_h, n_w, d_feat] (SAM's, ViTDet's): its tokens in raster order, handed as they are
        grid = (int(loaded["Q"].shape[1]), int(loaded["Q"].shape[2]))
        loaded = {role: t.flatten(1, 2) for role, t in loaded.items()}
    if loaded:
        tensors, sizes = _from_files(loaded, shapes, module, notes, o.cache, o.layout)
        if guard is not None:
            guard(sizes)
    else:
        if o.grid is not None and is_module and self_attention and o.layout in ("row", "col"):
            grid, batch = (o.grid, o.batch) if o.grid[0] * o.grid[1] > 0 else image_grid(o, shapes)
            o = dataclasses.replace(o, nq=grid[0] * grid[1], batch=batch)
        sizes = _choose(o, plan, shapes, is_module)
        batch = _file_sizes(o, self_attention, is_module).get("n_batch")
        if batch is not None and sizes.get("n_batch") == batch:
            notes.append(f"n_batch = {batch}, the first axis of --mask {o.mask} (--batch N sets it)")
        if guard is not None:
            guard(sizes)
        dtype = next(iter(module.parameters()), torch.empty(0)).dtype if is_module else torch.float32
        generator = torch.Generator().manual_seed(input_seed(o.seed))
        tensors = {role: torch.randn(*(sizes[d] for d in role_dims(role, sizes, is_module, o.layout)),
                                     generator=generator, dtype=dtype)
                   for role in ROLES[len(plan.tensors)]}
        if o.one_input and sizes.get("n_K") == sizes["n_Q"] and all(
                t.shape == tensors["Q"].shape for t in tensors.values()):
            tensors = dict.fromkeys(tensors, tensors["Q"])  # the same object for every role
    roles = dict(zip(plan.tensors, ROLES[len(plan.tensors)], strict=True))
    reference_mask, allowed = _masks(o, plan, sizes, notes, is_module)
    files = {"Q": o.q, "K": o.k or o.q, "V": o.v or o.k or o.q}
    ops = {name: f"loaded from {files[role]}" if files[role] else
           f"torch.randn({', '.join(role_dims(role, sizes, is_module, o.layout))})" for name, role in roles.items()}
    if not loaded and len(set(map(id, tensors.values()))) < len(tensors):
        first = plan.tensors[0]
        ops = {name: ops[name] if name == first else f"{first}, the same tensor" for name in ops}
    extra = dict(shapes.extra)
    if grid is not None:
        extra.update({"n_h": grid[0], "n_w": grid[1]})
        ops = {name: op if op.startswith("loaded") else f"{op.replace('n_Q', 'n_h, n_w')} (n_Q = n_h·n_w tokens "
               "in raster order)" for name, op in ops.items()}
    for name, count in plan.listed.items():  # Music Transformer's `inputs` = [q, k, v]
        ops[name] += f", handed as a list of {count}: [{', '.join([name] * count)}]"
    for name in plan.grouped:  # Flamingo's media [b, t, m, d]
        if name in ops:
            ops[name] += ", handed as one group of its tokens: [n_batch, 1, n_K, d_feat]"
    inputs = Inputs({name: tensors[role] for name, role in roles.items()}, roles, reference_mask, sizes, ops, notes,
                    allowed, extra_names=extra, layout=o.layout, grid=grid)
    if o.cache:
        inputs.cache = _cache(sizes, o.seed, tensors["Q"].dtype, sizes.get("d_V") if is_module else None)
    return inputs


# The inputs' stream, apart from the module's: trace builds the module under torch.manual_seed(seed), and a module
# whose __init__ draws with normal_ (Megatron's `init.normal_(std=0.02)`, an nn.Embedding) would otherwise hold the
# very numbers of the inputs, scaled (W = 0.02·x: scores symmetric, a fused output's values made twice, so that no
# reader could tell its rows by value); the same for a function's weights, drawn from the seed (weightargs.py)
INPUT_STREAM = 104729


def input_seed(seed: int) -> int:
    """The seed of the random inputs for trace's --seed `seed`."""
    return seed + INPUT_STREAM


def image_grid(o: InputOptions, shapes: ShapePlan) -> tuple[tuple[int, int], int | None]:
    """((n_h, n_w), n_batch) of an image input: --nq's tokens as near a square as they divide (n_h ≤ n_w); without
    --nq, the two smallest sizes no other dim has (n_batch chosen as for any input), a small image whose axes are
    named."""
    if o.nq is not None:
        h = max(d for d in range(1, int(o.nq ** 0.5) + 1) if o.nq % d == 0)
        return (h, o.nq // h), o.batch
    batch = choose_sizes(dict(shapes.fixed), ["n_batch"], {"n_batch": o.batch}, tuple(shapes.extra.values()))
    taken = {*shapes.fixed.values(), *shapes.extra.values(), batch["n_batch"], 1, 3}  # 3: a fused q, k, v
    h = next(n for n in range(2, 64) if n not in taken)
    return (h, next(n for n in range(h + 1, 64) if n not in taken)), batch["n_batch"]


def _check(o: InputOptions, plan: Plan, is_module: bool) -> None:
    if len(plan.tensors) == 2 and not is_module:  # a function's two tensors say nothing of which is which
        raise UsageError(plan.unfed())
    if plan.self_attention and o.nk is not None and o.nk != o.nq and not keys_of_own_queries(o, plan, is_module):
        raise nk_refused(o, plan, is_module)
    if plan.self_attention and o.dv is not None and o.dv != o.dk:
        raise UsageError(f"{plan.signature} takes one tensor (self-attention), so d_V = d_K; drop --dv")
    if o.mask and plan.mask is None and not is_module:  # a module's describes the reference, as --causal does
        raise UsageError(f"--mask: {plan.signature} has no mask parameter to pass it to (--causal and --window "
                         "describe the reference even without one)")
    if o.cache:
        if is_module and plan.cache is not None and not plan.self_attention:  # a cache, beside more than x
            raise UsageError(f"--cache {o.cache} runs a decode step of self-attention, which feeds x alone beside "
                             f"its cache ({plan.cache}); {plan.signature} also takes {', '.join(plan.tensors[1:])} "
                             "without a default, which trace cannot make: trace the module that calls it with them, "
                             "or give them defaults")
        if not is_module or (plan.cache is None and not plan.cache_held) or not plan.self_attention:
            raise UsageError(f"--cache {o.cache} runs a decode step, which needs a module whose forward takes x and "
                             "a cache (kv_cache, past_key_value, layer_past, ...; or past_key and past_value); "
                             f"{plan.signature} takes none")
    elif plan.cache is not None and plan.cache in plan.tensors:
        raise UsageError(f"{plan.signature} needs {plan.cache}: give --cache N for a decode step after N positions")
    if plan.tables and not o.rope:
        raise UsageError(f"{plan.signature} takes RoPE's tables ({', '.join(plan.tables)}): add --rope (and "
                         "--rope-base B) so that trace can make them and the reference rotates alike")


def nk_refused(o: InputOptions, plan: Plan, is_module: bool) -> UsageError:
    """--nk refused for a forward that takes one tensor and reads no memory beside it."""
    more = f" (with --cache {o.cache}, n_K = {o.cache} + n_Q)" if o.cache else ""
    if plan.memories() and is_module and not o.cache:
        more += (f": none of {', '.join(plan.memories())} (defaulting to None), given keys of another length, is "
                 "what its key and value projections read")
    return UsageError(f"{plan.signature} takes one tensor (self-attention), so n_K = n_Q{more}; drop --nk")


def keys_of_own_queries(o: InputOptions, plan: Plan, is_module: bool) -> bool:
    """Whether --nk may be the length of a module's one input, no memory beside it: the keys' where the module makes
    its queries itself (Perceiver's latents, read from the run: usertrace/queries.py); where it does not, the run
    refuses --nk after all (runs/trace.py)."""
    return is_module and plan.self_attention and not plan.memories() and not o.cache and not o.q and o.nq is None


def _choose(o: InputOptions, plan: Plan, shapes: ShapePlan, is_module: bool) -> dict[str, int]:
    self_attention = plan.self_attention
    wanted = (["n_batch"] if o.batch != 0 else []) + ["n_Q"] + ([] if self_attention else ["n_K"])  # 0: 2-D
    wanted += [] if is_module else ["d_K"] + ([] if self_attention else ["d_V"])
    filed = _file_sizes(o, self_attention, is_module)
    if o.nk is not None and keys_of_own_queries(o, plan, is_module):  # the one input is as long as --nk says
        o = dataclasses.replace(o, nq=o.nk)
    given = {"n_batch": o.batch or filed.get("n_batch"), "n_Q": o.nq or filed.get("n_Q"),
             "n_K": o.nk or filed.get("n_K"), "d_K": o.dk, "d_V": o.dv}
    fixed = dict(shapes.fixed) | ({"n_cache": o.cache} if o.cache else {})
    avoid = tuple(shapes.extra.values()) + _group(fixed, shapes.extra)  # n_group: an axis of grouped queries
    while True:
        sizes = choose_sizes(fixed, wanted, given, avoid)
        if self_attention:
            sizes["n_K"] = sizes["n_Q"] + o.cache
        if (self_attention or len(plan.tensors) == 2) and not is_module:
            sizes["d_V"] = sizes["d_K"]  # V is K's tensor
        taken = [v for k, v in sizes.items() if k != "n_K"] + list(avoid)
        if not o.cache or o.nq is not None or sizes["n_K"] not in taken:
            return sizes
        avoid = (*avoid, sizes["n_Q"])  # n_cache + n_Q lands on another dim's size: another n_Q


def _file_sizes(o: InputOptions, self_attention: bool, is_module: bool) -> dict[str, int]:
    """The sizes a --mask file says where no flag does: n_K its last axis (the keys'), where the keys' length is
    not the queries' (query, key and value given apart), else n_Q (self-attention without a cache); n_batch its
    first axis, for a 4-D file (a 3-D one before a module's or a function's headless scores), and for a 2-D file
    of self-attention whose rows are not its columns (key padding [n_batch, n_K]). An axis of 1 is shared and says
    nothing. Then those a --position-bias file says that the mask's do not (biasfile.sizes)."""
    if o.q or not (o.mask or o.position_bias):
        return {}
    from attnscope import masks
    from attnscope.tensors import load_tensor
    from attnscope.usertrace import biasfile

    biased = biasfile.sizes(tuple(int(s) for s in load_tensor(o.position_bias, meta=True).shape), self_attention,
                            o.cache, o.batch is not None) if o.position_bias else {}  # its header: the shape alone
    if not o.mask:
        return biased
    shape = masks.normalize(load_tensor(o.mask)).shape
    found: dict[str, int] = {}
    if shape and shape[-1] > 1 and not o.cache:
        found["n_Q" if self_attention else "n_K"] = int(shape[-1])
    batched = len(shape) == 4 or (len(shape) == 3 and (is_module or not o.heads))
    # a 2-D file of self-attention without a cache whose rows are not its columns is no [n_Q, n_K] pattern (n_Q = n_K
    # there): key padding [n_batch, n_K], flash-attn's key_padding_mask and HF's 2-D attention_mask (_key_padding);
    # so is one of queries and keys given apart whose rows are not the queries' length (DistilBERT's
    # forward(query, key, value, mask) with its mask [bs, k_length], transformers' `_prepare_4d_attention_mask`)
    padding = len(shape) == 2 and not o.cache and shape[0] != shape[-1] and (
        self_attention or (o.nq or 0) != shape[0])
    if o.batch is None and (batched or padding) and shape[0] > 1:
        found["n_batch"] = int(shape[0])
    return biased | found  # the mask's sizes first


def _group(fixed: dict[str, int], extra: dict[str, int]) -> tuple[int, ...]:
    """n_group = n_head / n_kv_head, where both are known: a size no chosen dim may take, so an axis of grouped
    queries ([.., n_kv_head, n_group, n_Q, d_head]) is never named from another dim."""
    n_head, kv = fixed.get("n_head"), fixed.get("n_kv_head") or extra.get("n_kv_head")
    if not n_head or not kv or kv == n_head or n_head % kv:
        return ()
    return (n_head // kv,)


def role_dims(role: str, sizes: dict[str, int], is_module: bool, layout: str = "row") -> tuple[str, ...]:
    """An input's dims: [n_batch, (n_head,) n, d], or [.., d, n] in the column layout, [n, n_batch, d] time-first;
    no n_batch for 2-D inputs."""
    n = "n_Q" if role == "Q" else "n_K"
    d = "d_V" if role == "V" else "d_K"
    if is_module:
        d = input_width(role, sizes)
    heads: tuple[str, ...] = ()
    if not is_module and "n_head" in sizes:
        heads = ("n_kv_head",) if role != "Q" and "n_kv_head" in sizes else ("n_head",)
    batch = ("n_batch",) if "n_batch" in sizes else ()
    if layout == "time" and batch and not heads:
        return (n, "n_batch", d)
    if layout == "bthd" and batch and heads:  # a function's heads behind the tokens (flash-attn's, JAX's 'bqhd')
        return ("n_batch", n, *heads, d)
    if layout == "tbhd" and batch and heads:  # time-first, the heads split (Megatron's core attention [s, b, np, hn])
        return (n, "n_batch", *heads, d)
    return (*batch, *heads, *((d, n) if layout == "col" else (n, d)))


def input_width(role: str, sizes: dict[str, int]) -> str:
    """The dim a module's input of `role` (Q, K or V) is wide by: d_feat, the keys' and values' d_kv_in where they
    read a context of its own width, the values' d_v_in where they read another width than the keys (MobileBERT's)."""
    if role == "V" and "d_v_in" in sizes:
        return "d_v_in"
    return "d_kv_in" if role != "Q" and "d_kv_in" in sizes else "d_feat"


def _cache(sizes: dict[str, int], seed: int, dtype: Any, d_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's cache: random keys (taken as already rotated, as transformers' caches hold them) and
    values, [n_batch, n_kv_head, n_cache, d_head], drawn after the inputs, as `mha --cache` draws them; the values
    `d_v` wide per head where the module's are not d_head wide."""
    import torch

    shape = (sizes["n_batch"], sizes.get("n_kv_head", sizes["n_head"]), sizes["n_cache"], sizes["d_head"])
    generator = torch.Generator().manual_seed(seed + 1)
    keys = torch.randn(shape, generator=generator).to(dtype)
    return keys, torch.randn(*shape[:3], d_v or shape[3], generator=generator).to(dtype)


def load_files(o: InputOptions, self_attention: bool) -> dict[str, torch.Tensor]:
    from attnscope.tensors import load_tensor

    if (o.k or o.v) and not o.q:
        raise UsageError("--k/--v need --q too (with only --q, K = V = Q)")
    if self_attention and (o.k or o.v):
        raise UsageError("this callable takes one tensor (self-attention: K = V = Q); give only --q")
    loaded: dict[str, torch.Tensor] = {}
    if o.q:
        loaded["Q"] = load_tensor(o.q)
        loaded["K"] = load_tensor(o.k) if o.k else loaded["Q"]
        loaded["V"] = load_tensor(o.v) if o.v else loaded["K"]
    return loaded


def _from_files(loaded: dict[str, torch.Tensor], shapes: ShapePlan, module: Any, notes: list[str],
                n_cache: int, layout: str = "row") -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    from attnscope.attention.dot_product import common_dtype

    Q, K, V = loaded["Q"], loaded["K"], loaded["V"]
    for name, t in (("--q", Q), ("--k", K), ("--v", V)):
        wide = input_width(name[-1].upper(), shapes.fixed)
        width = shapes.fixed.get(wide)
        if module is not None and (t.dim() != 3 or t.shape[-1] != width):
            dim = "d_feat" if width == shapes.fixed.get("d_feat") else \
                "d_v_in: its values read another width" if wide == "d_v_in" else "d_kv_in: its keys read a context"
            raise UsageError(f"{name} is {list(t.shape)} but the module takes [n_batch, n, {width}] ({dim})")
        if module is None and t.dim() < 2:
            raise UsageError(f"{name} is {list(t.shape)}; attention inputs are [.., n, d]")
    if module is not None:
        dtype = next(iter(module.parameters())).dtype
        if any(t.dtype != dtype for t in (Q, K, V)):
            notes.append(f"the inputs were converted to {str(dtype).removeprefix('torch.')}, the module's dtype")
    else:
        dtype, note = common_dtype(Q, K, V)
        if note:
            notes.append(note)
    converted = {id(t): t.to(dtype) for t in (Q, K, V)}  # K is Q when only --q: it stays the same tensor
    tensors = {"Q": converted[id(Q)], "K": converted[id(K)], "V": converted[id(V)]}
    sizes = dict(shapes.fixed) | ({"n_cache": n_cache} if n_cache else {})
    n, d = (-1, -2) if layout == "col" else (0, -1) if layout == "time" else (-2, -1)
    sizes.update({"n_Q": int(Q.shape[n]), "n_K": int(K.shape[n]) + n_cache})
    if Q.dim() >= 3:
        sizes["n_batch"] = int(Q.shape[1 if layout == "time" else 0])
    if module is None:
        sizes.update({"d_K": int(Q.shape[d]), "d_V": int(V.shape[d])})
        if Q.dim() == 4:
            sizes["n_head"] = int(Q.shape[1])
            if K.dim() == 4 and K.shape[1] != Q.shape[1]:
                sizes["n_kv_head"] = int(K.shape[1])
    return tensors, sizes


def _masks(o: InputOptions, plan: Plan, sizes: dict[str, int], notes: list[str] | None = None,
           is_module: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the reference's mask: the file under the mask rule; what the user's mask parameter stands for: causal,
    window and file combined, True = may attend, or a float bias when the file holds one). A module's file is
    judged against the reference's scores [n_batch, n_head, n_Q, n_K], whatever layout the code's own scores take
    ([n_batch·n_head, n_Q, n_K] for DETR's bmm); where n_head is not known yet, as many heads as the file says."""
    from attnscope import masks
    from attnscope.tensors import load_tensor

    n_Q, n_K = sizes["n_Q"], sizes["n_K"]
    col = o.layout == "col"  # the column form's scores are [.., n_K, n_Q]: a file is given so, causal transposed
    loaded = masks.normalize(load_tensor(o.mask)) if o.mask else None
    given = loaded  # what the code's mask parameter is given of the file
    if loaded is not None:
        scores = (*_leading(sizes, loaded if is_module else None), *((n_K, n_Q) if col else (n_Q, n_K)))
        padding = _key_padding(loaded, sizes, scores, col)
        if padding is not None and notes is not None:
            notes.append(f"--mask {o.mask}: [n_batch, n_K] = {list(loaded.shape)}, read as key padding "
                         f"{list(padding.shape)} (a key masked for every query of its sequence)")
        windows = _per_window(loaded, sizes) if is_module and padding is None and not col else None
        if windows is not None and notes is not None:
            m = loaded.shape[0]
            notes.append(f"--mask {o.mask}: [{m}, n_Q, n_K], one mask a window: n_batch = {sizes['n_batch']} holds "
                         f"{sizes['n_batch'] // m} groups of {m} windows, the batch element b masked by the file's "
                         f"row b mod {m} (Swin's shifted windows, added per window as `attn.view(B // nW, nW, ..) + "
                         "mask`); your code is given the file as it is")
        # (the column form's file [n_batch, n_K, n_Q]: a feature map's module, MobileViT's unfolding)
        rows = _per_sequence(loaded, sizes, scores, col) if is_module and padding is None and windows is None \
            else None
        if rows is not None and notes is not None:
            notes.append(f"--mask {o.mask}: [n_batch, {'n_K, n_Q' if col else 'n_Q, n_K'}] = {list(loaded.shape)}, "
                         "one mask a sequence, read "
                         f"as {list(rows.shape)} (every head); your code is given the file as it is")
        loaded = padding if padding is not None else windows if windows is not None else \
            rows if rows is not None else loaded
        given = loaded if windows is None and rows is None else given
        _fits(loaded, scores, sizes, o, plan, is_module)
    if plan.mask is None:
        if loaded is not None and notes is not None and not plan.masks_at_default:  # as --causal and --window: the
            # reference's, the code's own (a mask parameter left at its default says so in its own note)
            notes.append(f"--mask {o.mask}: {plan.signature} takes no mask, so the file describes the reference "
                         "alone, a mask your code is expected to apply by itself")
        return loaded, None
    from attnscope.spec import AttentionSpec

    built, _ = masks.structural(AttentionSpec.asked(o.causal, o.window, o.cache, window_side=o.window_side), n_Q, n_K)
    built = None if plan.switched is not None else built  # the code's own switch makes the rule (causalflag.py)
    # [n_Q, n_K] -> [n_K, n_Q] for the column form
    built = built.transpose(0, 1) if built is not None and col else built
    # [1, n_Q, n_K], the Annotated Transformer's `subsequent_mask` shape: it broadcasts against [n_batch, n_Q, n_K]
    # and [n_batch, n_head, n_Q, n_K] scores, and after the `mask.unsqueeze(1)` that code does for the heads.
    # (2-D inputs, one sequence, get the mask as it is: [1, ..] would add an axis to their scores)
    allowed = masks.combine(built.unsqueeze(0) if built is not None and "n_batch" in sizes else built, given)
    if allowed is None and plan.mask_open:  # a required mask the code cannot run on None: one that masks nothing
        import torch

        allowed = torch.ones(*((1,) if "n_batch" in sizes else ()), *((n_K, n_Q) if col else (n_Q, n_K)),
                             dtype=torch.bool)
        if notes is not None:
            notes.append(f"{plan.mask}: given a mask that masks nothing, [.., {'n_K, n_Q' if col else 'n_Q, n_K'}] "
                         "all True: your code takes it with no default and reads it without a test for None "
                         "(--mask FILE, --causal or --window give another)")
    return loaded, allowed


def _fits(mask: torch.Tensor, scores: tuple[int, ...], sizes: dict[str, int], o: InputOptions, plan: Plan,
          is_module: bool) -> None:
    """masks.check_broadcast, its refusal saying the flags that make the file fit, read from its shape
    (maskfit.flags: its last axis n_K, its rows n_batch where it is key padding [n_batch, n_K])."""
    from attnscope import masks
    from attnscope.usertrace import maskfit

    try:
        masks.check_broadcast(mask, scores)
    except UsageError as refused:
        unbatched = maskfit.unbatched(mask, sizes, o)
        if unbatched is not None:  # --batch 0 against a file of several sequences: the flag to change
            raise UsageError(unbatched) from None
        fit = maskfit.flags(mask, sizes, o, plan, is_module)
        if fit is None:
            raise
        raise UsageError(f"{refused}; as {fit[0]} it takes {fit[1]}") from None


def _per_window(mask: torch.Tensor, sizes: dict[str, int]) -> torch.Tensor | None:
    """A module's file `[m, n_Q, n_K]` with fewer rows than n_batch, a whole divisor of it (a mask per window,
    Swin's `[nW, N, N]`, for a batch of n_batch / m images of m windows each, the window the fastest): the
    reference's `[n_batch, 1, n_Q, n_K]`, row b the file's row b mod m; None for any other file."""
    n_batch = sizes.get("n_batch")
    m = int(mask.shape[0]) if mask.dim() == 3 else 0
    if n_batch is None or not 1 < m < n_batch or n_batch % m or tuple(mask.shape[1:]) != (sizes["n_Q"], sizes["n_K"]):
        return None
    return mask.repeat(n_batch // m, 1, 1).unsqueeze(1)  # [m, n_Q, n_K] -> [n_batch, 1, n_Q, n_K], every head


def _per_sequence(mask: torch.Tensor, sizes: dict[str, int], scores: tuple[int, ...],
                  col: bool = False) -> torch.Tensor | None:
    """A module's 3-D file [n_batch, n_Q, n_K] (`col`: the column form's [n_batch, n_K, n_Q]) that does not broadcast
    from the right as [n_head, n_Q, n_K] (CPM-Ant's and the Annotated Transformer's `[batch, len_q, len_k]` mask, which
    the code unsqueezes for the heads itself): the reference's [n_batch, 1, n_Q, n_K]; None for any other file."""
    from attnscope.cost import broadcast_shapes

    n_batch = sizes.get("n_batch")
    lengths = (sizes["n_K"], sizes["n_Q"]) if col else (sizes["n_Q"], sizes["n_K"])
    if mask.dim() != 3 or n_batch is None or len(scores) != 4 or tuple(mask.shape) != (n_batch, *lengths):
        return None
    try:
        if broadcast_shapes(tuple(mask.shape), scores) == scores:
            return None  # it reads as a mask a head ([n_head, n_Q, n_K]) where n_batch = n_head: as it broadcasts
    except ValueError:
        pass
    return mask.unsqueeze(1)


def _key_padding(mask: torch.Tensor, sizes: dict[str, int], scores: tuple[int, ...], col: bool
                 ) -> torch.Tensor | None:
    """A 2-D file [n_batch, n_K] that does not broadcast as [n_Q, n_K] (flash-attn's key_padding_mask, HF's 2-D
    attention_mask): key padding, [n_batch, 1, 1, n_K] before scores [n_batch, n_head, n_Q, n_K] ([n_batch, 1, n_K]
    before 3-D ones; [.., n_K, 1] in the column form). None where the file is no such mask; where n_batch = n_Q
    a 2-D file is [n_Q, n_K], as it broadcasts."""
    from attnscope.cost import broadcast_shapes

    n_batch, n_K = sizes.get("n_batch"), sizes["n_K"]
    if mask.dim() != 2 or n_batch is None or len(scores) < 3 or tuple(mask.shape) != (n_batch, n_K):
        return None
    try:
        if broadcast_shapes(tuple(mask.shape), scores) == scores:
            return None
    except ValueError:
        pass
    if col:
        return mask.reshape(n_batch, *(1,) * (len(scores) - 3), n_K, 1)
    return mask.reshape(n_batch, *(1,) * (len(scores) - 2), n_K)


def _leading(sizes: dict[str, int], mask: torch.Tensor | None = None) -> tuple[int, ...]:
    """The scores' axes before [n_Q, n_K]; with `mask` (a module's file), a heads' axis always: n_head where it is
    known, else the file's own (1 where it has none): the reference's scores are [n_batch, n_head, n_Q, n_K]."""
    batch = (sizes["n_batch"],) if "n_batch" in sizes else ()
    if "n_head" in sizes:
        return (*batch, sizes["n_head"])
    if mask is None or not batch:
        return batch
    return (*batch, int(mask.shape[-3]) if mask.dim() >= 4 else 1)


def plan_notes(plan: Plan, inputs: Inputs) -> list[str]:
    """What the parameters that are not tensors were given, and dims that share a size."""
    notes = []
    shared: dict[int, list[str]] = {}
    for name, size in inputs.sizes.items():
        shared.setdefault(size, []).append(name)
    for names in shared.values():
        if len(names) > 1 and set(names) != {"n_Q", "n_K"} and set(names) != {"d_K", "d_V"}:
            notes.append(f"{' and '.join(names)} are both {inputs.sizes[names[0]]}: an axis of that size reads "
                         f"{'|'.join(names)}; sizes that differ tell them apart")
    if plan.mask and inputs.allowed is None:
        notes.append(f"{plan.mask} = None (give --causal, --window or --mask FILE to pass a mask)")
    notes += [said for said in plan.said.values() if said]
    nones = [n for n in plan.nones if n not in plan.given and n not in inputs.also_masked and n not in plan.said]
    zeros = [n for n in plan.zeros if n not in plan.given]
    if nones:
        notes.append(f"{', '.join(nones)} = None")
    if zeros:
        notes.append(f"{', '.join(zeros)} = 0.0 (no dropout, so the numbers can be compared)")
    if plan.given:
        notes.append(f"--forward: {', '.join(f'{k}={v!r}' for k, v in plan.given.items())}")
    return notes
