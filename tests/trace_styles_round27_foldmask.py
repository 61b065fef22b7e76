"""Attention that folds its heads into the batch (`[n_batch·n_head, n, d_head]`, bmm scores) and takes its mask in a
shape of its own: a bmm-era HF attention (ProphetNet's, BART's before SDPA) whose own assert asks for an additive
`attention_mask` `[n_batch·n_head, 1, src_len]`; a fairseq-MultiheadAttention-like one, time-first, an additive
`attn_mask [tgt, src]` beside a `key_padding_mask [bsz, src]` (1 = pad, its docstring says); a diffusers-like
Attention + AttnProcessor handed the mask as prepare_attention_mask makes it, an additive `[n_batch·n_head, 1, n_K]`
fed to `baddbmm` (with or without a shape check of its own); a Set-Transformer-like MAB that folds the heads the other
way (`torch.cat(Q.split(dim_split, 2), 0)`: row head·batch + b), its additive mask laid so. Plants: the mask added
on the queries' axis, added (or applied) after the softmax, its polarity read the other way round.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def _trained(module: nn.Module) -> nn.Module:
    return trained(module, 27)


class BmmAttention(nn.Module):
    """HF ProphetNet's / BART's bmm attention: the queries scaled by head_dim**-0.5, heads folded into the batch by
    `_shape(..).view(bsz * num_heads, -1, head_dim)`, an additive mask it asserts is [bsz·num_heads, 1, src_len]."""

    def __init__(self, hidden_size=24, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, layer_head_mask=None,
                output_attentions=False):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        source = hidden_states if key_value_states is None else key_value_states
        key_states = self._shape(self.k_proj(source), -1, bsz)
        value_states = self._shape(self.v_proj(source), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        assert attention_mask is None or attention_mask.size() == (self.num_heads * bsz, 1, src_len), (
            f"`attention_mask` should be of size {(bsz * self.num_heads, 1, src_len)}, but is {attention_mask.shape}")
        if attention_mask is not None:
            if self.bug == "mask_on_queries":  # [bsz·heads, src_len, 1]: the padding laid on the queries
                attn_weights = attn_weights + attention_mask.transpose(1, 2)
            elif self.bug != "mask_after_softmax":
                attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        if attention_mask is not None and self.bug == "mask_after_softmax":
            attn_weights = attn_weights + attention_mask
        if layer_head_mask is not None:
            attn_weights = (layer_head_mask.view(1, -1, 1, 1) * attn_weights.view(
                bsz, self.num_heads, tgt_len, src_len)).view(bsz * self.num_heads, tgt_len, src_len)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim))
        return attn_output, (attn_weights if output_attentions else None)


class FairseqMultihead(nn.Module):
    """fairseq's MultiheadAttention, time-first [T, B, C]: heads folded by `view(T, bsz * heads, d).transpose(0, 1)`.

    Args:
        key_padding_mask (ByteTensor, optional): mask to exclude keys that are pads, of shape `(batch, src_len)`,
            where padding elements are indicated by 1s.
        attn_mask (FloatTensor, optional): additive mask of shape `(tgt_len, src_len)` that prevents attention to
            certain positions.
    """

    def __init__(self, embed_dim=24, num_heads=4, bug=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.bug = embed_dim, num_heads, bug
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _trained(self)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(key), self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == bsz
            assert key_padding_mask.size(1) == src_len
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        padded = None
        if key_padding_mask is not None:
            padded = key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool)
            if self.bug == "polarity":
                padded = ~padded
            if self.bug != "probs_masked":
                attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
                attn_weights = attn_weights.masked_fill(padded, float("-inf"))
                attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        if padded is not None and self.bug == "probs_masked":  # the padding zeroed after the softmax
            attn_probs = attn_probs.view(bsz, self.num_heads, tgt_len, src_len).masked_fill(padded, 0.0)
            attn_probs = attn_probs.view(bsz * self.num_heads, tgt_len, src_len)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        weights = attn_probs.view(bsz, self.num_heads, tgt_len, src_len).mean(dim=1) if need_weights else None
        return attn, weights


class FoldedProcessorAttention(nn.Module):
    """diffusers' Attention with AttnProcessor: head_to_batch_dim, `baddbmm(attention_mask, q, kᵀ, beta=1,
    alpha=scale)`, the mask an additive [batch·heads, 1, key_tokens] as prepare_attention_mask hands it on; with
    `checked`, the shape checked first (a ValueError naming the shape it wants)."""

    def __init__(self, query_dim=24, heads=4, dim_head=6, checked=False, bug=None):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads, self.scale, self.checked, self.bug = heads, dim_head ** -0.5, checked, bug
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(0.0)])
        _trained(self)

    def head_to_batch_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len, self.heads, dim // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(batch_size * self.heads, seq_len, dim // self.heads)

    def batch_to_head_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // self.heads, self.heads, seq_len, dim)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size // self.heads, seq_len, dim * self.heads)

    def get_attention_scores(self, query, key, attention_mask=None):
        if attention_mask is None or self.bug == "mask_after_softmax":
            baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype)
            beta = 0
        else:
            baddbmm_input = attention_mask.transpose(-1, -2) if self.bug == "mask_on_queries" else attention_mask
            beta = 1
        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=self.scale)
        attention_probs = attention_scores.softmax(dim=-1)
        if attention_mask is not None and self.bug == "mask_after_softmax":
            attention_probs = attention_probs + attention_mask
        return attention_probs

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch_size, key_tokens, _ = (hidden_states if encoder_hidden_states is None else encoder_hidden_states).shape
        if attention_mask is not None and self.checked and attention_mask.shape != (batch_size * self.heads, 1,
                                                                                     key_tokens):
            raise ValueError(f"attention_mask should be ({batch_size * self.heads}, 1, {key_tokens}), "
                             f"got {tuple(attention_mask.shape)}")
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = self.head_to_batch_dim(self.to_q(hidden_states))
        key = self.head_to_batch_dim(self.to_k(encoder_hidden_states))
        value = self.head_to_batch_dim(self.to_v(encoder_hidden_states))
        attention_probs = self.get_attention_scores(query, key, attention_mask)
        hidden_states = self.batch_to_head_dim(torch.bmm(attention_probs, value))
        return self.to_out[1](self.to_out[0](hidden_states))


class MaskedSetAttention(nn.Module):
    """Set Transformer's MAB (Lee et al. 2019) with a key mask: heads folded by split and cat, head-major
    (`torch.cat(Q.split(dim_split, 2), 0)`), scores divided by √dim_V, the additive mask [heads·batch, 1, N] laid as
    that fold lays its rows, `O = Q_ + A·V_` head by head, then `O + relu(fc_o(O))`."""

    def __init__(self, dim_Q=24, dim_K=24, dim_V=24, num_heads=4, bug=None):
        super().__init__()
        self.dim_V, self.num_heads, self.bug = dim_V, num_heads, bug
        self.fc_q, self.fc_k, self.fc_v = nn.Linear(dim_Q, dim_V), nn.Linear(dim_K, dim_V), nn.Linear(dim_K, dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)
        _trained(self)

    def forward(self, Q, mask=None):
        Q, K, V = self.fc_q(Q), self.fc_k(Q), self.fc_v(Q)
        dim_split = self.dim_V // self.num_heads
        Q_, K_, V_ = (torch.cat(t.split(dim_split, 2), 0) for t in (Q, K, V))
        logits = Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V)
        if mask is not None and self.bug != "mask_after_softmax":
            logits = logits + (mask.transpose(1, 2) if self.bug == "mask_on_queries" else mask)
        A = torch.softmax(logits, 2)
        if mask is not None and self.bug == "mask_after_softmax":
            A = A + mask
        out = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        return out + F.relu(self.fc_o(out))
