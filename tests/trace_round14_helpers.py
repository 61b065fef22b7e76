"""What tests/test_trace_round14_{gates,chunked,floatmask}.py share: a module moved off its initial weights in
float64, a plant holding its weights, a key-padding file, and the heads split and merged as
F.scaled_dot_product_attention's checks read them."""

import torch


def moved(module, seed=3):
    """`module` with every weight moved off its initial value, float64, eval()."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module.double().eval()


def heads(t, h=4):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)  # [B, n, h·d] -> [B, h, n, d]


def merged(t):
    return t.transpose(1, 2).flatten(2)  # [B, h, n, d] -> [B, n, h·d]


def planted(cls, ours, bug, *args, **init):
    """`cls(bug=bug, **init)` holding `ours`'s weights, in float64, run on `args`: the plant's output."""
    wrong = cls(bug=bug, **init).double().eval()
    wrong.load_state_dict(ours.state_dict())
    return wrong(*args)


def padding_file(folder, first_padded):
    """A key padding `[2, 7]`, True = may attend, the first sequence's keys from `first_padded` on padded, saved
    as .npy in `folder`: its path."""
    import numpy as np

    keep = np.ones((2, 7), dtype=bool)
    keep[0, first_padded:] = False
    path = folder / "pad.npy"
    np.save(path, keep)
    return str(path)
