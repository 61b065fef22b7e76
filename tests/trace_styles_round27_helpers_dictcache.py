"""Round 27's decode caches kept as dicts keyed the code's own way, the length of the cache under a key whose name
says nothing of a length: an XLM-like layer (`{"cur_len": n, self.layer_id: (k, v)}`, the length added to the
query positions of the causal mask it builds), a fairseq-like layer (`incremental_state[self._state_key]` a dict of
its own, `{"prev_key": [b, h, n, d], "prev_value": ...}`, heads folded into the batch, an additive `attn_mask`
[n_Q, n_K]), and a layer whose whole cache is one dict `{"k": .., "v": .., <length key>: n}`, the length key a name
of the caller's choosing (`t`, `n_past`, `pos`, `idx`), compared with the key positions. Plants: the cache joined
after the new keys, the length not advanced (the queries placed from position 0)."""

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values, as a trained model's are."""
    g = torch.Generator().manual_seed(127)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) + 0.01)
    return module


class XlmLikeLayer(nn.Module):
    """XLM's MultiHeadAttention habit: `cache["cur_len"]` cached positions, the layer's (k, v) [bs, heads, n, d]
    under its own `layer_id`, written back; the causal mask built from the query positions, cur_len on."""

    NEW_ID = itertools.count()

    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.layer_id = next(XlmLikeLayer.NEW_ID)
        self.dim, self.n_heads, self.bug = dim, n_heads, bug
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self)

    def forward(self, input, cache=None):
        bs, qlen, dim = input.size()
        start = 0 if cache is None else cache["cur_len"]
        klen = start + qlen
        dim_per_head = dim // self.n_heads

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        q = shape(self.q_lin(input)) / math.sqrt(dim_per_head)
        k, v = shape(self.k_lin(input)), shape(self.v_lin(input))
        if cache is not None:
            if self.layer_id in cache:
                k_, v_ = cache[self.layer_id]
                if self.bug == "cache_order":
                    k, v = torch.cat([k, k_], dim=2), torch.cat([v, v_], dim=2)
                else:
                    k, v = torch.cat([k_, k], dim=2), torch.cat([v_, v], dim=2)
            cache[self.layer_id] = (k, v)
        q_pos = torch.arange(qlen) + (0 if self.bug == "length_not_advanced" else start)
        masked = torch.arange(klen)[None, :] > q_pos[:, None]  # [qlen, klen]
        scores = torch.matmul(q, k.transpose(2, 3)).masked_fill(masked, -float("inf"))
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        context = torch.matmul(weights, v).transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)
        return (self.out_lin(context),)


class FairseqLikeAttention(nn.Module):
    """fairseq MultiheadAttention's incremental decoding, batch-first: the state a dict of its own under the module's
    own key, `{"prev_key": [bsz, heads, n, d], "prev_value": ..}`, read with `in` and `[]`, viewed into the folded
    [bsz·heads, n, d] the scores are taken in, and written back; a key padding mask kept beside them if any."""

    NEW_ID = itertools.count()

    def __init__(self, embed_dim=24, num_heads=3, bug=None):
        super().__init__()
        self._state_key = f"attn_state.{next(FairseqLikeAttention.NEW_ID)}"
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        _trained(self)

    def forward(self, query, attn_mask=None, incremental_state=None):
        bsz, tgt_len, embed_dim = query.size()
        saved_state = None
        if incremental_state is not None and self._state_key in incremental_state:
            saved_state = incremental_state[self._state_key]
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q, k, v = (t.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
                   .reshape(bsz * self.num_heads, -1, self.head_dim) for t in (q, k, v))
        if saved_state is not None:
            if "prev_key" in saved_state:
                prev_key = saved_state["prev_key"].reshape(bsz * self.num_heads, -1, self.head_dim)
                k = torch.cat([k, prev_key], dim=1) if self.bug == "cache_order" else torch.cat([prev_key, k], dim=1)
            if "prev_value" in saved_state:
                prev_value = saved_state["prev_value"].reshape(bsz * self.num_heads, -1, self.head_dim)
                v = torch.cat([v, prev_value], dim=1) if self.bug == "cache_order" else torch.cat([prev_value, v], 1)
            if "prev_key_padding_mask" in saved_state:
                raise ValueError("no key padding in this layer")
        if incremental_state is not None:
            incremental_state[self._state_key] = {
                "prev_key": k.view(bsz, self.num_heads, -1, self.head_dim),
                "prev_value": v.view(bsz, self.num_heads, -1, self.head_dim)}
        attn_weights = torch.bmm(q, k.transpose(1, 2))  # [bsz·heads, tgt_len, src_len]
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.unsqueeze(0)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn), None


class OwnKeyState(nn.Module):
    """A cache of the caller's making: one dict `{"k": [b, h, n, d], "v": .., <length_key>: n}`, the length compared
    with the key positions for its causal mask, the state written back one step on."""

    def __init__(self, width=32, heads=2, length_key="t", bug=None):
        super().__init__()
        self.heads, self.length_key, self.bug = heads, length_key, bug
        self.wqkv = nn.Linear(width, 3 * width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        _trained(self)

    def forward(self, x, cache=None):
        b, n, c = x.shape
        q, k, v = self.wqkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        t = 0
        if cache is not None:
            t = cache[self.length_key]
            if self.bug == "cache_order":
                k, v = torch.cat((k, cache["k"]), dim=2), torch.cat((v, cache["v"]), dim=2)
            else:
                k, v = torch.cat((cache["k"], k), dim=2), torch.cat((cache["v"], v), dim=2)
            cache["k"], cache["v"], cache[self.length_key] = k, v, t + n
        if self.bug == "length_not_advanced":
            t = 0
        query_at = torch.arange(n)[:, None] + t
        keep = torch.arange(k.shape[2])[None, :] <= query_at
        scores = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        out = scores.softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, n, c))
