"""RoPE's pair handed in one argument annotated as one tensor (transformers' Gemma 3: `position_embeddings:
torch.Tensor = None`, then `cos, sin = position_embeddings`): the annotation made it a position embedding added to
the input, trace fed it one tensor, and the code raised on the unpacking. The code's own unpacking says it is a pair
(pairparams.unpacked_in_two), so under --rope it gets RoPE's (cos, sin). Checked first against a float64 formula
(rotate_half RoPE, then SDPA)."""

from __future__ import annotations

import textwrap

import torch
import torch.nn.functional as F
from tracecases import assert_named, assert_passes, run_case

STYLE = """
import torch
from torch import nn
import torch.nn.functional as F


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class PairAnnotated(nn.Module):
    def __init__(self, dim=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.d, self.bug = n_head, dim // n_head, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g))

    def forward(self, hidden_states, position_embeddings: torch.Tensor = None):
        b, n, c = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.n_head, self.d).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        if self.bug != "k_unrotated":
            k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c))
"""


def _tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat((angles, angles), -1)[None]
    return emb.cos(), emb.sin()


def test_a_pair_annotated_as_one_tensor_gets_ropes_tables(runner, tmp_path):
    path = tmp_path / "pair_annotated.py"
    path.write_text(textwrap.dedent(STYLE))
    from test_trace_command import user_module

    m = user_module(str(path)).PairAnnotated().double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    cos, sin = _tables(6, 8)
    heads = [p(x).view(2, 6, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj)]
    turned = []
    for t in heads[:2]:  # rotation by complex numbers over the half-split pairs (i, i + d/2)
        z = torch.complex(t[..., :4], t[..., 4:]) * torch.polar(torch.ones_like(cos[..., :4]), torch.atan2(
            sin[..., :4], cos[..., :4]))[:, None]
        turned.append(torch.cat((z.real, z.imag), -1))
    want = m.o_proj(F.scaled_dot_product_attention(turned[0], turned[1], heads[2], is_causal=True)
                    .transpose(1, 2).reshape(2, 6, 32))
    assert torch.allclose(m(x, (cos, sin)), want, atol=1e-10)
    code, out = run_case(runner, str(path), "PairAnnotated", None, ("--rope", "--causal"))
    assert_passes(code, out)
    code, out = run_case(runner, str(path), "PairAnnotated", "bug='k_unrotated'", ("--rope", "--causal"))
    assert_named(code, out, "rope.not_applied")


def test_transformers_own_gemma3_attention_in_its_file(runner):
    import transformers.models.gemma3.modeling_gemma3 as gemma3

    code, out = run_case(runner, gemma3.__file__, "Gemma3Attention",
                         "config=Gemma3TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, "
                         "head_dim=8), layer_idx=0", ("--rope", "--causal"))
    assert_passes(code, out)
