"""`--check`: the same inputs through PyTorch's own attention, compared tensor by tensor.

References: `F.scaled_dot_product_attention` (same mask and scale) for SDPA and for MHA's inner step,
and `torch.nn.MultiheadAttention` with this module's weights copied in for MHA. nn.MultiheadAttention
takes boolean masks the other way round (True = masked out), so masks are inverted for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnscope import masks
from attnscope.multihead import MultiHeadAttention
from attnscope.trace import Trace

# atol, rtol per dtype: what a different but correct summation order can give.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class Comparison:
    name: str
    reference: str
    max_abs_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance  # NaN compares False: a NaN never passes


def compare(name: str, reference_name: str, ours: torch.Tensor, reference: torch.Tensor,
            skip: torch.Tensor | None = None) -> Comparison:
    """Max |ours - reference| against `atol + rtol * max|reference|`; `skip` (broadcastable) leaves rows out."""
    atol, rtol = TOLERANCES.get(ours.dtype, TOLERANCES[torch.float32])
    if ours.shape != reference.shape:
        return Comparison(name, reference_name, float("inf"), 0.0)
    if not ours.numel():
        return Comparison(name, reference_name, 0.0, atol)
    reference = reference.detach().to(ours.dtype)
    if skip is not None:
        reference = torch.where(skip, 0.0, reference)
    # One temporary in the tensors' own dtype (the compared tensors may be as large as the attention
    # itself; float64 copies would triple the memory --check needs).
    diff = torch.sub(ours.detach(), reference)
    if skip is not None:
        diff.masked_fill_(skip, 0.0)
    max_diff = float(diff.abs_().max())  # NaN anywhere makes it NaN, and NaN never passes
    low, high = torch.aminmax(reference)
    return Comparison(name, reference_name, max_diff, atol + rtol * max(abs(float(low)), abs(float(high))))


def check_sdpa(trace: Trace, mask: torch.Tensor | None, scale: float | None) -> list[Comparison]:
    Q, K, V = trace["Q"], trace["K"], trace["V"]
    if mask is not None:
        mask = masks.as_attention_mask(mask, tuple(trace["scores"].shape), Q.dtype)
    reference = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale)
    return [compare("out", "F.scaled_dot_product_attention", trace["out"], reference)]


def check_sdpa_columns(trace: Trace, mask: torch.Tensor | None, scale: float | None) -> list[Comparison]:
    """The column form against PyTorch's row-form attention on the transposed inputs, transposed back."""
    Q, K, V = (trace[n].transpose(-2, -1) for n in ("Q", "K", "V"))
    if mask is not None:
        mask = masks.as_attention_mask(mask, tuple(trace["scores"].shape), Q.dtype).transpose(-2, -1)
    reference = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale).transpose(-2, -1)
    return [compare("out", "F.scaled_dot_product_attention(row form)ᵀ", trace["out"], reference)]


def reference_mha(module: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    """A torch.nn.MultiheadAttention holding exactly this module's weights."""
    bias = module.W_q.bias is not None
    ref = torch.nn.MultiheadAttention(module.d_feat, module.n_head, bias=bias, batch_first=True,
                                      device=module.W_q.weight.device, dtype=module.W_q.weight.dtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([module.W_q.weight, module.W_k.weight, module.W_v.weight]))
        ref.out_proj.weight.copy_(module.W_o.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([module.W_q.bias, module.W_k.bias, module.W_v.bias]))
            ref.out_proj.bias.copy_(module.W_o.bias)
    return ref.eval()


def check_mha(module: MultiHeadAttention, trace: Trace, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
              mask: torch.Tensor | None) -> list[Comparison]:
    n_batch, n_Q, n_K, n_head = Q.shape[0], Q.shape[1], K.shape[1], module.n_head
    scores_shape = (n_batch, n_head, n_Q, n_K)
    if mask is not None:
        mask = masks.as_attention_mask(mask.unsqueeze(1) if mask.dim() == 3 else mask, scores_shape, Q.dtype)
    inner = F.scaled_dot_product_attention(trace["Q_split"], trace["K_split"], trace["V_split"], attn_mask=mask)
    rows = [compare("x_raw", "F.scaled_dot_product_attention", trace["x_raw"], inner)]

    ref = reference_mha(module)
    ref_mask = None
    if mask is not None:
        # nn.MultiheadAttention: boolean True = masked OUT, shape [n_Q, n_K] or [n_batch * n_head, n_Q, n_K].
        full = mask.expand(scores_shape).reshape(n_batch * n_head, n_Q, n_K)
        ref_mask = ~full if full.dtype == torch.bool else full
    with torch.no_grad():
        x, attention = ref(Q, K, V, attn_mask=ref_mask, need_weights=True, average_attn_weights=False)
    # nn.MultiheadAttention gives NaN for a query that may attend to no key, where PyTorch's SDPA (and
    # attnscope) give 0; those rows are compared against SDPA above and left out here.
    skip = masks.fully_masked_rows(mask).expand(n_batch, n_head, n_Q, 1) if mask is not None else None
    rows.append(compare("attention", "nn.MultiheadAttention", trace["attention"], attention, skip))
    rows.append(compare("x", "nn.MultiheadAttention", trace["x"], x,
                        skip.any(dim=1) if skip is not None else None))
    return rows
