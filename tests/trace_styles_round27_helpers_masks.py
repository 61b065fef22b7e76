"""The mask helpers of tests/trace_styles_round27_helpers.py, in a file of their own beside it (as a model's
`modeling_utils.py` or `layers/masks.py` sits beside its attention): a BERT-like extension of a 0/1 mask that
branches on the mask's rank, 2-D key padding or 3-D a mask per query, any other rank refused. Each branch moves the
mask's axes by a permute, the same ops in each; the plant sits in the 3-D branch, which trace's first form (the key
padding it is given) never reaches."""

import torch


def extended_bias(mask, dtype, bug=None):
    """A 0/1 mask (1 = may attend), [batch, key] or [batch, query, key], as an additive bias [batch, 1, query or 1,
    key]: 0 where a key is kept, the dtype's lowest where it is masked."""
    if mask.dim() == 2:  # [batch, key] -> [batch, 1, 1, key]
        extended = mask[:, :, None, None].permute(0, 2, 3, 1)
    elif mask.dim() == 3:  # [batch, query, key] -> [batch, 1, query, key]
        extended = mask[:, :, :, None].permute(0, 3, 2, 1) if bug == "mask3d_transposed" else \
            mask[:, :, :, None].permute(0, 3, 1, 2)
    else:
        raise ValueError(f"a mask of rank 2 or 3, not {mask.dim()}")
    return (1.0 - extended.to(dtype)) * torch.finfo(dtype).min


def split_heads(x, heads):
    """[batch, n, heads·d] -> [batch, heads, n, d]."""
    batch, n, width = x.shape
    return x.view(batch, n, heads, width // heads).transpose(1, 2)
