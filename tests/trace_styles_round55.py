"""Styles for tests/test_trace_round55.py, written afresh.

UnfoldedPixels: MobileViT's global representation (apple/ml-cvnets' MobileViTBlock) on a feature map
`[B, C, H, W]`: the map cut into 2×2 patches by F.unfold, the tokens at one pixel position of every patch moved into
the batch axis (`[B·P, N, C]`), multi-head attention over them with one fused qkv Linear, and F.fold back.
bug='kv_swapped' takes the keys from the values' third of qkv and the values from the keys'."""

import torch
import torch.nn.functional as F
from torch import nn


class UnfoldedPixels(nn.Module):
    def __init__(self, channels=16, heads=2, patch=2, bug=None):
        super().__init__()
        self.heads, self.patch, self.bug = heads, patch, bug
        self.qkv_proj = nn.Linear(channels, 3 * channels)
        self.out_proj = nn.Linear(channels, channels)

    def attention(self, x):
        b, n, c = x.shape
        qkv = self.qkv_proj(x).reshape(b, n, 3, self.heads, -1).transpose(1, 3).contiguous()  # [b, h, 3, n, d]
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.bug == "kv_swapped":
            key, value = value, key
        query = query * (c // self.heads) ** -0.5
        attn = torch.matmul(query, key.transpose(-1, -2)).softmax(dim=-1)
        out = torch.matmul(attn, value).transpose(1, 2).reshape(b, n, c)
        return self.out_proj(out)

    def forward(self, feature_map):
        B, C, H, W = feature_map.shape
        p = self.patch
        patches = F.unfold(feature_map, kernel_size=p, stride=p)  # [B, C·P, N]
        N = patches.shape[-1]
        patches = patches.reshape(B, C, p * p, N).permute(0, 2, 3, 1).reshape(B * p * p, N, C)
        patches = self.attention(patches)
        patches = patches.reshape(B, p * p, N, C).permute(0, 3, 1, 2).reshape(B, C * p * p, N)
        return F.fold(patches, output_size=(H, W), kernel_size=p, stride=p)


class InlineInProj(nn.Module):
    """DETR's decoder self-attention with torch's in_proj written out (the `multi_head_attention_forward` copies of
    DETR-era code): `q = k = tgt + query_pos`, the values `tgt`, each projected by its block of rows of one
    `in_proj_weight`, batch-first. bug='v_rows_of_k' takes the values' block from the keys' rows, `[E:2E]`, copied
    with the key block's slice."""

    def __init__(self, d_model=32, nhead=4, bug=None):
        super().__init__()
        self.d_model, self.nhead, self.bug = d_model, nhead, bug
        self.in_proj_weight = nn.Parameter(torch.randn(3 * d_model, d_model) * d_model ** -0.5)
        self.in_proj_bias = nn.Parameter(0.1 * torch.randn(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, tgt, query_pos=None):
        E, bsz, tgt_len = self.d_model, tgt.shape[0], tgt.shape[1]
        head_dim = E // self.nhead
        q = k = tgt if query_pos is None else tgt + query_pos
        q = F.linear(q, self.in_proj_weight[:E], self.in_proj_bias[:E])
        k = F.linear(k, self.in_proj_weight[E:2 * E], self.in_proj_bias[E:2 * E])
        start = E if self.bug == "v_rows_of_k" else 2 * E
        v = F.linear(tgt, self.in_proj_weight[start:start + E], self.in_proj_bias[start:start + E])
        q = q * head_dim ** -0.5
        q, k, v = (t.reshape(bsz, tgt_len, self.nhead, head_dim).transpose(1, 2).reshape(bsz * self.nhead, tgt_len,
                                                                                          head_dim) for t in (q, k, v))
        weights = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
        out = torch.bmm(weights, v).reshape(bsz, self.nhead, tgt_len, head_dim).transpose(1, 2).reshape(bsz, tgt_len, E)
        return self.out_proj(out)


class AxialRotary(nn.Module):
    """A 2-D rotary on a 3×4 grid of patches, as Pixtral's vision encoder lays it out (half of the pairs turned by
    the patch's row, the other half by its column, `rotate_half` over cos and sin repeated), q, k, v and o Linear
    layers, F.scaled_dot_product_attention. bug='keys_unrotated' turns the queries alone."""

    def __init__(self, dim=32, heads=4, grid=(3, 4), bug=None):
        super().__init__()
        self.heads, self.grid, self.bug = heads, grid, bug
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, patches):
        B, N, C = patches.shape
        d = C // self.heads
        freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        rows, cols = torch.arange(N) // self.grid[1], torch.arange(N) % self.grid[1]
        angles = torch.cat([rows[:, None] * freqs[::2], cols[:, None] * freqs[1::2]], dim=-1)  # [N, d / 2]
        emb = torch.cat([angles, angles], dim=-1).to(patches.dtype)
        cos, sin = emb.cos(), emb.sin()
        q, k, v = (p(patches).view(B, N, self.heads, d).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + self.rotate_half(q) * sin
        if self.bug != "keys_unrotated":
            k = k * cos + self.rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, C))


