"""ALiBi's bias handed in by the model, as a forward argument (docs/trace.md, "Biases, qk-norm and the scale"):
`attnscope trace --alibi` hands it the reference's ALiBi in the layout the code reads.

    attnscope trace docs/examples/alibi_args.py:BloomAlibi --causal --alibi   # alibi [n_batch·n_head, 1, n_K]
    attnscope trace docs/examples/alibi_args.py:MptAlibi --causal --alibi     # position_bias [n_head, 1, n_K]
    attnscope trace docs/examples/alibi_args.py:BloomAlibi --causal           # exit 2: pass --alibi
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BloomAlibi(nn.Module):
    """BLOOM's: alibi [n_batch·n_head, 1, n_K] (build_alibi_tensor: slopes · j), the scores alibi.baddbmm(q, kᵀ)."""

    def __init__(self, hidden=32, n_head=4):
        super().__init__()
        self.h, self.d = n_head, hidden // n_head
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, alibi, attention_mask):
        b, n, c = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        q, k, v = (t.reshape(b * self.h, n, self.d) for t in (q, k, v))
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(self.d))
        probs = F.softmax(scores.view(b, self.h, n, n) + attention_mask, dim=-1)
        out = torch.bmm(probs.view(b * self.h, n, n), v).view(b, self.h, n, self.d).transpose(1, 2)
        return self.dense(out.reshape(b, n, c))


class MptAlibi(nn.Module):
    """transformers' MPT: position_bias [n_head, 1, n_K] (build_mpt_alibi_tensor), sliced and added."""

    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.h, self.d = n_heads, d_model // n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states, position_bias, attention_mask=None):
        b, n, c = hidden_states.shape
        q, k, v = (t.view(b, n, self.h, self.d).transpose(1, 2) for t in self.Wqkv(hidden_states).chunk(3, dim=2))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        scores = scores + position_bias[:, :, -k.shape[-2]:]
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, torch.finfo(q.dtype).min)
        out = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.out_proj(out)
