"""`attnscope trace` on attention whose output carries a learned per-channel gain after its output projection
(LayerScale: timm's `ls1(attn(x))`, CaiT's `gamma_1 * x`, a computed `log_scale.exp()`, a scalar `tanh(alpha)`), and on
q, k, v cut from one packed parameter in another order than q, k, v (issue #41, round 31).

The gain folds into the output projection's rows (diag(g)·W_o): a convention, read by experiment (the reference's
output times the gain gives back what the code returns) and said in a note naming it; the same gain applied twice
stays the divergence, and mistakes upstream of a gain are still named. A packed parameter read q, v, k gets the
layout note a fused projection's output gets; where it is PyTorch's own `in_proj_weight` (documented q | k | v) the
note says that a state dict nn.MultiheadAttention wrote would be read in another order. Styles of our own
(tests/trace_styles_round31_gain.py), each checked first against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round31_gain.py")
styles = user_module(STYLES)
N_HEAD, N, B, D = 4, 5, 2, 32


def heads(t: torch.Tensor) -> torch.Tensor:
    """[b, n, d] -> [b, n_head, n, d_head]."""
    b, n, d = t.shape
    return t.view(b, n, N_HEAD, d // N_HEAD).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA in float64 on [b, n, d] projections, the heads merged back to [b, n, d]."""
    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
    return out.transpose(1, 2).reshape(q.shape)


