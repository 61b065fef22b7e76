"""Joint (two-stream) attention whose mistakes live in one stream's own steps, before the join, each in its own style:

- SD3Joint: diffusers' JointAttnProcessor2_0 as a module: a q, k and v Linear per stream (to_q.., add_q_proj..),
  heads by view + transpose, an RMSNorm module per stream for q and k (`shared=True`: one pair for both streams),
  joined by torch.cat on the sequence dim (the image first; `context_first=True`: the context first), SDPA, the
  output split back, to_out and to_add_out (`context_out=False`: none for the context, SD3's last block).
- FluxDouble: Flux's double-stream attention: one fused qkv Linear per stream viewed `[B, L, 3, H, D]` and permuted
  (no einops), unbound, a QKNorm written by hand (rsqrt of the mean square, a `scale` parameter), txt + img joined,
  SDPA, merged, split, one proj per stream.
- FunctionalJoint: `joint_attention(x, c, weights, heads)`, a function over plain tensors: F.linear with the
  module's nn.Parameters, a LayerNorm over each head by F.layer_norm with a weight and bias (HunyuanDiT's qk-norm),
  heads `[B, L, H, D]` joined on the tokens (dim 1), transposed for SDPA (`kv_heads=2`: grouped-query).

Plants (`bug=`): 'ctx_knorm_missing' (the context's keys never normalized), 'ctx_v_knormed' (its values normalized by
its keys' norm), 'ctx_kv_swapped' (its keys and values swapped at the join); FluxDouble also 'unpack_swapped'
(`q, v, k = qkv.unbind(0)` for the text: swapped before the norm).
"""

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module, seed):
    """Weights moved off their initial values: norm gains around 1, biases nonzero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm.weight", "scale", "_g")) or p.dim() == 1 and "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


class SD3Joint(nn.Module):
    def __init__(self, dim=32, heads=4, shared=False, context_first=False, context_out=True, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.bug = heads, dim // heads, bug
        self.context_first, self.context_out = context_first, context_out
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        if shared:
            self.norm_added_q, self.norm_added_k = self.norm_q, self.norm_k
        else:
            self.norm_added_q, self.norm_added_k = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.to_out = nn.Linear(dim, dim)
        self.to_add_out = nn.Linear(dim, dim) if context_out else None
        _trained(self, 1)

    def _split(self, t):
        b = t.shape[0]
        return t.view(b, -1, self.heads, self.head_dim).transpose(1, 2)  # [B, L, H·D] -> [B, H, L, D]

    def forward(self, hidden_states, encoder_hidden_states=None):
        query = self.norm_q(self._split(self.to_q(hidden_states)))
        key = self.norm_k(self._split(self.to_k(hidden_states)))
        value = self._split(self.to_v(hidden_states))
        if encoder_hidden_states is not None:
            c_query = self.norm_added_q(self._split(self.add_q_proj(encoder_hidden_states)))
            c_key = self._split(self.add_k_proj(encoder_hidden_states))
            if self.bug != "ctx_knorm_missing":
                c_key = self.norm_added_k(c_key)
            c_value = self._split(self.add_v_proj(encoder_hidden_states))
            if self.bug == "ctx_v_knormed":
                c_value = self.norm_added_k(c_value)
            if self.bug == "ctx_kv_swapped":
                c_key, c_value = c_value, c_key
            if self.context_first:
                query, key, value = (torch.cat([c, s], dim=2) for c, s in
                                     ((c_query, query), (c_key, key), (c_value, value)))
            else:
                query, key, value = (torch.cat([s, c], dim=2) for s, c in
                                     ((query, c_query), (key, c_key), (value, c_value)))
        out = F.scaled_dot_product_attention(query, key, value)
        b = out.shape[0]
        out = out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim)  # [B, H, L, D] -> [B, L, H·D]
        if encoder_hidden_states is None:
            return self.to_out(out)
        n, m = hidden_states.shape[1], encoder_hidden_states.shape[1]
        x, c = (out[:, m:], out[:, :m]) if self.context_first else (out[:, :n], out[:, n:])
        return self.to_out(x), (self.to_add_out(c) if self.to_add_out is not None else c)


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query_scale = nn.Parameter(torch.ones(dim))
        self.key_scale = nn.Parameter(torch.ones(dim))

    @staticmethod
    def _rms(x, scale):
        rrms = torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + 1e-6)
        return (x * rrms) * scale

    def forward(self, q, k, v):
        return self._rms(q, self.query_scale).to(v), self._rms(k, self.key_scale).to(v)


class FluxDouble(nn.Module):
    def __init__(self, hidden=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.img_qkv, self.txt_qkv = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, 3 * hidden)
        self.img_norm, self.txt_norm = QKNorm(hidden // num_heads), QKNorm(hidden // num_heads)
        self.img_proj, self.txt_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        with torch.no_grad():
            for norm in (self.img_norm, self.txt_norm):
                norm.query_scale.uniform_(0.5, 1.5)
                norm.key_scale.uniform_(0.5, 1.5)
        _trained(self, 2)

    def _qkv(self, qkv):
        B, L, _ = qkv.shape
        return qkv.view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # -> [3, B, H, L, D]

    def forward(self, img, txt):
        img_q, img_k, img_v = self._qkv(self.img_qkv(img)).unbind(0)
        img_q, img_k = self.img_norm(img_q, img_k, img_v)
        if self.bug == "unpack_swapped":
            txt_q, txt_v, txt_k = self._qkv(self.txt_qkv(txt)).unbind(0)
        else:
            txt_q, txt_k, txt_v = self._qkv(self.txt_qkv(txt)).unbind(0)
        normed_q, normed_k = self.txt_norm(txt_q, txt_k, txt_v)
        txt_q = normed_q
        if self.bug != "ctx_knorm_missing":
            txt_k = normed_k
        if self.bug == "ctx_v_knormed":
            txt_v = self.txt_norm(txt_q, txt_v, txt_v)[1]
        if self.bug == "ctx_kv_swapped":
            txt_k, txt_v = txt_v, txt_k
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        x = F.scaled_dot_product_attention(q, k, v)
        B, H, L, D = x.shape
        x = x.permute(0, 2, 1, 3).reshape(B, L, H * D)
        txt_attn, img_attn = x[:, : txt.shape[1]], x[:, txt.shape[1]:]
        return self.img_proj(img_attn), self.txt_proj(txt_attn)


def joint_attention(x, c, w, heads, bug=None):
    """Joint attention over x's tokens and c's, from the weights `w` (a dict of tensors), heads `[B, L, H, D]`; keys
    and values of fewer heads (grouped-query) where their weights are narrower."""
    d = w["img_wq"].shape[0] // heads

    def heads_of(t):
        return t.unflatten(-1, (-1, d))  # [B, L, H·D] -> [B, L, H, D]

    def norm(t, side):
        return F.layer_norm(t, t.shape[-1:], w[f"{side}_g"], w[f"{side}_b"], eps=1e-5)

    parts = {}
    for s, t in (("img", x), ("txt", c)):
        q = heads_of(F.linear(t, w[f"{s}_wq"], w[f"{s}_bq"]))
        k = heads_of(F.linear(t, w[f"{s}_wk"], w[f"{s}_bk"]))
        v = heads_of(F.linear(t, w[f"{s}_wv"], w[f"{s}_bv"]))
        q = norm(q, f"{s}_qnorm")
        if not (s == "txt" and bug == "ctx_knorm_missing"):
            k = norm(k, f"{s}_knorm")
        if s == "txt" and bug == "ctx_v_knormed":
            v = norm(v, f"{s}_knorm")
        if s == "txt" and bug == "ctx_kv_swapped":
            k, v = v, k
        parts[s] = (q, k, v)
    q, k, v = (torch.cat([a, b], dim=1) for a, b in zip(parts["img"], parts["txt"], strict=True))  # [B, L, H, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         enable_gqa=k.shape[2] != q.shape[2])
    out = out.transpose(1, 2).flatten(2)  # [B, H, L, D] -> [B, L, H·D]
    n = x.shape[1]
    return F.linear(out[:, :n], w["img_wo"]), F.linear(out[:, n:], w["txt_wo"])


class FunctionalJoint(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        d = dim // heads
        for s in ("img", "txt"):
            for r in ("q", "k", "v"):
                width = dim if r == "q" else kv_heads * d
                setattr(self, f"{s}_w{r}", nn.Parameter(torch.randn(width, dim) / dim**0.5))
                setattr(self, f"{s}_b{r}", nn.Parameter(torch.zeros(width)))
            for side in ("qnorm", "knorm"):
                setattr(self, f"{s}_{side}_g", nn.Parameter(torch.ones(d)))
                setattr(self, f"{s}_{side}_b", nn.Parameter(torch.zeros(d)))
            setattr(self, f"{s}_wo", nn.Parameter(torch.randn(dim, dim) / dim**0.5))
        _trained(self, 3)

    def forward(self, x, context):
        return joint_attention(x, context, dict(self.named_parameters()), self.heads, self.bug)
