"""Window attention on an image, as Florence-2's DaViT and timm's Swin block write it: the input `[b, h, w, c]`, cut
into windows inside the module, attended within each, and folded back into the image it returns, `[b, h, w, c]`
(no `.view(b, h * w, c)` at the end). `bug` plants one mistake."""

import torch
from torch import nn


class ImageWindows(nn.Module):
    def __init__(self, dim=32, heads=4, window=2, bug=""):
        super().__init__()
        self.heads, self.window, self.bug = heads, window, bug
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, c = x.shape
        s = self.window
        windows = x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        n = windows.shape[0]
        q, k, v = self.qkv(windows).reshape(n, s * s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scale = (c // self.heads) ** -0.5
        scale = scale * scale if self.bug == "scale_twice" else scale  # twice: 1 / d_head
        a = (q @ k.transpose(-2, -1) * scale).softmax(-1)
        out = self.proj((a @ v).transpose(1, 2).reshape(n, s * s, c))
        return out.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


def alibi_slopes(heads, from_zero=False):
    """ALiBi's slopes for a power of 2 heads, 2^(-8 h / heads), h = 1 to heads (h = 0 to heads - 1: the plant)."""
    return [2 ** (-8 * (h if from_zero else h + 1) / heads) for h in range(heads)]


class SymmetricAlibi(nn.Module):
    """JinaBERT's and MosaicBERT's encoder attention as written afresh: fused Wqkv, a bidirectional ALiBi bias
    −m_h · |i − j| built from the slopes it keeps, added to the scores."""

    def __init__(self, dim=32, heads=4, bug=""):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.Wqkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.slopes = alibi_slopes(heads, from_zero=bug == "slopes_from_zero")

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.Wqkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().to(x.dtype)
        bias = -torch.tensor(self.slopes, dtype=x.dtype)[:, None, None] * distance
        bias = -bias if self.bug == "sign" else bias
        scores = q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5 + bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class ApartHeadDim(nn.Module):
    """Nemotron-H's attention as written afresh: head_dim set apart from hidden_size / num_heads (16 beside 48 / 4),
    GQA by repeat_interleave; the plant scales by (hidden_size // num_heads) ** -0.5."""

    def __init__(self, hidden_size=48, heads=4, kv_heads=2, head_dim=16, bug=""):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bug = heads, kv_heads, head_dim, bug
        widths = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
        for name, width in widths.items():
            setattr(self, name, nn.Linear(hidden_size, width, bias=False))
        self.o_proj = nn.Linear(heads * head_dim, hidden_size, bias=False)
        self.scale = (hidden_size // heads if bug == "scale_from_hidden" else head_dim) ** -0.5

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (p(x).view(b, n, self.kv_heads, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-2, -1) * self.scale).masked_fill(~causal, float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))
