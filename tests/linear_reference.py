"""The exact matrix M of a linear attention layer computed the slow, obvious way: the recurrence run on the
identity over value indices, token by token, in float64 (attnscope's own way before the chunked form of
attention/linear_attention.py). The reference of tests/test_linear_attention.py and benchmarks/bench_linear.py;
it shares no code with attnscope.

a_{t,t} = beta_t k_t and a_{t,s} = (I - beta_t k_t k_t^T) D_t a_{t-1,s} for s < t (D_t = exp(g_t), a scalar or one
per key channel); M[t, s] = q_t^T a_{t,s}. beta None: no key removal, a_{t,t} = k_t (MiniMax's lightning)."""

from __future__ import annotations

import torch


def effective_matrix_by_recurrence(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                                   A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[n_batch, n_head, n, d_K]`, g `[.., n]` or `[.., n, d_K]`, beta `[.., n]` or None, A `[n_batch, n_head,
    d_K, n_cache]` the a_{t,s} of earlier positions. Returns M `[n_batch, n_head, n, n_cache + n]` and A after."""
    q, k, g = (x.to(torch.float64) for x in (q, k, g))
    beta = None if beta is None else beta.to(torch.float64)
    n_batch, n_head, n, d_K = q.shape
    n_cache = A.shape[-1]
    A = torch.cat([A.to(torch.float64), A.new_zeros(n_batch, n_head, d_K, n, dtype=torch.float64)], dim=-1)
    M = q.new_zeros(n_batch, n_head, n, n_cache + n)  # [n_batch, n_head, n, n_cache + n]
    for t in range(n):
        seen = A[..., : n_cache + t + 1]  # [n_batch, n_head, d_K, n_cache + t + 1]: a_{t,s} is 0 for s > t
        decay = g[:, :, t].exp()
        seen.mul_(decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        k_t = k[:, :, t]  # [n_batch, n_head, d_K]
        if beta is None:
            seen[..., -1] += k_t
        else:
            # [n_batch, n_head, 1, d_K] @ [.., d_K, n_cache + t + 1] -> [n_batch, n_head, 1, n_cache + t + 1]
            seen.sub_(beta[:, :, t, None, None] * k_t[..., None] * (k_t[..., None, :] @ seen))  # (I - beta k k^T) D A
            seen[..., -1] += beta[:, :, t, None] * k_t  # a_{t,t} = beta_t k_t
        # [n_batch, n_head, 1, d_K] @ [.., d_K, n_cache + t + 1] -> [n_batch, n_head, n_cache + t + 1]
        M[:, :, t, : n_cache + t + 1] = (q[:, :, t, None, :] @ seen)[..., 0, :]  # q_t^T a_{t,s}
    return M, A
