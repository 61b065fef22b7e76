"""`attnscope trace` on round 14b's kinds (tests/trace_styles_round14_groups.py; each correct style checked against
F.scaled_dot_product_attention in float64, each bug shown to change the output):
- a mask the code compares with a number (`mask < 0`, `mask == finfo.min`, `mask > -1`) is additive, and the mask
  applied after the softmax that way is `mask.after_softmax`, by experiment;
- dropout left on is `dropout.left_on` by experiment wherever it sits: on the heads' output, on the merged heads
  before the output projection, after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round14_groups.py")
styles = user_module(STYLES)
COMPARED = ("SlicedCompared", "WhereBelowZero", "FinfoMinEquals")
DROPPED = ("ResidDropoutAfterProj", "DropoutBeforeProj", "DropoutOnHeads")


def _lin(layer, x):
    return F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())


def _heads(t, b, n, h=4):
    return t.view(b, n, h, -1).transpose(1, 2)  # [b, n, h·d] -> [b, h, n, d]


FUSED = (("to_qkv", "to_out"), ("qkv", "proj"), ("qkv", "dense"), ("c_attn", "c_proj"))


def _qkv_out(m, x):
    """(q, k, v) [b, h, n, d] in float64 and the output projection, from each style's own weights."""
    b, n, _ = x.shape
    if hasattr(m, "q_proj"):
        q, k, v, out = _lin(m.q_proj, x), _lin(m.k_proj, x), _lin(m.v_proj, x), m.o_proj
    elif hasattr(m, "to_q"):
        q, k, v, out = _lin(m.to_q, x), _lin(m.to_k, x), _lin(m.to_v, x), m.to_out
    elif hasattr(m, "W_q"):
        q, k, v, out = _lin(m.W_q, x), _lin(m.W_k, x), _lin(m.W_v, x), m.W_o
    else:
        fused, proj = next((f, p) for f, p in FUSED if hasattr(m, f) and hasattr(m, p))
        q, k, v = _lin(getattr(m, fused), x).chunk(3, -1)  # each style's fused output is [q | k | v]
        out = getattr(m, proj)
    return _heads(q, b, n), _heads(k, b, n), _heads(v, b, n), out


def _sdpa64(m, x, allowed):
    q, k, v, out = _qkv_out(m, x)
    b, n, _ = x.shape
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return _lin(out, y.transpose(1, 2).reshape(b, n, -1))


def test_the_styles_are_their_formulas_and_the_bugs_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 32, generator=g)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & torch.tensor([[1] * 6, [1] * 4 + [0] * 2],
                                                                                  dtype=torch.bool)[:, None, None, :]
    with torch.no_grad():
        for name in COMPARED:
            torch.manual_seed(1)
            right = getattr(styles, name)().eval()
            torch.manual_seed(1)
            wrong = getattr(styles, name)(bug="after").eval()
            fill = torch.finfo(torch.float32).min if name == "FinfoMinEquals" else float("-inf")
            bias = torch.zeros(2, 1, 6, 6).masked_fill(~allowed, fill)
            got = right(x, bias)
            assert torch.allclose(got.double(), _sdpa64(right, x, allowed), atol=1e-5), name
            assert not torch.allclose(wrong(x, bias), got, atol=1e-3), name
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        for name in DROPPED:
            torch.manual_seed(1)
            right = getattr(styles, name)().eval()
            torch.manual_seed(1)
            wrong = getattr(styles, name)(bug="on").eval()
            got = right(x)
            assert torch.allclose(got.double(), _sdpa64(right, x, causal), atol=1e-5), name
            assert not torch.allclose(wrong(x), got, atol=1e-3), name


