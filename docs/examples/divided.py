"""Divided space-time attention (docs/trace.md, "Divided attention: groups beside a shared token"), TimeSformer's
way: a cls token at 0, then 2 frames of 3 patches; each patch attends across the frames (its group: the same patch
in each frame) and to the cls token, whose key and value are prepended to every group; the cls token attends over
all. divided_time_7x7.npy is that pattern as full attention's mask (`bug='axis'`: the softmax over the queries):

    attnscope trace docs/examples/divided.py:DividedTime --mask docs/examples/divided_time_7x7.npy --nq 7
    attnscope trace docs/examples/divided.py:DividedTime --init "bug='axis'" --mask docs/examples/divided_time_7x7.npy --nq 7
"""

import torch
import torch.nn as nn


def attend(q, k, v, dim=-1):
    weights = torch.einsum('b i d, b j d -> b i j', q, k).softmax(dim=dim)  # [b, queries, keys]
    return torch.einsum('b i j, b j d -> b i d', weights, v)


class DividedTime(nn.Module):
    def __init__(self, dim=32, heads=4, frames=2, bug=None):
        super().__init__()
        self.heads, self.frames, self.bug = heads, frames, bug
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, dim = x.shape
        h, f, p = self.heads, self.frames, (n - 1) // self.frames
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2).reshape(b * h, n, -1)  # [(b h), n, d]
                   for t in self.to_qkv(x).chunk(3, dim=-1))
        d = q.shape[-1]
        q = q * d ** -0.5
        cls_out = attend(q[:, :1], k, v)  # the cls token over every token
        # '(b h) (f p) d -> (b h p) f d': each patch's frames a group
        q_, k_, v_ = (t[:, 1:].reshape(b * h, f, p, d).transpose(1, 2).reshape(b * h * p, f, d) for t in (q, k, v))
        k_ = torch.cat((k[:, :1].repeat_interleave(p, dim=0), k_), dim=1)  # the cls key first in every group
        v_ = torch.cat((v[:, :1].repeat_interleave(p, dim=0), v_), dim=1)
        out = attend(q_, k_, v_, dim=-2 if self.bug == "axis" else -1)  # [(b h p), f, d]
        out = out.reshape(b * h, p, f, d).transpose(1, 2).reshape(b * h, f * p, d)
        out = torch.cat((cls_out, out), dim=1).reshape(b, h, n, d).transpose(1, 2).reshape(b, n, dim)
        return self.to_out(out)
