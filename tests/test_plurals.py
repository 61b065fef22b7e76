"""Counts in messages take their noun's number: "the last 1 key padded", not "1 keys" (issue 36, item 11)."""

from __future__ import annotations

from cli_main import run_main

from attnscope.words import counted


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
