"""Attention sinks in the words of each library (translations.py says the mask; this says the sinks beside it).

A sink (GPT-OSS; sinks.py) is one more logit per head in every softmax row, dropped after. What each library
must be told, where it can be told at all:
- F.scaled_dot_product_attention: one more key of zeros (its score q·0 is 0) whose float attn_mask column holds
  the head's sink, and one more value of zeros, so the sink takes weight and gives nothing back.
- transformers: not in the mask; GPT-OSS's attention hands its `sinks` parameter to every attention function as
  `s_aux` (`eager_attention_forward` concatenates it as the column).
- FlexAttention: the output renormalized with the log-sum-exp it returns: the keys keep a share
  `exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)` of each row, as transformers' flex integration does.
- nn.MultiheadAttention: cannot; `add_zero_attn=True` adds a zero key and value, which is a sink whose logit is
  always 0, not a learned one per head.
- flash-attn: `flash_attn_func` has no sink argument; transformers reaches GPT-OSS's sinks on flash through
  kernels-community's vllm-flash-attn3 (`s_aux`) or flash-attn 4 (`learnable_sink`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.readings.translations import CALL, FLASH, FLEX, HF, MHA, SDPA, build, mask_terms

if TYPE_CHECKING:
    from attnscope.spec import AttentionSpec

ZERO_KEY = ("k = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], dim=-2)\n"
            "v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)")


def with_sinks(said: dict[str, str], n_Q: int, n_K: int, spec: AttentionSpec, pad: int,
               user: str | None) -> dict[str, str]:
    """Each library's snippet for the mask (`said`, translations.translate's), with the sinks (`sinks`, one logit
    per head) told as it takes them."""
    return {SDPA: _sdpa(n_Q, n_K, user, mask_terms(n_Q, n_K, spec, pad, user)),
            MHA: ("not expressible: nn.MultiheadAttention has no per-head sink;\n"
                  "add_zero_attn=True adds a zero key and value, a sink whose logit is always 0"),
            HF: _transformers(said[HF]),
            FLASH: ("not expressible with flash_attn_func: flash-attn 2 has no sink argument;\n"
                    "transformers passes GPT-OSS's sinks as s_aux to flash-attn 3 from\n"
                    "kernels-community/vllm-flash-attn3, or as learnable_sink to flash-attn 4"),
            FLEX: _flex(said[FLEX])}


def _sdpa(n_Q: int, n_K: int, user: str | None, terms: list[tuple[str, str]]) -> str:
    lines = ["# sink h: a key and value of zeros; the key's attn_mask column is sinks[h]",
             *build(n_Q, n_K, terms)]
    base = "user_mask" if user == "float" else f"torch.zeros({n_Q}, {n_K})"
    lines.append(f"seen = {base}.masked_fill(~allowed, float('-inf'))" if terms else f"seen = {base}")
    lines += [f"sink_column = sinks.view(-1, 1, 1).expand(-1, {n_Q}, 1)  # [n_head, n_Q, 1]",
              f"attn_mask = torch.cat([seen.expand(len(sinks), {n_Q}, {n_K}), sink_column], dim=-1)",
              ZERO_KEY, CALL]
    return "\n".join(lines)


def _transformers(mask: str) -> str:
    return "\n".join([mask, "# the sinks are not in the mask: GptOssAttention passes its `sinks` as s_aux",
                      "from types import SimpleNamespace",
                      "from transformers.models.gpt_oss import modeling_gpt_oss",
                      "layer = SimpleNamespace(sinks=sinks, num_key_value_groups=1, training=False)",
                      "attend, scale = modeling_gpt_oss.eager_attention_forward, q.shape[-1] ** -0.5",
                      "out, weights = attend(layer, q, k, v, mask, scaling=scale)",
                      "out = out.transpose(1, 2)  # [n_batch, n_head, n_Q, d_head]"])


def _flex(mask: str) -> str:
    lines = mask.splitlines()
    call = lines[-1].replace("flex_attention(q, k, v, ", "flex_attention(q, k, v, return_aux=lse, ")
    call = call.replace("out = ", "out, aux = ")
    return "\n".join(["from torch.nn.attention.flex_attention import AuxRequest  # torch >= 2.9",
                      *lines[:-1], "lse = AuxRequest(lse=True)  # before torch 2.9: return_lse=True", call,
                      "# the keys keep exp(lse) / (exp(lse) + exp(sink)) of a row, the sink the rest",
                      "out = out * torch.sigmoid(aux.lse - sinks.view(1, -1, 1)).unsqueeze(-1)"])
