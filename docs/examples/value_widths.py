"""Values narrower than the queries and keys (docs/trace.md, "Values of another width than the keys"): a Perceiver
IO-like cross-attention, learned latents normed by one LayerNorm reading inputs normed by another, d_K = 8 and
d_V = 6 per head, a BERT-style additive padding. `bug='scale_v'` divides the scores by √d_V:

    attnscope trace docs/examples/value_widths.py:LatentCross --batch 2 --nk 9 --mask docs/examples/pad_2x9.npy
    attnscope trace docs/examples/value_widths.py:LatentCross --init "bug='scale_v'" --batch 2 --nk 9 \
        --mask docs/examples/pad_2x9.npy
"""

import math

import torch
import torch.nn as nn


class LatentCross(nn.Module):
    def __init__(self, n_latents=5, d_latents=32, d_inputs=16, qk_channels=32, v_channels=24, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.latents = nn.Parameter(torch.randn(n_latents, d_latents))
        self.latent_norm = nn.LayerNorm(d_latents)
        self.input_norm = nn.LayerNorm(d_inputs)
        self.q = nn.Linear(d_latents, qk_channels)
        self.k = nn.Linear(d_inputs, qk_channels)
        self.v = nn.Linear(d_inputs, v_channels)
        self.out = nn.Linear(v_channels, d_latents)

    def split(self, x):  # [b, n, h·d] -> [b, h, n, d], d the projection's own width per head
        return x.view(*x.shape[:2], self.heads, -1).permute(0, 2, 1, 3)

    def forward(self, inputs, attention_mask=None):
        latents = self.latent_norm(self.latents).expand(inputs.shape[0], -1, -1)
        inputs = self.input_norm(inputs)
        q, k, v = self.split(self.q(latents)), self.split(self.k(inputs)), self.split(self.v(inputs))
        d = v.shape[-1] if self.bug == "scale_v" else q.shape[-1]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if attention_mask is not None:  # 1 = attend, 0 = padding
            scores = scores + (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        context = scores.softmax(dim=-1) @ v
        return self.out(context.permute(0, 2, 1, 3).flatten(2))
