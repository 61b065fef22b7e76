"""Progress (issue 43, item 17): --all-layers, --generate and a long input count layers and tokens done out of their
total on a terminal (render/progress.py), and write nothing where stderr is a pipe. The totals are checked against
the model's own config (transformers' num_hidden_layers) and the tokens asked for; the GGUF keep bound against the
bytes of the tensors dequantized."""

from __future__ import annotations

import io
from contextlib import contextmanager

import pytest
import tiny_gguf
from rich.console import Console

from attnscope.cli import app
from attnscope.models.forward.long import long_head
from attnscope.models.gguf.checkpoint import GgufCheckpoint
from attnscope.models.gguf.header import read_header
from attnscope.render.progress import Spinner, counting
from attnscope.runs.head import run_head
from attnscope.runs.head_result import HeadOptions

TEXT = "the cat sat on the mat and the dog sat on the log"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny_gguf.write("llama", tmp_path_factory.mktemp("progress"), "Q8_0")


class Recorder:
    """A Progress that writes down each message's total and the indices it was told of."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int | None, str, list[int]]] = []

    @contextmanager
    def __call__(self, message: str, total: int | None = None, unit: str = "layer"):
        ticks: list[int] = []
        self.seen.append((message, total, unit, ticks))
        yield ticks.append


def counted_runs(recorder: Recorder) -> list[tuple[int | None, str, list[int]]]:
    return [(total, unit, ticks) for _, total, unit, ticks in recorder.seen if total is not None]


def test_all_layers_and_generate_count_to_their_totals(gguf):
    n_layer = tiny_gguf.hf_model("llama", 300).config.num_hidden_layers  # the reference's own layer count
    recorder = Recorder()
    run_head(HeadOptions(model=str(gguf), layer=1, head=0, text=TEXT, all_layers=True), progress=recorder)
    assert counted_runs(recorder) == [(n_layer, "layer", list(range(n_layer)))]
    recorder = Recorder()
    run_head(HeadOptions(model=str(gguf), layer=1, head=0, text=TEXT, generate=3), progress=recorder)
    assert counted_runs(recorder) == [(3, "token", [0, 1, 2])]


def test_long_head_counts_layers_up_to_the_asked_one(gguf):
    from attnscope.models.config import read_config
    from attnscope.models.families import open_model

    recorder: list[int] = []
    model = open_model(gguf, read_config(gguf))
    with model.checkpoint:
        long_head(model, [5, 6, 7, 8, 9, 10], [0] * 6, 1, 0, progress=recorder.append)
    assert recorder == [0, 1]


def test_spinner_counts_on_a_terminal_and_says_nothing_on_a_pipe():
    assert counting(11, 30, "layer") == "layer 12 of 30"
    assert counting(1999, 2048, "token") == "token 2,000 of 2,048"
    terminal = io.StringIO()
    spinner = Spinner(Console(file=terminal, force_terminal=True, width=80))
    with spinner("running all 3 layers on 12 tokens", total=3) as tick:
        for index in range(3):
            tick(index)
    assert "running all 3 layers on 12 tokens: layer 3 of 3" in terminal.getvalue()  # the last count, as drawn
    piped = io.StringIO()
    quiet = Spinner(Console(file=piped, force_terminal=False, width=80))
    with quiet("running all 3 layers", total=3) as tick:
        tick(0)
    assert piped.getvalue() == ""


def test_piped_all_layers_and_generate_write_no_progress(gguf, runner):
    for extra in (["--all-layers"], ["--generate", "2"], ["--all-layers", "--json"]):
        result = runner.invoke(app, ["head", "--model", str(gguf), "--layer", "1", "--text", TEXT, *extra])
        assert result.exit_code == 0, result.output
        assert "layer 1 of" not in result.stderr and "token 1 of" not in result.stderr
        if "--json" in extra:
            assert result.stdout.lstrip().startswith("{")


def test_generate_keeps_each_tensor_dequantized_once_within_the_bound(gguf, monkeypatch):
    from attnscope.models.gguf import checkpoint

    with GgufCheckpoint(read_header(gguf)) as opened:  # a single pass keeps nothing
        key = next(k for k in opened.keys if k.endswith("q_proj.weight"))
        opened.tensor(key)
        assert opened._kept == {}
        opened.reads_again()
        first = opened.tensor(key)
        assert opened.tensor(key) is first and opened._kept_bytes == first.numel() * 4
    calls: list[str] = []
    tensor = GgufCheckpoint.tensor

    def counting_tensor(self, key):  # a whole tensor dequantized: one not kept from before
        if key not in self._kept and ".layers." in key:
            calls.append(key)
        return tensor(self, key)

    monkeypatch.setattr(GgufCheckpoint, "tensor", counting_tensor)
    run_head(HeadOptions(model=str(gguf), layer=1, head=0, text=TEXT, generate=4))
    whole = list(calls)
    assert whole and len(whole) == len(set(whole))  # each layer's matrices dequantized once for 4 tokens
    # a bound of 0 keeps nothing: every step dequantizes again (what a machine without the memory gets)
    monkeypatch.setattr(checkpoint, "_keep_bound", lambda: 0)
    calls.clear()
    run_head(HeadOptions(model=str(gguf), layer=1, head=0, text=TEXT, generate=4))
    again = list(calls)
    assert len(again) >= 4 * len(set(whole))
