"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention layers (linear_attention.py: the delta rule and its
exact matrix) and gated full attention, three to one by default (`layer_types`, or every `full_attention_interval`-th
layer full), with Qwen3-MoE's experts plus a gated shared expert (qwen3_moe.py). transformers'
`Qwen3NextDecoderLayer` (models/qwen3_next/modeling_qwen3_next.py) is the reference.

Checkpoint keys, under `model.` in `Qwen3NextForCausalLM`; every RMSNorm scales by (1 + w) (`Qwen3NextRMSNorm`),
but the linear layers' gated output norm, which scales by w:

    layers.L.self_attn.q_proj.weight   [n_head·2·d_head, d_model]  head h: rows h·2·d_head ... its query, then as
                                                                   many rows of its output gate (W_G)
    layers.L.self_attn.{k,v}_proj.weight, o_proj.weight, q_norm.weight, k_norm.weight   as Qwen3's
    layers.L.linear_attn.in_proj_qkvz.weight  [n_k_head·(2·d_K + 2·group·d_V), d_model]  per key head g, in order:
        its query (d_K rows), key (d_K), the values of its `group` value heads (group·d_V), their output gates z
    layers.L.linear_attn.in_proj_ba.weight  [n_k_head·2·group, d_model]  per key head: its value heads' b, then a
    layers.L.linear_attn.conv1d.weight  [conv_width, 1, kernel]  over [every q, every k, every v]
    layers.L.linear_attn.A_log, dt_bias  [n_head]; norm.weight [d_V]; out_proj.weight [d_model, n_head·d_V]

A full layer (`Qwen3NextAttention`): Qwen3's attention (qk-norm per head, here (1 + w)) with partial RoPE
(`partial_rotary_factor`, 0.25 by default: the first quarter of each head turns), then each head's output times
sigmoid of its gate rows (steps `gate`, `x_gated`) before o_proj. A linear layer (`Qwen3NextGatedDeltaNet`):
q, k, v, z, b, a from the two fused projections, the short convolution, beta = sigmoid(b),
g = -exp(A_log) · softplus(a + dt_bias), the delta rule, RMSNorm(x_raw) · silu(z), out_proj.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from attnscope.attention.multihead import MultiHeadAttention
from attnscope.errors import UsageError
from attnscope.models.families.qwen3_moe import Qwen3Moe
from attnscope.spec import AttentionSpec
from attnscope.words import counted

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.attention.linear_attention import DeltaInputs, DeltaSizes, LinearState
    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config
    from attnscope.models.family import Slice
    from attnscope.trace import Trace

LINEAR = "linear_attn"
KINDS = ("linear_attention", "full_attention")


