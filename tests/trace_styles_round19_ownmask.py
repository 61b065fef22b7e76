"""Attention that masks by itself beside a mask parameter of its caller's, in the forms real libraries write it (round
19: GPT-Neo's `bias` buffer beside its padding `attention_mask`, a window built from the positions, torch's
nn.MultiheadAttention with the block's own attn_mask), for tests/test_trace_round19_ownmask.py. Each takes
`bug=None`: a planted mistake, which trace names by experiment."""

import math

import torch
import torch.nn as nn


class CodeGenLike(nn.Module):
    """A CodeGen/GPT-J-style layer: one fused qkv_proj, the causal rule a boolean buffer sliced by the key length
    (a local layer's window built into it), `torch.where(causal, w, finfo.min)`, then the caller's additive
    `attention_mask` ([n_batch, 1, 1, n_K] padding in the real model) added."""

    def __init__(self, embed_dim=32, num_heads=4, max_positions=16, window=None, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        causal = torch.ones(max_positions, max_positions, dtype=torch.bool).tril()
        if window is not None and bug != "no_window":
            causal = causal & ~torch.ones(max_positions, max_positions, dtype=torch.bool).tril(-window)
        self.register_buffer("causal_mask", causal[None, None], persistent=False)
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.scale_attn = math.sqrt(self.head_dim)

    def _split(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        b, n, d = hidden_states.shape
        query, key, value = (self._split(t) for t in self.qkv_proj(hidden_states).split(d, dim=-1))
        q_len, k_len = query.size(-2), key.size(-2)
        causal = self.causal_mask[:, :, k_len - q_len:k_len, :k_len]
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.bug == "mask_mult":
            attn_weights = attn_weights * causal
        elif self.bug == "fill_zero":
            attn_weights = attn_weights.masked_fill(~causal, 0.0)
        else:
            attn_weights = torch.where(causal, attn_weights, torch.finfo(attn_weights.dtype).min)
        attn_weights = attn_weights / self.scale_attn
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = attn_weights.softmax(dim=-1)
        out = torch.matmul(attn_weights, value)
        return self.out_proj(out.permute(0, 2, 1, 3).reshape(b, n, d))


class WindowFromPositions(nn.Module):
    """A decoder layer that builds its own sliding window from the positions (the queries after the cached keys:
    `past + arange(n)`), ANDs in the caller's key padding (`padding_mask` [n_batch, n_K], True = padded) and hands
    the boolean to F.scaled_dot_product_attention; a decode step's cache is the tuple (keys, values)."""

    def __init__(self, dim=32, n_heads=4, window=3, bug=None):
        super().__init__()
        self.n_heads, self.window, self.bug = n_heads, window, bug
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x, padding_mask=None, past_key_value=None):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.n_heads, -1).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        past = 0
        if past_key_value is not None:
            past = past_key_value[0].shape[-2]
            k = torch.cat([past_key_value[0], k], dim=-2)
            v = torch.cat([past_key_value[1], v], dim=-2)
        keys = torch.arange(k.shape[-2])[None, :]
        queries = torch.arange(n)[:, None] if self.bug == "upper_left" else past + torch.arange(n)[:, None]
        allowed = keys <= queries
        if self.bug != "no_window":
            allowed = allowed & (queries - keys < self.window)
        if padding_mask is not None:
            allowed = allowed[None, None] & ~padding_mask[:, None, None, :]
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.wo(out.transpose(1, 2).reshape(b, n, d))


class LibraryMHA(nn.Module):
    """A causal block over torch's nn.MultiheadAttention (batch_first), its attn_mask made by the block: float, as
    nn.Transformer.generate_square_subsequent_mask makes it (-inf above the diagonal), or boolean, True = not
    allowed; the caller's key_padding_mask handed on."""

    def __init__(self, d_model=32, nhead=4, boolean=False, bug=None):
        super().__init__()
        self.boolean, self.bug = boolean, bug
        self.self_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)

    def forward(self, src, key_padding_mask=None):
        n = src.shape[1]
        if self.boolean:
            keep = torch.ones(n, n, dtype=torch.bool).tril()
            attn_mask = keep if self.bug == "inverted" else ~keep
        else:
            attn_mask = torch.full((n, n), float("-inf"), dtype=src.dtype)
            attn_mask = attn_mask.tril() if self.bug == "inverted" else attn_mask.triu(1)
        out, _ = self.self_attn(src, src, src, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                need_weights=False)
        return out


class RelativeTableMasked(nn.Module):
    """Music Transformer's relative global attention (Huang et al.): q · Eᵀ of a learned table of relative distances,
    multiplied by a 0/1 mask of the positions (no pair before the sequence) and skewed into [n_Q, n_K], added to the
    scores; the causal rule is the caller's `mask` (True = may attend). The mask multiplied in is the relative term's,
    not the scores': no mask of its own over the attention."""

    def __init__(self, d=32, h=4, max_seq=16, bug=None):
        super().__init__()
        self.h, self.dh, self.max_seq, self.bug = h, d // h, max_seq, bug
        self.Wq, self.Wk, self.Wv, self.fc = (nn.Linear(d, d) for _ in range(4))
        self.E = nn.Parameter(torch.randn(max_seq, d // h) * 0.3)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (p(x).reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for p in (self.Wq, self.Wk, self.Wv))
        e = self.E[max(0, self.max_seq - n):, :]
        qe = torch.einsum("bhld,md->bhlm", q, e)
        keep = torch.arange(n)[None, :] >= (n - 1 - torch.arange(n))[:, None]  # pairs of real distances
        qe = keep.to(qe.dtype) * qe
        padded = nn.functional.pad(qe, [1, 0])  # skewing: [.., n, n + 1] read as [.., n + 1, n], first row dropped
        srel = padded.reshape(b, self.h, n + 1, n)[:, :, 1:, :]
        logits = (q @ k.transpose(-1, -2) + srel) / math.sqrt(self.dh)
        if mask is not None:
            logits = logits.masked_fill(~mask, -1e9)
        weights = logits.softmax(-1 if self.bug != "axis" else -2)
        return self.fc((weights @ v).permute(0, 2, 1, 3).reshape(b, n, -1))
