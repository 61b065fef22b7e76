"""Terms, biases and scales a module computes itself, for docs/trace.md ("How conventions are read").

- CosineWindow: Swin Transformer V2's window attention, shrunk: cosine scores times a learned temperature a head,
  `exp(clamp(logit_scale, max=log 100))`, a continuous position bias `16 · sigmoid(mlp(coords))` gathered by the
  relative index, and Swin's shifted-window mask [nW, N, N] added per window (`attn.view(B // nW, nW, ..)`).
- DecomposedRelPos: Segment Anything's attention (MViTv2's decomposed relative positions), its tokens a 3 × 3 grid:
  `q · R_h` and `q · R_w` added to the scores viewed [B·H, qh, qw, kh, kw].
- TalkingHeads: talking-heads attention as x-transformers writes it: the logits mixed across the heads by a 1x1
  Conv2d before the softmax, the weights by another after it, causal by `triu(j - i + 1)`.

`bug=` plants a mistake: "kv_swapped", "bias_transposed", "softmax_axis" (CosineWindow); "no_scale" (the first
two); "split_no_permute" (DecomposedRelPos); "causal_diagonal" (TalkingHeads: `triu(j - i)`: no own key).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _relative_index(n):
    coords = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")).flatten(1)  # [2, n·n]
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + n - 1  # [n·n, n·n, 2]
    return rel[..., 0] * (2 * n - 1) + rel[..., 1]


class CosineWindow(nn.Module):
    def __init__(self, dim=32, window=3, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.logit_scale = nn.Parameter(torch.log(torch.tensor([4.0, 9.0, 16.0, 30.0])).view(num_heads, 1, 1))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, num_heads, bias=False))
        r = torch.arange(-(window - 1), window, dtype=torch.float32) / (window - 1) * 8
        table = torch.stack(torch.meshgrid(r, r, indexing="ij"), -1)  # [2w-1, 2w-1, 2]
        self.register_buffer("coords_table", torch.sign(table) * torch.log2(table.abs() + 1) / math.log2(8))
        self.register_buffer("index", _relative_index(window))
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(dim) * 0.5), nn.Parameter(torch.randn(dim) * 0.5)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))  # no bias on the keys
        qkv = F.linear(x, self.qkv.weight, bias).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = (qkv[0], qkv[2], qkv[1]) if self.bug == "kv_swapped" else (qkv[0], qkv[1], qkv[2])
        scale = 1.0 if self.bug == "no_scale" else torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * scale
        table = self.cpb_mlp(self.coords_table).view(-1, self.num_heads)
        position = table[self.index.view(-1)].view(N, N, -1)
        position = position.permute(2, 1, 0) if self.bug == "bias_transposed" else position.permute(2, 0, 1)
        attn = attn + 16 * torch.sigmoid(position).unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = (attn.view(B_ // nW, nW, self.num_heads, N, N) + mask[None, :, None]).view(-1, self.num_heads, N, N)
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C))


class DecomposedRelPos(nn.Module):
    def __init__(self, dim=32, num_heads=4, grid=3, bug=None):
        super().__init__()
        self.num_heads, self.grid, self.bug = num_heads, grid, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.randn(2 * grid - 1, dim // num_heads) * 0.5)
        self.rel_pos_w = nn.Parameter(torch.randn(2 * grid - 1, dim // num_heads) * 0.5)

    def forward(self, x):
        B, N, C = x.shape
        g = self.grid
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(*SPLIT_ORDER[self.bug == "split_no_permute"])
        q, k, v = qkv.reshape(3, B * self.num_heads, N, -1).unbind(0)  # [B·H, N, d] each
        attn = q @ k.transpose(-2, -1) if self.bug == "no_scale" else (q * self.scale) @ k.transpose(-2, -1)
        rel = torch.arange(g)[:, None] - torch.arange(g)[None, :] + g - 1  # [g, g]
        r_q = q.reshape(-1, g, g, q.shape[-1])
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, self.rel_pos_h[rel])
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, self.rel_pos_w[rel])
        attn = (attn.view(-1, g, g, g, g) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).view(-1, N, N)
        x = (attn.softmax(dim=-1) @ v).view(B, self.num_heads, N, -1).permute(0, 2, 1, 3).reshape(B, N, C)
        return self.proj(x)


class TalkingHeads(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.pre_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=False)
        self.post_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.to_qkv(x).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.shape[-1] ** -0.5
        dots = self.pre_softmax_talking_heads(dots)
        causal_mask = torch.ones(N, N, dtype=torch.bool).triu(0 if self.bug == "causal_diagonal" else 1)
        dots = dots.masked_fill(causal_mask, -torch.finfo(dots.dtype).max)
        attn = self.post_softmax_talking_heads(dots.softmax(dim=-1))
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(B, N, C))


# the permute of DecomposedRelPos's fused qkv [B, N, 3, H, d]: the heads moved before the tokens, or (the plant) not
SPLIT_ORDER = {False: (2, 0, 3, 1, 4), True: (2, 0, 1, 3, 4)}