class LinearLayers:
    """What a hybrid of linear attention and full attention layers adds to a family page (Qwen3-Next, Qwen3.5,
    Kimi Linear): which layer is which (`layer_types`), a linear layer's own heads, its DeltaLayer, notes and head
    steps. A mixin before the page of the full layers' family: `class Qwen3Next(LinearLayers, Qwen3Moe)`; the
    family sets `delta` (DeltaSizes) and `delta_inputs(layer, X, add)`."""

    delta: DeltaSizes
    n_layer: int
    n_head: int
    config: Config
    architecture: str
    linear_name = "Gated DeltaNet"

    def layer_kind(self, layer: int) -> str:
        """`layer_types[layer]`, or the config class's default: full every `full_attention_interval`-th layer."""
        kinds = self.config.str_list("layer_types", self.n_layer)
        if kinds is None:
            every = self.config.integer("full_attention_interval", default=4)
            return "full_attention" if (layer + 1) % every == 0 else "linear_attention"
        if kinds[layer] not in KINDS:
            raise UsageError(f"{self.config.path}: layer_types[{layer}] is {kinds[layer]!r}; {self.architecture}'s "
                             f"layers are {' or '.join(KINDS)}")
        return kinds[layer]

    def linear(self, layer: int) -> bool:
        return self.layer_kind(layer) == "linear_attention"

    def heads_in(self, layer: int) -> int:
        """A linear layer has its own heads (its value heads), one matrix M each."""
        return self.delta.n_head if self.linear(layer) else self.n_head

    def check_position(self, layer: int, head: int) -> None:
        from attnscope.models.family import check_position

        check_position(self.n_layer, self.n_head, layer, 0)
        n = self.heads_in(layer)
        if not 0 <= head < n:
            kind = "linear attention" if self.linear(layer) else "full attention"
            raise UsageError(f"{{head}} {head} is out of range: layer {layer} ({kind}) has {counted(n, 'head')}, "
                             f"0 to {n - 1}", "head")

    full_note = "a full attention layer"  # what the family's full layers are, in the traced layer's notes

    def layer_notes(self, layer: int) -> list[str]:
        if not self.linear(layer):
            return [f"layer {layer} is {self.full_note}"]
        from attnscope.attention.linear_attention import EFFECTIVE_NOTE

        s = self.delta
        return [f"layer {layer} is a linear attention layer ({self.linear_name}): no softmax, no KV cache; its state "
                f"is [n_head, d_K, d_V] = [{s.n_head}, {s.d_K}, {s.d_V}] per sequence", EFFECTIVE_NOTE]

    def layer_head_notes(self, layer: int, head: int) -> list[str]:
        """A linear layer's head: where its weights lie (`linear_head_note`), and what its pattern is; a full
        layer's as the family's (head_notes)."""
        if not self.linear(layer):
            return self.head_notes(head)  # type: ignore[attr-defined, no-any-return]
        return [f"{self.linear_head_note(layer, head)}; its pattern is the exact matrix M of this linear attention "
                "layer (effective_attention)"]

    def linear_head_note(self, layer: int, head: int) -> str:
        """Which key head serves value head `head` (grouped: Qwen3-Next's 16 key heads for 32 value heads)."""
        s = self.delta
        group = s.n_head // s.n_k_head
        served = f"key head {head // group} of {s.n_k_head} (= {head} // {group}) serves value heads " \
                 f"{head // group * group} to {head // group * group + group - 1}: its W_Q, W_K; " if group > 1 else ""
        return f"{served}W_V, W_O and the output gate are value head {head}'s own"

    def attention(self, layer: int, record: bool) -> Any:
        if self.linear(layer):
            return DeltaLayer(self.delta, lambda X, add: self.delta_inputs(layer, X, add), record)
        return super().attention(layer, record)  # type: ignore[misc]

    def delta_inputs(self, layer: int, X: torch.Tensor, add: Any) -> DeltaInputs:
        raise NotImplementedError

    def projections(self, layer: int) -> dict[str, Any]:
        """A linear layer has no attention module's state dict to load (DeltaLayer reads its weights through
        `delta_inputs`), so none; a full layer's as its family's."""
        return {} if self.linear(layer) else super().projections(layer)  # type: ignore[misc, no-any-return]

    def head_trace(self, layer: Trace, head: int) -> Trace:
        if "effective_attention" not in layer:
            return super().head_trace(layer, head)  # type: ignore[misc, no-any-return]
        return linear_head_trace(layer, head)

    def estimate_bytes(self, layer: int, n_tokens: int) -> int:
        """Every family's, and a linear layer's M `[n_head, n, n]` in float64 beside its float32 copy."""
        return super().estimate_bytes(layer, n_tokens) + 12 * self.delta.n_head * n_tokens * n_tokens  # type: ignore[misc, no-any-return]


