"""`attnscope trace` on what held-out round 49 found (8/8 correct, 31/32 plants; PaLM, Speech2Text, HunYuan,
MiniCPM, Starcoder2, Idefics, Jamba, GPT-NeoX). Idefics' cross-attention with its keys taken from the value
projection (`key_states = self.v_proj(...)`, then k's RMSNorm on them) was left unnamed: the keys' norm, before its
weight, has rows of RMS 1, and valuenorm.py read it as a norm of the values (the values' own line-up row was the
misused keys), so every experiment ran on values normed as the code's never are. A tensor the pattern is computed
from (the queries' and keys' side: a softmax's ancestors, a kernel's query and key) is now never read as the values'
norm. The style is checked first against F.scaled_dot_product_attention in float64 with the norms written out."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case, saved

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round49_idefics.py")
styles = user_module(STYLES)
B, N_Q, N_K = 2, 5, 9
IMAGES = np.array([[True] * N_K, [True] * 6 + [False] * 3])


def _rms(x, weight):
    return weight * x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


def _reference(m, x, images, mask):
    q = m.q_proj(x).unflatten(-1, (m.num_heads, -1)).transpose(1, 2)
    k, v = (p(images).unflatten(-1, (m.num_heads, -1)).transpose(1, 2) for p in (m.k_proj, m.v_proj))
    q, k = _rms(q, m.q_layer_norm.weight), _rms(k, m.k_layer_norm.weight)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    return m.o_proj(out.transpose(1, 2).flatten(2))


def test_the_style_is_its_formula_and_the_plant_changes_it():
    g = torch.Generator().manual_seed(49)
    m = styles.IdeficsCrossAttention().double().eval()
    with torch.no_grad():
        for p in m.parameters():  # the norms' weights too: off 1
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1]) + (
                1.0 if p.dim() == 1 else 0.0))
        x = torch.randn(B, N_Q, 32, generator=g, dtype=torch.float64)
        images = torch.randn(B, N_K, 48, generator=g, dtype=torch.float64)
        mask = torch.from_numpy(IMAGES)
        got = m(x, images, mask.double())
        assert (got - _reference(m, x, images, mask)).abs().max() < 1e-6  # its variance in float32
        planted = styles.IdeficsCrossAttention(bug="keys_from_values").double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x, images, mask.double()) - got).abs().max() > 1e-3


@pytest.fixture()
def images(tmp_path):
    return saved(tmp_path, "images.npy", IMAGES)


def test_keys_taken_from_the_values_and_normed_are_named(runner, images):
    options = ("--nq", str(N_Q), "--nk", str(N_K), "--mask", images, "--qk-norm", "head")
    assert_passes(*run_case(runner, STYLES, "IdeficsCrossAttention", None, options))
    found = assert_named(*run_case(runner, STYLES, "IdeficsCrossAttention", "bug='keys_from_values'", options),
                         "kv.keys_from_values")
    assert "normalizes its values" not in found["diagnosis"]
