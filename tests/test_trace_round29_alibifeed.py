"""`attnscope trace --alibi` on attention that takes ALiBi's bias as a forward argument its model built (issue #41):
the argument is handed the reference's ALiBi in the layout the code reads (BLOOM's [n_batch·n_head, 1, n_K] for
`alibi.baddbmm`, MPT's [n_head, 1, n_K] sliced and added, llm-foundry's [1, n_head, 1, n_K] `attn_bias`; a tensor
the code hands to baddbmm under any name), a note says which; without --alibi, code that requires it is refused in
one line. Styles of our own (tests/trace_styles_round29_alibifeed.py), each checked first against
F.scaled_dot_product_attention in float64 with ALiBi as an additive bias; the plants (sign, heads' slopes, the bias
after the softmax) named by experiment. Transformers' own BloomAttention and MptAttention, traced in their own
files, exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import assert_named, assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round29_alibifeed.py")
styles = user_module(STYLES)
OPTIONS = ("--causal", "--alibi")
N_HEAD, N = 4, 6


def slopes(n_head: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8 * (h + 1) / n_head) for h in range(n_head)], dtype=torch.float64)


def alibi_row(n_head: int, n: int) -> torch.Tensor:
    """[n_head, 1, n]: m_h · j, BLOOM's build_alibi_tensor (no query term)."""
    return slopes(n_head)[:, None, None] * torch.arange(n, dtype=torch.float64)[None, None, :]


def expected(q, k, v):
    """SDPA in float64 with ALiBi's −m_h · (i − j) and the causal mask as one additive bias; q, k, v [B, h, n, d]."""
    n = q.shape[-2]
    i = torch.arange(n, dtype=torch.float64)
    bias = -slopes(q.shape[1])[:, None, None] * (i[:, None] - i[None, :])
    bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def causal_additive(n: int) -> torch.Tensor:
    return torch.zeros(n, n, dtype=torch.float64).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))


def run_style(name: str, x: torch.Tensor, bug: str = "") -> torch.Tensor:
    m = getattr(styles, name)(bug=bug).double()
    b = x.shape[0]
    row = alibi_row(N_HEAD, N)
    if name in ("BloomLike", "ByUse"):
        return m(x, row.expand(b, -1, -1, -1).reshape(b * N_HEAD, 1, N), causal_additive(N))
    if name == "MptLike":
        return m(x, row, torch.ones(N, N).triu(1).bool())
    return m(x, row[None])