class Qwen3Next(LinearLayers, Qwen3Moe):
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_next",)  # type: ignore[assignment]
    query = "input_layernorm.weight"  # every layer has one; layer 0 is a linear layer, without q_proj
    default_head_dim = 256  # type: ignore[assignment]  # Qwen3NextConfig's
    norm_plus_one = True  # Qwen3NextRMSNorm: (1 + w), the qk-norms too
    whole_head_default = False  # Qwen3NextRotaryEmbedding turns partial_rotary_factor of each head, 0.25 by default
    partial_default = 0.25  # Qwen3NextConfig.__post_init__ sets it where config.json leaves it out

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        from attnscope.attention.linear_attention import DeltaSizes

        n_k = config.integer("linear_num_key_heads", default=16)
        n_v = config.integer("linear_num_value_heads", default=32)
        if n_v % n_k:
            raise UsageError(f"{config.path}: linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads "
                             f"{n_k}; fix config.json")
        self.delta = DeltaSizes(n_head=n_v, n_k_head=n_k, d_K=config.integer("linear_key_head_dim", default=128),
                                d_V=config.integer("linear_value_head_dim", default=128),
                                kernel=config.integer("linear_conv_kernel_dim", default=4),
                                eps=config.number("rms_norm_eps", default=1e-6))
        for layer in range(self.n_layer):
            self.layer_kind(layer)  # a bad layer_types entry is refused now, not at layer L

    full_note = ("a gated full attention layer: each head's output is scaled by sigmoid of its gate rows of q_proj "
                 "(gate, x_gated) before o_proj")

    # --- the full layers: gated attention ----------------------------------------------------------------------

    def rope(self, layer_type: str | None = None) -> Any:
        from dataclasses import replace

        rope = super().rope(layer_type)
        given = (self.config.mapping("rope_parameters") or {}).get("partial_rotary_factor",
                                                                   self.config.raw("partial_rotary_factor"))
        return rope if given is not None else replace(rope, partial_rotary_factor=self.partial_default)

    def attention_spec(self, layer: int) -> AttentionSpec:
        if self.linear(layer):
            return AttentionSpec(causal=True)  # a token reads itself and the tokens before it, through the state
        return AttentionSpec(causal=True, rope=self.rope(), qk_norm=self.qk_norm())

    def window(self, layer: int) -> int | None:
        return None

    def attention_module(self, layer: int) -> Any:
        return GatedAttention

    def projections(self, layer: int) -> dict[str, Any]:
        """The full layer's: q_proj cut into each head's query rows (W_q) and gate rows (W_gate)."""
        state = super().projections(layer)
        if not state:  # a linear layer (LinearLayers.projections)
            return state
        q_w, q_b = _split_gate(state.pop("W_q.weight"), self.n_head, self.d_head), None
        if "W_q.bias" in state:
            q_b = _split_gate(state.pop("W_q.bias"), self.n_head, self.d_head)
        state["W_q.weight"], state["W_gate.weight"] = q_w
        if q_b is not None:
            state["W_q.bias"], state["W_gate.bias"] = q_b
        return state

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        from attnscope.models.family import Slice

        if self.linear(layer):
            return self.linear_slices(layer, head)
        parts = super().head_slices(layer, head)
        d, bias = self.d_head, self.biases()[0]
        q = self.key(layer, "self_attn.q_proj.weight")
        moved = [Slice("W_Q", q, "rows", head * 2 * d, head * 2 * d + d),
                 Slice("W_G", q, "rows", head * 2 * d + d, (head + 1) * 2 * d, dims=("d_head", "d_model"))]
        if bias:
            qb = self.key(layer, "self_attn.q_proj.bias")
            moved += [Slice("b_Q", qb, "rows", head * 2 * d, head * 2 * d + d),
                      Slice("b_G", qb, "rows", head * 2 * d + d, (head + 1) * 2 * d, dims=("d_head",))]
        return moved + [p for p in parts if p.name not in ("W_Q", "b_Q")]

    def head_notes(self, head: int) -> list[str]:
        return [*super().head_notes(head), "W_G: head h's output gate, the rows after its query in q_proj: its output "
                "is scaled by sigmoid(X @ W_G.T)"]

    # --- the linear layers -------------------------------------------------------------------------------------

    def qkvz_rows(self, head: int) -> dict[str, tuple[int, int]]:
        """Value head h's rows of in_proj_qkvz (its key head's q and k, its own v and z) and of in_proj_ba."""
        s, group = self.delta, self.delta.n_head // self.delta.n_k_head
        g, i = divmod(head, group)
        block = 2 * s.d_K + 2 * group * s.d_V
        start, values = g * block, g * block + 2 * s.d_K
        return {"q": (start, start + s.d_K), "k": (start + s.d_K, start + 2 * s.d_K),
                "v": (values + i * s.d_V, values + (i + 1) * s.d_V),
                "z": (values + group * s.d_V + i * s.d_V, values + group * s.d_V + (i + 1) * s.d_V),
                "b": (g * 2 * group + i, g * 2 * group + i + 1),
                "a": (g * 2 * group + group + i, g * 2 * group + group + i + 1)}

    def linear_slices(self, layer: int, head: int) -> list[Slice]:
        """Value head h of a linear layer: its key head's W_Q, W_K, its W_V and gate W_Z, its b and a rows, A_log,
        dt_bias, the output norm's weight, its W_O columns (the convolution's taps: conv1d.weight, every channel)."""
        from attnscope.models.family import Slice

        rows = self.qkvz_rows(head)
        key = lambda name: self.key(layer, f"{LINEAR}.{name}")  # noqa: E731
        fused, ba = key("in_proj_qkvz.weight"), key("in_proj_ba.weight")
        parts = [Slice(f"W_{n.upper()}", fused, "rows", *rows[n], dims=(f"d_{'K' if n in 'qk' else 'V'}", "d_model"))
                 for n in ("q", "k", "v", "z")]
        parts += [Slice(f"W_{n}", ba, "rows", *rows[n], dims=("1", "d_model")) for n in ("b", "a")]
        return parts + self._shared_linear_slices(layer, head)

    def _shared_linear_slices(self, layer: int, head: int) -> list[Slice]:
        from attnscope.models.family import Slice

        s = self.delta
        key = lambda name: self.key(layer, f"{LINEAR}.{name}")  # noqa: E731
        return [Slice("A_log", key("A_log"), "rows", head, head + 1, dims=("1",)),
                Slice("dt_bias", key("dt_bias"), "rows", head, head + 1, dims=("1",)),
                Slice("norm", key("norm.weight"), "rows", 0, s.d_V, dims=("d_V",)),
                Slice("W_O", key("out_proj.weight"), "cols", head * s.d_V, (head + 1) * s.d_V, dims=("d_model", "d_V"))]

    def linear_projections(self, layer: int) -> dict[str, torch.Tensor]:
        """q, k, v, z, b, a weights `[out, d_model]` in head order, cut from the two fused projections."""
        import torch

        s, group = self.delta, self.delta.n_head // self.delta.n_k_head
        qkvz = self.weight(layer, f"{LINEAR}.in_proj_qkvz.weight")
        qkvz = qkvz.view(s.n_k_head, 2 * s.d_K + 2 * group * s.d_V, -1)  # [n_k_head, per key head, d_model]
        q, k, v, z = torch.split(qkvz, [s.d_K, s.d_K, group * s.d_V, group * s.d_V], dim=1)
        # [n_k_head·2·n_group, d_model] -> [n_k_head, 2·n_group, d_model]
        ba = self.weight(layer, f"{LINEAR}.in_proj_ba.weight").view(s.n_k_head, 2 * group, -1)
        b, a = torch.split(ba, [group, group], dim=1)
        # each [n_k_head, rows, d_model] -> [n_k_head·rows, d_model]
        return {name: w.reshape(-1, w.shape[-1]) for name, w in
                (("q", q), ("k", k), ("v", v), ("z", z), ("b", b), ("a", a))}

    def delta_inputs(self, layer: int, X: torch.Tensor, add: Any) -> DeltaInputs:
        """`Qwen3NextGatedDeltaNet.forward` up to the convolution: the projections, beta and g."""
        import torch
        import torch.nn.functional as F

        from attnscope.attention.linear_attention import DeltaInputs

        w = {name: t.to(X.device) for name, t in self.linear_projections(layer).items()}  # meta X: shapes only
        mixed = add("QKV_feat", X @ torch.cat([w["q"], w["k"], w["v"]]).T,  # [n_batch, n, conv_width]
                    ("n_batch", "n_tokens", "2·n_k_head·d_K+n_head·d_V"), self.qkv_op,
                    2 * X.shape[0] * X.shape[1] * X.shape[2] * self.delta.conv_width)
        own = lambda name: self.weight(layer, f"{LINEAR}.{name}").float().to(X.device)  # noqa: E731
        beta = torch.sigmoid(X @ w["b"].T)  # [n_batch, n, n_head]
        g = -own("A_log").exp() * F.softplus(X @ w["a"].T + own("dt_bias"))  # [n_batch, n, n_head]
        # the gate: [n_batch, n, d_model] @ [d_model, n_head·d_V] -> [n_batch, n, n_head·d_V]
        return DeltaInputs(mixed, beta, g, X @ w["z"].T, own("conv1d.weight"), own("norm.weight"),
                           own("out_proj.weight"))

    qkv_op = "in_proj_qkvz(X): the q, k and v rows of each key head's block, in head order"

    # --- the MLP: Qwen3-MoE's experts and a gated shared expert -------------------------------------------------

    def experts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`Qwen3NextSparseMoeBlock`: Qwen3-MoE's routed experts, plus sigmoid(shared_expert_gate(x)) times the
        shared expert's SwiGLU."""
        import torch

        from attnscope.models import blocks

        routed = super().experts(layer, x)
        act = blocks.activation(self.config.raw("hidden_act", default="silu"), f"{self.config.path}: hidden_act")
        gate, up, down = (self.weight(layer, f"mlp.shared_expert.{n}.weight") for n in ("gate_proj", "up_proj",
                                                                                          "down_proj"))
        shared = blocks.gated_mlp(x, gate, up, down, act)
        # [.., d_model] @ [d_model, 1] -> [.., 1]: one gate per token
        return routed + torch.sigmoid(x @ self.weight(layer, "mlp.shared_expert_gate.weight").T) * shared


