"""--svg and --html on every command: well-formed, standalone and offline, holding every step shown, in colour
whatever the terminal had, and under --save's promises (no overwrite without --force, nothing half-written).
The commands that show attention write the explorer page as --html (tests/test_page.py drives it in a browser);
mask and bench write the terminal's record."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from tiny_models import SENTENCE, build

from attnscope.cli import app

SVG_NS = "http://www.w3.org/2000/svg"
MY_ATTENTION = str(Path(__file__).resolve().parents[1] / "docs" / "examples" / "my_attention.py")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    build("bert", folder)
    return folder


def commands(tiny_bert: Path) -> dict[str, list[str]]:
    """One run of every command, small; the JSON of the same run names the steps its table shows."""
    return {
        "sdpa": ["sdpa", "--batch", "2", "--nq", "5", "--nk", "7", "--dk", "4", "--dv", "4", "--heatmap"],
        "mha": ["mha", "--batch", "2", "--nq", "6", "--d-feat", "16", "--heads", "4", "--causal", "--all-heads"],
        "mask": ["mask", "--nq", "4", "--cache", "4", "--window", "3"],
        "head": ["head", "--model", str(tiny_bert), "--layer", "1", "--text", SENTENCE, "--all-heads"],
        "bert": ["bert", "--model", str(tiny_bert), "--layer", "0", "--head", "2"],
        "trace": ["trace", f"{MY_ATTENTION}:attention", "--causal"],
        "bench sdpa": ["bench", "sdpa", "--batch", "1", "--nq", "8", "--nk", "8", "--runs", "1", "--warmup", "0"],
        "bench mha": ["bench", "mha", "--batch", "1", "--nq", "8", "--d-feat", "16", "--heads", "2", "--runs", "1",
                      "--warmup", "0"],
    }


def step_names(payload: dict) -> set[str]:
    """The step names a command's table shows, from its JSON."""
    if payload["command"] in ("head", "bert"):
        names = {t["name"] for t in payload["tensors"]} | {s["name"] for s in payload.get("layer_steps", [])}
        return names | {f"{h['head']}: {h['kind']}" for h in payload.get("heads", [])}
    if payload["command"] == "mask":
        return set(payload["translations"])
    if payload["command"].startswith("bench"):
        return {word for c in payload["contenders"] for word in c["name"].split()}
    return {s["name"] for s in payload.get("tensors", payload.get("steps", []))}


def svg_text(svg: str) -> str:
    """The text an SVG shows, line by line (Rich writes one <text> per run of a style; a space is &#160;)."""
    root = ET.fromstring(svg)
    return "".join(node.text or "" for node in root.iter(f"{{{SVG_NS}}}text")).replace("\xa0", " ")


PAGES = ("sdpa", "mha", "head", "bert", "trace")  # --html is the explorer page (attnscope/views/explorer.py)


def assert_offline(page: str, scripts: bool = False) -> None:
    urls = set(re.findall(r"https?://[^\s\"'<>)]*", page))
    assert urls <= {SVG_NS}, urls
    assert scripts or "<script" not in page.lower()
    assert "<link" not in page.lower() and not re.search(r"\ssrc\s*=", page, re.I)
    assert "@import" not in page and "@font-face" not in page and not re.search(r"url\((?!#)", page)


