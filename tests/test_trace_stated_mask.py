"""`attnscope trace` on code whose own words say how it reads its boolean mask (usertrace/statedmask.py): where
its ops read the mask the other way round, the mask is given as the words say and `mask.polarity` is named by
experiment; where they agree, or the words say nothing, the ops' convention is read and the run passes
(tests/trace_styles_stated_mask.py; each style checked against F.scaled_dot_product_attention in float64, each bug
shown to change the output)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

from attnscope.usertrace import statedmask

STYLES = str(Path(__file__).resolve().parent / "trace_styles_stated_mask.py")
styles = user_module(STYLES)


def _moved(module):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return module.double()


def _sdpa_heads(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def test_the_styles_are_sdpa_and_the_flipped_masks_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 24, generator=g, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    m = _moved(styles.TutorialMHA())
    q, k, v = (w(x).view(2, 5, 3, 8).transpose(1, 2) for w in (m.w_q, m.w_k, m.w_v))
    want = m.w_o(_sdpa_heads(q, k, v, causal).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(m(x, causal[None]), want, atol=1e-10)
    flipped = styles.TutorialFlipped().double()
    flipped.load_state_dict(m.state_dict())
    assert not torch.allclose(flipped(x, causal[None]), want, atol=1e-3)

    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = _sdpa_heads(q, k, v, causal)
    assert torch.allclose(styles.SplitCore()(q, k, v, ~causal[None, None]), want, atol=1e-10)
    assert not torch.allclose(styles.SplitFlipped()(q, k, v, ~causal[None, None]), want, atol=1e-3)
    assert not torch.allclose(styles.SplitTwice()(q, k, v, ~causal[None, None]), want, atol=1e-3)

    keys = torch.tensor([[True] * 6 + [False] * 3, [True] * 8 + [False]])
    context = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    c = _moved(styles.FoldedCross())
    q = c.to_q(x).view(2, 5, 3, 8).transpose(1, 2)
    k, v = (w(context).view(2, 9, 3, 8).transpose(1, 2) for w in (c.to_k, c.to_v))
    want = c.to_out(_sdpa_heads(q, k, v, keys[:, None, None, :]).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(c(x, context, keys), want, atol=1e-10)
    wrong = styles.FoldedFlipped().double()
    wrong.load_state_dict(c.state_dict())
    assert not torch.allclose(wrong(x, context, keys), want, atol=1e-3)

    h = torch.randn(2, 9, 24, generator=g, dtype=torch.float64)
    w = _moved(styles.WhereMHA())
    q, k, v = w.qkv(h).view(2, 9, 3, 3, 8).permute(2, 0, 3, 1, 4)
    want = w.out(_sdpa_heads(q, k, v, keys[:, None, None, :]).transpose(1, 2).reshape(2, 9, 24))
    assert torch.allclose(w(h, keys.long()), want, atol=1e-10)
    wrong = styles.WhereFlipped().double()
    wrong.load_state_dict(w.state_dict())
    assert not torch.allclose(wrong(h, keys.long()), want, atol=1e-3)

    q, k, v = (torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = _sdpa_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal).transpose(1, 2)
    assert torch.allclose(styles.heads_last_attention(q, k, v, causal), want, atol=1e-10)
    assert not torch.allclose(styles.heads_last_flipped(q, k, v, causal), want, atol=1e-3)


@pytest.fixture
def padding(tmp_path):
    path = tmp_path / "pad.npy"
    np.save(path, np.array([[True] * 6 + [False] * 3, [True] * 8 + [False]]))
    return str(path)


def test_the_large_negative_styles_are_sdpa_and_the_flips_change_them():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 24, generator=g, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    m = _moved(styles.StaticBlock())
    q, k, v = (w(x).view(2, 5, 3, 8).transpose(1, 2) for w in (m.w_q, m.w_k, m.w_v))
    want = m.w_o(_sdpa_heads(q, k, v, causal).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(m(x, x, x, causal.long()), want, atol=1e-10)
    wrong = styles.StaticFlipped().double()
    wrong.load_state_dict(m.state_dict())
    assert not torch.allclose(wrong(x, x, x, causal.long()), want, atol=1e-3)

    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = _sdpa_heads(q, k, v, causal)
    assert torch.allclose(styles.minus_inf_attention(q, k, v, causal), want, atol=1e-10)
    assert not torch.allclose(styles.minus_inf_flipped(q, k, v, causal), want, atol=1e-3)

    keep = torch.tensor([[True] * 3 + [False] * 2, [True] * 4 + [False]])
    p = _moved(styles.PaddedKeys())
    q, k, v = p.qkv(x).view(2, 5, 3, 3, 8).permute(2, 0, 3, 1, 4)
    want = p.proj(_sdpa_heads(q, k, v, keep[:, None, None, :]).transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(p(x, (~keep).long()), want, atol=1e-10)
    wrong = styles.PaddedFlipped().double()
    wrong.load_state_dict(p.state_dict())
    assert not torch.allclose(wrong(x, (~keep).long()), want, atol=1e-3)


RIGHT = [("TutorialMHA", ("--causal",)), ("SplitCore", ("--heads", "3", "--causal")),
         ("FoldedCross", ("--batch", "2", "--nq", "5", "--nk", "9", "PAD")),
         ("WhereMHA", ("--batch", "2", "--nq", "9", "PAD")), ("heads_last_attention", ("--heads", "3", "--causal")),
         ("StaticBlock", ("--causal",)), ("minus_inf_attention", ("--heads", "3", "--causal")),
         ("PaddedKeys", ("--nq", "9", "PAD"))]
WRONG = [("TutorialFlipped", ("--causal",), "mask.polarity", 'True where a key may be attended'),
         ("SplitFlipped", ("--heads", "3", "--causal"), "mask.polarity", "True = masked"),
         ("FoldedFlipped", ("--batch", "2", "--nq", "5", "--nk", "9", "PAD"), "mask.polarity",
          "where the mask is False"),
         ("WhereFlipped", ("--batch", "2", "--nq", "9", "PAD"), "mask.polarity", "for tokens to attend"),
         ("heads_last_flipped", ("--heads", "3", "--causal"), "mask.polarity", "False means the weight is masked out"),
         ("SplitTwice", ("--heads", "3", "--causal"), "scale.twice", None),
         ("StaticFlipped", ("--causal",), "mask.polarity", "very low value (indicating -inf) to the positions where"),
         ("minus_inf_flipped", ("--heads", "3", "--causal"), "mask.polarity", "-inf where the mask is False"),
         ("PaddedFlipped", ("--nq", "9", "PAD"), "mask.polarity", "large negative value where the mask is 1")]


def _args(args, padding):
    return [a for arg in args for a in (("--mask", padding) if arg == "PAD" else (arg,))]


@pytest.mark.parametrize(("name", "args"), RIGHT, ids=[r[0] for r in RIGHT])
def test_code_that_reads_its_mask_as_its_words_say_passes(runner, padding, name, args):
    result, out = trace(runner, f"{STYLES}:{name}", *_args(args, padding))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not any("own words" in n for n in out["notes"])


@pytest.mark.parametrize(("name", "args", "experiment", "words"), WRONG, ids=[w[0] for w in WRONG])
def test_code_that_reads_its_mask_against_its_words_is_named(runner, padding, name, args, experiment, words):
    result, out = trace(runner, f"{STYLES}:{name}", *_args(args, padding))
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == experiment, out["first_divergence"]
    if words is not None:
        assert any("as your code's own words say" in n and words in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("text", "kind"), [
    ("mask: True = masked", "masked"), ("mask is True where a key may be attended", "attend"),
    ("attention_mask: 1 for tokens that are **not masked**, 0 for tokens that are **masked**.", "attend"),
    ("the mask: True for padded positions", "masked"),
    ("a key mask, filled with -finfo.max where False", "attend"),
    ("mask (bool): True means the query may not attend to the key", "masked"),
    ("the mask: zeros for tokens to keep", "masked"),
    ("mask: filled with -1e9 where the mask is 0", "attend"),
    ("Write a very low value (indicating -inf) to the positions where mask == 0", "attend"),
    ("the scores are set to -inf where the mask is 1.", "masked"),
    ("a mask of 0.5 or 1.0 means nothing here", None),
    ("attn_mask: additive float mask, 0 = may attend, -inf = masked", None),
    ("mask of shape [b, 1, n_Q, n_K]", None),
    ("causal_mask: True = future", None),
    ("padding_mask: True = padded", None),  # another parameter's words
])
def test_the_words_read(text, kind, tmp_path):
    path = tmp_path / "words.py"
    path.write_text(f'"""{text}"""\n')
    said = statedmask.read(path, None, "mask", ("padding_mask",))
    assert (said.kind if said else None) == kind, text


def test_words_of_both_polarities_in_one_place_say_none(tmp_path):
    path = tmp_path / "both.py"
    path.write_text('"""mask: True = masked. mask: True = may attend."""\n')
    assert statedmask.read(path, None, "mask") is None
    path.write_text('"""mask: True = masked. mask: True = may attend."""\n\n\ndef helper(mask):\n'
                    '    """mask: 1 for padding."""\n\n\ndef attend(mask):\n    return helper(mask)\n')
    said = statedmask.read(path, None, "mask", traced=("attend",))
    assert said is not None and said.kind == "masked" and said.line == 5
    assert statedmask.read(path, None, "mask", traced=("elsewhere",)) is None  # a helper the target never calls
