"""`attnscope trace` on code that takes its mask in two forms and builds its own rule from one of them only:
transformers' Mistral before 4.48 (`_prepare_4d_causal_attention_mask_with_cache_position`) passes a 4-D mask
through as it is and makes the causal mask, with its sliding window, from a 2-D 0/1 key padding. Handed the 4-D
form with the rule in it, the code's own window was never run, so a window left out of it passed (held-out round
48); trace now gives such code the key padding alone, in the shape and convention its own rule is built from
(runs/trace_mask.py's _keys_form), and checks the code's rule. The 2-D branch's `(causal + mask) == 0` is read as a
0/1 mask merged into the code's own, not as a mask added to the scores (masking._compared_after). The style is
checked first against F.scaled_dot_product_attention in float64 with the window and padding written out."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round49_keysform.py")
styles = user_module(STYLES)
B, T, W = 2, 9, 3
PADDING = np.array([[True] * T, [True] * 7 + [False] * 2])  # the second sequence's last 2 keys: every query keeps one


def _rotate(x):
    d = x.shape[-1]
    angle = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.cat((angle, angle), -1)
    return x * angle.cos() + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * angle.sin()


def _reference(m, x):
    q, k, v = (p(x).unflatten(-1, (-1, m.head_dim)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    q, k = _rotate(q), _rotate(k)
    k, v = (t.repeat_interleave(m.heads // m.kv_heads, 1) for t in (k, v))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & (j > i - W) & torch.from_numpy(PADDING)[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return m.o_proj(out.transpose(1, 2).flatten(2))


def test_the_style_is_its_formula_and_the_plants_change_it():
    g = torch.Generator().manual_seed(49)
    m = styles.MistralSdpaFreeAttention().double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1]))
        x = torch.randn(B, T, 40, generator=g, dtype=torch.float64)
        padding = torch.from_numpy(PADDING).double()
        got = m(x, padding)[0]
        assert (got - _reference(m, x)).abs().max() < 1e-6
        for bug in ("window_only_cached", "softmax_queries"):
            planted = styles.MistralSdpaFreeAttention(bug=bug).double().eval()
            planted.load_state_dict(m.state_dict())
            # (the softmax over the queries, in float32 as the style's is, meets float64's finfo.min as -inf: a
            # padded key's column of -inf gives NaN)
            assert (planted(x, padding)[0] - got).nan_to_num(nan=1.0).abs().max() > 1e-3


@pytest.fixture()
def padding(tmp_path):
    return saved(tmp_path, "padding.npy", PADDING)


def test_the_code_builds_its_rule_from_key_padding_and_lines_up(runner, padding):
    code, out = run_case(runner, STYLES, "MistralSdpaFreeAttention", None,
                         ("--causal", "--window", str(W), "--rope", "--mask", padding))
    assert_passes(code, out)
    notes = " ".join(out["notes"])
    assert "key padding alone" in notes and "more than one form" not in notes, notes


@pytest.mark.parametrize(("bug", "entry"), [("window_only_cached", "mask.no_window"),
                                            ("softmax_queries", "softmax.axis")])
def test_the_codes_own_rule_is_the_one_checked(runner, padding, bug, entry):
    assert_named(*run_case(runner, STYLES, "MistralSdpaFreeAttention", f"bug='{bug}'",
                           ("--causal", "--window", str(W), "--rope", "--mask", padding)), entry)
