"""An attention that normalizes its input itself before its fused projection reads it, as lucidrains' vit-pytorch
writes it (docs/trace.md, "A norm before the projections")."""

from torch import nn


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x):
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        attn = (q @ k.transpose(-1, -2) * self.scale).softmax(dim=-1)
        return self.to_out((attn @ v).transpose(1, 2).reshape(b, n, -1))
