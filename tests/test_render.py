"""Output read at 80 and 100 columns: every command's table fits, no token is broken, nothing is cut.

Every command of the Typer app is rendered through the app with the examples of its own --help (so
commands added later are covered), at both widths, with NO_COLOR=1, as a pipe would see it.
"""

from __future__ import annotations

import json
import re

import pytest
import typer
from examples import commands, help_examples, model_names, prepare, provide_models
from rich.cells import cell_len
from rich.console import Console

from attnscope.cli import app
from attnscope.render.fit import atoms, wrap

WIDTHS = (80, 100)
LEAVES = [(" ".join(path), cmd) for path, cmd in commands(typer.main.get_command(app)) if not hasattr(cmd, "commands")]
CASES = list({ex.args: (name, ex) for name, _ in LEAVES for ex in help_examples(app)
              if ex.args[: len(name.split())] == tuple(name.split())}.values())
MODELS = model_names(app, [ex for _, ex in CASES])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return provide_models(tmp_path_factory.mktemp("models"), MODELS)


def fast(args: tuple[str, ...], command: object) -> list[str]:
    """The example without --json (the table is what is checked), and a bench timed once."""
    out: list[str] = []
    timing = {"--runs", "--warmup"}
    for previous, arg in zip(("", *args), args, strict=False):
        if arg != "--json" and arg not in timing and previous not in timing:
            out.append(arg)
    options = {opt for p in getattr(command, "params", []) for opt in getattr(p, "opts", [])}
    return out + (["--runs", "1", "--warmup", "0"] if "--runs" in options else [])


def without_heatmap_labels(lines: list[str]) -> list[str]:
    """The lines, less a heatmap's key labels (written downwards, so `[CLS]` spans five lines)."""
    kept, in_labels = [], False
    for line in lines:
        if line.startswith("H = row entropy"):  # the legend's last line; the labels follow
            in_labels = True
        elif in_labels and "  → " in line:
            in_labels = False
        elif in_labels:
            continue
        kept.append(line)
    return kept


def balanced(line: str) -> bool:
    depth = {"(": 0, "[": 0}
    for char in line:
        if char in "([":
            depth[char] += 1
        elif char in ")]":
            depth["(" if char == ")" else "["] -= 1
            if min(depth.values()) < 0:
                return False
    return not any(depth.values())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("name", "example"), CASES, ids=[ex.line for _, ex in CASES])
