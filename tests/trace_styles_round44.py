"""Styles for tests/test_trace_round44.py, from held-out round 44. LightGlue is transformers' own
`LightGlueAttention` (models/lightglue/modeling_lightglue.py), its weights moved: RoPE's pair handed in as
`position_embeddings=None` by default, and when None the code rotates nothing (LightGlue's keypoint encoding is
the caller's); its `rotate_half` pairs adjacent coordinates, so the pair is laid out interleaved
(`repeat_interleave(2)`). `bug=` plants a mistake: 'rope_on_values' (the values turned too: rope.on_values),
'ignored' (the tables never used: rope.not_applied). Wav2Vec2 is torchaudio's wav2vec2 `SelfAttention` (0.13, before
it called F.scaled_dot_product_attention): the keys split as `[B, nH, Hd, L]`, q scaled before the product, the
Transformer's additive mask `[B, 1, L, L]` (-10000.0 at padded keys) added in place, each row's max taken out before
the softmax. `bug=`: 'mask_after_softmax' (mask.after_softmax), 'softmax_queries' (`softmax(dim=2)`:
softmax.axis), 'scale_both' (k scaled too: scale.twice), 'merge' (`[B, nH, L, Hd]` reshaped straight:
heads.merge_without_transpose). MQAv2 is timm's `MultiQueryAttentionV2` (MobileNetV4): an NCHW feature map, the
projections raw Parameters applied by einsum ('bnd,hkd->bnhk', one key head 'bmd,dk->bmk', 'bnhv,dhv->bdn'), the
weights laid out `[b, n, h, m]`. `bug='dropout_on'`: `F.dropout(attn, p)`, whose training defaults to True
(dropout.left_on). MQA2d is timm's `MultiQueryAttention2d` (MobileNetV4 hybrid) with kv_stride=2: 1x1 Conv2d
projections of an NCHW map, one key and one value head, each of k and v downsampled by its own strided depthwise
Conv2d and BatchNorm2d first, SDPA broadcasting the one key/value head. `bug=`: 'query_straight' (the projected
query `[b, h·k, H, W]` reshaped straight to `[b, h, n, k]`, its transpose(-1, -2) left out:
heads.split_without_permute), 'scaled_twice' (q scaled before SDPA scales it: scale.twice)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LightGlueConfig  # noqa: F401  (the config --init builds)
from transformers.models.lightglue import modeling_lightglue as hf


def _moved(module: nn.Module, seed: int) -> None:
    """Every weight off its initial value (trained-looking: no zero bias), the same in each instance of a class."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class LightGlue(hf.LightGlueAttention):
    def __init__(self, config, layer_idx=0, bug=None):
        super().__init__(config, layer_idx)
        self.bug = bug
        _moved(self, 441)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, **kwargs):
        if self.bug is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None and self.bug != "ignored":
            cos, sin = position_embeddings
            query_states, key_states = hf.apply_rotary_pos_emb(query_states, key_states, cos, sin)
            if self.bug == "rope_on_values":
                value_states, _ = hf.apply_rotary_pos_emb(value_states, value_states, cos, sin)
        attn_output, attn_weights = hf.eager_attention_forward(self, query_states, key_states, value_states,
                                                               attention_mask, scaling=self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class Wav2Vec2(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, dropout=0.0, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.dropout = torch.nn.Dropout(dropout)
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        _moved(self, 442)

    def forward(self, x, attention_mask=None, position_bias=None, key_padding_mask=None):
        batch_size, length, embed_dim = x.size()
        if attention_mask is not None:
            shape_ = (batch_size, 1, length, length)
            if attention_mask.size() != shape_:
                raise ValueError(f"The expected attention mask shape is {shape_}. Found {attention_mask.size()}.")
        shape = (batch_size, length, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(*shape).transpose(2, 1)  # B, nH, L, Hd
        k = self.k_proj(x).view(*shape).permute(0, 2, 3, 1)  # B, nH, Hd, L
        v = self.v_proj(x).view(*shape).transpose(2, 1)  # B, nH, L, Hd
        weights = (self.scaling * q) @ (self.scaling * k if self.bug == "scale_both" else k)  # B, nH, L, L
        if attention_mask is not None and self.bug != "mask_after_softmax":
            weights += attention_mask
        # subtracting a constant value from the tensor won't change the output of softmax
        weights = weights - weights.max(dim=-1, keepdim=True)[0]
        weights = torch.nn.functional.softmax(weights, dim=2 if self.bug == "softmax_queries" else -1)
        if attention_mask is not None and self.bug == "mask_after_softmax":
            weights += attention_mask
        weights = self.dropout(weights)
        output = weights @ v  # B, nH, L, Hd
        if self.bug != "merge":
            output = output.transpose(2, 1)
        output = output.reshape(batch_size, length, embed_dim)
        return self.out_proj(output), None


class MQAv2(nn.Module):
    def __init__(self, dim=32, num_heads=4, key_dim=8, value_dim=8, attn_drop=0.1, bug=None):
        super().__init__()
        self.num_heads, self.key_dim, self.value_dim, self.bug = num_heads, key_dim, value_dim, bug
        self.scale = key_dim ** -0.5
        self.query_proj = nn.Parameter(torch.randn([num_heads, key_dim, dim]))
        self.key_proj = nn.Parameter(torch.randn([dim, key_dim]))
        self.value_proj = nn.Parameter(torch.randn([dim, value_dim]))
        self.attn_drop = nn.Dropout(attn_drop)
        self.out_proj = nn.Parameter(torch.randn([dim, num_heads, value_dim]))
        self.proj_drop = nn.Dropout(0.0)
        _moved(self, 443)

    def _reshape_input(self, t):
        s = t.shape
        return t.reshape(s[0], s[1], -1).transpose(1, 2)

    def forward(self, x, m=None):
        b, _, h, w = x.shape
        m = m if m is not None else x
        reshaped_x = self._reshape_input(x)
        reshaped_m = self._reshape_input(m)
        q = torch.einsum("bnd,hkd->bnhk", reshaped_x, self.query_proj)
        k = torch.einsum("bmd,dk->bmk", reshaped_m, self.key_proj)
        attn = torch.einsum("bnhk,bmk->bnhm", q, k) * self.scale
        attn = attn.softmax(dim=-1)
        attn = F.dropout(attn, self.attn_drop.p) if self.bug == "dropout_on" else self.attn_drop(attn)
        v = torch.einsum("bmd,dv->bmv", reshaped_m, self.value_proj)
        o = torch.einsum("bnhm,bmv->bnhv", attn, v)
        result = torch.einsum("bnhv,dhv->bdn", o, self.out_proj)
        result = self.proj_drop(result)
        return result.reshape(b, -1, h, w)


class MQA2d(nn.Module):
    def __init__(self, dim=32, num_heads=4, key_dim=8, value_dim=8, kv_stride=2, dw_kernel_size=3, bug=None):
        super().__init__()
        self.num_heads, self.key_dim, self.value_dim, self.bug = num_heads, key_dim, value_dim, bug
        self.scale = key_dim ** -0.5
        pad = ((kv_stride - 1) + (dw_kernel_size - 1)) // 2  # timm's get_padding
        self.query = nn.Sequential()
        self.query.add_module("proj", nn.Conv2d(dim, num_heads * key_dim, 1, bias=False))
        for role, width in (("key", key_dim), ("value", value_dim)):
            branch = nn.Sequential()
            branch.add_module("down_conv", nn.Conv2d(dim, dim, dw_kernel_size, stride=kv_stride, padding=pad,
                                                     groups=dim))
            branch.add_module("norm", nn.BatchNorm2d(dim))
            branch.add_module("proj", nn.Conv2d(dim, width, 1, bias=False))
            setattr(self, role, branch)
        self.output = nn.Sequential()
        self.output.add_module("proj", nn.Conv2d(value_dim * num_heads, dim, 1, bias=False))
        _moved(self, 444)
        g = torch.Generator().manual_seed(445)
        for norm in (self.key.norm, self.value.norm):  # running statistics of a trained model
            norm.running_mean.copy_(torch.randn(dim, generator=g) * 0.1)
            norm.running_var.copy_(torch.rand(dim, generator=g) + 0.5)

    def _reshape_input(self, t):
        s = t.shape
        return t.reshape(s[0], s[1], -1).transpose(1, 2).unsqueeze(1).contiguous()

    def _reshape_projected_query(self, t, num_heads, key_dim):
        s = t.shape
        if self.bug == "query_straight":
            return t.reshape(s[0], num_heads, -1, key_dim).contiguous()
        return t.reshape(s[0], num_heads, key_dim, -1).transpose(-1, -2).contiguous()

    def _reshape_output(self, t, num_heads, h_px, w_px):
        s = t.shape
        feat_dim = s[-1] * num_heads
        return t.transpose(1, 2).reshape(s[0], h_px, w_px, feat_dim).permute(0, 3, 1, 2).contiguous()

    def forward(self, x, attn_mask=None):
        B, C, H, W = x.shape
        q = self._reshape_projected_query(self.query(x), self.num_heads, self.key_dim)
        k = self._reshape_input(self.key(x))
        v = self._reshape_input(self.value(x))
        if self.bug == "scaled_twice":
            q = q * self.scale
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.output(self._reshape_output(o, self.num_heads, H, W))
