"""Attention whose projections no reference of four Linear layers holds. docs/trace.md traces them:

    attnscope trace docs/examples/joint_attention.py:JointAttention --nk 5
    attnscope trace docs/examples/joint_attention.py:ParallelBlock --causal
    attnscope trace docs/examples/joint_attention.py:CogJoint --nk 5
    attnscope trace docs/examples/joint_attention.py:NormedJoint --nk 5 --init "bug='context_kv_swapped'"

- JointAttention: SD3's MMDiT joint attention, as diffusers' JointAttnProcessor2_0 writes it (shortened): the
  sample's and the context's streams, each with its own q/k/v projections and output projection, joined along the
  tokens for one F.scaled_dot_product_attention and split back.
- ParallelBlock: a parallel block (PaLM, GPT-J) without its residual: one Linear writes q, k, v and the MLP's input,
  one Linear reads the merged heads beside the MLP's activation.
- CogJoint: CogVideoX's joint attention: the text's and the video's tokens joined before shared projections.
- NormedJoint: SD3.5's, a qk-norm per stream, with a mistake of one stream's own to plant.
"""
import torch
import torch.nn.functional as F
from torch import nn


class JointAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out, self.to_add_out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states=None):
        b, n, d = hidden_states.shape
        query, key, value = (p(hidden_states).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                             for p in (self.to_q, self.to_k, self.to_v))
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = (
                p(encoder_hidden_states).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
            query = torch.cat([query, c_query], dim=2)
            key = torch.cat([key, c_key], dim=2)
            value = torch.cat([value, c_value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value)
        out = out.transpose(1, 2).reshape(b, -1, d)
        if encoder_hidden_states is None:
            return self.to_out(out)
        return self.to_out(out[:, :n]), self.to_add_out(out[:, n:])


class ParallelBlock(nn.Module):
    def __init__(self, d_model=32, n_head=4, d_ff=64):
        super().__init__()
        self.n_head, self.d_ff = n_head, d_ff
        self.w_in = nn.Linear(d_model, 3 * d_model + d_ff, bias=False)
        self.w_out = nn.Linear(d_model + d_ff, d_model, bias=False)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v, h = self.w_in(x).split([d, d, d, self.d_ff], dim=-1)
        q, k, v = (t.view(b, n, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, n, d)
        return self.w_out(torch.cat([out, F.gelu(h)], dim=-1))


class CogJoint(nn.Module):
    """CogVideoX's joint attention, shortened: the text's and the video's tokens joined before shared projections."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states):
        text_seq_length = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        b, n, d = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        out = self.to_out(out)
        return out[:, text_seq_length:], out[:, :text_seq_length]


class NormedJoint(nn.Module):
    """SD3.5's joint attention with a qk-norm per stream (nn.RMSNorm over each head), the context's tokens first.
    `bug='context_k_unnormed'` leaves the context's key norm out, `bug='context_kv_swapped'` joins the context's values
    as its keys and its keys as its values."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim // heads, eps=1e-6), nn.RMSNorm(dim // heads, eps=1e-6)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(dim // heads, eps=1e-6), nn.RMSNorm(dim // heads, eps=1e-6)
        self.to_out, self.to_add_out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states):
        b, n, d = hidden_states.shape
        query, key, value = (p(hidden_states).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                             for p in (self.to_q, self.to_k, self.to_v))
        query, key = self.norm_q(query), self.norm_k(key)
        c_query, c_key, c_value = (p(encoder_hidden_states).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                                   for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        c_query = self.norm_added_q(c_query)
        if self.bug != "context_k_unnormed":
            c_key = self.norm_added_k(c_key)
        if self.bug == "context_kv_swapped":
            c_key, c_value = c_value, c_key
        query = torch.cat([c_query, query], dim=2)
        key = torch.cat([c_key, key], dim=2)
        value = torch.cat([c_value, value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value).transpose(1, 2).reshape(b, -1, d)
        m = encoder_hidden_states.shape[1]
        return self.to_out(out[:, m:]), self.to_add_out(out[:, :m])
