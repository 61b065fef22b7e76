"""Attention over feature maps [B, C, H, W] with pointwise Conv2d projections, as the latent-diffusion and VQGAN
autoencoders write it: the CompVis taming-transformers / latent-diffusion `AttnBlock` (GroupNorm, q, k, v and
proj_out each a 1x1 Conv2d, `q.reshape(b, c, h*w).permute(0, 2, 1)`, `torch.bmm(q, k)`, `int(c)**(-0.5)`, softmax
over dim 2, `torch.bmm(v, w_.permute(0, 2, 1))`, the residual); a VQGAN-like block with heads over the channels
(einsum per head, keys first in the scores); a block whose queries, keys and values are 1x1 Conv1d layers over the
flattened map and whose output projection is an nn.Linear over the channels (rows). Plants: no scale, the softmax
over the queries, keys and values swapped, the transpose of the pattern left out."""

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # latent-diffusion's SpatialSelfAttention writes its reshapes with einops where it is installed
    from einops import rearrange
except ImportError:  # pragma: no cover - the same reshapes by hand
    rearrange = None


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values (norm weights off 1, biases off 0), as a trained model's are."""
    g = torch.Generator().manual_seed(27)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


def Normalize(in_channels, num_groups=8):
    return nn.GroupNorm(num_groups=num_groups, num_channels=in_channels, eps=1e-6, affine=True)


class AttnBlock(nn.Module):
    """taming-transformers' / latent-diffusion's AttnBlock, as written there."""

    def __init__(self, in_channels=16, bug=None):
        super().__init__()
        self.in_channels, self.bug = in_channels, bug
        self.norm = Normalize(in_channels)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        _trained(self)

    def forward(self, x):
        h_ = x
        h_ = self.norm(h_)
        q = self.q(h_)
        k = self.k(h_)
        v = self.v(h_)
        if self.bug == "kv_swapped":
            k, v = v, k

        # compute attention
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w)
        q = q.permute(0, 2, 1)   # b,hw,c
        k = k.reshape(b, c, h * w)  # b,c,hw
        w_ = torch.bmm(q, k)     # b,hw,hw    w[b,i,j]=sum_c q[b,i,c]k[b,c,j]
        if self.bug != "no_scale":
            w_ = w_ * (int(c) ** (-0.5))
        w_ = torch.nn.functional.softmax(w_, dim=1 if self.bug == "softmax_queries" else 2)

        # attend to values
        v = v.reshape(b, c, h * w)
        if self.bug != "no_transpose":
            w_ = w_.permute(0, 2, 1)   # b,hw,hw (first hw of k, second of q)
        h_ = torch.bmm(v, w_)     # b, c,hw (hw of q) h_[b,c,j] = sum_i v[b,c,i] w_[b,i,j]
        h_ = h_.reshape(b, c, h, w)

        h_ = self.proj_out(h_)

        return x + h_


class SpatialSelfAttention(nn.Module):
    """latent-diffusion's SpatialSelfAttention: einsums "bij,bjk->bik", its reshapes with einops.rearrange (by
    .reshape/.permute where einops is not installed)."""

    def __init__(self, in_channels=16, bug=None):
        super().__init__()
        self.bug = bug
        self.norm = Normalize(in_channels, 4)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        _trained(self)

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        if rearrange is not None:
            q = rearrange(q, "b c h w -> b (h w) c")
            k = rearrange(k, "b c h w -> b c (h w)")
        else:
            q, k = q.reshape(b, c, h * w).permute(0, 2, 1), k.reshape(b, c, h * w)
        w_ = torch.einsum("bij,bjk->bik", q, k)
        w_ = w_ * (int(c) ** (-0.5)) if self.bug != "no_scale" else w_
        w_ = torch.nn.functional.softmax(w_, dim=1 if self.bug == "softmax_queries" else 2)
        if rearrange is not None:
            v = rearrange(v, "b c h w -> b c (h w)")
            w_ = rearrange(w_, "b i j -> b j i")
        else:
            v, w_ = v.reshape(b, c, h * w), w_.permute(0, 2, 1)
        h_ = torch.einsum("bij,bjk->bik", v, w_)
        h_ = rearrange(h_, "b c (h w) -> b c h w", h=h) if rearrange is not None else h_.reshape(b, c, h, w)
        return x + self.proj_out(h_)


