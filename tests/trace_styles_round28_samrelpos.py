"""Round 28: decomposed 2-D relative positions (Segment Anything, ViTDet, MViTv2) whose term is built on its own and
laid out as the scores by a method that reads the scores' shape alone (`term.reshape_as(attn)`, `.view_as(attn)`,
`.expand_as(attn)`), then added. The scores lend that op a shape, none of their values: the term is not made from
q · kᵀ. Each module takes x [B, N, C] (N = grid², raster order) and a `bug` naming one planted mistake.

- FoldedReshapeAs: fused qkv, heads folded into the batch [B·h, N, d], the queries scaled before the product, the term
  from the unscaled queries as [B·h, g, g, g, g], `.reshape_as(attn)` (transformers' SamVisionAttention's layout);
- HeadsViewAs: q, k, v layers of their own, heads kept [B, h, N, d], the product scaled after it, the term
  [B, h, g, g, g, g] from one einsum per axis, `.view_as(scores)`;
- ExpandedParts: fused qkv chunked, heads kept, each part of the term laid [B, h, g, g, g, g] by `.expand_as` of a
  zero tensor of that shape, summed, flattened and added in place (`attn.add_(...)`);
- ViewedHelper: ViTDet's `add_decomposed_rel_pos` helper, the scores viewed [B·h, qy, qx, ky, kx] and summed with
  both parts there, viewed back.

The plant `split_no_permute` splits the fused projection into heads without moving them before the tokens (SAM's
qkv permuted (2, 0, 1, 3, 4)), the term then made from those queries: the code's own q · kᵀ is the content product.
"""

import torch
from torch import nn


def _trained(module):
    with torch.no_grad():  # every weight off its init (zero tables and biases hide bugs)
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))


def _rel(g):
    return torch.arange(g)[:, None] - torch.arange(g)[None, :] + g - 1  # [g, g]: query row minus key row, shifted


