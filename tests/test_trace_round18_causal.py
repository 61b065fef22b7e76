"""`attnscope trace --causal` on code whose forward takes a causal switch of its own (usertrace/causalflag.py): the
switch is read from what its truth makes the code do, by experiment (a mask of one side of a diagonal, which it makes
by itself), and handed True, the code's mask parameters None, so that the mask is made once, by the code; plants of
the same code named by experiment. Styles of our own (tests/trace_styles_round18_causal.py), each checked against
F.scaled_dot_product_attention in float64, each plant shown to change it. And a mask's words read only where the
traced target states them (usertrace/statedmask.py; tests/trace_styles_round18_stated.py: classes of one file that
state opposite polarities)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import moved
from tracecases import assert_named, assert_passes, run_case

from attnscope.usertrace import causalflag, statedmask

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round18_causal.py")
STATED = str(Path(__file__).resolve().parent / "trace_styles_round18_stated.py")
styles = user_module(STYLES)


def _planted(cls, ours, bug):
    """`cls(bug=bug)` holding `ours`'s weights, float64, eval()."""
    wrong = cls(bug=bug).double().eval()
    wrong.load_state_dict(ours.state_dict())
    return wrong


def test_the_styles_are_causal_sdpa_with_their_switch_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        mha = moved(styles.CalledAsMHA())
        want = mha.out_proj(_merged(F.scaled_dot_product_attention(
            _heads(mha.q_proj(x)), _heads(mha.k_proj(x)), _heads(mha.v_proj(x)), is_causal=True)))
        assert torch.allclose(mha(x, x, x, is_causal=True)[0], want, atol=1e-10)
        assert not torch.allclose(mha(x, x, x)[0], want, atol=1e-3)  # its default: no mask
        for bug in ("scale_twice", "mask_flipped"):
            assert (_planted(styles.CalledAsMHA, mha, bug)(x, x, x, is_causal=True)[0] - want).abs().max() > 1e-2

        nano = moved(styles.NanoFlag())
        q, k, v = nano.c_attn(x).split(32, dim=2)
        want = nano.c_proj(_merged(F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), is_causal=True)))
        assert torch.allclose(nano(x, causal=True), want, atol=1e-10)
        assert not torch.allclose(nano(x), want, atol=1e-3)
        for bug in ("kv_swapped", "scale_none"):
            assert (_planted(styles.NanoFlag, nano, bug)(x, causal=True) - want).abs().max() > 1e-2

        layer = moved(styles.FlaggedLayer())
        q, k, v = (_heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        want = layer.o_proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        assert torch.allclose(layer(x, is_causal=True), want, atol=1e-10)
        assert not torch.allclose(layer(x), want, atol=1e-3)
        for bug in ("off_by_one", "mask_flipped", "softmax_axis"):
            assert (_planted(styles.FlaggedLayer, layer, bug)(x, is_causal=True) - want).abs().max() > 1e-2

        q, k, v = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.allclose(styles.switched_attention(q, k, v, causal=True), want, atol=1e-10)
        assert not torch.allclose(styles.switched_attention(q, k, v, local=True, causal=True), want, atol=1e-3)
        assert not torch.allclose(styles.switched_twice(q, k, v, causal=True), want, atol=1e-3)


RIGHT = [("CalledAsMHA", (), "is_causal"), ("NanoFlag", (), "causal"), ("FlaggedLayer", (), "is_causal"),
         ("switched_attention", ("--heads", "4"), "causal")]


@pytest.mark.parametrize(("name", "args", "switch"), RIGHT, ids=[r[0] for r in RIGHT])
def test_a_causal_switch_of_the_code_is_handed_true_under_causal(runner, name, args, switch):
    code, out = run_case(runner, STYLES, name, options=("--causal", *args))
    assert_passes(code, out)
    said = [n for n in out["notes"] if n.startswith(f"{switch} = True: with it your code masks by itself")]
    assert said, out["notes"]
    if name in ("CalledAsMHA", "FlaggedLayer"):  # never the code's mask and trace's together
        assert "= None, so that the mask is made once, by your code" in said[0], said
    assert not any(n.startswith("local = True") for n in out["notes"])  # a band is no causal switch


@pytest.mark.parametrize(("name", "args"), [("NanoFlag", ()), ("switched_attention", ("--heads", "4"))])
def test_without_causal_the_switch_keeps_its_default(runner, name, args):
    code, out = run_case(runner, STYLES, name, options=args)
    assert_passes(code, out)
    assert not any("causal switch" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "bug", "cause"), [
    ("CalledAsMHA", "scale_twice", "scale.twice"),
    ("CalledAsMHA", "mask_flipped", "mask.polarity"),
    ("NanoFlag", "kv_swapped", "kv.swapped"),
    ("NanoFlag", "scale_none", "scale.none"),
    ("FlaggedLayer", "off_by_one", "mask.off_by_one"),
    ("FlaggedLayer", "mask_flipped", "mask.polarity"),
    ("FlaggedLayer", "softmax_axis", "softmax.axis"),
])
def test_plants_behind_the_switch_are_named_by_experiment(runner, name, bug, cause):
    assert_named(*run_case(runner, STYLES, name, f"bug='{bug}'", ("--causal",)), cause)