@pytest.mark.parametrize("name", ["sdpa", "mha", "mask", "head", "bert", "trace", "bench sdpa", "bench mha"])
def test_every_command_exports_what_it_shows(runner, tiny_bert, tmp_path, name):
    args = commands(tiny_bert)[name]
    payload = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    svg, page = tmp_path / "out.svg", tmp_path / "out.html"
    result = runner.invoke(app, [*args, "--svg", str(svg), "--html", str(page)], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert result.stderr == f"attnscope: wrote {svg} and {page}\n"
    svg_page, html_page = svg.read_text(encoding="utf-8"), page.read_text(encoding="utf-8")
    shown = svg_text(svg_page)  # parses as XML
    assert ET.fromstring(svg_page).tag == f"{{{SVG_NS}}}svg"
    assert_offline(svg_page)
    assert_offline(html_page, scripts=name in PAGES)
    names = step_names(payload)
    assert names
    for step in names:
        assert step in shown, f"{step} is not in the SVG"
    if name in PAGES:  # the page: its tables hold every step, its data every head's kind
        import html as html_module

        assert 'data-testid="layer-select"' in html_page and "default-src 'none'" in html_page
        tables = html_module.unescape(re.sub(r"<[^>]+>", "\n", html_page[: html_page.index('id="explorer"')]))
        for step in names:
            if ": " in step and step.split(": ")[0].isdigit():  # "3: previous-token", a head and its kind
                assert f'"kind":"{step.split(": ")[1]}"' in html_page, step
            else:
                assert step in tables.splitlines(), f"{step} is not in the page's tables"
        return
    for step in names:
        assert step.replace(">", "&gt;").replace("<", "&lt;") in html_page, f"{step} is not in the HTML"
    terminal_lines = [line.rstrip() for line in result.stdout.splitlines() if line.strip()]
    body = re.sub(r"<[^>]+>", "", html_page[html_page.index("<pre>"):])  # the page's text, tags removed
    import html as html_module

    body = html_module.unescape(body)
    for line in terminal_lines:  # exactly what was shown, line for line (cells aside: painted in the file)
        if not set(line) & set("░▒▓█"):
            assert line in body, line


def test_exports_are_in_colour_when_the_terminal_has_none(runner, tmp_path):
    svg = tmp_path / "heatmap.svg"
    result = runner.invoke(app, ["sdpa", "--batch", "1", "--nq", "3", "--nk", "4", "--dk", "4", "--dv", "4",
                                 "--heatmap", "--svg", str(svg)], env={"NO_COLOR": "1", "COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "\x1b[" not in result.stdout and "░" in result.stdout + "▒▓█"  # the terminal: shades, no colour
    page = svg.read_text()
    assert "#440154" in page and "#fde725" in page  # viridis' ends, the legend's scale
    assert "H = row entropy in bits" in svg_text(page)
    assert not set("░▒▓█") & set(page)  # each painted cell a clean block: its shade glyph left out


@pytest.mark.parametrize("option, name", [("--svg", "a.svg"), ("--html", "a.html")])
def test_existing_file_is_kept_without_force(runner, tmp_path, option, name):
    target = tmp_path / name
    target.write_text("mine")
    args = ["sdpa", "--batch", "1", "--nq", "2", "--nk", "3", "--dk", "2", "--dv", "2"]
    refused = runner.invoke(app, [*args, option, str(target)])
    assert refused.exit_code == 2 and refused.stdout == ""  # refused before the run
    assert refused.stderr == f"attnscope: error: {option} {target}: the file exists; pass --force to replace it\n"
    assert target.read_text() == "mine"
    forced = runner.invoke(app, [*args, option, str(target), "--force"])
    assert forced.exit_code == 0, forced.output
    assert target.read_text() != "mine" and "scores" in target.read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--svg", ""], "an empty file name; give a file, or leave the option out"),
    (["--svg", "out.png"], "--svg out.png: unknown file type; end the name with .svg"),
    (["--html", "out.svg"], "--html out.svg: unknown file type; end the name with .html or .htm"),
    (["--svg", "a.svg", "--json"], "--svg writes the output as shown, and --json prints JSON instead of it; drop "
                                   "--json, or --svg"),
    (["--svg", "no/such/folder/a.svg"], "--svg no/such/folder/a.svg: the folder no/such/folder does not exist"),
])
def test_bad_export_names_are_one_line(tmp_path, monkeypatch, args, message):
    from cli_main import run_main

    monkeypatch.chdir(tmp_path)
    result = run_main("mask", "--nq", "3", *args)
    assert result.code == 2 and result.stdout == ""
    assert len(result.error_lines) == 1 and message in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_writes_nothing(runner, tmp_path):
    result = runner.invoke(app, ["sdpa", "--q", str(tmp_path / "missing.npy"), "--svg", str(tmp_path / "a.svg"),
                                 "--html", str(tmp_path / "a.html")])
    assert result.exit_code == 2
    assert list(tmp_path.iterdir()) == []  # no file, no temporary .part


def test_exit_1_after_the_output_still_exports_it(runner, tmp_path):
    """`trace` finding a bug exits 1 once it has shown everything: the export holds the divergence."""
    svg = tmp_path / "bug.svg"
    result = runner.invoke(app, ["trace", f"{MY_ATTENTION}:MultiHeadedAttention", "--init", "d_feat=200, n_head=5",
                                 "--svg", str(svg)])
    assert result.exit_code == 1, result.output
    assert "first divergence" in svg_text(svg.read_text())
    page = tmp_path / "bug.html"
    again = runner.invoke(app, ["trace", f"{MY_ATTENTION}:MultiHeadedAttention", "--init", "d_feat=200, n_head=5",
                                "--html", str(page)])
    assert again.exit_code == 1 and "<p class='verdict bad'>first divergence: scores" in page.read_text()


def test_a_file_that_appears_during_the_run_is_kept(tmp_path):
    from attnscope.cli.common import exporting
    from attnscope.errors import UsageError

    target = tmp_path / "late.svg"
    with pytest.raises(UsageError, match="the file exists"), exporting(str(target), None, force=False, json=False,
                                                                        title="t") as out:
        out.print("the run")
        target.write_text("someone else's")
    assert target.read_text() == "someone else's"
    assert [p.name for p in tmp_path.iterdir()] == ["late.svg"]


def test_code_the_terminal_wraps_is_wrapped_in_the_file(runner, tmp_path):
    """`mask` prints its translations unwrapped (soft wrap: code to paste whole); the terminal wraps a long
    line, and so does the SVG, which would otherwise cut it at the width."""
    svg = tmp_path / "mask.svg"
    result = runner.invoke(app, ["mask", "--nq", "4", "--cache", "4", "--window", "3", "--svg", str(svg)],
                           env={"COLUMNS": "50"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) > 50  # lines longer than the width
    shown = svg_text(svg.read_text())
    assert "".join(shown.split()) == "attnscopemask" + "".join(result.stdout.split())  # the title, then all
