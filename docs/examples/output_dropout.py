"""A GPT-2-like attention with dropout on its output, after the output projection (docs/trace.md, "Dropout in
training mode"). `bug='on'` calls F.dropout without `training=`, so it drops in eval() mode too:

    attnscope trace docs/examples/output_dropout.py:ResidDropout --init "bug='on'" --causal
"""

import torch.nn as nn
import torch.nn.functional as F


class ResidDropout(nn.Module):
    def __init__(self, n_embd=32, n_head=4, resid_pdrop=0.1, bug=None):
        super().__init__()
        self.n_head, self.resid_pdrop, self.bug = n_head, resid_pdrop, bug
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        y = self.c_proj(y)
        if self.bug == "on":
            return F.dropout(y, self.resid_pdrop)  # training= left out: True
        return F.dropout(y, self.resid_pdrop, self.training)
