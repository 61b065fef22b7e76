"""Counts in messages take their noun's number: "the last 1 key padded", not "1 keys" (issue 36, item 11)."""

from __future__ import annotations

from cli_main import run_main

from attnscope.usertrace.weightrows import cut_rows
from attnscope.words import counted, run_of


def test_counted_says_one_and_many():
    assert [counted(1, "key"), counted(3, "key"), counted(1, "query"), counted(2048, "query")] == [
        "1 key", "3 keys", "1 query", "2,048 queries"]
    assert counted(0, "op") == "0 ops" and counted(2, "day") == "2 days"


def test_one_padded_key_and_one_query_read_in_the_singular():
    outcome = run_main("mask", "--nq", "1", "--nk", "4", "--pad", "1")
    assert outcome.code == 0, outcome.stderr
    assert "mask [1 query x 4 keys]" in outcome.stdout
    assert "the last 1 key padded" in outcome.stdout and "1 keys" not in outcome.stdout
    assert "the last 1 key is padding" in outcome.stdout or "the last 1 key is cut" in outcome.stdout
    many = run_main("mask", "--nq", "2", "--nk", "4", "--pad", "2").stdout
    assert "mask [2 queries x 4 keys]" in many and "the last 2 keys padded" in many


def test_sdpa_header_with_one_padded_key():
    outcome = run_main("sdpa", "--batch", "1", "--nq", "2", "--nk", "3", "--pad", "1", "--heatmap")
    assert outcome.code == 0, outcome.stderr
    assert "last 1 key padded" in outcome.stdout and "[2 queries x 3 keys]" in outcome.stdout


def test_positions_read_as_a_step_a_run_or_a_list():
    assert run_of("tokens", [0, 5, 10, 15]) == "tokens 0, 5, … 15 (5 apart)"
    assert run_of("keys", [3, 4, 5, 6, 7]) == "keys 3 to 7"
    assert run_of("keys", [0, 2, 3, 9, 10, 11, 12]) == "keys 0, 2, 3, 9, 10, 11, …"
    assert run_of("tokens", [0, 4]) == "tokens 0, 4"


def test_a_cut_weights_name_gives_back_its_parameter_and_rows():
    assert cut_rows("attn.in_proj_weight[32:64]") == ("attn.in_proj_weight", 32, 64, True)
    assert cut_rows("W[1]") == ("W", 1, 2, False)
    assert cut_rows("q_proj") is None
