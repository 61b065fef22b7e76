"""Runs: what each command does between parsing its options and rendering the result (no terminal code)."""
