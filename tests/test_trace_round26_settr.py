"""`attnscope trace` on Set-Transformer-like blocks (round 26's settransformer): the queries added back to the
attention's output head by head (`O = Q_ + A·V_`, usertrace/outterm.py), then LayerNorms of the code's own around an
rFF residual. With `ln=True` the norm between the merge and the rFF's Linear was no op trace read: correct code was
a false alarm at x, and its plants were named by no experiment. Now the term's add is held by the reference and the
ops after the merge are read as the code's own (usertrace/outops.py), compared up to the merge. A plant that folds
the heads into the batch by a straight reshape (batch-major) while the merge reads them head-major is
heads.split_without_permute: the term is read off the data flow as the queries the scores read, and the rerun adds
its own. Styles of our own (tests/trace_styles_round26_settr.py), each checked against a float64 formula."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round26_settr.py")
styles = user_module(STYLES)
SCALE = ("--scale", repr(1 / math.sqrt(32)))  # the blocks divide by √dim, not √d_head


def _heads_attention(q, k, v, heads, residual=True):
    """[B, N, D] each, float64: per-head softmax(q kᵀ / √D) v by F.scaled_dot_product_attention, plus each head's q
    where `residual`, heads merged back to [B, N, D]."""
    B, D = q.shape[0], q.shape[-1]
    q, k, v = (t.reshape(B, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(D)) + (q if residual else 0)
    return out.transpose(1, 2).reshape(B, -1, D)


def _norm(x, ln):
    """LayerNorm by its formula, the module's weight and bias; the identity where the block has none."""
    if not isinstance(ln, torch.nn.LayerNorm):
        return x
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def _mab(m, x, y, act=F.gelu):
    o = _norm(_heads_attention(m.to_q(x), m.to_k(y), m.to_v(y), m.heads), m.ln0)
    return _norm(o + act(m.ff(o)), m.ln1)


def test_the_styles_are_set_attention():
    torch.manual_seed(0)
    x, y = torch.randn(3, 7, 32, dtype=torch.float64), torch.randn(3, 9, 24, dtype=torch.float64)
    for ln in (True, False):
        m = styles.SetSAB(ln=ln).double()
        torch.testing.assert_close(m(x), _mab(m.block, x, x))
        m = styles.SetMAB(ln=ln).double()
        torch.testing.assert_close(m(y[:, :7], y), _mab(m, y[:, :7], y))
        m = styles.SeedPool(ln=ln).double()
        torch.testing.assert_close(m(x), _mab(m.mab, m.S.repeat(3, 1, 1), x))
        m = styles.HeadAxisMAB(ln=ln).double()
        norms = m.norms if m.norms is not None else (None, None)
        o = _norm(_heads_attention(m.fc_q(x), m.fc_k(x), m.fc_v(x), 4), norms[0])
        torch.testing.assert_close(m(x), _norm(o + F.relu(m.fc_o(o)), norms[1]))
    m = styles.NormedOut().double()
    o = m.ln0(_heads_attention(m.to_q(x), m.to_k(x), m.to_v(x), 4, residual=False))
    torch.testing.assert_close(m(x), m.ln1(o + F.relu(m.ff(o))))


CORRECT = [("SetSAB", "ln=True", SCALE), ("SetSAB", "ln=False", SCALE),
           ("SetMAB", "ln=True", (*SCALE, "--nk", "9")), ("HeadAxisMAB", "ln=True", SCALE),
           ("HeadAxisMAB", "ln=False", SCALE), ("SeedPool", "ln=True", SCALE), ("NormedOut", None, SCALE)]
PLANTS = [("SetSAB", "ln=True, bug='flat_fold'", SCALE, "heads.split_without_permute"),
          ("SetSAB", "ln=False, bug='flat_fold'", SCALE, "heads.split_without_permute"),
          ("SetSAB", "ln=True, bug='no_scale'", SCALE, "scale.none"),
          ("SetSAB", "ln=True, bug='softmax_queries'", SCALE, "softmax.axis"),
          ("HeadAxisMAB", "ln=True, bug='no_scale'", SCALE, "scale.none"),
          ("SeedPool", "ln=True, bug='no_scale'", SCALE, "scale.none"),
          ("NormedOut", "bug='flat_fold'", SCALE, "heads.split_without_permute")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32)
    for name, init, _, _ in PLANTS:
        kwargs = eval(f"dict({init})")  # noqa: S307 - the rows above
        good, bad = getattr(styles, name)(**{k: v for k, v in kwargs.items() if k != "bug"}), \
            getattr(styles, name)(**kwargs)
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_the_notes_say_the_residual_and_the_norm(runner):
    code, out = run_case(runner, STYLES, "SetSAB", "ln=True", SCALE)
    notes = [" ".join(n.split()) for n in out["notes"]]
    assert code == 0 and any("adds its queries, head by head" in n for n in notes), notes
    assert any("ops of its own to its merged heads" in n and "layer_norm" in n for n in notes), notes