class MultiHeadAttnBlock(nn.Module):
    """A VQGAN-like attention block with heads over the channels: views and einsums, the scores keys first
    ([B, H, n_K, n_Q], softmax over dim -2), no permute back of the pattern."""

    def __init__(self, channels=16, num_heads=2, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.norm = nn.GroupNorm(4, channels, eps=1e-6)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)
        _trained(self)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        d = C // self.num_heads
        q, k, v = (t.view(B, self.num_heads, d, H * W) for t in (q, k, v))
        scale = 1.0 if self.bug == "no_scale" else d ** -0.5
        attn = torch.einsum("bhdk,bhdq->bhkq", k, q) * scale  # [B, H, n_K, n_Q]
        attn = attn.softmax(dim=-1 if self.bug == "softmax_queries" else -2)
        out = torch.einsum("bhdk,bhkq->bhdq", v, attn)
        return x + self.proj_out(out.reshape(B, C, H, W))


class MixedProjections(nn.Module):
    """q, k, v pointwise Conv1d layers over the flattened map [B, C, H·W] (columns), the output projection an
    nn.Linear over the channels of the tokens laid as rows, the result handed back as a map."""

    def __init__(self, channels=16, num_heads=2, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.norm = nn.GroupNorm(4, channels, eps=1e-6)
        self.to_q = nn.Conv1d(channels, channels, 1)
        self.to_k = nn.Conv1d(channels, channels, 1)
        self.to_v = nn.Conv1d(channels, channels, 1)
        self.to_out = nn.Linear(channels, channels)
        _trained(self)

    def forward(self, x):
        B, C, *spatial = x.shape
        x = x.reshape(B, C, -1)
        h = self.norm(x)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)  # [B, C, n]
        q, k, v = (t.reshape(B, self.num_heads, C // self.num_heads, -1).transpose(-2, -1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug == "no_scale" else None)
        out = out.transpose(1, 2).reshape(B, -1, C)  # [B, n, C]: rows
        out = self.to_out(out).transpose(1, 2)  # [B, C, n]
        return (x + out).reshape(B, C, *spatial)


class DiffusersAttentionBlock(nn.Module):
    """diffusers' early AttentionBlock (the VAE's mid-block before `Attention` took over): a GroupNorm over the map
    [B, C, H, W], the map laid as rows [B, H·W, C] for nn.Linear query, key, value and proj_attn, heads of
    num_head_channels, the scale split over q and k, the map rebuilt, the residual."""

    def __init__(self, channels=16, num_head_channels=8, norm_num_groups=4, bug=None):
        super().__init__()
        self.channels, self.bug = channels, bug
        self.num_heads = channels // num_head_channels
        self.group_norm = nn.GroupNorm(num_channels=channels, num_groups=norm_num_groups, eps=1e-6, affine=True)
        self.query = nn.Linear(channels, channels)
        self.key = nn.Linear(channels, channels)
        self.value = nn.Linear(channels, channels)
        self.proj_attn = nn.Linear(channels, channels, 1)
        _trained(self)

    def transpose_for_scores(self, projection):
        new_projection_shape = projection.size()[:-1] + (self.num_heads, -1)
        return projection.view(new_projection_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        residual = hidden_states
        batch, channel, height, width = hidden_states.shape
        hidden_states = self.group_norm(hidden_states)
        hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        query_states = self.transpose_for_scores(self.query(hidden_states))
        key_states = self.transpose_for_scores(self.key(hidden_states))
        value_states = self.transpose_for_scores(self.value(hidden_states))
        scale = 1 / (self.channels / self.num_heads) ** 0.25
        k_scale = 1.0 if self.bug == "k_share" else scale
        attention_scores = torch.matmul(query_states * scale, key_states.transpose(-1, -2) * k_scale)
        attention_probs = torch.softmax(attention_scores.float(), dim=-1).type(attention_scores.dtype)
        hidden_states = torch.matmul(attention_probs, value_states)
        hidden_states = hidden_states.permute(0, 2, 1, 3).contiguous()
        new_hidden_states_shape = hidden_states.size()[:-2] + (self.channels,)
        hidden_states = hidden_states.view(new_hidden_states_shape)
        hidden_states = self.proj_attn(hidden_states)
        hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        return hidden_states + residual
