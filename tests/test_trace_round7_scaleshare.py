"""`attnscope trace` on a scale split between the queries and the keys (issue 41; tests/
trace_styles_round7_scaleshare.py): Whisper's `q * d_head ** -0.25`, `k * d_head ** -0.25` is the reference's
scale, and the share one of them forgets is `scale.half` by experiment, with the share the code kept read from its
tensors; the scores scaled once by d_head^-0.25 (no share held) are said so. Each correct style is checked apart from
attnscope against F.scaled_dot_product_attention, and each planted bug changes its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED
from test_trace_command import user_module
from tracecases import run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round7_scaleshare.py")
styles = user_module(STYLES)

# entry -> [(target, how the bug is given (--init or --forward), the bug)]; test_trace_catalog counts them
PLANTED: dict[str, list[tuple[str, str, str]]] = {
    "scale.half": [
        ("SpeechSelfAttention", "--init", "k_share"),
        ("SpeechSelfAttention", "--init", "q_share"),
        ("split_scale_attention", "--forward", "k_share"),
        ("split_scale_attention", "--forward", "q_share"),
        ("FusedShares", "--init", "k_share"),
        ("FusedShares", "--init", "q_share"),
    ],
}


def _heads(t: torch.Tensor, h: int = 4) -> torch.Tensor:
    return t.view(*t.shape[:-1], h, -1).transpose(1, 2).double()


def _merged(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1).float()


def test_styles_against_sdpa():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    module = styles.SpeechSelfAttention().eval()
    q, k, v = (_heads(layer(x)) for layer in (module.query, module.key, module.value))
    expected = module.out(_merged(F.scaled_dot_product_attention(q, k, v)))
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-4)
    module = styles.FusedShares().eval()
    q, k, v = (_heads(t) for t in module.to_qkv(x).chunk(3, dim=-1))
    expected = module.proj(_merged(F.scaled_dot_product_attention(q, k, v)))
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-4)
    q, k, v = torch.randn(3, 2, 4, 7, 8).unbind(0)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
    torch.testing.assert_close(styles.split_scale_attention(q, k, v), expected, atol=1e-5, rtol=1e-4)

    for cls in (styles.SpeechSelfAttention, styles.FusedShares):
        kept = cls().eval()
        for bug in ("q_share", "k_share"):
            mutant = cls(bug=bug).eval()
            mutant.load_state_dict(kept.state_dict())
            assert not torch.allclose(mutant(x), kept(x), atol=1e-3), (cls, bug)
    for bug in ("q_share", "k_share", "fourth_root"):
        assert not torch.allclose(styles.split_scale_attention(q, k, v, bug), styles.split_scale_attention(q, k, v))


def _run(runner, target: str, *args: str) -> tuple[int, dict]:
    return run_case(runner, STYLES, target, options=args)


@pytest.mark.parametrize("target", ["SpeechSelfAttention", "split_scale_attention", "FusedShares"])
def test_split_scale_passes(runner, target):
    code, out = _run(runner, target)
    assert code == 0 and out["first_divergence"] is None, (out["first_divergence"], out.get("error"))
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]


@pytest.mark.parametrize(("target", "how", "bug"), PLANTED["scale.half"])
def test_forgotten_share_named_by_experiment(runner, target, how, bug):
    code, out = _run(runner, target, how, f"bug='{bug}'")
    found = out["first_divergence"]
    assert code == 1 and found is not None, out.get("error")
    assert found["experiment"] == "scale.half" and found["evidence"].startswith("by experiment"), found
    kept, missing = ("queries", "keys") if bug == "k_share" else ("keys", "queries")
    said = found["diagnosis"]
    assert f"takes the {kept}' share, and the {missing}' share of the scale is missing" in said, said
    assert "^-0.25 = 0.595" in said and "^-0.5 = 0.354" in said, said


def test_scores_scaled_by_the_fourth_root(runner):
    code, out = _run(runner, "split_scale_attention", "--forward", "bug='fourth_root'")
    found = out["first_divergence"]
    assert code == 1 and found["experiment"] == "scale.half", found
    said = found["diagnosis"]
    assert "square root of the scale" in said and "share of the scale is missing" not in said, said
