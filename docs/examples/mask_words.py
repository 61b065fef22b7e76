"""Words, switches and data flow that each say something of a mask (docs/trace.md, "A mask whose polarity the code's
words say" and "A causal switch of your code's own"): the TensorFlow tutorial's attention ported as it is (its mask
added as `mask * -1e9`, no words), an encoder whose softmax helper takes the padding turned round, and a fairseq-like
layer with key padding beside a causal switch of its own."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class TfTutorialMHA(nn.Module):
    def __init__(self, d_model=32, num_heads=4):
        super().__init__()
        self.num_heads, self.depth = num_heads, d_model // num_heads
        self.wq, self.wk, self.wv = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def split_heads(self, x, batch_size):
        return x.view(batch_size, -1, self.num_heads, self.depth).permute(0, 2, 1, 3)  # [b, h, n, depth]

    def forward(self, x, mask=None):
        batch_size = x.shape[0]
        q, k, v = (self.split_heads(w(x), batch_size) for w in (self.wq, self.wk, self.wv))
        logits = q @ k.transpose(-1, -2) / math.sqrt(self.depth)  # [b, h, n_Q, n_K]
        if mask is not None:
            logits += mask * -1e9
        out = (torch.softmax(logits, dim=-1) @ v).permute(0, 2, 1, 3)  # [b, n, h, depth]
        return self.dense(out.reshape(batch_size, -1, self.num_heads * self.depth))


def masked_softmax(scores, pad):
    """pad: bool, True = masked out."""
    return scores.masked_fill(pad, float("-inf")).softmax(dim=-1)


class EncoderHelper(nn.Module):
    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x, attention_mask=None):
        """attention_mask: 1 for tokens that are not masked, 0 for tokens that are masked."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [b, h, n, d_head]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [b, h, n_Q, n_K]
        pad = attention_mask == (1 if self.bug == "polarity" else 0)
        return self.out((masked_softmax(scores, pad) @ v).transpose(1, 2).reshape(b, n, d))


class PaddedCausal(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, key_padding_mask=None, is_causal=False):
        b, n, d = x.shape
        q, k, v = self.in_proj(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [b, h, n, d_head]
        keep = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]  # [b, 1, 1, n_K]
        if is_causal:
            ahead = torch.ones(n, n, dtype=torch.bool).triu(1)
            keep = ~ahead if keep is None else keep & ~ahead
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # [b, h, n, d_head]
        return self.out_proj(y.transpose(1, 2).reshape(b, n, d))
