"""`attnscope trace`'s catalog, widened by the held-out round 7 (issue 41): a sliding window forgotten
(`mask.no_window`) or not described (`mask.window_untold`), the scores scaled by any size of the run (`scale.n`:
n_Q, n_K, n_head, ...; solved from the code's numbers) or by a number no size gives (`scale.other`), and the softcap
(Gemma 2's `attn_logit_softcapping`, read from the module's config as its `query_pre_attn_scalar` is, or given by
--softcap): missing, after the mask, in the wrong form, at another value, or not described. Gemma 2's sliding window
merged into the causal mask the layer is given is read as the code's own (the layer gets the causal part alone).

The styles are tests/trace_styles_round7_catalog.py. Every correct one is checked apart from attnscope against
F.scaled_dot_product_attention or a float64 formula on its own weights and exits 0; every planted bug changes the
output and is named by experiment.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_passes, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round7_catalog.py")
styles = user_module(STYLES)
S = STYLES

MISTRAL = ("--init", "config=MistralConfig()", "--nq", "8")
GEMMA = "config=Gemma2Config()"
# entry -> [(target, init (None: none), options)]
PLANTED: dict[str, list[tuple[str, str | None, tuple[str, ...]]]] = {
    "mask.no_window": [
        ("MistralLike", "config=MistralConfig(), bug='no_window'", ("--window", "3", "--nq", "8")),
        ("local_attention_no_window", None, ("--window", "3", "--heads", "4")),
        ("LocalBidirectional", "bug='no_window'", ("--window", "4", "--window-side", "both", "--nq", "8")),
    ],
    "mask.window_untold": [
        ("MistralLike", "config=MistralConfig()", ("--causal", "--nq", "8")),
        ("local_attention", None, ("--causal", "lower-right", "--heads", "4")),
        ("LocalBidirectional", None, ("--nq", "8")),
    ],
    "scale.n": [
        ("bmhk_scaled_by_m", None, ("--heads", "4", "--causal")),
        ("column_scaled_by_n", None, ()),
        ("SeqScaled", "bug='by_heads'", ("--causal",)),
    ],
    "scale.other": [
        ("bmhk_scaled_by_constant", None, ("--heads", "4", "--causal")),
        ("column_scaled_by_constant", None, ()),
        ("SeqScaled", "bug='by_constant'", ("--causal",)),
    ],
    "softcap.missing": [
        ("Gemma2Like", f"{GEMMA}, bug='no_softcap'", ("--rope", "--causal")),
        ("softcapped_no_softcap", None, ("--heads", "4", "--causal", "--softcap", "2")),
        ("GrokLike", "bug='no_softcap'", ("--causal", "--softcap", "2")),
    ],
    "softcap.after_mask": [
        ("Gemma2Like", f"{GEMMA}, bug='after_mask'", ("--rope", "--causal")),
        ("softcapped_after_mask", None, ("--heads", "4", "--causal", "--softcap", "2")),
        ("GrokLike", "bug='after_mask'", ("--causal", "--softcap", "2")),
    ],
    "softcap.form": [
        ("Gemma2Like", f"{GEMMA}, bug='no_multiply'", ("--rope", "--causal")),
        ("softcapped_no_divide", None, ("--heads", "4", "--causal", "--softcap", "2")),
        ("GrokLike", "bug='before_scale'", ("--causal", "--softcap", "2")),
    ],
    "softcap.value": [
        ("Gemma2Like", f"{GEMMA}, bug='final_cap'", ("--rope", "--causal")),
        ("softcapped_other_cap", None, ("--heads", "4", "--causal", "--softcap", "2")),
        ("GrokLike", "bug='other_cap'", ("--causal", "--softcap", "2")),
    ],
    "softcap.untold": [
        ("Gemma2Like", "config=Gemma2Config(attn_logit_softcapping=None), bug='literal_cap'", ("--rope", "--causal")),
        ("softcapped_attention", None, ("--heads", "4", "--causal")),
        ("GrokLike", None, ("--causal",)),
    ],
}
CORRECT = [
    ("MistralLike", "config=MistralConfig()", ("--window", "3", "--nq", "8")),
    ("NeoLocal", None, ("--window", "3", "--scale", "1", "--nq", "8")),
    ("LocalBidirectional", None, ("--window", "4", "--window-side", "both", "--nq", "8")),
    ("Gemma2Like", GEMMA, ("--rope", "--causal")),  # softcap 2 and scale 24^-0.5 read from the config
    ("softcapped_attention", None, ("--heads", "4", "--causal", "--softcap", "2")),
    ("GrokLike", None, ("--causal", "--softcap", "2")),
    ("GrokLike", "multiplier=0.0884", ("--causal", "--softcap", "2")),  # attn_output_multiplier read as its scale
]
# the words each entry's message must hold, for one of its plants
SAYS = {"scale.n": ("n_head = 4", "the number of heads"), "scale.other": ("--scale 0.3",),
        "mask.no_window": ("window of 3 left out",), "mask.window_untold": ("--window 3",),
        "softcap.untold": ("--softcap 2",), "softcap.value": ("caps the scores at 3, not 2",)}


@pytest.mark.parametrize(("target", "init", "options"), CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_styles_pass(runner, target, init, options):
    assert_passes(*run_case(runner, STYLES, target, init, options))


CASES = [(entry, *case) for entry, cases in PLANTED.items() for case in cases]


@pytest.mark.parametrize(("entry", "target", "init", "options"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_planted_bug_named_by_experiment(runner, entry, target, init, options):
    code, out = run_case(runner, STYLES, target, init, options)
    assert code == 1, out
    found = out["first_divergence"]
    assert found["experiment"] == entry, found
    assert found["evidence"].startswith("by experiment"), found
    if target in ("MistralLike", "SeqScaled", "softcapped_other_cap", "softcapped_attention"):
        for words in SAYS.get(entry, ()):
            assert words in found["diagnosis"], found["diagnosis"]


def test_every_entry_planted_in_three_styles():
    for entry, cases in PLANTED.items():
        assert len({target.split("_")[0] if target[0].islower() else target for target, _, _ in cases}) >= 3, entry


def test_gemma2_window_merged_into_the_causal_mask(runner):
    """transformers 4.44's Gemma 2 sliding layer merges its window into the 4-D mask it is given: the layer gets the
    causal part alone (trace's mask never hides its window), passes, and its window off by one is named."""
    code, out = run_case(runner, STYLES, "Gemma2Sliding", f"{GEMMA}, window=4",
                         ("--rope", "--causal", "--window", "4"))
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert any("takes the rest of the rule" in n for n in out["notes"]), out["notes"]
    code, out = run_case(runner, STYLES, "Gemma2Sliding", f"{GEMMA}, window=4, bug='off_by_one'",
                         ("--rope", "--causal", "--window", "4"))
    assert code == 1 and out["first_divergence"]["experiment"] == "mask.off_by_one", out["first_divergence"]


# --- the styles checked apart from attnscope ----------------------------------------------------------------


def _same(bug: torch.nn.Module, right: torch.nn.Module) -> torch.nn.Module:
    """The bug's module holding the correct one's weights, in eval() mode."""
    bug.load_state_dict(right.state_dict())
    return bug.eval()


def _causal(n_q: int, n_k: int) -> torch.Tensor:
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)


