"""`attnscope trace` where the code's own scale carries a factor, and where keys and values are swapped before RoPE
(round 27b's HF DeBERTa-v2 and Pixtral). DeBERTa divides every part of its scores by √(3 · d_head) (scale_factor = 1 +
c2p + p2c); a plant dividing by √(3 · d_model) was named scale.other ("0.102062 is no size of the run: pass --scale
0.102062"), advice that hides the bug. Now the factor the reference's own scale carries (1/√(k · d_head): DeBERTa's
spread scale, a declared query_pre_attn_scalar = k · d_head, --scale) carries over to the sizes a mistake puts in
d_head's place (scale.d_model, scale.n, scale.d_head), and the line-up under the spread scale is kept where it names
such a size. Pixtral's k_proj and v_proj exchanged before its 2-D RoPE ended with "none of the usual causes fits": its
angle table, read from the rotated keys, was looked for on a rotation of the key projection only; now the rotated
keys may be the value projection's (ropefreqs.angles_from), and kv.swapped's rerun rotates the values as keys. Styles
of our own (tests/trace_styles_round27_scalekv.py), each checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_scalekv.py")
styles = user_module(STYLES)
KSCALE = ("--scale", repr(32 ** -0.5))  # KScaled's (d_head · k)^-0.5, d_head = 16, k = 2


def _heads(t, h):
    b, n, c = t.shape
    return t.view(b, n, h, c // h).transpose(1, 2)


def _rotated(t, cos, sin):
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    m = styles.DisentangledBlock().double()
    q, k, v = (_heads(p(x), 4) for p in (m.query_proj, m.key_proj, m.value_proj))
    rel = m.rel_embeddings
    pos_k, pos_q = (_heads(p(rel)[None], 4)[0] for p in (m.key_proj, m.query_proj))  # [H, 2span, d]
    i = torch.arange(8)
    index = (i[:, None] - i[None, :] + m.span).clamp(0, 2 * m.span - 1)  # [n, n]
    c2p = torch.einsum("bhid,hijd->bhij", q, pos_k[:, index])  # q_i · pos_k[i - j]
    p2c = torch.einsum("bhjd,hijd->bhij", k, pos_q[:, index])  # k_j · pos_q[i - j]
    scale = (3 * 8) ** -0.5
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=(c2p + p2c) * scale, scale=scale)
    torch.testing.assert_close(m(x), want.transpose(1, 2).reshape(2, 8, 32))
    m = styles.PreAttnScalar().double()
    q, k, v = (_heads(p(x), 4) for p in (m.q_proj, m.k_proj, m.v_proj))
    want = F.scaled_dot_product_attention(q, k, v, scale=(3 * 8) ** -0.5).transpose(1, 2).reshape(2, 8, 32)
    torch.testing.assert_close(m(x), m.o_proj(want))
    m = styles.KScaled().double()
    q, k, v = (_heads(t, 2) for t in m.qkv(x).split(32, dim=-1))
    want = F.scaled_dot_product_attention(q, k, v, scale=(2 * 16) ** -0.5).transpose(1, 2).reshape(2, 8, 32)
    torch.testing.assert_close(m(x), m.out(want))
    m = styles.GridBlock().double()
    freqs = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)  # row: freqs 0, 2; column: freqs 1, 3
    row, col = (i // 4).double(), (i % 4).double()
    half = torch.stack([row * freqs[0], row * freqs[2], col * freqs[1], col * freqs[3]], dim=-1)
    angles = torch.cat((half, half), dim=-1)
    q, k, v = (_heads(p(x), 4) for p in (m.attention.q_proj, m.attention.k_proj, m.attention.v_proj))
    q, k = (_rotated(t, angles.cos(), angles.sin()) for t in (q, k))
    want = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 8, 32)
    torch.testing.assert_close(m(x), m.attention.o_proj(want))
    m = styles.LlamaLike().double()
    angles = torch.outer(i.double(), freqs)
    angles = torch.cat((angles, angles), dim=-1)
    q, k, v = (_heads(p(x), 4) for p in (m.q_proj, m.k_proj, m.v_proj))
    q, k = (_rotated(t, angles.cos(), angles.sin()) for t in (q, k))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 32)
    torch.testing.assert_close(m(x), m.o_proj(want))


CORRECT = [("DisentangledBlock", None, ()), ("PreAttnScalar", None, ()), ("KScaled", None, KSCALE),
           ("GridBlock", None, ("--nq", "8")), ("LlamaLike", None, ("--rope", "--causal"))]
PLANTS = [("DisentangledBlock", "bug='scale_hidden'", (), "scale.d_model"),
          ("PreAttnScalar", "bug='scale_hidden'", (), "scale.d_model"),
          ("KScaled", "bug='scale_hidden'", KSCALE, "scale.d_model"),
          ("GridBlock", "bug='kv_swapped'", ("--nq", "8"), "kv.swapped"),
          ("LlamaLike", "bug='kv_swapped'", ("--rope", "--causal"), "kv.swapped")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    for name, init, _, _ in PLANTS:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows' own literals
        good, bad = styles.__dict__[name](), styles.__dict__[name](**kwargs)
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_factor_is_said_with_the_size_in_d_heads_place(runner):
    code, out = run_case(runner, STYLES, "DisentangledBlock", "bug='scale_hidden'")
    said = " ".join(out["first_divergence"]["diagnosis"].split())
    assert code == 1 and "√(3·d_model)" in said and "--scale" not in said, said
    assert "1/√(3·d_head)" in said, said  # the code's own scale, not 1/√d_head
