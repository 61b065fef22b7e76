"""Shared fixtures. Tiny models are built on the fly; nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch

# The tests never reach the network: a model that is not on disk must fail fast, as offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_COLOR", "1")


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture()
def runner():
    """A CliRunner whose results' stderr has each message on one line (tests/cli_main.unwrapped)."""
    from cli_main import unwrapped
    from typer.testing import CliRunner

    class Runner(CliRunner):
        def invoke(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            result = super().invoke(*args, **kwargs)
            result.stderr_bytes = unwrapped(result.stderr_bytes.decode()).encode()
            return result

    return Runner()