@pytest.mark.parametrize("name", COMPARED)
def test_a_mask_compared_with_a_number_is_additive_and_after_the_softmax_by_experiment(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = " ".join(out["notes"])
    assert "additive float, 0 = may attend" in said, said
    if name != "SlicedCompared":  # it adds its mask (the comparison is its bug's)
        assert "it compares the mask with a number that tells an additive mask's 0 and" in said, said
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='after'", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "mask.after_softmax" and first["evidence"].startswith("by experiment"), first


def test_a_compared_mask_with_padding(runner, tmp_path):
    padded = torch.ones(2, 7, dtype=torch.bool)  # the file: True = may attend, the second sequence's last 2 padded
    padded[1, 5:] = False
    path = tmp_path / "pad.pt"
    torch.save(padded, path)
    args = ("--batch", "2", "--nq", "7", "--mask", str(path), "--causal")
    result, out = trace(runner, f"{STYLES}:WhereBelowZero", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:SlicedCompared", "--init", "bug='after'", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "mask.after_softmax", out["first_divergence"]


@pytest.mark.parametrize("name", DROPPED)
def test_dropout_left_on_anywhere_on_the_output_is_named_by_experiment(runner, name):
    result, out = trace(runner, f"{STYLES}:{name}", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='on'", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "dropout.left_on" and first["evidence"].startswith("by experiment"), first
    assert "training argument defaults to True" in first["diagnosis"], first


# --- attention within groups of tokens the module makes itself --------------------------------------------------

GROUPED = {"UnfoldPatches": lambda r, c: (r % 2) * 2 + c % 2,  # the same pixel of each 2×2 patch
           "WindowPartition": lambda r, c: (r // 2) * 2 + c // 2,  # the same 2×2 window
           "ChunkedLocal": lambda r, c: (r * 4 + c) // 4,  # the same chunk of 4 consecutive tokens
           "AxialColumns": lambda r, c: c}  # the same column of the 4×4 grid


def _same_group(name: str) -> torch.Tensor:
    """[16, 16], True where two tokens of the 4×4 grid (raster order) share a group of the style's."""
    t = torch.arange(16)
    label = GROUPED[name](t // 4, t % 4)
    return label[:, None] == label[None, :]


def _grouped64(m, x, allowed):
    """The style as SDPA over the whole sequence under its group mask, in float64, with its own weights."""
    b, n, d = x.shape
    if hasattr(m, "to_kv"):
        q, (k, v), out = _lin(m.to_q, x), _lin(m.to_kv, x).chunk(2, -1), m.to_out
        q, k, v = _heads(q, b, n), _heads(k, b, n), _heads(v, b, n)
    else:
        q, k, v, out = _qkv_out(m, x)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return _lin(out, y.transpose(1, 2).reshape(b, n, -1))


def test_the_grouped_styles_are_sdpa_under_their_group_mask_and_the_bugs_change_them():
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name in GROUPED:
            torch.manual_seed(1)
            right = getattr(styles, name)().eval()
            torch.manual_seed(1)
            wrong = getattr(styles, name)(bug="scale").eval()
            got = right(x)
            assert torch.allclose(got.double(), _grouped64(right, x, _same_group(name)), atol=1e-5), name
            assert not torch.allclose(wrong(x), got, atol=1e-3), name
        torch.manual_seed(1)
        unfolded = styles.WindowPartition(bug="fold").eval()
        assert not torch.allclose(unfolded(x).double(), _grouped64(unfolded, x, _same_group("WindowPartition")),
                                  atol=1e-3)
        torch.manual_seed(1)
        band = styles.OwnBandMask().eval()
        torch.manual_seed(1)
        after = styles.OwnBandMask(bug="after").eval()
        x8 = x[:, :8]
        got = band(x8)
        assert torch.allclose(got.double(), _sdpa64(band, x8, styles.band_pattern(8)), atol=1e-5)
        assert not torch.allclose(after(x8), got, atol=1e-3)


@pytest.mark.parametrize("name", list(GROUPED))
def test_groups_the_module_makes_are_its_convention_and_a_plant_inside_is_named(runner, name, tmp_path):
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", "16")
    assert result.exit_code == 0, result.stdout + result.stderr
    said = " ".join(out["notes"])
    assert "your code attends within groups of 4 tokens (4 a sequence" in said, said
    assert "a --mask [n_batch, n_Q, n_K] True where two tokens share a group says the same" in said, said
    path = tmp_path / "groups.pt"
    torch.save(_same_group(name), path)
    result, out = trace(runner, f"{STYLES}:{name}", "--nq", "16", "--mask", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "the --mask file allows no pair across them" in " ".join(out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", "--init", "bug='scale'", "--nq", "16")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"].startswith("scale.") and first["evidence"].startswith("by experiment"), first
    assert first["reference"] == "scores", first


def test_causal_chunks_are_the_causal_rule_within_each_group(runner):
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.manual_seed(1)
        right = styles.CausalChunks().eval()
        torch.manual_seed(1)
        wrong = styles.CausalChunks(bug="scale").eval()
        allowed = _same_group("ChunkedLocal") & torch.ones(16, 16, dtype=torch.bool).tril()
        assert torch.allclose(right(x).double(), _sdpa64(right, x, allowed), atol=1e-5)
        assert not torch.allclose(wrong(x), right(x), atol=1e-3)
    result, out = trace(runner, f"{STYLES}:CausalChunks", "--nq", "16", "--causal")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "the causal rule within each group, its tokens in order" in " ".join(out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:CausalChunks", "--init", "bug='scale'", "--nq", "16", "--causal")
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"].startswith("scale.") and first["evidence"].startswith("by experiment"), first


def test_a_fold_that_does_not_undo_the_unfold_and_a_mask_across_groups_are_no_pass(runner, tmp_path):
    result, out = trace(runner, f"{STYLES}:WindowPartition", "--init", "bug='fold'", "--nq", "16")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["reference"] == "x", out["first_divergence"]
    assert "does not put the tokens back" in out["first_divergence"]["diagnosis"], out["first_divergence"]
    path = tmp_path / "wide.pt"  # each token may see its own window and the next one: pairs across the groups
    torch.save(_same_group("WindowPartition") | _same_group("ChunkedLocal"), path)
    result, out = trace(runner, f"{STYLES}:WindowPartition", "--nq", "16", "--mask", str(path))
    assert result.exit_code == 1, result.stdout + result.stderr


def test_a_mask_file_describes_the_reference_of_a_forward_that_takes_none(runner, tmp_path):
    result, out = trace(runner, f"{STYLES}:OwnBandMask", "--nq", "8")  # its own pattern, untold: --mask says it
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "masks by itself with a pattern of its own" in out["first_divergence"]["diagnosis"], out
    assert "describe it with --mask FILE" in out["first_divergence"]["diagnosis"], out
    path = tmp_path / "band.pt"
    torch.save(styles.band_pattern(8), path)
    result, out = trace(runner, f"{STYLES}:OwnBandMask", "--nq", "8", "--mask", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "takes no mask, so the file describes the reference alone" in " ".join(out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:OwnBandMask", "--init", "bug='after'", "--nq", "8", "--mask", str(path))
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == "mask.after_softmax" and first["evidence"].startswith("by experiment"), first
