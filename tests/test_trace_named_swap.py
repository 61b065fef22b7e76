"""Four projections named one role each but used in other roles (k_proj's output multiplied by the pattern,
v_proj's making the scores) are a swap to report, never a layout to read (issue 41: "k/v swapped" in the catalog;
data flow alone had read the code as correct with q=q_proj, k=v_proj, v=k_proj and exited 0). Each style's
correct self is held to F.scaled_dot_product_attention with its own weights (a reference sharing no attnscope
code) and exits 0; the swapped one computes another output, exits 1, and the catalog's experiment names it."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace

BODY = '''
import math
import torch
import torch.nn as nn


class Attn(nn.Module):
    def __init__(self, d_model=32, n_head=4):
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.{q} = nn.Linear(d_model, d_model)
        self.{k} = nn.Linear(d_model, d_model)
        self.{v} = nn.Linear(d_model, d_model)
        self.{o} = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q = self.{q}(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)   # [B, H, T, D]
        k = self.{k}(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)
        v = self.{v}(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)
        scores = (q @ {keys}.transpose(-2, -1)) / math.sqrt(self.d_head)        # [B, H, T, T]
        y = scores.softmax(-1) @ {values}                                       # [B, H, T, D]
        return self.{o}(y.transpose(1, 2).reshape(B, T, C))
'''

STYLES = {  # the names people give the four projections
    "hf": dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj"),
    "bert": dict(q="query", k="key", v="value", o="dense"),
    "tutorial": dict(q="W_q", k="W_k", v="W_v", o="W_o"),
}


def _write(tmp_path, style: str, swapped: bool) -> str:
    keys, values = ("v", "k") if swapped else ("k", "v")
    path = tmp_path / f"{style}_{'swapped' if swapped else 'right'}.py"
    path.write_text(textwrap.dedent(BODY.format(**STYLES[style], keys=keys, values=values)))
    return str(path)


def _own_vs_reference(path: str, style: str) -> float:
    """How far the module's own output is from F.scaled_dot_product_attention holding its weights by name."""
    spec = importlib.util.spec_from_file_location(f"swap_{style}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    attn = module.Attn().eval()
    names = STYLES[style]
    x = torch.randn(2, 5, 32)
    split = lambda t: t.view(2, 5, 4, 8).transpose(1, 2)  # noqa: E731
    q, k, v = (split(getattr(attn, names[r])(x)) for r in "qkv")
    ref = getattr(attn, names["o"])(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32))
    with torch.no_grad():
        return float((attn(x) - ref).abs().max())


@pytest.mark.parametrize("style", sorted(STYLES))
def test_named_projections_used_in_swapped_roles_are_a_bug(runner, tmp_path, style):
    right, swapped = _write(tmp_path, style, False), _write(tmp_path, style, True)
    assert _own_vs_reference(right, style) < 1e-5
    assert _own_vs_reference(swapped, style) > 1e-3

    result, out = trace(runner, f"{right}:Attn")
    assert result.exit_code == 0, result.output

    result, out = trace(runner, f"{swapped}:Attn")
    assert result.exit_code == 1, result.output
    assert out["first_divergence"]["experiment"] == "kv.swapped"
    k, v = STYLES[style]["k"], STYLES[style]["v"]
    assert f"{v} as K" in out["reference"] and f"{k} as V" in out["reference"]