def test_a_function_scaled_by_d_head_behind_its_switch_is_named(runner):
    assert_named(*run_case(runner, STYLES, "switched_twice", options=("--causal", "--heads", "4")), "scale.d_head")


@pytest.mark.parametrize(("rows", "expected"), [
    (torch.ones(5, 5).tril(), True),  # causal
    (torch.ones(5, 5).tril(-1), True),  # the diagonal masked too (off by one), row 0 of no key
    (torch.ones(5, 5).triu(), True),  # the other side
    (torch.ones(4, 7).tril(3), True),  # lower-right in a decode step
    (((torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs() < 2).double(), False),  # a band
    (torch.ones(5, 5), False),  # nothing masked
])
def test_one_side_of_a_diagonal(rows, expected):
    scores = torch.randn(2, 3, *rows.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = scores.masked_fill(rows == 0, torch.finfo(scores.dtype).min).softmax(-1)  # a row of no key: alike
    assert causalflag.half_plane(weights) is expected
    assert causalflag.half_plane(scores.masked_fill(rows == 0, float("-inf")).softmax(-1)) is expected  # NaN rows


def test_a_pattern_that_differs_between_sequences_is_no_switch():
    weights = torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(2)).tril()
    assert causalflag.half_plane(weights)
    weights[1, 4, 0] = 0
    assert not causalflag.half_plane(weights)


STATED_RIGHT = ["KeepWords", "MaskedWords", "NoWords"]


@pytest.mark.parametrize("name", STATED_RIGHT)
def test_each_class_reads_its_mask_as_its_own_words_say(runner, name):
    code, out = run_case(runner, STATED, name, options=("--causal",))
    assert_passes(code, out)
    assert not any("own words" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "words"), [("KeepWords", "True where a key may be attended"),
                                             ("MaskedWords", "1 = masked")])
def test_a_class_read_against_its_own_words_is_named_with_them(runner, name, words):
    code, out = run_case(runner, STATED, name, "bug='flipped'", ("--causal",))
    assert_named(code, out, "mask.polarity")
    assert any("as your code's own words say" in n and words in n for n in out["notes"]), out["notes"]


def test_the_words_of_a_neighbour_the_target_never_reaches_say_nothing(tmp_path):
    path = tmp_path / "two.py"
    path.write_text('class Plain:\n    def forward(self, x, mask=None):\n        return x\n\n\n'
                    'class Stated:\n    def forward(self, x, mask=None):\n        """mask: 1 = masked."""\n'
                    '        return x\n')
    assert statedmask.read(path, 3, "mask", traced=("Plain",)) is None
    said = statedmask.read(path, 9, "mask", traced=("Stated",))
    assert said is not None and said.kind == "masked"
    for name, kind in (("KeepWords", "attend"), ("MaskedWords", "masked"), ("NoWords", None)):
        said = statedmask.read(Path(STATED), None, "mask", traced=(name, "_Heads"))
        assert (said.kind if said else None) == kind, name
