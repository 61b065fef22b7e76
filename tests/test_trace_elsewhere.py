"""A name whose code is written in another file than the one named (held-out round 51): a class that inherits its
forward from a file beside it, a class or a function imported, torch's nn.MultiheadAttention bound to a name. trace
records the ops where the forward is written (load.Target.code), says so in a note and in `params.code_file`; before,
no op was recorded and a correct module was said to differ. The base style is checked first against
F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import trace_styles_elsewhere_base as base
from tracecases import assert_named, assert_passes, run_case

from attnscope.cli import app

HERE = Path(__file__).parent
STYLES = str(HERE / "trace_styles_elsewhere.py")
BASE = str((HERE / "trace_styles_elsewhere_base.py").resolve())


def _reference(m: base.FusedCausalAttention, x: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.unflatten(-1, (m.heads, -1)).transpose(1, 2) for t in m.qkv(x).chunk(3, dim=-1))
    return m.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def test_the_base_style_is_causal_attention_and_its_plants_change_it():
    torch.manual_seed(0)
    m = base.FusedCausalAttention().double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    got = m(x)
    assert (got - _reference(m, x)).abs().max() < 1e-10
    for bug in ("scale_d_model", "softmax_queries"):
        planted = base.FusedCausalAttention(bug=bug).double().eval()
        planted.load_state_dict(m.state_dict())
        assert (planted(x) - got).abs().max() > 1e-3
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    assert (base.attend(q, k, v) - F.scaled_dot_product_attention(q, k, v)).abs().max() < 1e-10


@pytest.mark.parametrize("target", ["Attention", "FusedCausalAttention"])
def test_a_forward_written_beside_the_file_is_recorded_there(runner, target):
    code, out = run_case(runner, STYLES, target, None, ("--causal",))
    assert_passes(code, out)
    assert out["params"]["code_file"] == BASE and out["params"]["file"].endswith("trace_styles_elsewhere.py")
    said = " ".join(" ".join(out["notes"]).split())
    assert f"{target}'s forward is written in trace_styles_elsewhere_base.py, not in trace_styles_elsewhere.py" \
        in said, said
    lines = {s["line"] for s in out["steps"] if s["line"] is not None}
    assert lines and max(lines) <= len(Path(BASE).read_text().splitlines())


def test_a_function_imported_and_torchs_own_module_line_up(runner):
    code, out = run_case(runner, STYLES, "attend")
    assert_passes(code, out)
    assert "attend is written in trace_styles_elsewhere_base.py" in " ".join(" ".join(out["notes"]).split())
    code, out = run_case(runner, STYLES, "TorchAttention", "embed_dim=32, num_heads=4, batch_first=True")
    assert_passes(code, out)
    assert out["params"]["code_file"].endswith(str(Path("torch", "nn", "modules", "activation.py")))


def test_a_forward_of_its_own_stays_in_the_file_named(runner):
    code, out = run_case(runner, STYLES, "Wrapped", None, ("--causal",))
    assert_passes(code, out)
    assert out["params"]["code_file"] == out["params"]["file"]
    assert not any("is written in" in n for n in out["notes"])


@pytest.mark.parametrize(("bug", "entry"), [("scale_d_model", "scale.d_model"), ("softmax_queries", "softmax.axis")])
def test_a_plant_in_the_inherited_forward_is_named_at_its_own_line(runner, bug, entry):
    found = assert_named(*run_case(runner, STYLES, "Attention", f"bug={bug!r}", ("--causal",)), entry)
    lines = Path(BASE).read_text().splitlines()
    assert found["line"] is not None and ("scores" in lines[found["line"] - 1] or "softmax" in lines[found["line"] - 1])


def test_an_inherited_init_that_raises_is_placed_in_its_own_file(runner):
    result = runner.invoke(app, ["trace", f"{STYLES}:Attention", "--init", "width=-3"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    lines = Path(BASE).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "nn.Linear(width, 3 * width)" in text)
    assert f"failed at trace_styles_elsewhere_base.py:{line}: RuntimeError" in said, said
