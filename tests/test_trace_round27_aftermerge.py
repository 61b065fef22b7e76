"""`attnscope trace` after the merge of the heads (usertrace/aftermerge.py): the code's own ops from its merged heads
(or its output projection) to what it returns. Before, the line-up ended at the merge: a Set Transformer block whose
`ln0` result was kept under a name nobody read, an `F.relu` called out of place, a BitNet sub-norm or an output gate
computed and dropped, a block's residual added twice, all exited 0 ("every reference step has its equal"), and no
correct module's output was compared end to end. Now the ops after the merge are run again on the reference's merged
tensor and compared with the code's, the return value too (a note says so), and a result made from the merged heads
that reaches nothing returned, or an input added twice on the way, is the difference, said to be after the merge at
the op and line where it first appears, naming no catalog mistake. Styles in tests/trace_styles_round27_aftermerge.py,
each checked here against a float64 formula (F.scaled_dot_product_attention in float64, the norms by their formulas).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import case_ids, passing_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round27_aftermerge.py")
styles = user_module(STYLES)
SOURCE = Path(STYLES).read_text().splitlines()
SCALE = ("--scale", repr(1 / math.sqrt(16)))  # the Set Transformer divides by √dim_V, not √d_head


def _line(text: str) -> int:
    """The line of the styles file that holds `text` (once)."""
    found = [i + 1 for i, line in enumerate(SOURCE) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def _heads(q, k, v, heads, scale=None, residual=False):
    """[B, N, h·d] each, float64: per-head attention by F.scaled_dot_product_attention (k and v may have fewer heads:
    repeated), plus each head's queries where `residual`, merged back to [B, N, h·d]."""
    B = q.shape[0]
    d = q.shape[-1] // heads
    q, k, v = (t.reshape(B, t.shape[1], -1, d).transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale) + (q if residual else 0)
    return out.transpose(1, 2).reshape(B, -1, heads * d)


def _layer_norm(x, ln):
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def _mab(m, x, y):
    o = _heads(m.fc_q(x), m.fc_k(y), m.fc_v(y), m.num_heads, 1 / math.sqrt(m.dim_V), residual=True)
    o = _layer_norm(o, m.ln0) if hasattr(m, "ln0") else o
    o = o + torch.clamp(m.fc_o(o), min=0)
    return _layer_norm(o, m.ln1) if hasattr(m, "ln1") else o


def test_the_styles_compute_their_formulas():
    torch.manual_seed(0)
    x, y = torch.randn(3, 7, 16, dtype=torch.float64), torch.randn(3, 9, 16, dtype=torch.float64)
    for ln in (True, False):
        m = styles.SAB(ln=ln).double()
        torch.testing.assert_close(m(x), _mab(m.mab, x, x))
    m = styles.MAB().double()
    torch.testing.assert_close(m(x, y), _mab(m, x, y))
    b = styles.BitNetAttention().double()
    h = torch.randn(3, 7, 32, dtype=torch.float64)
    merged = _heads(b.q_proj(h), b.k_proj(h), b.v_proj(h), 4)
    normed = merged / torch.sqrt(merged.pow(2).mean(-1, keepdim=True) + 1e-6) * b.attn_sub_norm.weight
    torch.testing.assert_close(b(h), b.o_proj(normed), atol=1e-5, rtol=1e-5)  # the norm runs in float32, as HF's
    g = styles.GatedAttention().double()
    q, k, v = g.to_qkv(h).chunk(3, dim=-1)
    gate = 1 / (1 + torch.exp(-g.to_gate(h)))
    torch.testing.assert_close(g(h), h + g.to_out(_heads(q, k, v, 4) * gate))


CORRECT = [("SAB", "ln=True", SCALE), ("SAB", "ln=False", SCALE), ("MAB", None, (*SCALE, "--nk", "9")),
           ("BitNetAttention", None, ()), ("GatedAttention", None, ())]
# (target, init, options, the user's tensor the difference is shown at, the line it is at)
PLANTS = [("SAB", "bug='ln0_unused'", SCALE, "O_normed", _line("O_normed = self.ln0(O)")),
          ("SAB", "bug='relu_dropped'", SCALE, None, _line("F.relu(H)  #")),
          ("MAB", "bug='relu_dropped'", (*SCALE, "--nk", "9"), None, _line("F.relu(H)  #")),
          ("BitNetAttention", "bug='subnorm_unused'", (), "normed_output", _line("return self.weight * hidden")),
          ("GatedAttention", "bug='gate_unused'", (), "gated", _line("gated = out * gate")),
          ("GatedAttention", "bug='residual_twice'", (), "h", _line("h = h + x"))]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    for target, init, _, _, _ in PLANTS:
        x = torch.randn(2, 7, 32 if target in ("BitNetAttention", "GatedAttention") else 16)
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows above
        good, bad = getattr(styles, target)(), getattr(styles, target)(**kwargs)
        args = (x, x) if target == "MAB" else (x,)
        assert (good(*args) - bad(*args)).abs().max() > 1e-3, (target, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=case_ids(CORRECT))
def test_correct_output_is_compared_end_to_end(runner, target, init, options):
    code, out = run_case(runner, STYLES, target, init, options)
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any("your output is compared end to end" in n for n in notes), notes


@pytest.mark.parametrize(("target", "init", "options", "user", "line"), PLANTS, ids=case_ids(PLANTS))
def test_plants_after_the_merge_are_said_so(runner, target, init, options, user, line):
    code, out = run_case(runner, STYLES, target, init, options)
    found = out["first_divergence"]
    assert code == 1 and found is not None, out
    assert found["experiment"] is None and "after the merge" in found["diagnosis"], found
    assert found["line"] == line and (user is None or found["user"] == user), found
    assert all(row["status"] in ("equal", "permuted") for row in out["alignment"]), out["alignment"]