class GatedAttention(MultiHeadAttention):
    """MultiHeadAttention with Qwen3-Next's output gate (`Qwen3NextAttention`): `W_gate` projects X to
    n_head·d_head, and each head's output is multiplied by sigmoid of it before W_o (steps `gate`, `x_gated`)."""

    def __init__(self, d_feat: int, n_head: int, *args: Any, **kwargs: Any) -> None:
        from torch import nn

        super().__init__(d_feat, n_head, *args, **kwargs)
        self.W_gate = nn.Linear(d_feat, n_head * self.d_head, bias=self.W_q.bias is not None,
                                device=self.W_q.weight.device)

    def forward(self, Q: torch.Tensor, K: torch.Tensor | None = None, V: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                position_bias: torch.Tensor | None = None) -> Trace:
        import torch

        from attnscope import cost
        from attnscope.trace import Trace

        W_o = self.W_o
        self.W_o = _through()  # MultiHeadAttention's last step, held back for the gate
        try:
            inner = super().forward(Q, K, V, mask, cache, position_bias)
        finally:
            self.W_o = W_o
        merged = inner["x"]  # [n_batch, n_Q, n_head·d_head]: x_rsh2, the heads merged before W_o
        trace = Trace(notes=list(inner.notes))
        for step in inner.steps:
            if step.name != "x":
                trace.add_step(step)
        width = "n_head·d_head"
        gate = self.W_gate(Q)  # [n_batch, n_Q, n_head·d_head]
        if self.record:
            gate = trace.add("gate", torch.sigmoid(gate), ("n_batch", "n_Q", width), "sigmoid(W_gate(Q))",
                             cost.linear_flops(gate.shape, Q.shape[-1], self.W_gate.bias is not None) + gate.numel())
            x_gated = trace.add("x_gated", merged * gate, ("n_batch", "n_Q", width), "x_rsh2 * gate", merged.numel())
        else:
            x_gated = merged * torch.sigmoid(gate)
        x = self.W_o(x_gated)  # [n_batch, n_Q, d_feat]
        trace.add("x", x, ("n_batch", "n_Q", "d_feat"), "W_o(x_gated)",
                  cost.linear_flops(x.shape, x_gated.shape[-1], self.W_o.bias is not None))
        return trace