def _heads(x: torch.Tensor, layer: torch.nn.Linear, n: int) -> torch.Tensor:
    b, t, _ = x.shape
    return layer(x).view(b, t, n, -1).transpose(1, 2)


def _rope(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(n, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((angle, angle), -1)
    return emb.cos()[None], emb.sin()[None]


def _capped(q, k, v, allowed, scale, cap):
    """softmax(cap · tanh(q kᵀ scale / cap), masked) v in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def test_window_styles_are_pytorchs_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    band = (i - j >= 0) & (i - j < 3)
    with torch.no_grad():
        m = styles.MistralLike(styles.MistralConfig()).eval()
        k, v = (_heads(x, m.k_proj, 2).repeat_interleave(2, 1), _heads(x, m.v_proj, 2).repeat_interleave(2, 1))
        want = F.scaled_dot_product_attention(_heads(x, m.q_proj, 4), k, v, attn_mask=band)
        torch.testing.assert_close(m(x), m.o_proj(want.transpose(1, 2).reshape(2, 8, 32)), atol=1e-5, rtol=1e-5)
        n = styles.NeoLocal().eval()
        want = F.scaled_dot_product_attention(_heads(x, n.q_proj, 4), _heads(x, n.k_proj, 4), _heads(x, n.v_proj, 4),
                                              attn_mask=band, scale=1.0)
        torch.testing.assert_close(n(x), n.out_proj(want.transpose(1, 2).reshape(2, 8, 32)), atol=1e-5, rtol=1e-5)
        q, kk, vv = torch.randn(3, 2, 4, 8, 8)
        torch.testing.assert_close(styles.local_attention(q, kk, vv),
                                   F.scaled_dot_product_attention(q, kk, vv, attn_mask=band))
        lb = styles.LocalBidirectional().eval()
        qkv = lb.Wqkv(x).view(2, 8, 3, 4, 8)
        q, kk, vv = (qkv[:, :, r].transpose(1, 2) for r in range(3))
        want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=(i - j).abs() <= 2)
        torch.testing.assert_close(lb(x), lb.Wo(want.transpose(1, 2).reshape(2, 8, 32)), atol=1e-5, rtol=1e-5)
        for bug in (styles.MistralLike(styles.MistralConfig(), bug="no_window"), styles.NeoLocal(bug="no_window"),
                    styles.LocalBidirectional(bug="no_window")):
            right = {"MistralLike": m, "NeoLocal": n, "LocalBidirectional": lb}[type(bug).__name__]
            assert not torch.allclose(_same(bug, right)(x), right(x), atol=1e-4)
        q, kk, vv = torch.randn(3, 2, 4, 8, 8)
        assert not torch.allclose(styles.local_attention_no_window(q, kk, vv), styles.local_attention(q, kk, vv))


def test_scale_styles_are_pytorchs_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 4, 8), torch.randn(2, 6, 4, 8)  # BMHK
    bmhk = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(styles.bmhk_attention(q, k, v), bmhk)
    Q, K, V = torch.randn(8, 6), torch.randn(8, 9), torch.randn(5, 9)  # the column form [d, n]
    torch.testing.assert_close(styles.column_attention(Q, K, V),
                               F.scaled_dot_product_attention(Q.T, K.T, V.T).T)
    m = styles.SeqScaled().eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(_heads(x, m.query, 4), _heads(x, m.key, 4), _heads(x, m.value, 4),
                                              is_causal=True)
        torch.testing.assert_close(m(x), m.proj(want.transpose(1, 2).reshape(2, 7, 32)), atol=1e-5, rtol=1e-5)
        for bug in ("by_seq", "by_heads", "by_constant"):
            assert not torch.allclose(_same(styles.SeqScaled(bug=bug), m)(x), m(x), atol=1e-4)
    for f in (styles.bmhk_scaled_by_m, styles.bmhk_scaled_by_constant):
        assert not torch.allclose(f(q, k, v), bmhk)
    for f in (styles.column_scaled_by_n, styles.column_scaled_by_constant):
        assert not torch.allclose(f(Q, K, V), styles.column_attention(Q, K, V))


def test_softcap_styles_are_the_formula():
    torch.manual_seed(2)
    x = torch.randn(2, 7, 32)
    causal = _causal(7, 7)
    with torch.no_grad():
        g = styles.Gemma2Like(styles.Gemma2Config()).eval()
        cos, sin = _rope(7, 16)
        q, k = styles.apply_rotary_pos_emb(_heads(x, g.q_proj, 4), _heads(x, g.k_proj, 2), cos, sin)
        v = _heads(x, g.v_proj, 2)
        heads = _capped(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal, 24 ** -0.5, 2.0)
        want = g.o_proj(heads.float().transpose(1, 2).reshape(2, 7, 64))
        mask = torch.zeros(7, 7).masked_fill(~causal, torch.finfo(torch.float32).min)[None, None]
        torch.testing.assert_close(g(x, (cos, sin), mask), want, atol=1e-5, rtol=1e-5)
        for bug in ("no_softcap", "after_mask", "no_multiply", "before_scale", "final_cap"):
            planted = _same(styles.Gemma2Like(styles.Gemma2Config(), bug=bug), g)
            assert not torch.allclose(planted(x, (cos, sin), mask), want, atol=1e-4), bug
        literal = _same(styles.Gemma2Like(styles.Gemma2Config(attn_logit_softcapping=None), bug="literal_cap"), g)
        torch.testing.assert_close(literal(x, (cos, sin), mask), want, atol=1e-5, rtol=1e-5)  # caps at 2 anyway
        uncapped = _same(styles.Gemma2Like(styles.Gemma2Config(attn_logit_softcapping=None)), g)
        assert not torch.allclose(uncapped(x, (cos, sin), mask), want, atol=1e-4)
        gr = styles.GrokLike().eval()
        q, k, v = (t.view(2, 7, 4, 8).transpose(1, 2) for t in gr.qkv(x).split(32, -1))
        want = gr.out(_capped(q, k, v, causal, 8 ** -0.5, 2.0).float().transpose(1, 2).reshape(2, 7, 32))
        torch.testing.assert_close(gr(x), want, atol=1e-5, rtol=1e-5)
        for bug in ("no_softcap", "after_mask", "no_multiply", "before_scale", "other_cap"):
            assert not torch.allclose(_same(styles.GrokLike(bug=bug), gr)(x), want, atol=1e-4), bug
        own = _same(styles.GrokLike(multiplier=0.0884), gr)  # Grok-1's own multiplier, not 1/√d_head
        want = gr.out(_capped(q, k, v, causal, 0.0884, 2.0).float().transpose(1, 2).reshape(2, 7, 32))
        torch.testing.assert_close(own(x), want, atol=1e-5, rtol=1e-5)
    q, k, v = torch.randn(3, 2, 4, 6, 8)
    want = _capped(q, k, v, _causal(6, 6), 8 ** -0.5, 2.0).float()
    torch.testing.assert_close(styles.softcapped_attention(q, k, v), want, atol=1e-5, rtol=1e-5)
    for f in (styles.softcapped_no_softcap, styles.softcapped_after_mask, styles.softcapped_no_divide,
              styles.softcapped_other_cap):
        assert not torch.allclose(f(q, k, v), want, atol=1e-4), f.__name__


def test_gemma2_sliding_style_is_the_formula():
    torch.manual_seed(3)
    x = torch.randn(2, 7, 32)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    band = (i - j >= 0) & (i - j < 4)
    cos, sin = _rope(7, 16)
    mask = torch.zeros(7, 7).masked_fill(~_causal(7, 7), torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        g = styles.Gemma2Sliding(styles.Gemma2Config(), window=4).eval()
        q, k = styles.apply_rotary_pos_emb(_heads(x, g.q_proj, 4), _heads(x, g.k_proj, 2), cos, sin)
        v = _heads(x, g.v_proj, 2)
        heads = _capped(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), band, 24 ** -0.5, 2.0)
        want = g.o_proj(heads.float().transpose(1, 2).reshape(2, 7, 64))
        torch.testing.assert_close(g(x, (cos, sin), mask), want, atol=1e-5, rtol=1e-5)
        off = _same(styles.Gemma2Sliding(styles.Gemma2Config(), window=4, bug="off_by_one"), g)
        assert not torch.allclose(off(x, (cos, sin), mask), want, atol=1e-4)
    assert math.isclose(g.scaling, 24 ** -0.5)
