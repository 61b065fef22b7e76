"""`attnscope trace --causal --alibi` on attention whose model hands it ALiBi merged into its one additive mask argument
(round 30's Baichuan-13B: `_gen_alibi_mask` builds `m_h · j` plus -inf above the diagonal, the attention adds it to its
scores; traced alone, trace handed it a plain 0/-inf mask and then said "your attn_weights adds no position bias", a
false alarm; issue #41). Where the module takes no ALiBi parameter, builds no position bias itself and adds its mask to
its scores, the mask is handed ALiBi's bias merged into it, laid out as the scores it meets ([n_head, n_Q, n_K],
[n_batch, n_head, n_Q, n_K], [n_batch·n_head, n_Q, n_K]; SDPA's attn_mask as its float form), with a note. Styles of our
own (tests/trace_styles_round30_alibimask.py), each checked first against a float64 formula of ALiBi attention; plants
in the module's code named by experiment; a module that builds its own ALiBi beside its mask keeps it (its sign flipped
is named)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round30_alibimask.py")
styles = user_module(STYLES)
OPTIONS = ("--causal", "--alibi")
N_HEAD, N, D = 4, 6, 32


def causal_additive(n: int) -> torch.Tensor:
    return torch.zeros(n, n, dtype=torch.float64).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))


def alibi_mask(n_head: int, n: int) -> torch.Tensor:
    """[n_head, n, n] float64: Baichuan's merged mask, m_h · j plus -inf above the diagonal (slopes 2^(-8 (h+1)/H))."""
    m = torch.tensor([2.0 ** (-8 * (h + 1) / n_head) for h in range(n_head)], dtype=torch.float64)
    return m[:, None, None] * torch.arange(n, dtype=torch.float64)[None, None, :] + causal_additive(n)


def formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ALiBi attention written out in float64: softmax(q kᵀ / √d − m_h (i − j), causal) v; q, k, v [B, H, n, d]."""
    n_head, n, d = q.shape[1], q.shape[2], q.shape[3]
    m = torch.tensor([2.0 ** (-8 * (h + 1) / n_head) for h in range(n_head)], dtype=torch.float64)
    i = torch.arange(n, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) / d ** 0.5 - m[:, None, None] * (i[:, None] - i[None, :])
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return scores.softmax(-1) @ v


def heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    b, n, _ = t.shape
    return t.view(b, n, n_head, -1).transpose(1, 2)


def run_style(name: str, x: torch.Tensor, bug: str = "") -> torch.Tensor:
    """The style run as its model runs it: the merged mask in the shape it takes."""
    m = getattr(styles, name)(bug=bug).double()
    mask = alibi_mask(N_HEAD, N)
    if name == "FoldedMask":
        return m(x, mask.repeat(x.shape[0], 1, 1))
    if name == "GroupedMask":
        return m(x, mask[None].expand(x.shape[0], -1, -1, -1))
    return m(x, mask)


def reference(name: str, x: torch.Tensor) -> torch.Tensor:
    m = getattr(styles, name)().double()
    b = x.shape[0]
    if name == "HeadsMask":
        q, k, v, out = m.wq(x), m.wk(x), m.wv(x), m.wo
    elif name == "FoldedMask":
        q, k, v, out = m.q_proj(x), m.k_proj(x), m.v_proj(x), m.out_proj
    elif name == "GroupedMask":
        q, out = m.q_proj(x), m.o_proj
        k, v = (heads(p(x), 2).repeat_interleave(2, dim=1).transpose(1, 2).reshape(b, N, -1)
                for p in (m.k_proj, m.v_proj))
    elif name == "KernelMask":
        q, k, v = m.W_pack(x).chunk(3, dim=-1)
        out = m.o_proj
    else:
        q, k, v = m.to_qkv(x).chunk(3, dim=-1)
        out = m.to_out
    return out(formula(heads(q, N_HEAD), heads(k, N_HEAD), heads(v, N_HEAD)).transpose(1, 2).reshape(b, N, D))


NAMES = ("HeadsMask", "FoldedMask", "GroupedMask", "KernelMask")
CORRECT = [(name, None, OPTIONS) for name in NAMES]
PLANTS = [("HeadsMask", "bug='no_scale'", OPTIONS, "scale.none"),
          ("HeadsMask", "bug='heads'", OPTIONS, "alibi.slopes"),
          ("FoldedMask", "bug='no_scale'", OPTIONS, "scale.none"),
          ("FoldedMask", "bug='axis'", OPTIONS, "softmax.axis"),
          ("GroupedMask", "bug='no_scale'", OPTIONS, "scale.none"),
          ("GroupedMask", "bug='kv'", OPTIONS, "kv.swapped"),
          ("KernelMask", "bug='no_scale'", OPTIONS, "scale.none")]


@pytest.mark.parametrize("name", NAMES)
def test_the_styles_are_alibi_attention(name):
    x = torch.randn(2, N, D, dtype=torch.float64)
    want = reference(name, x)
    assert torch.allclose(run_style(name, x), want, atol=1e-6), name  # HeadsMask takes its softmax in float32
    for _, init, _, _ in (p for p in PLANTS if p[0] == name):
        bug = init.split("'")[1]
        assert (run_style(name, x, bug) - want).abs().max() > 1e-3, (name, bug)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


@pytest.mark.parametrize(("name", "layout"), [("HeadsMask", "[n_head, n_Q, n_K]"),
                                              ("FoldedMask", "[n_batch·n_head, n_Q, n_K]"),
                                              ("GroupedMask", "[n_batch, n_head, n_Q, n_K]"),
                                              ("KernelMask", "[n_head, n_Q, n_K]")])
def test_a_note_says_alibi_was_merged_into_the_mask(runner, name, layout):
    code, out = run_case(runner, STYLES, name, None, OPTIONS)
    assert_passes(code, out)
    assert any(f"merged into one additive tensor {layout}, as Baichuan's model hands it" in note
               for note in out["notes"]), out["notes"]


def test_without_alibi_the_mask_is_the_mask_alone(runner):
    """Without --alibi nothing is merged: the reference adds no ALiBi and the code is handed the plain mask."""
    code, out = run_case(runner, STYLES, "HeadsMask", None, ("--causal",))
    assert_passes(code, out)
    assert not any("merged into one additive tensor" in note for note in out["notes"]), out["notes"]


def test_a_module_that_builds_its_own_alibi_keeps_it(runner):
    """OwnAlibi adds ALiBi of its own beside the additive mask it takes: by experiment (its softmax's input, less
    the scaled q kᵀ, keeps a term the same in every sequence) it gets the plain mask, so its bias is compared as it
    makes it, and its slopes negated are named alibi.sign."""
    x = torch.randn(2, N, D, dtype=torch.float64)
    want = reference("OwnAlibi", x)
    assert torch.allclose(styles.OwnAlibi().double()(x, causal_additive(N)), want, atol=1e-10)
    assert (styles.OwnAlibi(bug="own_sign").double()(x, causal_additive(N)) - want).abs().max() > 1e-3
    code, out = run_case(runner, STYLES, "OwnAlibi", None, OPTIONS)
    assert_passes(code, out)
    assert not any("merged into one additive tensor" in note for note in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "OwnAlibi", "bug='own_sign'", OPTIONS)
    assert_named(code, out, "alibi.sign")