def _through() -> Any:
    """Stands in for W_o while MultiHeadAttention runs, so its `x` is the merged heads, before the gate."""
    from torch import nn

    class Through(nn.Module):
        bias = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    return Through()


class DeltaLayer:
    """A linear attention layer as the forward calls an attention module: `layer(X, cache=None)` gives the trace
    (x its output), `empty_cache()` and `cache_after(trace)` carry the state step to step (models/forward/stream.py).
    `project(X, add)` is the family's projections (DeltaInputs); the rest is linear_attention.delta_rule."""

    def __init__(self, sizes: DeltaSizes, project: Any, record: bool) -> None:
        self.sizes, self.project, self.record = sizes, project, record
        self.spec = AttentionSpec(causal=True)
        self._after: dict[int, LinearState] = {}

    def __call__(self, X: torch.Tensor, cache: LinearState | None = None) -> Trace:
        from attnscope.attention.linear_attention import check_note, delta_rule
        from attnscope.attention.multihead import _keep_tensor
        from attnscope.trace import Trace

        trace = Trace()
        add = trace.add if self.record else _keep_tensor
        x, state, figure = delta_rule(add, self.project(X, add), self.sizes, cache, self.record)
        if not self.record:
            trace.add("x", x, ("n_batch", "n_tokens", "d_model"), "out_proj(...): the linear attention layer")
        note = check_note(figure)
        if note:
            trace.notes.append(note)
        self._after[id(trace)] = state
        return trace

    def effective_rows(self, X: torch.Tensor, head: int, block: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Value head `head`'s M on a long input, in blocks of query rows (linear_attention.effective_rows)."""
        from attnscope.attention.linear_attention import _keep, effective_rows

        return effective_rows(self.project(X, _keep), self.sizes, head, block)

    def to(self, device: Any) -> DeltaLayer:
        """The weights are read at each call, onto X's device: a meta X runs the layer as shapes
        (models/forward/long.py)."""
        return self

    def empty_cache(self, n_batch: int = 1) -> LinearState:
        from attnscope.attention.linear_attention import empty_state

        return empty_state(self.sizes, n_batch)

    def cache_after(self, trace: Trace) -> LinearState:
        """The state after the call that made `trace`: the convolution's last inputs and S (and, for the view,
        every position's effective key and value)."""
        return self._after.pop(id(trace))


def linear_head_trace(layer: Trace, head: int) -> Trace:
    """Value head h of a linear layer, as views into the layer's steps: X, the query and key of its key head
    (normed and repeated where the layer norms them), its values, beta (a delta rule's), g, its effective_attention M
    and output, and its state."""
    from attnscope.trace import Trace

    trace = Trace()
    X = layer.step("X")
    trace.add("X", X.tensor[0], X.dims[1:], f"{X.op} (n_batch 0)", allocates=False)
    for name, sources in (("Q", ("Q_normed", "Q_split")), ("K", ("K_normed", "K_split")), ("V", ("V_split",)),
                          ("beta", ("beta",)), ("g", ("g",)), ("effective_attention", ("effective_attention",)),
                          ("out", ("x_raw",)), ("state", ("state",))):
        source = next((s for s in sources if s in layer), None)
        if source is None:  # MiniMax's lightning attention: no norm of q and k, no beta
            continue
        step = layer.step(source)
        trace.add(name, step.tensor[0, head], step.dims[2:], f"{source}[0, {head}]", allocates=False)
    return trace


def _split_gate(weight: torch.Tensor, n_head: int, d_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's rows (or bias) as `Qwen3NextAttention` reads them: per head d_head query rows, then d_head gate rows."""
    per_head = weight.view(n_head, 2 * d_head, *weight.shape[1:])  # [n_head, 2·d_head, (d_model)]
    query, gate = per_head[:, :d_head], per_head[:, d_head:]
    # [n_head, d_head, (d_model)] -> [n_head·d_head, (d_model)], each
    return query.reshape(n_head * d_head, *weight.shape[1:]), gate.reshape(n_head * d_head, *weight.shape[1:])


def eager_linear(folder: Path, model_type: str, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own run of layers 0..`layer` on `ids` (`truncated.load`, eager, float32): linear layer
    `layer`'s output `[n_tokens, d_model]` and its recurrence's output before the gated norm `[n_tokens,
    n_head·d_V]` (the norm's input, hooked, heads merged): what `head --check` holds x and M @ V against."""
    import torch
    from transformers import AutoModel

    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    full, n_layer = truncated.full_config(folder, model_type, layer)
    model = truncated.load(AutoModel, folder, truncated.cut(full, n_layer, layer), model_type, traced=False)
    inner = getattr(model, "language_model", model)  # Qwen3.5's multimodal model: its text model
    module = getattr(inner.layers[layer], "linear_attn", None) or inner.layers[layer].self_attn
    norm = getattr(module, "norm", None) or module.o_norm
    seen: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(lambda m, a, out: seen.__setitem__("x", out[0] if isinstance(out, tuple)
                                                                           else out)),
             norm.register_forward_hook(lambda m, a, out: seen.__setitem__("core", a[0]))]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)  # a cache of linear layers only: transformers fails
    finally:
        for hook in hooks:
            hook.remove()
    return seen["x"][0], seen["core"].reshape(len(ids), -1)  # [n_tokens, d_model], [n_tokens, n_head·d_V]
