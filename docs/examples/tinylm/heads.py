import torch


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, n_heads * d] -> [B, n_heads, T, d]"""
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else torch.repeat_interleave(x, n_rep, dim=1)
