"""What the trace rounds' tests ask of one case: `attnscope trace STYLES:TARGET --json` run on a style file, and a
correct style passing (exit 0, no divergence) or a planted bug named by the right catalog entry *by experiment*
(exit 1, first_divergence.experiment, evidence "by experiment ...").

    code, out = run_case(runner, STYLES, "Block", "bug='no_scale'", ("--causal",))
    assert_named(code, out, "scale.none")
"""

from __future__ import annotations

from collections.abc import Sequence

from test_trace_command import trace


def run_case(runner, styles: str, target: str, init: str | None = None,
             options: Sequence[str] = ()) -> tuple[int, dict]:
    """trace's exit code and its JSON; fails the test where trace wrote no JSON (a refusal, a crash)."""
    result, out = trace(runner, f"{styles}:{target}", *(("--init", init) if init else ()), *options)
    assert out is not None, result.stdout + result.stderr
    return result.exit_code, out


def assert_passes(code: int, out: dict) -> None:
    assert code == 0 and out["first_divergence"] is None, out["first_divergence"]


def assert_named(code: int, out: dict, entry: str) -> dict:
    """The first divergence, named `entry` by experiment."""
    found = out["first_divergence"]
    assert code == 1 and found is not None, out
    assert found["experiment"] == entry and found["evidence"].startswith("by experiment"), found
    return found


def case_ids(cases: Sequence[tuple]) -> list[str]:
    """pytest ids for (target, ...) cases: the target and the case's place in the list."""
    return [f"{case[0]}-{i}" for i, case in enumerate(cases)]
