"""Attention modules that hold Linear layers a run never applies to the merge of the heads, beside q, k and v and no
output projection of their own (or one the run does not call), each correct and with bugs planted the way people make
them:

- `EntityAwareSelfAttention`: HF LUKE's `LukeSelfAttention` with words only: `query`, `key`, `value` and the
  entity-aware `w2e_query`, `e2w_query`, `e2e_query`, the latter held and called only where entities are given;
  an additive key-padding mask [n_batch, 1, 1, n_K]; the merged heads returned as (words, entities). No output
  projection (its dense lives in the next module, as BertSelfOutput's).
- `FlaggedOutAttention`: a fused-kernel style `q_proj`, `k_proj`, `v_proj` and an `out_proj` called only where
  `project_out` is set (off here, as in an encoder that returns the merge to a block that projects it).
- `InputGatedAttention`: `query`, `key`, `value` and a `gate` Linear applied to the INPUT after the attention is
  computed (`merged * sigmoid(gate(x))`), never to the merge; no output projection.

Plants (`bug=`): `scale_d_model` (divided by √d_model), `split_no_permute` (heads viewed straight as [b, h, n, d]),
`mask_on_queries` (the key-padding mask laid on the query rows). Every weight is moved off its initial value.
"""

import math

import torch
import torch.nn as nn


def _trained(module: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(41)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


class _Heads(nn.Module):
    """The shared frame: split, scale, mask, softmax, merge, with the plants."""

    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, hidden_size // num_heads, bug
        self.hidden_size = hidden_size

    def split(self, x):
        b, n, _ = x.shape
        if self.bug == "split_no_permute":
            return x.view(b, self.num_heads, n, self.head_dim)
        return x.view(b, n, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def attend(self, q, k, v, attention_mask):
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.hidden_size if self.bug == "scale_d_model" else self.head_dim)
        if attention_mask is not None:
            scores = scores + (attention_mask.transpose(-1, -2) if self.bug == "mask_on_queries" else attention_mask)
        probs = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), self.hidden_size)


class EntityAwareSelfAttention(_Heads):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__(hidden_size, num_heads, bug)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.w2e_query = nn.Linear(hidden_size, hidden_size)
        self.e2w_query = nn.Linear(hidden_size, hidden_size)
        self.e2e_query = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def forward(self, word_hidden_states, attention_mask=None, entity_hidden_states=None):
        if entity_hidden_states is not None:  # the entity-aware queries: not in a words-only run
            hidden = torch.cat([word_hidden_states, entity_hidden_states], dim=1)
            extra = self.w2e_query(word_hidden_states) + self.e2w_query(word_hidden_states)
            hidden = hidden + self.e2e_query(hidden) + extra.mean()
        else:
            hidden = word_hidden_states
        key_layer = self.split(self.key(hidden))
        value_layer = self.split(self.value(hidden))
        query_layer = self.split(self.query(hidden))
        context = self.attend(query_layer, key_layer, value_layer, attention_mask)
        words = context[:, :word_hidden_states.size(1), :]
        return words, (None if entity_hidden_states is None else context[:, word_hidden_states.size(1):, :])


class FlaggedOutAttention(_Heads):
    def __init__(self, hidden_size=32, num_heads=4, project_out=False, bug=None):
        super().__init__(hidden_size, num_heads, bug)
        self.project_out = project_out
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = (self.split(proj(hidden_states)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        merged = self.attend(q, k, v, attention_mask)
        return self.out_proj(merged) if self.project_out else merged


class InputGatedAttention(_Heads):
    def __init__(self, hidden_size=32, num_heads=4, bug=None):
        super().__init__(hidden_size, num_heads, bug)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.gate = nn.Linear(hidden_size, hidden_size)
        _trained(self)

    def forward(self, x, attention_mask=None):
        merged = self.attend(self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x)),
                             attention_mask)
        gate = torch.sigmoid(self.gate(x))  # from the input, after the attention: never applied to the merge
        return merged * gate