class FoldedReshapeAs(nn.Module):
    def __init__(self, dim=32, heads=4, grid=3, bug=None):
        super().__init__()
        self.heads, self.grid, self.bug = heads, grid, bug
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.randn(2 * grid - 1, dim // heads) * 0.5)
        self.rel_pos_w = nn.Parameter(torch.randn(2 * grid - 1, dim // heads) * 0.5)
        _trained(self)

    def rel_term(self, q):
        g = self.grid
        grid_q = q.reshape(q.shape[0], g, g, q.shape[-1])
        rows = torch.einsum("bywc,ykc->bywk", grid_q, self.rel_pos_h[_rel(g)])
        cols = torch.einsum("bywc,wkc->bywk", grid_q, self.rel_pos_w[_rel(g)])
        return rows[:, :, :, :, None] + cols[:, :, :, None, :]  # [B·h, qy, qx, ky, kx]

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, -1)
        qkv = qkv.permute(2, 0, 1, 3, 4) if self.bug == "split_no_permute" else qkv.permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.heads, N, -1).unbind(0)
        attn = q @ k.transpose(-2, -1) if self.bug == "no_scale" else (q * self.scale) @ k.transpose(-2, -1)
        attn = attn + self.rel_term(q).reshape_as(attn)
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = (attn @ v).reshape(B, self.heads, N, -1)
        out = out.reshape(B, N, C) if self.bug == "merge_no_transpose" else out.permute(0, 2, 1, 3).reshape(B, N, C)
        return self.proj(out)


class HeadsViewAs(nn.Module):
    def __init__(self, dim=32, heads=4, grid=3, bug=None):
        super().__init__()
        self.heads, self.grid, self.bug = heads, grid, bug
        self.d = dim // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.table_y = nn.Parameter(torch.randn(2 * grid - 1, self.d) * 0.5)
        self.table_x = nn.Parameter(torch.randn(2 * grid - 1, self.d) * 0.5)
        _trained(self)

    def forward(self, x):
        B, N, C = x.shape
        g = self.grid
        q, k, v = (f(x).view(B, N, self.heads, self.d).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / self.d if self.bug == "scale_d_head" else scores * self.d ** -0.5
        grid_q = q.reshape(B, self.heads, g, g, self.d)
        along_y = torch.einsum("bnyxc,ykc->bnyxk", grid_q, self.table_y[_rel(g)])
        along_x = torch.einsum("bnyxc,xkc->bnyxk", grid_q, self.table_x[_rel(g)])
        term = (along_y.unsqueeze(-1) + along_x.unsqueeze(-2)).contiguous()  # [B, h, qy, qx, ky, kx]
        scores = scores + term.view_as(scores)
        probs = torch.softmax(scores, dim=-2 if self.bug == "softmax_axis" else -1)
        return self.out((probs @ v).transpose(1, 2).reshape(B, N, C))


class ExpandedParts(nn.Module):
    def __init__(self, dim=32, heads=4, grid=3, bug=None):
        super().__init__()
        self.heads, self.grid, self.bug = heads, grid, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.pos_rows = nn.Parameter(torch.randn(2 * grid - 1, dim // heads) * 0.5)
        self.pos_cols = nn.Parameter(torch.randn(2 * grid - 1, dim // heads) * 0.5)
        _trained(self)

    def forward(self, x):
        B, N, C = x.shape
        g, h = self.grid, self.heads
        parts = self.qkv(x).chunk(3, dim=-1)
        if self.bug == "split_no_permute":
            q, k, v = (t.reshape(B, h, N, -1) for t in parts)
        else:
            q, k, v = (t.reshape(B, N, h, -1).permute(0, 2, 1, 3) for t in parts)
        d = q.shape[-1]
        attn = (q @ k.transpose(-2, -1)) * d ** -0.5
        grid_q = q.reshape(B, h, g, g, d)
        shape = torch.zeros(B, h, g, g, g, g, dtype=q.dtype)
        rows = (grid_q.unsqueeze(-2) @ self.pos_rows[_rel(g)].transpose(-1, -2).unsqueeze(1)).squeeze(-2)
        cols = torch.einsum("bnyxc,xkc->bnyxk", grid_q, self.pos_cols[_rel(g)])
        term = rows[..., :, None].expand_as(shape) + cols[..., None, :].expand_as(shape)
        attn.add_(term.flatten(2, 3).flatten(3, 4))
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = attn @ v
        out = out.reshape(B, N, C) if self.bug == "merge_no_transpose" else out.transpose(1, 2).reshape(B, N, C)
        return self.o(out)


def add_decomposed(attn, q, table_h, table_w, g):
    """ViTDet's helper: the scores viewed [B·h, qy, qx, ky, kx], each axis's term broadcast along the other, viewed
    back."""
    grid_q = q.reshape(q.shape[0], g, g, q.shape[-1])
    rel_h = torch.einsum("byxc,ykc->byxk", grid_q, table_h[_rel(g)])
    rel_w = torch.einsum("byxc,xkc->byxk", grid_q, table_w[_rel(g)])
    attn = attn.view(-1, g, g, g, g) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
    return attn.view(-1, g * g, g * g)


class ViewedHelper(FoldedReshapeAs):  # its layers and tables, a forward of its own
    def forward(self, x):
        B, N, C = x.shape
        order = (2, 0, 1, 3, 4) if self.bug == "split_no_permute" else (2, 0, 3, 1, 4)
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, -1).permute(*order).reshape(3, -1, N, C // self.heads)
        attn = (q * (1.0 if self.bug == "no_scale" else self.scale)) @ k.transpose(-2, -1)
        attn = add_decomposed(attn, q, self.rel_pos_h, self.rel_pos_w, self.grid).softmax(dim=-1)
        return self.proj((attn @ v).view(B, self.heads, N, -1).permute(0, 2, 1, 3).reshape(B, N, C))
