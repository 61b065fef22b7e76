"""Cross-attention whose keys and values read an input of another width than the queries', in the forms real
libraries write it (tests/test_trace_r13_memory.py):

- a memory parameter that no name gives away, behind another optional parameter, read by a fused K/V projection of
  its own width (Perceiver IO's cross-attend: `features=None`);
- transformers' PerceiverAttention as a cross-attention (`inputs=None` read by `key = nn.Linear(kv_dim, ..)`,
  layernorm1 and layernorm2 before the projections, no query residual);
- Flamingo's MaskedCrossAttention: the text attends to visual features of `dim_visual`, a fused `to_kv`;
- a BLIP-2 Q-Former's learned query tokens attending to image embeddings of `encoder_width` (BERT's names, an
  extended additive mask);
- an attention pool whose learned queries go to nn.MultiheadAttention with kdim = vdim = the input's width;
- Set Transformer's PMA: seeds attending through bmm, heads folded into the batch, n_head·d_head not their width;
- transformers' BertSelfAttention as cross-attention: encoder_hidden_states of encoder_width, and with them its
  encoder_attention_mask the mask (attention_mask left unread).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class IOCrossAttend(nn.Module):
    """Perceiver IO's decoder cross-attention: output queries attend to features of their own width."""

    def __init__(self, dim=32, feat_dim=16, heads=4, dim_head=8, bug=None):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale, self.bug = heads, dim_head ** -0.5, bug
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(feat_dim, 2 * inner, bias=False)
        self.proj = nn.Linear(inner, dim)

    def forward(self, queries, attn_bias=None, features=None):
        src = queries if features is None else features
        k, v = self.to_kv(src).chunk(2, dim=-1)
        q = self.to_q(queries)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [b, h, n, d]
        if self.bug == "v_from_k":
            v = k
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale)
        return self.proj(out.transpose(1, 2).flatten(2))  # [b, n, h·d]


class PerceiverCrossAttention(nn.Module):
    """transformers' PerceiverAttention(is_cross_attention=True, use_query_residual=False), self and output folded
    into one module."""

    def __init__(self, q_dim=32, kv_dim=16, num_heads=4, qk_channels=32, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.qk_channels_per_head = qk_channels // num_heads
        self.layernorm1 = nn.LayerNorm(q_dim)
        self.layernorm2 = nn.LayerNorm(kv_dim)
        self.query = nn.Linear(q_dim, qk_channels)
        self.key = nn.Linear(kv_dim, qk_channels)
        self.value = nn.Linear(kv_dim, qk_channels)
        self.dense = nn.Linear(qk_channels, q_dim)

    def transpose_for_scores(self, x):
        x = x.view(*x.size()[:-1], self.num_heads, self.qk_channels_per_head)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, inputs=None, inputs_mask=None, output_attentions=False):
        hidden_states = self.layernorm1(hidden_states)
        inputs = self.layernorm2(inputs)
        queries = self.transpose_for_scores(self.query(hidden_states))
        keys = self.transpose_for_scores(self.key(inputs))
        values = self.transpose_for_scores(self.value(inputs))
        scores = torch.matmul(queries, keys.transpose(-1, -2))
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.qk_channels_per_head)
        if inputs_mask is not None:
            scores = scores + inputs_mask
        probs = nn.Softmax(dim=-1)(scores)
        context = torch.matmul(probs, values).permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.size()[:-2], self.num_heads * self.qk_channels_per_head)
        return (self.dense(context),)


