"""`attnscope trace` on a file that imports from its own package relatively (`from .config import ModelArgs`,
`from ..rotary import apply_rotary`, transformers' own `from ...modeling_utils import ...`): the file is imported
as a module of its package (usertrace/package.py), as Python imports it when the package is imported, so its
relative imports resolve; --init may call the package's classes. A file with no relative import is imported on its
own as before (its package's `__init__.py` never runs); a package whose name `import` finds elsewhere is refused in
one line. Each correct module checked against float64 F.scaled_dot_product_attention first."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from tracecases import assert_named, assert_passes, run_case

from attnscope.usertrace.package import package_of, relative_imports

CONFIG = """
from dataclasses import dataclass

@dataclass
class ModelArgs:
    dim: int = 32
    n_heads: int = 4
"""

ROTARY = """
import torch

def split_heads(x, n_heads):
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)
"""

ATTENTION = """
import math
import torch
import torch.nn as nn
from ..config import ModelArgs
from .heads import split_heads


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, bug=None):
        super().__init__()
        self.n_heads, self.bug = args.n_heads, bug
        self.wq = nn.Linear(args.dim, args.dim)
        self.wk = nn.Linear(args.dim, args.dim)
        self.wv = nn.Linear(args.dim, args.dim)
        self.wo = nn.Linear(args.dim, args.dim)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (split_heads(f(x), self.n_heads) for f in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1)
        if self.bug != "no_scale":
            scores = scores / math.sqrt(q.size(-1))
        out = torch.softmax(scores, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, t, c))
"""


def _package(tmp_path: Path, top: str = "mymodel") -> Path:
    """src/<top>/{__init__,config}.py and src/<top>/layers/{__init__,heads,attention}.py; the package's __init__
    raises where it is imported without its package (it is imported as a package, so it never does)."""
    root = tmp_path / "src" / top
    (root / "layers").mkdir(parents=True)
    (root / "__init__.py").write_text("MARK = 'package imported'\n")
    (root / "config.py").write_text(textwrap.dedent(CONFIG))
    (root / "layers" / "__init__.py").write_text("")
    (root / "layers" / "heads.py").write_text(textwrap.dedent(ROTARY))
    (root / "layers" / "attention.py").write_text(textwrap.dedent(ATTENTION))
    return root / "layers" / "attention.py"


def test_the_package_reads_from_its_folders(tmp_path):
    path = _package(tmp_path)
    package = package_of(path, path.read_text())
    assert package is not None and package.name == "mymodel.layers" and package.depth == 2
    assert package.root == (tmp_path / "src").resolve()
    assert relative_imports(path.read_text()) == 2 and relative_imports("import torch\n") == 0
    assert package_of(path, "import torch\n") is None  # no relative import: imported on its own
    assert relative_imports("def (:\n") == 0  # a syntax error is the import's to report


def test_a_module_of_a_package_is_traced_with_its_relative_imports(runner, tmp_path):
    path = _package(tmp_path)
    import importlib
    import sys
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        attention = importlib.import_module("mymodel.layers.attention")
        args = importlib.import_module("mymodel.config").ModelArgs()
        m = attention.Attention(args).double().eval()
        x = torch.randn(2, 5, 32, dtype=torch.float64)

        def heads(t):
            return t.view(2, 5, 4, 8).transpose(1, 2)

        want = m.wo(F.scaled_dot_product_attention(heads(m.wq(x)), heads(m.wk(x)), heads(m.wv(x)))
                    .transpose(1, 2).reshape(2, 5, 32))
        assert torch.allclose(m(x), want, atol=1e-10)
        planted = attention.Attention(args, bug="no_scale").double().eval()
        assert (planted(x) - want).abs().max() > 1e-2
    finally:
        sys.path.remove(str(tmp_path / "src"))
        for name in [n for n in sys.modules if n == "mymodel" or n.startswith("mymodel.")]:
            del sys.modules[name]
    code, out = run_case(runner, str(path), "Attention", "args=ModelArgs(dim=32, n_heads=4)")
    assert_passes(code, out)
    code, out = run_case(runner, str(path), "Attention", "args=ModelArgs(dim=32, n_heads=4), bug='no_scale'")
    assert_named(code, out, "scale.none")


def test_a_file_without_relative_imports_is_imported_alone(runner, tmp_path):
    """Nothing of its package runs: an `__init__.py` that raises is never imported."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "__init__.py").write_text("raise RuntimeError('the package is not to be imported')\n")
    source = textwrap.dedent(ATTENTION).replace("from ..config import ModelArgs\n", "").replace(
        "from .heads import split_heads\n", textwrap.dedent(ROTARY)).replace("args: ModelArgs", "args")
    (folder / "alone.py").write_text(source + textwrap.dedent(CONFIG))
    code, out = run_case(runner, str(folder / "alone.py"), "Attention", "args=ModelArgs()")
    assert_passes(code, out)


def test_a_package_whose_name_import_finds_elsewhere_is_refused(runner, tmp_path):
    """`json/attention.py` importing `.heads`: `import json` is the standard library's, whose modules the file
    would get in place of its own; one line says so, exit 2."""
    path = _package(tmp_path, top="json")
    from test_trace_command import trace

    result, out = trace(runner, f"{path}:Attention", "--init", "args=ModelArgs()")
    assert result.exit_code == 2 and out is None, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "imports relatively from its package json" in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_transformers_own_attention_traced_in_its_file(runner):
    """GPT2Attention in transformers' own modeling_gpt2.py (`from ...modeling_utils import ...`), with its own config
    class (imported relatively from configuration_gpt2): every step equal to the reference's."""
    import transformers.models.gpt2.modeling_gpt2 as gpt2

    code, out = run_case(runner, gpt2.__file__, "GPT2Attention",
                         "config=GPT2Config(n_embd=32, n_head=4), layer_idx=0", ("--causal",))
    assert_passes(code, out)