class GlobalBlocks(nn.Module):
    """Pegasus-X's global-local attention (models/pegasus_x/modeling_pegasus_x.py) on one sequence whose first
    `n_global` tokens are its global tokens: those attend to every token; the rest, in blocks of `block`, attend to
    the global tokens and to their own block, their scores two einsums joined along the keys' axis by torch.cat
    before one softmax. bug='softmax_dim' takes both softmaxes over the queries' axis."""

    def __init__(self, dim=32, heads=4, n_global=2, block=4, bug=None):
        super().__init__()
        self.heads, self.n_global, self.block, self.bug = heads, n_global, block, bug
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.out_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)

    def forward(self, hidden_states):
        B, N, C = hidden_states.shape
        H, d, G = self.heads, C // self.heads, self.n_global
        q, k, v = (p(hidden_states).view(B, N, H, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * d ** -0.5
        axis = -2 if self.bug == "softmax_dim" else -1
        global_probs = torch.einsum("BHGF,BHXF->BHGX", q[:, :, :G], k).softmax(dim=axis)
        global_out = torch.einsum("BHGX,BHXF->BHGF", global_probs, v)
        nb = (N - G) // self.block
        local_q, local_k, local_v = (t[:, :, G:].reshape(B, H, nb, self.block, d) for t in (q, k, v))
        to_global = torch.einsum("BHNKF,BHGF->BHNKG", local_q, k[:, :, :G])
        to_local = torch.einsum("BHNKF,BHNXF->BHNKX", local_q, local_k)
        probs = torch.cat([to_global, to_local], dim=-1).softmax(dim=axis)
        local_out = torch.einsum("BHNKG,BHGF->BHNKF", probs[..., :G], v[:, :, :G]) \
            + torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., G:], local_v)
        out = torch.cat([global_out, local_out.reshape(B, H, N - G, d)], dim=2)
        return self.out_proj(out.transpose(1, 2).reshape(B, N, C))


class ManyBlocks(nn.Module):
    """GlobalBlocks written block by block, as BigBird's block-sparse attention is (its first, middle and last
    blocks each scored and softmaxed apart): each block of queries against the global keys by a bmm viewed back (its
    torch_bmm_nd) and against its own block by a matmul, both scaled after the product, joined along the keys' axis
    and softmaxed; the global queries apart. bug='softmax_dim' takes every softmax over the queries' axis."""

    def __init__(self, dim=32, heads=4, n_global=2, block=2, bug=None):
        super().__init__()
        self.heads, self.n_global, self.block, self.bug = heads, n_global, block, bug
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states):
        B, N, C = hidden_states.shape
        H, d, G = self.heads, C // self.heads, self.n_global
        q, k, v = (p(hidden_states).view(B, N, H, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        axis, scale = (-2 if self.bug == "softmax_dim" else -1), d ** -0.5
        outs = [((q[:, :, :G] @ k.transpose(-1, -2)) * scale).softmax(dim=axis) @ v]
        for start in range(G, N, self.block):
            qb, kb, vb = (t[:, :, start:start + self.block] for t in (q, k, v))
            to_global = torch.bmm(qb.reshape(B * H, -1, d), k[:, :, :G].reshape(B * H, G, d).transpose(1, 2))
            to_global = to_global.view(B, H, -1, G) * scale
            to_block = (qb @ kb.transpose(-1, -2)) * scale
            probs = torch.cat([to_global, to_block], dim=-1).softmax(dim=axis)
            outs.append(probs[..., :G] @ v[:, :, :G] + probs[..., G:] @ vb)
        out = torch.cat(outs, dim=2)
        return self.out_proj(out.transpose(1, 2).reshape(B, N, C))
