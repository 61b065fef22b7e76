"""An autoencoder's attention over a feature map [B, C, H, W], as CompVis' latent-diffusion and taming-transformers
write it (`AttnBlock`): a GroupNorm, q, k, v and proj_out each a 1x1 Conv2d, the map flattened to H·W tokens,
`torch.bmm(q, k)` with q laid [b, hw, c], `int(c) ** -0.5`, the softmax over dim 2, `torch.bmm(v, w_.permute(0, 2,
1))`, the residual (docs/trace.md, "A pointwise Conv2d over a feature map")."""

import torch
from torch import nn


class AttnBlock(nn.Module):
    def __init__(self, in_channels=32, scaled=True):
        super().__init__()
        self.scaled = scaled
        self.norm = nn.GroupNorm(num_groups=8, num_channels=in_channels, eps=1e-6, affine=True)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1)

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w).permute(0, 2, 1)  # b, hw, c
        k = k.reshape(b, c, h * w)  # b, c, hw
        w_ = torch.bmm(q, k)  # b, hw, hw: w_[b, i, j] = q_i · k_j
        w_ = w_ * (int(c) ** (-0.5)) if self.scaled else w_
        w_ = torch.nn.functional.softmax(w_, dim=2)
        v = v.reshape(b, c, h * w)
        h_ = torch.bmm(v, w_.permute(0, 2, 1))  # b, c, hw
        return x + self.proj_out(h_.reshape(b, c, h, w))
