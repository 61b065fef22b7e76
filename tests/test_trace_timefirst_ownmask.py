"""Time-first code that masks by itself, traced without --causal (held-out round 13a, ChatGLM): its batch-first run
parts from the reference before the scores, its time-first run lines up past them and then differs by the
code's own causal mask. Before, trace kept the batch-first reading ("none of your tensors has scores's shape",
"RoPE is never applied"); now it reads the code as time-first and says what docs/trace.md promises: "your code
masks by itself ... describe it with --causal", which then passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

ROOT = Path(__file__).resolve().parent.parent
STYLES = str(Path(__file__).resolve().parent / "trace_styles_timefirst_ownmask.py")
CASES = [(str(ROOT / "docs" / "examples" / "time_first.py") + ":MegatronAttention", ()),
         (str(ROOT / "docs" / "examples" / "time_first.py") + ":ChatGLMAttention", ()),
         (STYLES + ":BufferedTimeFirst", ())]


def test_the_buffered_style_is_causal_sdpa_time_first():
    torch.manual_seed(0)
    m = user_module(STYLES).BufferedTimeFirst().double().eval()
    x = torch.randn(5, 2, 24, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = (p(x.transpose(0, 1)).view(2, 5, 3, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 24)
        assert torch.allclose(m(x), m.out_proj(y).transpose(0, 1), atol=1e-10)


@pytest.mark.parametrize(("target", "more"), CASES, ids=[c[0].rsplit(":", 1)[1] for c in CASES])
def test_time_first_code_masking_by_itself_is_told_to_say_causal(runner, target, more):
    result, out = trace(runner, target, *more)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert any("lines up with the reference only on time-first ones" in n for n in out["notes"]), out["notes"]
    diagnosis = out["first_divergence"]["diagnosis"]
    assert "your code masks by itself" in diagnosis and "describe it with --causal" in diagnosis, diagnosis
    told, _ = trace(runner, target, *more, "--causal")
    assert told.exit_code == 0, told.stdout
