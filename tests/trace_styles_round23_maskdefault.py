"""Round 23's mask at its default: attention computed over groups of the tokens the code regroups itself (Swin's
windows, an axial attention's columns, a video transformer's frames), whose optional mask argument means something
else than the whole [n, n] pattern a --mask file gives: Swin's shifted-window mask [n_windows, N, N], the key padding
of each regrouped sequence. Given the file, the code raises; at its default (None) it attends within its groups,
which is what the file's pattern says. Plants: no scale, keys and values swapped, the heads merged without their
transpose, the softmax over the queries."""

import torch
import torch.nn as nn


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


def window_partition(x, ws):
    """Swin's: [B, H, W, C] -> [B·n_windows, ws, ws, C]."""
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)


def window_reverse(windows, ws, H, W):
    B = int(windows.shape[0] / (H * W / ws / ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class WindowAttention(nn.Module):
    """Swin Transformer's window attention over a 4 x 4 grid of tokens in 2 x 2 windows (the grid's rows flattened
    into the sequence): `mask` is the shifted windows' additive mask [n_windows, N, N], added per window."""

    def __init__(self, dim=16, num_heads=2, grid=4, window_size=2, bug=None):
        super().__init__()
        self.dim, self.num_heads, self.grid, self.window_size, self.bug = dim, num_heads, grid, window_size, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, mask=None):
        B, L, C = x.shape
        ws = self.window_size
        windows = window_partition(x.view(B, self.grid, self.grid, C), ws).view(-1, ws * ws, C)
        B_, N, _ = windows.shape
        qkv = self.qkv(windows).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.bug == "kv_swapped":
            k, v = v, k
        if self.bug != "no_scale":
            q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = attn.softmax(dim=-1)
        windows = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        windows = self.proj(windows).view(-1, ws, ws, C)
        return window_reverse(windows, ws, self.grid, self.grid).view(B, L, C)


class AxialColumns(nn.Module):
    """An axial attention (lucidrains' axial-attention): the tokens of a 2 x 4 grid attend along its columns, the
    axis permuted next to last and the others folded into the batch; `mask` is the key padding of each column's
    sequence [B·W, H] (True = a real token), applied in place."""

    def __init__(self, dim=16, heads=2, shape=(2, 4), bug=None):
        super().__init__()
        self.heads, self.shape, self.bug = heads, shape, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        H, W = self.shape
        t = x.view(b, H, W, d).permute(0, 2, 1, 3).reshape(b * W, H, d)  # one sequence a column
        q, k, v = (self.to_q(t), *self.to_kv(t).chunk(2, dim=-1))
        e = d // self.heads
        q, k, v = (z.reshape(b * W, H, self.heads, e).transpose(1, 2) for z in (q, k, v))
        dots = torch.einsum("bhie,bhje->bhij", q, k) * e ** -0.5
        if mask is not None:
            dots.masked_fill_(~mask[:, None, None, :], float("-inf"))
        dots = dots.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhij,bhje->bhie", dots, v)
        if self.bug == "merge_no_transpose":
            out = out.reshape(b * W, H, d)
        else:
            out = out.transpose(1, 2).reshape(b * W, H, d)
        out = out.view(b, W, H, d).permute(0, 2, 1, 3).reshape(b, n, d)
        return self.to_out(out)


class FrameSpatial(nn.Module):
    """A video transformer's spatial attention (Latte's, DiT-like blocks over frames): [B, T·S, C] viewed as B·T
    sequences of one frame's S tokens; `attention_mask` is each frame's key padding [B·T, S] (True = a real token),
    applied with torch.where."""

    def __init__(self, hidden_size=16, num_heads=2, frames=2, bug=None):
        super().__init__()
        self.num_heads, self.frames, self.bug = num_heads, frames, bug
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def forward(self, hidden_states, attention_mask=None):
        B, L, C = hidden_states.shape
        S, h = L // self.frames, self.num_heads
        frames = hidden_states.reshape(B * self.frames, S, C)
        q, k, v = (p(frames).view(B * self.frames, S, h, C // h).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = C ** -0.5 if self.bug == "d_model" else (C // h) ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if attention_mask is not None:
            scores = torch.where(attention_mask[:, None, None, :], scores, torch.finfo(scores.dtype).min)
        weights = scores.softmax(-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(B, L, C)
        return self.o_proj(out)


class NeedsItsMask(nn.Module):
    """Axial columns as above, whose key padding has no default use of its own: it raises at None too (a mask the
    caller must give), so the first failure, on the --mask file, is reported."""

    def __init__(self, dim=16, heads=2, shape=(2, 4)):
        super().__init__()
        self.inner = AxialColumns(dim, heads, shape)

    def forward(self, x, mask=None):
        return self.inner(x, mask.bool())  # a None raises here
