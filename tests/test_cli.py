"""The command line through typer.testing.CliRunner, and once as the installed `attnscope` command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from cli_main import unwrapped

from attnscope.cli import app

SDPA_DEMO = {
    "Q": [3, 30, 128], "K": [3, 50, 128], "V": [3, 50, 256],
    "scores": [3, 30, 50], "attention": [3, 30, 50], "out": [3, 30, 256],
}
MHA_DEMO = {
    "Q_feat": [128, 32, 200], "K_feat": [128, 32, 200], "V_feat": [128, 32, 200],
    "Q_split": [128, 5, 32, 40], "K_split": [128, 5, 32, 40], "V_split": [128, 5, 32, 40],
    "scores": [128, 5, 32, 32], "attention": [128, 5, 32, 32], "x_raw": [128, 5, 32, 40],
    "x_rsh1": [128, 32, 5, 40], "x_rsh2": [128, 32, 200], "x": [128, 32, 200],
}
TENSOR_KEYS = {"name", "shape", "dims", "dtype", "bytes", "op"}


def run_json(runner, *args):
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_sdpa_demo_table(runner):
    result = runner.invoke(app, ["sdpa"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "out = softmax(Q Kᵀ / √d_K) V" in out
    assert "n_batch=3  n_Q=30  n_K=50  d_K=128  d_V=256" in out
    assert "[n_batch, n_Q, d_V] = [3, 30, 256]" in out
    # rows appear in step order
    positions = [out.index(f"\n {name} ") for name in SDPA_DEMO]
    assert positions == sorted(positions)


def test_mha_demo_table(runner):
    result = runner.invoke(app, ["mha"], env={"COLUMNS": "100"})  # (piped, it is 80: test_render.py)
    assert result.exit_code == 0, result.output
    assert "[n_batch, n_head, n_Q, d_head] = [128, 5, 32, 40]" in result.stdout
    assert "Q_feat.view(n_batch, -1, n_head, d_head).permute(0, 2, 1, 3)" in result.stdout


def test_tables_fit_100_columns(runner):
    for command in ("sdpa", "mha"):
        result = runner.invoke(app, [command], env={"COLUMNS": "100"})
        assert max(len(line) for line in result.stdout.splitlines()) <= 100


def test_sdpa_json_contract(runner):
    payload = run_json(runner, "sdpa")
    assert payload["command"] == "sdpa"
    assert {"batch", "nq", "nk", "dk", "dv", "seed"} <= set(payload["params"])
    assert [t["name"] for t in payload["tensors"]] == list(SDPA_DEMO)
    for tensor in payload["tensors"]:
        assert TENSOR_KEYS <= set(tensor)
        assert tensor["shape"] == SDPA_DEMO[tensor["name"]]
        assert len(tensor["dims"]) == len(tensor["shape"])
        assert tensor["bytes"] == 4 * __import__("math").prod(tensor["shape"])
        assert tensor["dtype"] == "float32"
    assert payload["tensors"][-1]["dims"] == ["n_batch", "n_Q", "d_V"]


def test_mha_json_contract(runner):
    payload = run_json(runner, "mha")
    assert payload["command"] == "mha"
    assert payload["params"]["d_head"] == 40
    assert [t["name"] for t in payload["tensors"]] == list(MHA_DEMO)
    for tensor in payload["tensors"]:
        assert TENSOR_KEYS <= set(tensor)
        assert tensor["shape"] == MHA_DEMO[tensor["name"]]


def test_mha_cross_attention_when_nk_differs(runner):
    payload = run_json(runner, "mha", "--nq", "8", "--nk", "20", "--d-feat", "32", "--heads", "4", "--batch", "2")
    shapes = {t["name"]: t["shape"] for t in payload["tensors"]}
    assert shapes["K_feat"] == [2, 20, 32]
    assert shapes["scores"] == [2, 4, 8, 20]
    assert shapes["x"] == [2, 8, 32]


def test_options_change_the_shapes(runner):
    payload = run_json(runner, "sdpa", "--batch", "2", "--nq", "5", "--nk", "7", "--dk", "4", "--dv", "3")
    assert {t["name"]: t["shape"] for t in payload["tensors"]}["out"] == [2, 5, 3]


def test_seed_makes_runs_repeatable(runner):
    first = runner.invoke(app, ["sdpa", "--nq", "2", "--nk", "3", "--dk", "2", "--dv", "2", "--values"]).stdout
    again = runner.invoke(app, ["sdpa", "--nq", "2", "--nk", "3", "--dk", "2", "--dv", "2", "--values"]).stdout
    other = runner.invoke(app, ["sdpa", "--nq", "2", "--nk", "3", "--dk", "2", "--dv", "2", "--values",
                                "--seed", "1"]).stdout
    assert first == again
    assert first != other


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sdpa", "--nq", "0"], "--nq"),
        (["sdpa", "--nk", "-3"], "--nk"),
        (["sdpa", "--dk", "0"], "--dk"),
        (["sdpa", "--dv", "0"], "--dv"),
        (["sdpa", "--batch", "0"], "--batch"),
        (["mha", "--heads", "0"], "--heads"),
        (["mha", "--d-feat", "0"], "--d-feat"),
        (["mha", "--d-feat", "200", "--heads", "7"], "--d-feat 200 is not divisible by --heads 7"),
        (["mha", "--dropout", "1"], "--dropout 1 is outside [0, 1)"),
        (["mha", "--dropout", "-0.5"], "--dropout -0.5 is outside [0, 1)"),
    ],
)
def test_bad_sizes_exit_2_with_a_message(runner, args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_not_divisible_suggests_the_nearest_head_counts(runner):
    result = runner.invoke(app, ["mha", "--d-feat", "200", "--heads", "7"])
    assert "--heads 5 or --heads 8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_help_ends_with_examples(runner):
    for command in ("sdpa", "mha"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0
        tail = result.stdout.rstrip().splitlines()[-6:]
        assert any(f"attnscope {command} --" in line for line in tail), tail


def test_version(runner):
    from attnscope import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"attnscope {__version__}"


def _installed_attnscope() -> list[str]:
    exe = shutil.which("attnscope", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "attnscope"]


def test_installed_command_runs_and_errors_are_one_line():
    ok = subprocess.run([*_installed_attnscope(), "sdpa", "--nq", "4", "--nk", "6"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "[n_batch, n_Q, n_K] = [3, 4, 6]" in ok.stdout
    for bad in (["sdpa", "--nq", "0"], ["sdpa", "--nq", "abc"], ["sdpa", "--no-such-option"],
                ["mha", "--d-feat", "10", "--heads", "3"], ["mha", "--d-feat", "10", "--heads", "3", "--json"]):
        failed = subprocess.run([*_installed_attnscope(), *bad], capture_output=True, text=True, timeout=120)
        assert failed.returncode == 2, (bad, failed.stderr)
        assert failed.stdout == ""  # with --json too: docs/json.md, a refusal prints no object
        lines = unwrapped(failed.stderr).strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnscope: error:"), failed.stderr


def test_the_console_script_leaves_at_once_with_its_output_whole_and_atexit_run():
    """`run` (the console script, `python -m attnscope`) ends with os._exit once torch is loaded, skipping the
    interpreter's teardown of torch (about 0.45 s): stdout must be flushed whole first, atexit handlers run, and
    the exit code be main's."""
    entry = ("import atexit, sys; from attnscope.cli import run; "
             "atexit.register(lambda: sys.stderr.write('atexit ran\\n')); sys.argv[0] = 'attnscope'; run()")
    big = subprocess.run([sys.executable, "-c", entry, "mask", "--nq", "200", "--nk", "200", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert big.returncode == 0, big.stderr
    assert len(big.stdout) > 65536  # more than a pipe holds: written through, not left in a buffer
    assert len(json.loads(big.stdout)["mask"]) == 200 and big.stderr == "atexit ran\n"
    bad = subprocess.run([sys.executable, "-c", entry, "sdpa", "--nq", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines()[0].startswith("attnscope: error:"), bad.stderr


# A user's attention function for `attnscope trace FILE:attention`: plain scaled dot-product attention.
PLAIN_ATTENTION = ("import torch\n\ndef attention(q, k, v):\n"
                   "    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v\n")


def test_trace_exits_as_the_users_own_program_would(tmp_path):
    """The quick exit is skipped where the user's code ran: a file their module left open unflushed is written
    by the interpreter's teardown, as it would be at the end of their own program."""
    left = tmp_path / "left-open.txt"
    mine = tmp_path / "mine.py"
    mine.write_text(f"LOG = open({str(left)!r}, 'w')\nLOG.write('kept')\n{PLAIN_ATTENTION}")
    result = subprocess.run([sys.executable, "-m", "attnscope", "trace", f"{mine}:attention"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert left.read_text() == "kept"


def test_a_command_runs_without_the_collectors_full_passes_and_trace_with_pythons_own(tmp_path):
    """The console script turns the cycle collector's full passes off (cli/collector.py: they cost the start of
    a command that imports torch and free nothing); the young generations still run. trace, which runs the
    user's code, has the collector as Python sets it."""
    import gc

    mine = tmp_path / "mine.py"
    mine.write_text(PLAIN_ATTENTION)
    entry = ("import atexit, gc, sys; from attnscope.cli import run; "
             "atexit.register(lambda: sys.stderr.write(f'{gc.get_threshold()}\\n')); sys.argv[0] = 'attnscope'; run()")
    for args, full_passes in ((["mask", "--nq", "3", "--nk", "3"], False), (["trace", f"{mine}:attention"], True)):
        result = subprocess.run([sys.executable, "-c", entry, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        young, middle, oldest = eval(result.stderr.splitlines()[-1])
        assert (young, middle) == gc.get_threshold()[:2]
        assert (oldest == gc.get_threshold()[2]) is full_passes and oldest > 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose writes fail")
@pytest.mark.parametrize("args", [["--help"], ["sdpa", "--help"], ["mask", "--nq", "3", "--nk", "3", "--json"],
                                  ["mask", "--nq", "300", "--nk", "300", "--json"], ["sdpa"], ["trace", "{mine}"]])
def test_output_that_cannot_be_written_is_one_line(args, tmp_path):
    """stdout on a full disk (/dev/full): one line that says so and exit 1, whether the write fails inside a
    command, in --help, or only at the last flush; never a traceback or "Exception ignored"."""
    mine = tmp_path / "mine.py"
    mine.write_text(PLAIN_ATTENTION)
    argv = [arg.replace("{mine}", f"{mine}:attention") for arg in args]
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "attnscope", *argv], stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert unwrapped(result.stderr).splitlines() == [
        "attnscope: error: could not write the output (No space left on device); free space where it goes, or send "
        "it elsewhere"]


@pytest.mark.parametrize("args", [["mask", "--nq", "300", "--nk", "300"],
                                  ["mask", "--nq", "300", "--nk", "300", "--json"],
                                  ["mha", "--d-feat", "64", "--heads", "4"], ["sdpa", "--json"]])
def test_a_reader_that_left_ends_the_command_quietly_with_141(args):
    """`attnscope ... | head`: the pipe's reader is gone before the output is written. Tables (Rich's console)
    and JSON end alike: nothing on stderr, exit 141 (128 + SIGPIPE, as a tool stopped by SIGPIPE gives)."""
    proc = subprocess.Popen([sys.executable, "-m", "attnscope", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "NO_COLOR": "1"})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before a byte is read
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert stderr == ""


def test_closed_stdout_or_stderr():
    """`>&-` closes stdout (Python leaves sys.stdout None): one line on stderr, exit 1, not an AttributeError.
    `2>&-` closes stderr: errors go nowhere, but the exit codes hold (0 for a good run, 2 for a bad option)."""
    def shell(line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "NO_COLOR": "1"})

    python = f"{sys.executable} -m attnscope"
    for args in ("sdpa --nq 2 --nk 3", "--help", "mask --nq 2 --nk 2 --json"):
        closed = shell(f"{python} {args} >&-")
        assert closed.returncode == 1 and unwrapped(closed.stderr).splitlines() == [
            "attnscope: error: could not write the output (stdout is closed); give it somewhere to go: a terminal, "
            "a file or a pipe"], (args, closed.stderr)
    good = shell(f"{python} sdpa --nq 2 --nk 3 2>&-")
    assert good.returncode == 0 and "[n_batch, n_Q, n_K] = [3, 2, 3]" in good.stdout
    assert shell(f"{python} sdpa --nq 0 2>&-").returncode == 2


def test_python_dash_m_works():
    result = subprocess.run([sys.executable, "-m", "attnscope", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    assert result.stdout.startswith("attnscope ")


# --- your own tensors, masks, --save, --check (the inputs issue) ------------------------------------


@pytest.fixture()
def files(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = {"q": (2, 4, 8), "k": (2, 6, 8), "v": (2, 6, 3), "v5": (2, 5, 3), "k9": (2, 6, 9),
              "q1d": (8,), "kb": (3, 6, 8)}
    paths = {}
    for name, shape in shapes.items():
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], rng.standard_normal(shape).astype(np.float32))
    paths["badmask"] = str(tmp_path / "badmask.npy")
    np.save(paths["badmask"], np.ones((3, 5), dtype=bool))
    paths["text"] = str(tmp_path / "q.txt")
    (tmp_path / "q.txt").write_text("1 2 3")
    paths["dir"] = str(tmp_path)
    return paths


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--q", "{dir}/missing.npy"], "missing.npy: no such file"),
        (["--q", "{text}"], "unknown tensor file type"),
        (["--q", "{q1d}"], "rank 1"),
        (["--q", "{q}", "--k", "{k9}", "--v", "{v}"], "d_Q = 8 but d_K = 9"),
        (["--q", "{q}", "--k", "{k}", "--v", "{v5}"], "n_K = 6 but n_V = 5"),
        (["--q", "{q}", "--k", "{kb}", "--v", "{kb}"], "do not broadcast"),
        (["--q", "{q}", "--k", "{k}", "--v", "{v}", "--mask", "{badmask}"], "[3, 5] does not broadcast"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(runner, files, args, message):
    result = runner.invoke(app, ["sdpa", *[a.format(**files) for a in args]])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_save_onto_existing_file_is_refused_and_untouched(runner, tmp_path):
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"precious")
    result = runner.invoke(app, ["sdpa", "--save", str(target)])
    assert result.exit_code == 2
    assert "--force" in result.stderr
    assert target.read_bytes() == b"precious"
    forced = runner.invoke(app, ["sdpa", "--save", str(target), "--force"])
    assert forced.exit_code == 0, forced.output
    assert target.read_bytes() != b"precious"


def test_check_prints_pass_per_tensor(runner):
    result = runner.invoke(app, ["mha", "--batch", "2", "--nq", "5", "--nk", "7", "--d-feat", "16", "--heads", "4",
                                 "--check", "--causal"])
    assert result.exit_code == 0, result.output
    for name in ("x_raw", "attention", "x"):
        assert any(line.split()[:1] == [name] and "PASS" in line for line in result.stdout.splitlines()), name


def test_check_json_and_exit_1_on_fail(runner, monkeypatch):
    from dataclasses import replace

    from attnscope.attention import dot_product as attention

    real = attention.sdpa  # the module's inner attention with a planted scale of 1
    monkeypatch.setattr(attention, "sdpa", lambda Q, K, V, mask=None, *, spec, **kw:
                        real(Q, K, V, mask, spec=replace(spec, scale=1.0), **kw))
    result = runner.invoke(app, ["mha", "--batch", "2", "--nq", "3", "--d-feat", "8", "--heads", "2", "--check",
                                 "--json"])
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["check_passed"] is False
    assert {c["name"]: c["passed"] for c in payload["check"]}["x"] is False


def test_bare_causal_means_upper_left_and_lower_right_differs(runner):
    base = ["sdpa", "--batch", "1", "--nq", "2", "--nk", "4", "--dk", "2", "--dv", "2", "--json", "--values"]
    bare = json.loads(runner.invoke(app, [*base, "--causal"]).stdout)
    upper = json.loads(runner.invoke(app, [*base, "--causal", "upper-left"]).stdout)
    lower = json.loads(runner.invoke(app, [*base, "--causal", "lower-right"]).stdout)
    attention = {p: {t["name"]: t for t in p_json["tensors"]}["attention"]["values"]
                 for p, p_json in (("bare", bare), ("upper", upper), ("lower", lower))}
    assert attention["bare"] == attention["upper"]
    assert attention["upper"][0][0][1:] == [0.0, 0.0, 0.0]  # query 0 sees key 0 only
    assert attention["lower"][0][0][3] == 0.0 and attention["lower"][0][0][2] > 0.0  # query 0 sees keys 0..2


def test_stats_and_values_in_table_and_json(runner):
    args = ["sdpa", "--batch", "1", "--nq", "2", "--nk", "3", "--dk", "2", "--dv", "2"]
    table = runner.invoke(app, [*args, "--stats", "--values"]).stdout
    assert "statistics" in table and "NaN" in table and "tensor([[" in table
    payload = json.loads(runner.invoke(app, [*args, "--stats", "--values", "--json"]).stdout)
    attention = {t["name"]: t for t in payload["tensors"]}["attention"]
    assert set(attention["stats"]) == {"min", "max", "mean", "std", "nan", "inf"}
    assert all(abs(sum(row) - 1) < 1e-6 for row in attention["values"][0])


def test_integer_inputs_say_float32(runner, tmp_path):
    import numpy as np

    np.save(tmp_path / "q.npy", np.arange(6).reshape(2, 3))
    result = runner.invoke(app, ["sdpa", "--q", str(tmp_path / "q.npy")])
    assert result.exit_code == 0
    assert "computed in float32" in result.stdout


@pytest.mark.parametrize("args", [[], ["bench"]])
def test_bare_command_prints_help_once(args):
    result = subprocess.run([*_installed_attnscope(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.count("Usage:") == 1


@pytest.mark.parametrize("columns", ["80", "40"])
def test_messages_wrap_to_the_terminal_as_one_message(columns):
    """Issue 36, item 6: stderr reached 250-330 columns. A message wraps at word boundaries to COLUMNS (80
    piped), its first line as before, its later lines indented; `unwrapped` gives back the one line."""
    from cli_main import run_main

    outcome = run_main("mha", "--d-feat", "200", "--heads", "7", env={"COLUMNS": columns})
    lines = outcome.wrapped.splitlines()
    assert outcome.code == 2 and len(lines) > 1, outcome.wrapped
    assert all(len(line) <= int(columns) for line in lines), outcome.wrapped
    assert lines[0].startswith("attnscope: error: ") and all(line.startswith("  ") for line in lines[1:])
    assert unwrapped(outcome.wrapped).splitlines() == [outcome.stderr.rstrip("\n")]
    assert "--heads 5 or --heads 8" in outcome.stderr  # a flag and its value are never split at a hyphen


def test_a_long_word_is_kept_whole_and_piped_stderr_wraps_at_80(monkeypatch, capsys):
    from attnscope.render.console import info, message_lines

    path = "/a/" + "very-long-folder/" * 8 + "config.json"
    assert message_lines("attnscope: error: ", f"{path}: no such file").splitlines() == [
        "attnscope: error:", f"  {path}:", "  no such file"]
    monkeypatch.delenv("COLUMNS", raising=False)  # captured stderr is no terminal: 80 columns
    info("bench mha: " + "x " * 100)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("attnscope: bench mha: ") and max(map(len, lines)) <= 80 and len(lines) == 3


@pytest.mark.parametrize("args", [["anatomy", "/nonexistent"], ["sdpa", "--q", "/nonexistent.npy"],
                                  ["mha", "--d-feat", "200", "--heads", "7"], ["diff", "/no1.pt", "/no2.pt"],
                                  ["head", "--model", "/nonexistent"]])
def test_debug_keeps_a_usage_error_exit_2(args):
    """Issue 36, fuzz 6: under --debug a usage error was re-raised, a traceback and exit 1."""
    from cli_main import assert_usage_error, run_main

    outcome = run_main(*args, "--debug")
    assert_usage_error(outcome)
    assert "Traceback" not in outcome.stderr
