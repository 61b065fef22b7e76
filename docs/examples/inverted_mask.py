"""ChatGLM2's core attention in batch-first form (docs/trace.md, "Masks in every convention"): the mask, True = masked
out, inverted on its way into F.scaled_dot_product_attention. `bug='polarity'` leaves the `~` out, against the
docstring's words:

    attnscope trace docs/examples/inverted_mask.py:InvertedMask --causal
    attnscope trace docs/examples/inverted_mask.py:InvertedMask --init "bug='polarity'" --causal
"""

import torch.nn as nn
import torch.nn.functional as F


class InvertedMask(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        """attention_mask: bool [b, 1, sq, sk], True = masked out."""
        b, n, d = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(b, n, 3, self.num_heads, d // self.num_heads)
        q, k, v = mixed.permute(2, 0, 3, 1, 4)  # each [b, h, n, d_head]
        if self.bug != "polarity":
            attention_mask = ~attention_mask
        context = F.scaled_dot_product_attention(q, k, v, attention_mask)  # [b, h, n, d_head]
        return self.dense(context.transpose(1, 2).reshape(b, n, d))
