"""`attnscope trace` on Qwen2-VL's vision-tower attention (round 32, held out): no batch axis, the rotary tables or
angles handed in, one image a block of cu_seqlens. RoPE's angles handed as `rotary_pos_emb` [n_Q, d_head / 2]
(transformers 4.45's form, tests/trace_styles_round32_qwen2vl.py) are fed as the angles, never as a position
embedding added to the input; `position_embeddings` (cos, sin) without a batch axis where the code has none
(transformers 5's VisionAttention, traced in place); and a --forward list given to a parameter annotated as a tensor
(`cu_seqlens: torch.Tensor`, which transformers 5 subtracts from itself) is handed as a tensor. Each style is first
checked against float64 SDPA on its own weights, apart from attnscope."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case, saved
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round32_qwen2vl.py")
HF = str(Path(transformers.__file__).parent / "models" / "qwen2_vl" / "modeling_qwen2_vl.py")
styles = user_module(STYLES)
N, D, H = 12, 64, 4  # tokens (two images: 5 and 7 patches), width, heads
CUTS = [0, 5, 12]


def _blocks() -> torch.Tensor:
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for a, b in zip(CUTS, CUTS[1:], strict=False):
        allowed[a:b, a:b] = True
    return allowed


@pytest.fixture
def mask_file(tmp_path):
    return saved(tmp_path, "blocks.npy", _blocks())  # True = may attend


def _angles(width: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width))
    return torch.arange(N, dtype=torch.float64)[:, None] * inv_freq  # [N, width / 2]


def _sdpa(module, x: torch.Tensor, turn_keys: bool = True) -> torch.Tensor:
    """float64: the fused projection split, each head's halves turned (rotate_half), SDPA within each image."""
    d = D // H
    q, k, v = module.qkv(x).reshape(N, 3, H, d).permute(1, 2, 0, 3)  # [H, N, d] each
    angle = torch.cat((_angles(d), _angles(d)), dim=-1)  # [N, d]

    def turned(t):
        return t * angle.cos() + torch.cat((-t[..., d // 2:], t[..., :d // 2]), dim=-1) * angle.sin()

    q, k = turned(q), turned(k) if turn_keys else k
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_blocks())  # [H, N, d]
    return module.proj(out.transpose(0, 1).reshape(N, D))


OPTIONS = ("--batch", "0", "--nq", str(N), "--rope", "--forward", f"cu_seqlens={CUTS}")


def test_the_style_is_sdpa_and_the_plant_changes_it():
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(320), dtype=torch.float64)
    with torch.no_grad():
        m = styles.VisionAttention().double()
        # its rotation runs in float32 (apply_rotary_pos_emb_vision's .float())
        assert torch.allclose(m(x, torch.tensor(CUTS), _angles(D // H)), _sdpa(m, x), atol=1e-5)
        planted = styles.VisionAttention(bug="keys_unturned").double()
        planted.load_state_dict(m.state_dict())
        assert torch.allclose(planted(x, torch.tensor(CUTS), _angles(D // H)), _sdpa(m, x, turn_keys=False),
                              atol=1e-5)
        assert (planted(x, torch.tensor(CUTS), _angles(D // H)) - _sdpa(m, x)).abs().max() > 1e-3


def test_transformers_vision_attention_is_sdpa_within_each_image():
    """transformers 5's VisionAttention (eager, each image's chunk apart) on the same float64 formula."""
    torch.manual_seed(321)
    m = hf.VisionAttention(hf.Qwen2VLVisionConfig(embed_dim=D, num_heads=H)).double().eval()
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(N, D, dtype=torch.float64)
        angle = torch.cat((_angles(D // H), _angles(D // H)), dim=-1)
        got = m(x, torch.tensor(CUTS), position_embeddings=(angle.cos(), angle.sin()))
        assert torch.allclose(got, _sdpa(m, x), atol=1e-5)  # its rotation runs in float32 too


def test_angles_handed_as_rotary_pos_emb_line_up(runner, mask_file):
    code, out = run_case(runner, STYLES, "VisionAttention", None, (*OPTIONS, "--mask", mask_file))
    assert_passes(code, out)
    fed = next(s for s in out["steps"] if s["name"] == "rotary_pos_emb")
    assert fed["shape"] == [N, D // H // 2] and "position·inv_freq" in fed["op"], fed


def test_keys_never_turned_are_named(runner, mask_file):
    assert_named(*run_case(runner, STYLES, "VisionAttention", "bug='keys_unturned'", (*OPTIONS, "--mask", mask_file)),
                 "rope.not_applied")


@pytest.mark.parametrize("cuts", [[0, N], CUTS])
def test_transformers_vision_attention_passes_in_place(runner, tmp_path, cuts):
    """position_embeddings (cos, sin) [n_Q, d_head] for code without a batch axis, and cu_seqlens=[...] handed as
    the tensor its annotation says: one image, or two with the block mask (each image's chunk attended apart)."""
    init = f"config=Qwen2VLVisionConfig(embed_dim={D}, num_heads={H})"
    options = ["--batch", "0", "--nq", str(N), "--rope", "--forward", f"cu_seqlens={cuts}"]
    if len(cuts) > 2:
        options += ["--mask", saved(tmp_path, "blocks.npy", _blocks())]
    code, out = run_case(runner, HF, "VisionAttention", init, options)
    assert_passes(code, out)
