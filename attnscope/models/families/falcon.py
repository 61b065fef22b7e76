"""Falcon <- Bloom: TII's Falcon (transformers' `FalconForCausalLM`): BLOOM's names (bloom.py), with RoPE in place
of ALiBi, no embedding LayerNorm, optional biases, the attention and MLP side by side, and three layouts of the
fused query/key/value (`FalconAttention._split_heads`).

Checkpoint keys, under `transformer.` in `FalconForCausalLM` and bare in `FalconModel`:

    word_embeddings.weight [vocab, d_model], ln_f.{weight,bias}
    h.L.self_attention.query_key_value.weight (.bias with `bias`), laid out by the config:
      new_decoder_architecture (Falcon 40B, 180B): [n_kv_head·(n_group + 2)·d_head, d_model], one run per KV
        group g: its n_group query heads, then its key, then its value; query head h = g·n_group + j sits at
        rows (g·(n_group + 2) + j)·d_head ..., its key at (g·(n_group + 2) + n_group)·d_head ..., value after;
      multi_query (Falcon 7B): [(n_head + 2)·d_head, d_model]: every query head, then the one key, then the one
        value (n_kv_head 1);
      neither: [3·d_model, d_model], fused per head as BLOOM's ([n_head, 3, d_head] rows).
    h.L.self_attention.dense.weight [d_model, d_model]                           head h = columns h·d_head ...
    h.L.ln_attn, h.L.ln_mlp (new layout, `num_ln_in_parallel_attn` 2), else h.L.input_layernorm and, when
    not `parallel_attn`, h.L.post_attention_layernorm                          LayerNorm with bias
    h.L.mlp.dense_h_to_4h, h.L.mlp.dense_4h_to_h                               `activation` (GELU)

A layer (`FalconDecoderLayer.forward`): parallel (`parallel_attn`, and always in the new layout)
`h' = h + attention(LN(h)) + mlp(LN'(h))` with LN' the attention's own norm unless there are two;
sequential `a = h + attention(LN(h))`, `h' = a + mlp(LN(a))`. The attention is causal, RoPE half-split over
the whole head (`FalconRotaryEmbedding`'s default ignores partial_rotary_factor), scaled by 1/sqrt(d_head).

`alibi: true` (Falcon-RW) is not read here: transformers 5's `FalconModel.forward` folds `alibi / sqrt(d_head)`
into the mask and `FalconAttention` adds `alibi` again before scaling, a bias that is not ALiBi's; such a
checkpoint runs through transformers (`reads` says no), its pattern exact, its steps untraced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models import blocks, lm_head
from attnscope.models.families.bloom import OUT, QKV, Bloom
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    import torch

    from attnscope.attention.multihead import MultiHeadAttention
    from attnscope.models.config import Config
    from attnscope.variants.rope import Rope


class Falcon(Bloom):
    model_types = ("falcon",)

    @staticmethod
    def reads(config: Config) -> bool:
        """Whether this page computes the checkpoint: not with ALiBi (see the module's docstring)."""
        return not config.flag("alibi")

    @property
    def new_layout(self) -> bool:
        return self.config.flag("new_decoder_architecture")

    def kv_heads(self) -> int:
        """`FalconAttention.num_kv_heads`: num_kv_heads in the new layout, 1 with multi_query, else n_head."""
        if self.new_layout:
            return self.config.integer("num_kv_heads", default=self.n_head)
        return 1 if self.config.flag("multi_query", default=True) else self.n_head

    def biases(self) -> tuple[bool, bool]:
        on = self.config.flag("bias")
        return on, on

    # --- where head h lives ---------------------------------------------------------------------------------

    def qkv_rows(self, head: int) -> dict[str, int]:
        """Where head h's query rows and its KV head's key and value rows start in query_key_value."""
        d = self.d_head
        if self.new_layout:
            g, j, run = head // self.n_group, head % self.n_group, self.n_group + 2
            return {"Q": (g * run + j) * d, "K": (g * run + self.n_group) * d, "V": (g * run + self.n_group + 1) * d}
        if self.n_kv_head == 1:
            return {"Q": head * d, "K": self.n_head * d, "V": (self.n_head + 1) * d}
        return super().qkv_rows(head)

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        placed = ", ".join(f"W_{n} rows {lo}:{lo + self.d_head}" for n, lo in self.qkv_rows(head).items())
        layout = ("grouped: each KV group's query heads, then its key and value" if self.new_layout else
                  "every query head, then the one key and value (multi_query)" if self.n_kv_head == 1 else
                  "fused per head, [n_head, 3, d_head] rows")
        return [f"query_key_value is {layout}: head {head} has {placed}", *super(Bloom, self).notes(layer, head)]

    # --- the attention's specifics ----------------------------------------------------------------------

    def rope(self) -> Rope:
        """`FalconRotaryEmbedding`: rope_parameters (or rope_theta + rope_scaling), the whole head turning."""
        from dataclasses import replace

        from attnscope.variants.rope import Rope

        try:
            rope = Rope.from_config(self.config.data, head_dim=self.d_head)
        except UsageError as error:
            raise UsageError(f"{self.config.path}: {error}; fix config.json") from None
        if rope is None:
            raise UsageError(f"{self.config.path}: rope_parameters is null; Falcon's layers rotate unless alibi")
        return replace(rope, partial_rotary_factor=1.0) if rope.kind == "default" else rope

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(causal=True, rope=self.rope())

    def projections(self, layer: int) -> dict[str, Any]:
        """W_q, W_k, W_v: their rows of query_key_value, gathered in head order; W_o: dense."""
        import torch

        d, qkv, out = self.d_head, self.biases()[0], self.biases()[1]
        state = {}
        for part in ("weight", "bias") if qkv else ("weight",):
            fused = self.weight(layer, f"{QKV}.{part}")
            kv_heads = [h * self.n_group for h in range(self.n_kv_head)]  # one query head per KV head
            for ours, name, heads in (("W_q", "Q", range(self.n_head)), ("W_k", "K", kv_heads), ("W_v", "V", kv_heads)):
                starts = [self.qkv_rows(h)[name] for h in heads]
                state[f"{ours}.{part}"] = torch.cat([fused[lo : lo + d] for lo in starts])  # [heads·d_head(, d_model)]
        state["W_o.weight"] = self.weight(layer, f"{OUT}.weight")
        if out:
            state["W_o.bias"] = self.weight(layer, f"{OUT}.bias")
        return state

    # --- the prefix -----------------------------------------------------------------------------------------

    def two_norms(self) -> bool:
        """`num_ln_in_parallel_attn` (2 by default in the new layout): ln_attn and ln_mlp."""
        count = self.config.raw("num_ln_in_parallel_attn", default=2 if self.new_layout else None)
        return self.new_layout and count == 2

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """`FalconModel.forward`: the token embeddings, no norm."""
        return self.checkpoint.rows(f"{self.prefix}word_embeddings.weight", ids)[None]  # [1, n_tokens, d_model]

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        name = "ln_attn" if self.two_norms() else "input_layernorm"
        return (self.norm(self.key(layer, name), h),
                f"{name}(h): LayerNorm of the residual stream entering layer {layer}")

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`FalconMLP`: dense_h_to_4h, `activation`, dense_4h_to_h (biased with `bias`)."""
        act = blocks.activation(self.config.raw("activation", default="gelu"), f"{self.config.path}: activation")
        up, down = (f"mlp.{n}" for n in ("dense_h_to_4h", "dense_4h_to_h"))
        biased = self.biases()[1]
        up_bias, down_bias = (self.weight(layer, f"{n}.bias") if biased else None for n in (up, down))
        return blocks.plain_mlp(x, self.weight(layer, f"{up}.weight"), up_bias, self.weight(layer, f"{down}.weight"),
                                down_bias, act)

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        """`FalconDecoderLayer.forward`."""
        x = self.attention_input(layer, h)[0]
        a = attention(x)["x"]
        if self.two_norms():
            return h + a + self.mlp(layer, self.norm(self.key(layer, "ln_mlp"), h))
        if self.new_layout or self.config.flag("parallel_attn", default=True):
            return h + a + self.mlp(layer, x)
        h = h + a
        return h + self.mlp(layer, self.norm(self.key(layer, "post_attention_layernorm"), h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`FalconForCausalLM`: ln_f, then lm_head (tied to word_embeddings by default)."""
        head = lm_head.weight(self, "word_embeddings.weight", True)  # [vocab, d_model]
        return self.norm(f"{self.prefix}ln_f", h) @ head.T  # [1, n, vocab]
