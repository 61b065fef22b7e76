"""`attnscope trace` on attention that adds a term of its own to its scores, computed from its queries or keys and a
table or the positions (tests/trace_styles_round7_relterm.py): Shaw et al.'s relative keys before the scale,
Transformer-XL's `(q + u) · kᵀ + (q + v) · R` with its relative shift (batch-first, and time-first as its repository
writes it), DeBERTa's c2p and p2c after it (v3's shared projections, v2's pos_key_proj and pos_query_proj). The
reference adds the code's term where the code does (a note says so): correct code lines up, and a catalog mistake
around the term is still named by experiment. Shaw et al.'s relative values (a term on the output) are the code's own
too (a note, exit 0).

Each correct style is checked apart from attnscope against a float64 formula, and each planted bug changes its
output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round7_relterm.py")
styles = user_module(STYLES)


def _trained(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module.eval()


def _lin(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = layer.weight.double()
    return x @ w.T + (layer.bias.double() if layer.bias is not None else 0)


def _heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    return t.unflatten(-1, (n_head, -1)).transpose(1, 2)  # [b, h, n, d]


def _finish(scores: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, out: torch.nn.Linear,
            extra: torch.Tensor | None = None) -> torch.Tensor:
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(-1)
    x = weights @ v
    if extra is not None:  # Shaw's relative values: Σ_j a_ij rel_v[j − i]
        x = x + torch.einsum("bhqk,qkd->bhqd", weights, extra)
    return _lin(out, x.transpose(1, 2).flatten(2))


def _shaw(m, x: torch.Tensor, allowed=None, values: bool = False) -> torch.Tensor:
    x = x.double()
    q, k, v = (_heads(_lin(layer, x), m.n_head) for layer in (m.q, m.k, m.v))
    n = x.shape[1]
    index = torch.tensor([[min(max(j - i, -m.max_dist), m.max_dist) + m.max_dist for j in range(n)] for i in range(n)])
    rel_k = m.rel_k.weight.double()[index]  # [n, n, d]
    scores = (q @ k.transpose(-2, -1) + torch.einsum("bhid,ijd->bhij", q, rel_k)) / math.sqrt(m.d_head)
    return _finish(scores, v, allowed, m.o, m.rel_v.weight.double()[index] if values else None)


def _xl(m, x: torch.Tensor) -> torch.Tensor:
    x, n = x.double(), x.shape[1]
    q, k, v = (_heads(t, m.n_head) for t in _lin(m.qkv_net, x).chunk(3, -1))
    dist = torch.arange(n, dtype=torch.float64)
    inv = 1 / 10000 ** (torch.arange(0, m.d_model, 2, dtype=torch.float64) / m.d_model)
    r = _lin(m.r_net, torch.cat([(dist[:, None] * inv).sin(), (dist[:, None] * inv).cos()], -1))  # r[d]: distance d
    r = r.view(n, m.n_head, m.d_head).double()
    u, w = m.r_w_bias.double()[None, :, None], m.r_r_bias.double()[None, :, None]
    content = (q + u) @ k.transpose(-2, -1)
    position = torch.zeros_like(content)
    for i in range(n):
        for j in range(i + 1):  # the relative shift puts distance i − j at (i, j), j ≤ i; the rest is masked
            position[:, :, i, j] = ((q[:, :, i] + w[:, :, 0]) * r[i - j]).sum(-1)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    return _finish((content + position) / math.sqrt(m.d_head), v, allowed, m.o_net)


def _deberta(m, x: torch.Tensor, allowed=None) -> torch.Tensor:
    """DeBERTa's scores: (q_i · k_j + q_i · pos_key[δ(i, j)] + k_j · pos_query[δ(j, i)]) / √d, δ(i, j) = clamp(i − j +
    span, 0, 2·span − 1); v3's table projected by the key and query projections, v2's by pos_key_proj and
    pos_query_proj (and no output projection)."""
    x, n = x.double(), x.shape[1]
    v2 = hasattr(m, "pos_key_proj")
    heads, size = (m.heads, m.head_size) if v2 else (m.heads, m.size)
    q, k, v = (_heads(_lin(layer, x), heads) for layer in (m.query_proj, m.key_proj, m.value_proj))
    table = m.rel_embeddings.double()[None]
    pos_key = _heads(_lin(m.pos_key_proj if v2 else m.key_proj, table), heads)
    pos_query = _heads(_lin(m.pos_query_proj if v2 else m.query_proj, table), heads)
    idx = torch.tensor([[min(max(i - j + m.span, 0), 2 * m.span - 1) for j in range(n)] for i in range(n)])
    c2p = torch.einsum("bhid,hijd->bhij", q, pos_key[0][:, idx])  # q_i · pos_key[δ(i, j)]
    p2c = torch.einsum("bhjd,hjid->bhij", k, pos_query[0][:, idx])  # k_j · pos_query[δ(j, i)]
    out = None if v2 else m.dense
    scores = (q @ k.transpose(-2, -1) + c2p + p2c) / math.sqrt(size * getattr(m, "scale_factor", 1))
    if out is not None:
        return _finish(scores, v, allowed, out)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def test_the_styles_are_their_formulas_and_the_bugs_change_them():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    with torch.no_grad():
        for cls, formula, bugs in (
                (lambda: styles.DisentangledAttention(summed=True), _deberta, ()),
                (styles.DebertaV2Attention, _deberta,
                 (styles.DebertaV2ScaleByHidden, styles.DebertaV2SoftmaxOverQueries)),
                (lambda: styles.DebertaV2Attention(scale_factor=3), _deberta, ()),
                (styles.RelKeyAttention, _shaw, (styles.RelKeyScaleByModel, styles.RelKeySoftmaxOverQueries)),
                (styles.DisentangledAttention, _deberta,
                 (styles.DisentangledScaleByHidden, styles.DisentangledFilledWithZero))):
            torch.manual_seed(2)
            m = _trained(cls())
            assert torch.allclose(m(x).double(), formula(m, x), atol=1e-5), cls
            assert torch.allclose(m(x, allowed).double(), formula(m, x, allowed), atol=1e-5), cls
            for bug in bugs:
                torch.manual_seed(2)
                planted = _trained(bug())
                assert not torch.allclose(planted(x, allowed), m(x, allowed), atol=1e-3), bug.__name__
        torch.manual_seed(2)
        m = _trained(styles.RelKeyValueAttention())
        assert torch.allclose(m(x).double(), _shaw(m, x, values=True), atol=1e-5)
        assert not torch.allclose(m(x).double(), _shaw(m, x), atol=1e-3)  # the values' term counts
        torch.manual_seed(2)
        m = _trained(styles.XLRelAttention())
        assert torch.allclose(m(x).double(), _xl(m, x), atol=1e-5)
        for bug in (styles.XLUnscaled, styles.XLSoftmaxOverQueries):
            torch.manual_seed(2)
            assert not torch.allclose(_trained(bug())(x), m(x), atol=1e-3), bug.__name__
        torch.manual_seed(2)
        m, t = _trained(styles.RelPartialLearnableAttn()), x.transpose(0, 1)  # time-first [qlen, bsz, d_model]
        assert torch.allclose(m(t).transpose(0, 1).double(), _xl(m, x), atol=1e-5)
        for bug in (styles.RelPartialScaleByModel, styles.RelPartialSoftmaxOverBatch):
            torch.manual_seed(2)
            assert not torch.allclose(_trained(bug())(t), m(t), atol=1e-3), bug.__name__


CORRECT = [
    ("RelKeyAttention", ()),
    ("RelKeyAttention", ("--causal",)),
    ("XLRelAttention", ("--causal",)),
    ("RelPartialLearnableAttn", ("--causal",)),  # time-first, scores [qlen, klen, bsz, n_head]
    ("DisentangledAttention", ()),
    ("DisentangledAttention", ("--batch", "2", "--nq", "5", "--nk", "5", "--causal")),
    ("DisentangledAttention", ("--init", "summed=True")),  # q · kᵀ / √d + c2p / √d + p2c / √d, one add at a time
    ("DebertaV2Attention", ("--batch", "2", "--causal")),  # pos_key_proj, pos_query_proj, no output projection
    ("DebertaV2Attention", ("--init", "scale_factor=3")),  # transformers' scale √(3·d_head): a note says it
    ("DebertaV2Attention", ("--init", "scale_factor=3", "--batch", "2", "--causal")),
]


@pytest.mark.parametrize(("name", "args"), CORRECT, ids=[f"{c[0]}{''.join(c[1])}" for c in CORRECT])
def test_correct_code_lines_up_with_a_note_of_its_term(runner, name, args):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["error"] is None
    note = next(n for n in out["notes"] if n.startswith("your code adds a term of its own to its scores"))
    assert "a convention, not a mistake" in note
    assert ("after the scale" if name.startswith(("Disentangled", "Deberta")) else "before the scale") in note
    assert "your own term on the scores" in out["reference"]
    if name.startswith("DebertaV2"):  # the relative term's products (q · pos_keyᵀ, k · pos_queryᵀ) make no roles
        assert "q=query_proj, k=key_proj, v=value_proj" in out["reference"]
    spread = [n for n in out["notes"] if n.startswith("scale 1/√(3·d_head) = 0.204124")]
    assert len(spread) == ("scale_factor=3" in args)  # DeBERTa's scale_factor, read only where the code has it


BUGS = [
    ("RelKeyScaleByModel", (), "scores", "scale.d_model"),
    ("RelKeySoftmaxOverQueries", ("--causal",), "attention", "softmax.axis"),
    ("XLUnscaled", ("--causal",), "scores", "scale.none"),
    ("XLSoftmaxOverQueries", ("--causal",), "attention", "softmax.axis"),
    ("RelPartialScaleByModel", ("--causal",), "scores", "scale.d_model"),
    ("RelPartialSoftmaxOverBatch", ("--causal",), "attention", "softmax.axis"),
    ("DisentangledScaleByHidden", (), "scores", "scale.d_model"),
    ("DisentangledFilledWithZero", ("--causal",), "masked_scores", "mask.filled_with_0"),
    ("DisentangledScaleByHidden", ("--init", "summed=True"), "scores", "scale.d_model"),
    ("DebertaV2ScaleByHidden", (), "scores", "scale.d_model"),
    ("DebertaV2SoftmaxOverQueries", ("--causal",), "attention", "softmax.axis"),
    ("DebertaV2SoftmaxOverQueries", ("--init", "scale_factor=3", "--causal"), "attention", "softmax.axis"),
]


@pytest.mark.parametrize(("name", "args", "step", "entry"), BUGS, ids=[b[0] + "".join(b[1]) for b in BUGS])
def test_planted_bugs_beside_the_term_are_named_by_experiment(runner, name, args, step, entry):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == (step, entry)
    assert first["evidence"].startswith("by experiment")
    assert any(n.startswith("your code adds a term of its own to its scores") for n in out["notes"])


def test_a_mask_of_its_own_beside_the_term_asks_for_causal(runner):
    result, out = trace(runner, f"{STYLES}:XLRelAttention")
    assert result.exit_code == 1
    assert "your code masks by itself" in out["first_divergence"]["diagnosis"]
    assert "--causal" in out["first_divergence"]["diagnosis"]


def test_relative_values_on_the_output_are_the_modules_own(runner):
    """Shaw's relative values are read as the code's own term on its output (outterm.py): a note, exit 0, every step
    compared (tests/test_trace_f12_kv.py has more styles, and mistakes beside the term named by experiment)."""
    result, out = trace(runner, f"{STYLES}:RelKeyValueAttention")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = next(n for n in out["notes"] if n.startswith("your code adds a term of its own to the attention's output"))
    assert "rel_v.weight" in said and "rel_k" not in said
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["attention"] == "equal" and rows["biased_scores"] == "equal" and rows["x"] == "equal"


@pytest.mark.parametrize("name", ["RelKeyHeadGain", "RelKeyQueryGain"])
def test_the_gain_on_the_content_scores_is_the_only_difference(name):
    torch.manual_seed(0)
    m, x = getattr(styles, name)(), torch.randn(2, 5, 32)
    with torch.no_grad():
        plain = styles.RelKeyAttention()
        plain.load_state_dict({k: t for k, t in m.state_dict().items() if k != "gain"})
        assert not torch.allclose(m(x), plain(x), atol=1e-4)  # the gain counts
        m.gain.fill_(1.0)
        assert torch.allclose(m(x), plain(x), atol=1e-6)  # and is the only difference


def test_a_learned_gain_a_head_beside_the_term_is_the_codes_own_scale(runner):
    """One number a head on q · kᵀ before the term, the sum scaled after: a learned temperature a head times the
    scale (usertrace/headscale.py), the term before the scale; both the code's own."""
    result, out = trace(runner, f"{STYLES}:RelKeyHeadGain")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith("your code scales its scores by a learned temperature of its own") for n in out["notes"])
    said = next(n for n in out["notes"] if n.startswith("your code adds a term of its own to its scores"))
    assert "before the scale" in said


def test_a_term_that_cannot_be_placed_is_said_in_one_line_not_blamed_on_the_scale(runner):
    result, out = trace(runner, f"{STYLES}:RelKeyQueryGain")
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["experiment"] is None and first["evidence"] is None
    assert first["diagnosis"].startswith("your scores add a term trace has no reference for (line ")
    assert "√d_head" not in first["diagnosis"]
