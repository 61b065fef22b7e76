"""`attnscope trace` on what held-out round 43 found. phi-1.5's MixFormer writes its key padding into a bias,
`torch.full((b, s), -10000.0).masked_fill_(key_padding_mask, 0.0)`, and adds it: True may attend, though the op is a
masked_fill on the mask. trace read every masked_fill of a mask as True = masked out, so correct code was called
mask.polarity, and each of its plants came with that false cause beside its own. A masked_fill (or where) of a mask
into a tensor of one number the code made is now a bias whose fill says the polarity (masking._filled_bias), and
such a bias, added to the scores, makes a parameter the mask whatever its name (maskuse.applied). Each style is
checked against F.scaled_dot_product_attention in float64, each plant shown to change its output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, case_ids, run_case, saved

HERE = Path(__file__).resolve().parent
STYLES = str(HERE / "trace_styles_round43.py")
styles = user_module(STYLES)
B, N, D, H = 2, 7, 32, 4


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.view(B, N, H, D // H).transpose(1, 2)


def _merged(o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2).reshape(B, N, D)


def reference(name: str, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """SDPA in float64 on the style's own weights; `keep` [B, N] True = a real key; PhiMixFormer causal too."""
    m = getattr(styles, name)().double()
    allowed = keep[:, None, None, :].expand(B, 1, N, N)
    if name == "PhiMixFormer":
        q, k, v = (_heads(t) for t in m.Wqkv(x).chunk(3, dim=-1))
        allowed = allowed & torch.ones(N, N, dtype=torch.bool).tril()
        return m.out_proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
    if name == "ZeroPadBias":
        q, k, v = (_heads(lin(x)) for lin in (m.q_lin, m.k_lin, m.v_lin))
        return m.out_lin(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
    q, k, v = (_heads(t) for t in m.qkv(x).chunk(3, dim=-1))
    return m.proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))


def run_style(name: str, x: torch.Tensor, keep: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    """The style with its mask in its own convention: MixFormer's True = may attend, ZeroPadBias' and
    KeepBiasInverted's True = pad."""
    m = getattr(styles, name)(bug=bug).double()
    return m(x, keep) if name == "PhiMixFormer" else m(x, ~keep)


PLANTS = [("PhiMixFormer", "diagonal", "mask.off_by_one"), ("PhiMixFormer", "scaled_twice", "scale.twice"),
          ("PhiMixFormer", "merge", "heads.merge_without_transpose"),
          ("ZeroPadBias", "scale_model", "scale.d_model"), ("ZeroPadBias", "merge", "heads.merge_without_transpose"),
          ("KeepBiasInverted", "scaled_twice", "scale.twice")]


@pytest.mark.parametrize("name", ["PhiMixFormer", "ZeroPadBias", "KeepBiasInverted"])
def test_the_styles_are_sdpa_and_the_plants_change_them(name):
    g = torch.Generator().manual_seed(43)
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 5:] = False
    want = reference(name, x, keep)
    with torch.no_grad():
        assert torch.allclose(run_style(name, x, keep), want, atol=1e-10)
        for _, bug, _ in (p for p in PLANTS if p[0] == name):
            assert (run_style(name, x, keep, bug) - want).abs().max() > 1e-3, bug


@pytest.fixture()
def padding(tmp_path):
    keep = np.ones((B, N), dtype=bool)
    keep[1, 5:] = False
    return ("--batch", str(B), "--nq", str(N), "--mask", saved(tmp_path, "pad.npy", keep))


def _options(name: str, padding: tuple[str, ...]) -> tuple[str, ...]:
    return ("--causal",) if name == "PhiMixFormer" else padding


def test_a_bias_of_minus_10000_filled_with_0_where_the_mask_holds_reads_true_as_may_attend(runner, padding):
    """MixFormer with trace's own padding (only --causal asked), and with a --mask file: exit 0, its polarity read
    from the bias its masked_fill writes."""
    for options in (("--causal",), ("--causal", *padding)):
        code, out = run_case(runner, STYLES, "PhiMixFormer", None, options)
        assert_passes(code, out)
        assert any(n.startswith("attention_mask: boolean, True = may attend") and "written into a bias, very "
                   "negative where it is False" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize("name", ["ZeroPadBias", "KeepBiasInverted"])
def test_a_bias_written_the_other_way_reads_true_as_masked_out(runner, padding, name):
    """A bias of zeros filled with -inf where the mask holds, and one of -1e9 filled with 0 where its complement
    holds, both True = masked out; KeepBiasInverted's `padding`, no mask by its name, is the mask by that bias."""
    code, out = run_case(runner, STYLES, name, None, padding)
    assert_passes(code, out)
    said = [n for n in out["notes"] if "True = masked out" in n]
    assert said and "written into a bias, very negative where it is True" in said[0], out["notes"]


@pytest.mark.parametrize(("name", "bug", "entry"), PLANTS, ids=case_ids(PLANTS))
def test_the_plants_are_named_alone(runner, padding, name, bug, entry):
    found = assert_named(*run_case(runner, STYLES, name, f"bug={bug!r}", _options(name, padding)), entry)
    assert "mask" not in found["experiment"] or entry.startswith("mask"), found
