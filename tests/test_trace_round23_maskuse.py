"""A --mask file goes to the argument the code uses as a mask, read from its use where no argument is named like one:
bfb7eb6 refused such a file in one line (exit 2: `forward(x, key_padding=None)` ran without it). Each optional
argument is tried as the mask and kept where the code applies it to its scores or weights (masked_fill, where, added
to them, multiplying them, an attention kernel's attn_mask: usertrace/maskuse.py); the refusal stays where none is
(an optional temperature the scores are divided by is no mask). Styles of our own
(tests/trace_styles_round23_maskuse.py), each checked against F.scaled_dot_product_attention in float64 with the
file as its boolean mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from tracecases import assert_named, assert_passes, case_ids, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round23_maskuse.py")
styles = user_module(STYLES)
KEEP = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # [n_batch, n_K]


def _adjacency() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.rand(7, 7, generator=g) < 0.5) | torch.eye(7, dtype=torch.bool)


def _prefix() -> torch.Tensor:
    i = torch.arange(7)
    return (i[None] <= i[:, None]) | (i[None] < 3)  # the first 3 tokens seen by all, causal after them


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("maskuse")
    made = {"ADJ": _adjacency(), "KEEP": KEEP, "PREFIX": _prefix()}
    for name, mask in made.items():
        np.save(folder / f"{name.lower()}.npy", mask.numpy())
    return {name: str(folder / f"{name.lower()}.npy") for name in made}


def _sdpa(x, q, k, v, out, heads, mask):
    b, n, _ = x.shape
    split = [t(x).view(b, n, heads, -1).transpose(1, 2) for t in (q, k, v)]
    return out(F.scaled_dot_product_attention(*split, attn_mask=mask).transpose(1, 2).reshape(b, n, -1))


def test_the_styles_are_attention_under_the_mask():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.GraphAttention().double()
    torch.testing.assert_close(m(x, _adjacency().long()), _sdpa(x, m.W_q, m.W_k, m.W_v, m.W_o, 2, _adjacency()))
    m = styles.ValidTokens().double()
    torch.testing.assert_close(m(x, KEEP.long()), _sdpa(x, m.query, m.key, m.value, m.dense, 2,
                                                         KEEP[:, None, None, :]))
    m = styles.PrefixLM().double()
    q, k, v = (lambda t, i=i: m.c_attn(t).split(16, -1)[i] for i in range(3))
    torch.testing.assert_close(m(x, _prefix()), _sdpa(x, q, k, v, m.c_proj, 2, _prefix()))


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    for name, bug, mask in (("GraphAttention", "after_softmax", _adjacency()), ("ValidTokens", "on_queries", KEEP),
                            ("PrefixLM", "transposed", _prefix()), ("PrefixLM", "kv_swapped", _prefix())):
        good, bad = getattr(styles, name)(), getattr(styles, name)(bug=bug)
        assert (good(x, mask) - bad(x, mask)).abs().max() > 1e-3, (name, bug)


CORRECT = [("GraphAttention", "adj", "ADJ", "e.masked_fill("), ("ValidTokens", "valid", "KEEP", "scores + "),
           ("PrefixLM", "visible", "PREFIX", "scaled_dot_product_attention(")]


@pytest.mark.parametrize(("target", "parameter", "file", "op"), CORRECT, ids=case_ids(CORRECT))
def test_the_argument_the_code_uses_as_its_mask_takes_the_file(runner, files, target, parameter, file, op):
    code, out = run_case(runner, STYLES, target, None, ("--nq", "7", "--batch", "2", "--mask", files[file]))
    assert_passes(code, out)
    said = [" ".join(n.split()) for n in out["notes"] if n.startswith(f"{parameter}: given the --mask file")]
    assert said and op in said[0] and said[0].endswith("though it is not named like a mask"), out["notes"]


PLANTS = [("GraphAttention", "after_softmax", "ADJ", "mask.after_softmax"),
          ("ValidTokens", "on_queries", "KEEP", "mask.on_queries"),
          ("PrefixLM", "transposed", "PREFIX", "mask.transposed"),
          ("PrefixLM", "kv_swapped", "PREFIX", "kv.swapped")]


@pytest.mark.parametrize(("target", "bug", "file", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_the_plants_are_named_by_experiment(runner, files, target, bug, file, entry):
    code, out = run_case(runner, STYLES, target, f"bug={bug!r}", ("--nq", "7", "--batch", "2", "--mask", files[file]))
    assert_named(code, out, entry)


def test_an_argument_that_is_no_mask_still_gets_the_refusal(runner, files):
    result, out = trace(runner, f"{STYLES}:Tempered", "--nq", "7", "--batch", "2", "--mask", files["PREFIX"])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and out is None, result.stdout
    assert "--mask prefix.npy was given to no argument of Tempered.forward(x, temperature=None)" in said, said
    assert "temperature is neither" in said, said
    assert_passes(*run_case(runner, STYLES, "Tempered", None, ("--nq", "7", "--batch", "2")))