def reference(name: str, x: torch.Tensor) -> torch.Tensor:
    m = getattr(styles, name)().double()
    b, n, d = x.shape

    def split(t):
        return t.view(b, n, N_HEAD, d // N_HEAD).transpose(1, 2)

    if name == "BloomLike":
        fused = m.query_key_value(x).view(b, n, N_HEAD, 3, d // N_HEAD)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        out = m.dense
    elif name == "ByUse":
        q, k, v = m.qkv(x).view(b, n, 3, N_HEAD, d // N_HEAD).permute(2, 0, 3, 1, 4)
        out = m.proj
    elif name == "MptLike":
        q, k, v = (split(t) for t in m.Wqkv(x).chunk(3, dim=2))
        out = m.out_proj
    else:
        q, k, v = split(m.q_proj(x)), split(m.k_proj(x)), split(m.v_proj(x))
        out = m.out_proj
    return out(expected(q, k, v).transpose(1, 2).reshape(b, n, d))


NAMES = ("BloomLike", "ByUse", "MptLike", "FoundryLike")
CORRECT = [(name, None, OPTIONS) for name in NAMES]
# alibi.after_softmax, the entry this round adds, in three styles (test_trace_catalog reads it)
PLANTED: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "alibi.after_softmax": [(name, "bug='after_softmax'", OPTIONS) for name in ("BloomLike", "MptLike", "FoundryLike")]}
PLANTS = [("BloomLike", "bug='sign'", OPTIONS, "alibi.sign"), ("BloomLike", "bug='heads'", OPTIONS, "alibi.slopes"),
          ("ByUse", "bug='sign'", OPTIONS, "alibi.sign"), ("MptLike", "bug='heads'", OPTIONS, "alibi.slopes"),
          ("FoundryLike", "bug='sign'", OPTIONS, "alibi.sign"),
          *((target, init, options, entry) for entry, cases in PLANTED.items() for target, init, options in cases)]


@pytest.mark.parametrize("name", NAMES)
def test_the_styles_are_sdpa_with_alibi(name):
    x = torch.randn(2, N, 32, dtype=torch.float64)
    want = reference(name, x)
    assert torch.allclose(run_style(name, x), want, atol=1e-6), name  # BLOOM and MPT take the softmax in float32
    for _, init, _, _ in (p for p in PLANTS if p[0] == name):
        bug = init.split("'")[1]
        assert (run_style(name, x, bug) - want).abs().max() > 1e-3, (name, bug)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize(("name", "layout"), [("BloomLike", "[n_batch·n_head, 1, n_K]"),
                                              ("ByUse", "[n_batch·n_head, 1, n_K]"),
                                              ("MptLike", "[n_head, 1, n_K]"),
                                              ("FoundryLike", "[1, n_head, 1, n_K]")])
def test_a_note_says_what_the_argument_was_given(runner, name, layout):
    code, out = run_case(runner, STYLES, name, None, OPTIONS)
    assert_passes(code, out)
    assert any("given ALiBi's bias (--alibi) as " + layout in note for note in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "asks"), [("BloomLike", "pass --alibi"), ("MptLike", "or pass --alibi")])
def test_without_alibi_the_required_argument_asks_for_it(runner, name, asks):
    result, _ = trace(runner, f"{STYLES}:{name}", "--causal")
    assert result.exit_code == 2, result.stdout + result.stderr
    assert asks in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(("model", "target", "init", "layout"), [
    ("bloom", "BloomAttention", "config=BloomConfig(hidden_size=64,n_head=4),layer_idx=0", "[n_batch·n_head, 1, n_K]"),
    ("mpt", "MptAttention", "config=MptConfig(d_model=64,n_heads=4)", "[n_head, 1, n_K]")])
def test_transformers_own_alibi_attention_in_its_file(runner, model, target, init, layout):
    """transformers' own BloomAttention (alibi.baddbmm, a residual through dropout_add) and MptAttention
    (position_bias sliced and added), traced in place in their modeling files (imported as modules of their
    package: usertrace/package.py)."""
    import importlib

    path = str(importlib.import_module(f"transformers.models.{model}.modeling_{model}").__file__)
    code, out = run_case(runner, path, target, init, OPTIONS)
    assert_passes(code, out)
    assert any(f"as {layout}" in note for note in out["notes"]), out["notes"]


def test_a_bias_the_module_makes_itself_is_its_own(runner):
    """llm-foundry's module that makes ALiBi where the caller hands none: under --alibi its `attn_bias` is left to
    it (its own bias, compared as it makes it), so a sign flipped in its own builder is named, not hidden by a bias
    trace handed in. Checked first against float64 SDPA with ALiBi."""
    x = torch.randn(2, N, 32, dtype=torch.float64)
    m = styles.FoundryOwn().double()
    heads = (lambda t: t.view(2, N, N_HEAD, 8).transpose(1, 2))  # noqa: E731
    want = m.out_proj(expected(heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x)))
                      .transpose(1, 2).reshape(2, N, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (styles.FoundryOwn(bug="own_sign").double()(x) - want).abs().max() > 1e-3
    code, out = run_case(runner, STYLES, "FoundryOwn", None, OPTIONS)
    assert_passes(code, out)
    code, out = run_case(runner, STYLES, "FoundryOwn", "bug='own_sign'", OPTIONS)
    assert_named(code, out, "alibi.sign")


def test_an_alibi_the_forward_tests_for_none_is_given_none(runner):
    """Falcon's `alibi` has no default but the forward asks `alibi is None` (its RoPE models pass None): without
    --alibi it gets None, no refusal; a mistake beside it is named as anywhere."""
    x = torch.randn(2, N, 32, dtype=torch.float64)
    m = styles.FalconLike().double()
    q, k, v = m.query_key_value(x).view(2, N, 3, N_HEAD, 8).unbind(2)
    want = m.dense(F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
                   .transpose(1, 2).reshape(2, N, 32))
    assert torch.allclose(m(x, None, causal_additive(N)), want, atol=1e-10)
    code, out = run_case(runner, STYLES, "FalconLike", None, ("--causal",))
    assert_passes(code, out)
    code, out = run_case(runner, STYLES, "FalconLike", "bug='no_scale'", ("--causal",))
    assert_named(code, out, "scale.none")