def test_every_command_reads_at_80_and_100_columns(name, example, width, runner, models, tmp_path, monkeypatch):
    import huggingface_hub.constants

    command = dict(LEAVES)[name]
    hub, folders = models
    prepare(tmp_path, example, folders)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    args = fast(example.args, command)
    result = runner.invoke(app, args, env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == example.status, result.output
    lines = result.stdout.splitlines()
    too_wide = [line for line in lines if cell_len(line) > width]
    assert not too_wide, f"{len(too_wide)} lines wider than {width}: {too_wide[0]!r}"
    assert "…" not in result.stdout, "something was cut"
    if "--values" not in args:  # a table's rows close what they open (tensor previews and prose may not)
        rows = [line for line in without_heatmap_labels(lines) if line.startswith(" ")]
        broken = [line for line in rows if not balanced(line)]
        assert not broken, f"a line breaks inside brackets: {broken[0]!r}"
    if "--save" in args:
        return  # the JSON run below would find the file written
    payload = runner.invoke(app, [*args, "--json"], env={"COLUMNS": str(width)})
    if not payload.stdout.startswith("{"):
        return
    data = json.loads(payload.stdout)
    for section in ("tensors", "steps", "layer_steps"):  # a section the table shows has every row intact
        steps = [step for step in data.get(section, []) if "dims" in step and "shape" in step]
        texts = [(f"[{', '.join(step['dims'])}]", f"= [{', '.join(map(str, step['shape']))}]", step) for step in steps]
        rows = {line.split()[0] for line in lines if line.startswith(" ") and line.strip()}
        if not steps or not all(step["name"] in rows for step in steps):
            continue  # not the table shown (head shows its layer's steps; the head's own are in the JSON)
        for dims, shape, step in texts:
            assert any(dims in line for line in lines), f"{dims} is broken"
            assert any(shape in line for line in lines), f"{shape} is broken"
            for atom in atoms(step.get("op", "")):  # the op breaks only between its atoms
                assert any(atom.strip() in line for line in lines), f"{step['op']!r} is broken inside {atom!r}"
    for contender in data.get("contenders", []):
        for word in contender["name"].split():
            assert any(word in line for line in lines), f"contender {contender['name']!r} is cut"


# --- the fitted table -----------------------------------------------------------------------------------


def test_atoms_break_only_between_tokens():
    assert atoms("[n_batch, n_head, n_Q, d_head] = [2, 2, 4, 4]") == [
        "[n_batch, n_head, n_Q, d_head]", " = [2, 2, 4, 4]"]
    assert atoms("Q_feat.view(n_batch, -1, n_head, d_head).permute(0, 2, 1, 3)") == [
        "Q_feat.view(n_batch, -1, n_head, d_head)", ".permute(0, 2, 1, 3)"]
    assert atoms("Q @ K.transpose(-2, -1) / sqrt(d_K)") == ["Q", " @ K.transpose(-2, -1)", " / sqrt(d_K)"]
    assert wrap(atoms("Q @ K.transpose(-2, -1) / sqrt(d_K)"), 24) == ["Q @ K.transpose(-2, -1)", "/ sqrt(d_K)"]
    # only an atom wider than the whole line is broken, after a comma first
    assert wrap(["[n_batch, n_head, n_Q, d_head]"], 20) == ["[n_batch, n_head,", "n_Q, d_head]"]


def render(renderable, width: int) -> str:
    console = Console(width=width, record=True, no_color=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def mha_steps():
    import torch

    from attnscope import MultiHeadAttention

    return MultiHeadAttention(8, 2)(torch.randn(2, 4, 8)).steps


def test_steps_table_drops_columns_in_the_stated_order():
    from attnscope.render.tables import steps_table

    table = steps_table(mha_steps())
    at_80 = render(table, 80)
    assert "[n_batch, n_head, n_Q, d_head]" in at_80 and "left out" not in at_80
    assert "Q_feat.view(n_batch, -1, n_head, d_head)" in at_80  # the chained call goes under it
    at_70 = render(table, 70)
    assert "left out to fit 70 columns: dtype (--json has them)" in at_70 and "FLOPs" in at_70  # dtype first
    at_64 = render(table, 64)
    assert "columns: dtype, FLOPs (" in at_64 and "size" in at_64
    at_56 = render(table, 56)
    assert "columns: dtype, FLOPs, size" in at_56
    for text, width in ((at_80, 80), (at_70, 70), (at_64, 64), (at_56, 56)):
        assert max(cell_len(line) for line in text.splitlines()) <= width
        assert all(balanced(line) for line in text.splitlines())


def test_bench_table_never_cuts_a_contender():
    from attnscope.render.bench import show_bench
    from attnscope.runs.race import BenchResult, Contender

    names = ["attnscope MultiHeadAttention (traced)", "attnscope MultiHeadAttention(record=False)",
             "torch.nn.MultiheadAttention"]
    result = BenchResult("mha", {"batch": 4, "nq": 256, "nk": 256, "d_feat": 512, "heads": 8, "bias": True,
                                 "causal": None, "device": "cpu", "dtype": "float32", "runs": 20, "warmup": 3},
                         2 * 10**9, [Contender(n, 123.456, 67.8, 2**24, 1e-7) for n in names],
                         memory_method="PyTorch's profiler", inputs_bytes=2**22, estimate_bytes=2**24 + 2**22)
    for width in (80, 100):
        console = Console(width=width, record=True, no_color=True, file=open("/dev/null", "w"))  # noqa: SIM115
        show_bench(console, result)
        text = console.export_text()
        assert "…" not in text and "None" not in text
        assert max(cell_len(line) for line in text.splitlines()) <= width
        for name in names:
            assert all(word in text for word in name.split())
        assert "bench mha  n_batch=4  n_Q=256  n_K=256  d_feat=512  n_head=8  bias" in text


# --- the heatmap ----------------------------------------------------------------------------------------


def heatmap_text(matrix, rows, cols, width=80, title="attention[0] (batch element 0)"):
    from attnscope.render.heatmap import show_heatmap
    from attnscope.runs.outputs import Heatmap

    console = Console(width=width, record=True, no_color=True, file=open("/dev/null", "w"))  # noqa: SIM115
    show_heatmap(console, Heatmap(title, matrix, rows, cols))
    return console.export_text()


def uniform(n_rows, n_cols):
    return [[1.0 / n_cols] * n_cols for _ in range(n_rows)]


def test_heatmap_of_a_60_token_sentence_fits_80_columns():
    tokens = [f"tok{i}" for i in range(60)]
    matrix = [[(0.5 if j == i else 0.5 / 59) for j in range(60)] for i in range(60)]
    text = heatmap_text(matrix, tokens, tokens)
    assert max(cell_len(line) for line in text.splitlines()) <= 80
    assert "each column = sum over 2 keys" in text  # said, not silent
    assert "darker" not in text and "more ink in shades" in text
    assert "H = row entropy in bits" in text and "log2 60 = 5.91" in text


def test_heatmap_keeps_cjk_labels_in_line():
    tokens = ["[CLS]", "猫", "が", "座", "った", "[SEP]"]
    text = heatmap_text(uniform(6, 6), tokens, tokens)
    lines = text.splitlines()
    first_row = next(i for i, line in enumerate(lines) if line.lstrip().startswith("[CLS] "))
    label_lines = lines[first_row - 5 : first_row]  # the tallest label, [CLS], is five characters
    start = lines[first_row].index("[CLS] ") + len("[CLS] ")  # cells before the first column (ASCII so far)
    for j, token in enumerate(tokens):  # each column's label reads downwards at its own cell offset
        written = "".join(_char_at_cell(line, start + 2 * j) for line in label_lines).strip()
        assert written == token[:5], (j, written)
    rows = lines[first_row : first_row + 6]
    assert len({cell_len(line[: line.index("→")]) for line in rows}) == 1  # every row as wide, in cells


def _char_at_cell(line: str, offset: int) -> str:
    cells = 0
    for char in line:
        if cells == offset:
            return char
        cells += cell_len(char)
        if cells > offset:
            return ""
    return ""


def test_heatmap_numbers_columns_when_a_cjk_label_cannot_fit_one_cell():
    tokens = ["猫"] + [f"t{i}" for i in range(49)]
    text = heatmap_text(uniform(3, 50), tokens[:3], tokens, width=80)
    assert "keys: 0=猫" in text
    assert max(cell_len(line) for line in text.splitlines()) <= 80


def test_heatmap_title_names_indices_not_sizes(runner, tmp_path):
    import numpy as np

    np.save(tmp_path / "q.npy", np.random.default_rng(0).standard_normal((2, 3, 5, 8)).astype(np.float32))
    result = runner.invoke(app, ["sdpa", "--q", str(tmp_path / "q.npy"), "--heatmap", "--heatmap-batch", "1",
                                 "--heatmap-head", "2"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "attention[1, 2] (batch element 1, head 2)  [5 queries x 5 keys]" in result.stdout
    three_d = runner.invoke(app, ["sdpa", "--heatmap", "--heatmap-head", "1"])
    assert three_d.exit_code == 2 and "no head axis" in three_d.stderr
    out_of_range = runner.invoke(app, ["mha", "--heatmap", "--heatmap-head", "7"])
    assert out_of_range.exit_code == 2
    assert "--heatmap-head 7 is out of range: n_head is 5, so valid is 0 to 4" in out_of_range.stderr


# --- what the headers say -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sdpa", "mha"])
def test_header_states_the_causal_alignment(runner, command):
    for align, rule in (("upper-left", "j ≤ i)"), ("lower-right", "j ≤ i + 2)")):
        result = runner.invoke(app, [command, "--nq", "4", "--nk", "6", "--causal", align], env={"COLUMNS": "100"})
        assert result.exit_code == 0, result.output
        header = result.stdout.split("\n\n")[0]
        assert f"causal {align} (query i sees keys {rule}" in header, header
    plain = runner.invoke(app, [command, "--nq", "4"])
    assert "causal" not in plain.stdout.split("\n\n")[0]


def test_units_scale(runner):
    from attnscope.cost import format_bytes, format_flops
    from attnscope.render.tables import short_flops

    assert format_flops(65_792 * 10**12) == "65.79 PFLOP"
    assert format_flops(133_681_870 * 10**12) == "133.68 EFLOP"
    assert format_flops(999) == "999 FLOP" and format_flops(2_590) == "2.59 kFLOP"
    assert format_bytes(3 * 2**50) == "3.0 PiB" and format_bytes(5 * 2**60) == "5.0 EiB"
    assert format_bytes(1023) == "1023 B" and format_bytes(1536) == "1.5 KiB"
    assert short_flops(65_792 * 10**12) == "65.8P" and short_flops(2 * 10**18) == "2.0E"
    result = runner.invoke(app, ["mha", "--d-feat", "4096", "--heads", "32", "--batch", "8", "--nq", "1000000",
                                 "--meta"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "total 133.68 PFLOP   peak memory 1.8 PiB traced" in result.stdout
    assert not re.search(r"\d{4,}\.\d+ ?T", result.stdout)  # no 65792.0T


def test_column_layout_heatmap_has_queries_as_rows(runner):
    import torch

    result = runner.invoke(app, ["sdpa", "--layout", "col", "--nq", "3", "--nk", "5", "--heatmap", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    attention = torch.tensor(payload["heatmap"]["matrix"])
    assert attention.shape == (3, 5) and torch.allclose(attention.sum(-1), torch.ones(3))  # rows are queries
    assert "transposed" in payload["heatmap"]["title"]


def test_tensor_values_in_json_are_finite_and_read_back_as_the_tensors_values(capsys):
    """`numbers` (a tensor's values, written compactly: a float32 tensor's by jsonfloats.py, every digit that tells
    its float32) parses back to the tensor's values exactly; a tensor holding NaN or Infinity still becomes null
    where they were."""
    import json

    import torch

    from attnscope.render.console import emit_json, numbers

    finite = torch.randn(2, 3, 4)
    broken = torch.tensor([[1.0, float("nan")], [float("-inf"), 2.5]])
    payload = {"a": numbers(finite), "b": numbers(broken), "c": [numbers(finite[0]), {"d": numbers(torch.tensor(3.0))}],
               "e": "text", "f": float("inf")}
    emit_json(payload)
    out = capsys.readouterr().out
    got = json.loads(out)
    assert torch.equal(torch.tensor(got["a"]), finite) and torch.equal(torch.tensor(got["c"][0]), finite[0])
    assert {k: got[k] for k in "bef"} == {"b": [[1.0, None], [None, 2.5]], "e": "text", "f": None}
    assert got["c"][1] == {"d": 3.0}
    assert "NaN" not in out and "Infinity" not in out


def test_masked_cells_read_apart_from_near_zero_weights():
    """Issue 36, item 7: a masked key and a weight near 0 were both blank. A masked cell is `·`, on the
    terminal's background even where colour is shown, and the legend says so."""
    from attnscope.render.heatmap import show_heatmap
    from attnscope.render.shading import MASKED
    from attnscope.runs.outputs import Heatmap

    hm = Heatmap("attention", [[1.0, 0.0, 0.0], [1e-9, 1.0, 0.0]], ["q0", "q1"], ["k0", "k1", "k2"],
                 [[False, True, True], [False, False, True]])
    for color_system in (None, "truecolor"):
        out = Console(width=80, color_system=color_system, record=True)
        show_heatmap(out, hm)
        text = out.export_text(styles=False)
        assert f"{MASKED} = masked" in text
        rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("q")}
        assert rows["q0"].startswith(f"q0 ██{MASKED} {MASKED} "), text
        assert rows["q1"].startswith(f"q1   ██{MASKED} "), text  # 1e-9: blank, not masked


def test_sdpa_heatmap_marks_the_masked_keys(runner):
    result = runner.invoke(app, ["sdpa", "--batch", "1", "--nq", "4", "--nk", "6", "--causal", "lower-right",
                                 "--window", "2", "--heatmap"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("q")]
    # lower-right, window 2 over 6 keys: query i sees keys i + 1 and i + 2
    assert [row[3:15].count("·") for row in rows] == [4, 4, 4, 4], rows
    assert rows[0][3:5] == "· " and rows[0][5:7] != "· " and rows[3][3:11] == "· · · · ", rows
    assert "masked: the key is hidden" in result.stdout
    shown = json.loads(runner.invoke(app, ["sdpa", "--batch", "1", "--nq", "4", "--nk", "6", "--causal", "--heatmap",
                                           "--json"]).stdout)["heatmap"]
    assert shown["masked"][0] == [False, True, True, True, True, True]
    plain = runner.invoke(app, ["sdpa", "--batch", "1", "--nq", "4", "--nk", "6", "--heatmap"])
    assert "·" not in plain.stdout and "masked" not in plain.stdout