class MaskedCrossAttention(nn.Module):
    """Flamingo's (flamingo-pytorch) cross-attention from text to visual features of their own width."""

    def __init__(self, dim=32, dim_visual=24, dim_head=8, heads=4, bug=None):
        super().__init__()
        inner_dim = dim_head * heads
        self.scale, self.heads, self.bug = dim_head ** -0.5, heads, bug
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, media):
        b, n, _ = x.shape
        x = self.norm(x)
        q = self.to_q(x)
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = (t.view(b, t.shape[1], self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        if self.bug != "no_scale":
            q = q * self.scale
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class QFormerPool(nn.Module):
    """A BLIP-2 Q-Former's cross-attention layer: learned query tokens attend to image embeddings of
    encoder_width (BERT's query/key/value names, the extended additive mask)."""

    def __init__(self, num_query_tokens=4, hidden_size=32, encoder_width=16, num_attention_heads=4, bug=None):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.randn(1, num_query_tokens, hidden_size) * 0.02)
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(encoder_width, self.all_head_size)
        self.value = nn.Linear(encoder_width, self.all_head_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.bug = bug

    def transpose_for_scores(self, x):
        x = x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size))
        return x.permute(0, 2, 1, 3)

    def forward(self, image_embeds, image_attention_mask=None):
        query_embeds = self.query_tokens.expand(image_embeds.shape[0], -1, -1)
        query_layer = self.transpose_for_scores(self.query(query_embeds))
        key_layer = self.transpose_for_scores(self.key(image_embeds))
        value_layer = self.transpose_for_scores(self.value(image_embeds))
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.attention_head_size)
        if image_attention_mask is not None:
            extended = image_attention_mask[:, None, None, :].to(scores.dtype)
            scores = scores + (1.0 - extended) * -10000.0
        probs = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return self.dense(context.view(context.size()[:-2] + (self.all_head_size,)))


class AttentionPool(nn.Module):
    """Learned queries pooling features of another width through nn.MultiheadAttention(kdim, vdim)."""

    def __init__(self, in_dim=16, dim=32, heads=4, num_queries=3):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_queries, dim))
        self.attn = nn.MultiheadAttention(dim, heads, kdim=in_dim, vdim=in_dim, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        q = self.queries.unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.attn(q, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]


class SeedPool(nn.Module):
    """Set Transformer's pooling by multihead attention, its seeds of dim features attending to a set of dim_in ones
    through bmm, the heads folded into the batch, their n_head·d_head (16) not the seeds' width (32) and said by no
    attribute of a head count's name."""

    def __init__(self, num_seeds=3, dim=32, dim_in=16, dim_V=16, splits=2):
        super().__init__()
        self.S = nn.Parameter(torch.randn(1, num_seeds, dim) * 0.5)
        self.splits = splits
        self.fc_q = nn.Linear(dim, dim_V)
        self.fc_k = nn.Linear(dim_in, dim_V)
        self.fc_v = nn.Linear(dim_in, dim_V)
        self.fc_o = nn.Linear(dim_V, dim)

    def fold(self, t):  # [b, n, g·d] -> [b·g, n, d]
        b, n, _ = t.shape
        return t.view(b, n, self.splits, -1).transpose(1, 2).reshape(b * self.splits, n, -1)

    def forward(self, X):
        b = X.shape[0]
        Q = self.fold(self.fc_q(self.S.repeat(b, 1, 1)))
        K, V = self.fold(self.fc_k(X)), self.fold(self.fc_v(X))
        A = torch.softmax(Q.bmm(K.transpose(1, 2)) / math.sqrt(Q.shape[-1]), 2)
        out = A.bmm(V).view(b, self.splits, Q.shape[1], -1).transpose(1, 2).reshape(b, Q.shape[1], -1)
        return self.fc_o(out)


class BertCrossSelfAttention(nn.Module):
    """transformers' BertSelfAttention as a decoder's cross-attention (is_cross_attention: key and value read
    encoder_width; with encoder_hidden_states its encoder_attention_mask is the mask, attention_mask unread)."""

    def __init__(self, hidden_size=32, encoder_width=24, num_attention_heads=4):
        super().__init__()
        self.num_attention_heads, self.attention_head_size = num_attention_heads, hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(encoder_width, hidden_size)
        self.value = nn.Linear(encoder_width, hidden_size)
        self.output = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, x):
        return x.view(*x.size()[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None):
        is_cross_attention = encoder_hidden_states is not None
        source = encoder_hidden_states if is_cross_attention else hidden_states
        if is_cross_attention:
            attention_mask = encoder_attention_mask
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(source))
        value_layer = self.transpose_for_scores(self.value(source))
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        if head_mask is not None:
            probs = probs * head_mask
        context = torch.matmul(probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return self.output(context.view(*context.size()[:-2], -1))


class PlainSelf(nn.Module):
    """One input, no memory, queries from it: self-attention, where --nk is refused."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
