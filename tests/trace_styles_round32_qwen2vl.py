"""Qwen2-VL's vision-tower attention as transformers 4.45 wrote it (models/qwen2_vl/modeling_qwen2_vl.py,
VisionAttention): no batch axis ([seq, dim]), a fused qkv reshaped (seq, 3, heads, -1).permute(1, 0, 2, 3), the
rotary angles handed in as `rotary_pos_emb` [seq, head_dim / 2] (its apply_rotary_pos_emb_vision takes their cos
and sin, repeated over the two halves, and turns the halves: rotate_half), one block of the additive mask per image
from `cu_seqlens`, scores / √head_dim, a float32 softmax, proj. `bug='keys_unturned'`: the keys never rotated."""

import math

import torch
from torch import nn


def apply_rotary_pos_emb_vision(tensor: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    orig_dtype = tensor.dtype
    tensor = tensor.float()
    cos = freqs.cos().unsqueeze(1).repeat(1, 1, 2).unsqueeze(0).float()
    sin = freqs.sin().unsqueeze(1).repeat(1, 1, 2).unsqueeze(0).float()
    x1, x2 = tensor[..., : tensor.shape[-1] // 2], tensor[..., tensor.shape[-1] // 2:]
    return ((tensor * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).to(orig_dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int = 64, num_heads: int = 4, bug: str = "") -> None:
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        g = torch.Generator().manual_seed(32)
        with torch.no_grad():  # trained-looking: no zero bias, no initial value left
            for p in self.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                rotary_pos_emb: torch.Tensor = None) -> torch.Tensor:
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q = apply_rotary_pos_emb_vision(q.unsqueeze(0), rotary_pos_emb).squeeze(0)
        if self.bug != "keys_unturned":
            k = apply_rotary_pos_emb_vision(k.unsqueeze(0), rotary_pos_emb).squeeze(0)
        attention_mask = torch.full([1, seq_length, seq_length], torch.finfo(q.dtype).min, dtype=q.dtype)
        for i in range(1, len(cu_seqlens)):
            attention_mask[..., cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = 0
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        attn_weights = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(0, 1).reshape(seq_length, -1)
        return self.proj(attn_output)