def reference(name: str, init: dict, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
    """The style's output from its own weights, by SDPA in float64, the gain applied as written: g · W_o(attn)."""
    m = getattr(styles, name)(**init).double()
    if name == "CaiTGain":
        return m.gamma_1 * m.to_out(attend(m.q(x), m.k(x), m.v(x)))
    if name == "ScaledBranch":
        q, k, v = m.attn.to_qkv(x).chunk(3, dim=-1)
        branch = m.branch
        gain = branch.log_scale.exp() if branch.exp else branch.layer_scale
        return gain * m.attn.proj(attend(q, k, v))
    if name == "TimeFirstGain":
        t = x.transpose(0, 1)  # [n, b, d] -> [b, n, d]
        out = m.wo(attend(m.wq(t), m.wk(t), m.wv(t))).transpose(0, 1)
        return out * torch.tanh(m.alpha)
    key, value = kv if kv is not None else (x, x)
    packed = getattr(m, m.param).reshape(3 * D, D)
    rows = {role: slice(i * D, (i + 1) * D) for i, role in enumerate(m.order)}
    q, k, v = (F.linear(t, packed[rows[r]], m.in_bias[rows[r]]) for t, r in ((x, "q"), (key, "k"), (value, "v")))
    return m.out(attend(q, k, v))


def run_style(name: str, init: dict, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
    m = getattr(styles, name)(**init).double()
    if name == "PackedRows":
        key, value = kv if kv is not None else (x, x)
        return m(x, key, value)
    return m(x)


def inputs(name: str) -> torch.Tensor:
    return torch.randn((N, B, D) if name == "TimeFirstGain" else (B, N, D), dtype=torch.float64)


GAINS = [("CaiTGain", {}), ("ScaledBranch", {}), ("ScaledBranch", {"exp": True}), ("TimeFirstGain", {})]
PACKED = [{}, {"order": "qvk"}, {"order": "qvk", "param": "qkv_weight"},
          {"order": "qvk", "param": "W", "stacked": True}]


@pytest.mark.parametrize(("name", "init"), GAINS + [("PackedRows", p) for p in PACKED])
def test_the_styles_are_sdpa(name, init):
    x = inputs(name)
    kv = (torch.randn(B, N + 2, D, dtype=torch.float64), torch.randn(B, N + 2, D, dtype=torch.float64)) \
        if name == "PackedRows" else None
    assert torch.allclose(run_style(name, init, x, kv), reference(name, init, x, kv), atol=1e-10), (name, init)


@pytest.mark.parametrize(("name", "bug"), [("CaiTGain", "softmax_axis"), ("CaiTGain", "kv_swapped"),
                                           ("CaiTGain", "gain_twice"), ("ScaledBranch", "scale_dim")])
def test_each_plant_moves_the_output(name, bug):
    x = inputs(name)
    assert not torch.allclose(run_style(name, {"bug": bug}, x), reference(name, {}, x), atol=1e-3), (name, bug)


def _init(init: dict) -> str | None:
    return ", ".join(f"{k}={v!r}" for k, v in init.items()) or None


CORRECT = [(name, _init(init), ()) for name, init in GAINS] + [("PackedRows", _init(p), ()) for p in PACKED]
PLANTS = [("CaiTGain", "bug='softmax_axis'", (), "softmax.axis"),
          ("CaiTGain", "bug='kv_swapped'", (), "kv.swapped"),
          ("ScaledBranch", "bug='scale_dim'", (), "scale.d_model")]

test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize(("name", "init", "words"), [("CaiTGain", None, "gamma_1"),
                                                     ("ScaledBranch", None, "branch.layer_scale"),
                                                     ("ScaledBranch", "exp=True", "branch.log_scale.exp()"),
                                                     ("TimeFirstGain", None, "tanh(alpha)")])
def test_the_gain_is_read_as_a_convention_and_named(runner, name, init, words):
    """The note names the gain, says it folds into the output projection and that the experiment reproduced the
    return; the line-up (the pattern included) is the one a module without the gain gets."""
    code, out = run_case(runner, STYLES, name, init)
    assert_passes(code, out)
    said = [n for n in out["notes"] if "learned gain" in n]
    assert len(said) == 1 and words in said[0] and "folds into the output projection" in said[0], out["notes"]
    assert "gives back what your code returns" in said[0], said
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["attention"] in ("equal", "permuted") and rows["x"] in ("equal", "permuted"), rows


def test_the_gain_applied_twice_stays_the_divergence(runner):
    """`gamma_1 * (gamma_1 * W_o(attn))`: the same parameter twice on the way out is no convention read; the
    return is where the code and the reference part, at the line that applies it again."""
    code, out = run_case(runner, STYLES, "CaiTGain", "bug='gain_twice'")
    found = out["first_divergence"]
    assert code == 1 and found is not None and found["reference"] == "x", found
    lines = Path(STYLES).read_text().splitlines()
    again = next(i for i, line in enumerate(lines, 1) if "out = self.gamma_1 * out" in line)
    assert found["line"] == again, found
    assert not any("learned gain" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("init", "said", "unsaid"), [
    (None, None, "rows hold"),
    ("order='qvk'", "in_proj_weight's rows hold q, v, k", None),
    ("order='qvk', param='qkv_weight'", "qkv_weight's rows hold q, v, k", "PyTorch"),
    ("order='qvk', param='W', stacked=True", "W's rows hold q, v, k", "PyTorch")])
def test_packed_rows_read_out_of_order_get_the_layout_note(runner, init, said, unsaid):
    code, out = run_case(runner, STYLES, "PackedRows", init)
    assert_passes(code, out)
    notes = " ".join(out["notes"])
    if said is not None:
        assert said in notes, notes
    if unsaid is not None:
        assert unsaid not in notes, notes


def test_pytorchs_own_in_proj_weight_read_q_v_k_says_its_documented_order(runner):
    """in_proj_weight is nn.MultiheadAttention's parameter, packed q | k | v as F.multi_head_attention_forward cuts
    it: the note says a state dict written by it would be read in another order (no mistake named: the code agrees
    with itself, and weights trained in its layout are right)."""
    code, out = run_case(runner, STYLES, "PackedRows", "order='qvk'")
    assert_passes(code, out)
    note = next(n for n in out["notes"] if "rows hold" in n)
    assert "PyTorch's packed q | k | v parameter" in note and "k and v swapped" in note, note
