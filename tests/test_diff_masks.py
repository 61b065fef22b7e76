"""`attnscope diff` of two runs that differ in their mask (issue 29): it says which run masks and how, in a diff's
words (A and B), never trace's advice to 'describe it with --causal'."""

from __future__ import annotations

import json

import pytest
from cli_main import run_main
from test_trace_causes import CAUSAL, module


def saved(tmp_path, name: str, *args: str, code: int = 0) -> str:
    path = str(tmp_path / f"{name}.safetensors")
    outcome = run_main(*args, "--save", path)
    assert outcome.code == code, outcome.stderr
    return path


def diff(a: str, b: str) -> dict:
    outcome = run_main("diff", a, b, "--json")
    assert outcome.code == 1, outcome.stderr
    return json.loads(outcome.stdout)["first_divergence"]


MHA = ("mha", "--heads", "2", "--d-feat", "8", "--batch", "2", "--nq", "5")


@pytest.mark.parametrize(("masked", "words"), [("B", "under a causal mask (upper-left, --causal)"),
                                              ("A", "under a causal mask (upper-left, --causal)")])
def test_mha_with_and_without_causal_says_which_run_masks(tmp_path, masked, words):
    plain, causal = saved(tmp_path, "plain", *MHA), saved(tmp_path, "causal", *MHA, "--causal")
    a, b = (plain, causal) if masked == "B" else (causal, plain)
    first = diff(a, b)
    other = "A" if masked == "B" else "B"
    assert first["diagnosis"].startswith(f"{masked} masks its scores and {other} does not"), first
    assert words in first["diagnosis"] and "describe it with" not in first["diagnosis"], first


def test_a_window_is_named_by_its_width(tmp_path):
    plain, window = saved(tmp_path, "plain", *MHA), saved(tmp_path, "window", *MHA, "--window", "2")
    first = diff(plain, window)
    assert "B masks its scores" in first["diagnosis"] and "sliding window of 2" in first["diagnosis"], first


def test_trace_runs_whose_code_masks_by_itself_say_so_in_a_diffs_words(tmp_path):
    """Neither run was given --causal; B's code masks by itself, A's does not."""
    unmasked = module(tmp_path, (CAUSAL, "allowed = torch.ones(T, T, dtype=torch.bool)"), name="unmasked.py")
    a = saved(tmp_path, "a", "trace", unmasked)
    b = saved(tmp_path, "b", "trace", module(tmp_path), code=1)  # trace itself: masks by itself, no --causal
    first = diff(a, b)
    assert "B masks where A does not" in first["diagnosis"] and "causal mask (upper-left)" in first["diagnosis"], first
    assert "describe it with" not in first["diagnosis"], first
