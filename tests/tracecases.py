"""What the trace rounds' tests ask of one case: `attnscope trace STYLES:TARGET --json` run on a style file, and a
correct style passing (exit 0, no divergence) or a planted bug named by the right catalog entry *by experiment*
(exit 1, first_divergence.experiment, evidence "by experiment ...").

    code, out = run_case(runner, STYLES, "Block", "bug='no_scale'", ("--causal",))
    assert_named(code, out, "scale.none")

and a round's two usual tests, one case a row, made by `passing_test` and `plants_test`:

    test_correct_styles_pass = passing_test(STYLES, CORRECT)        # rows (target, init, options)
    test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)  # rows (target, init, options, entry)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
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


def passing_test(styles: str, rows: Sequence[tuple], files: str | None = None) -> Callable[..., None]:
    """A test that each (target, init, options) row of `rows` passes, a case a row (ids: case_ids). `files`: the name
    of a fixture that maps placeholders among the options ("PAD") to the paths of the files it wrote."""

    @pytest.mark.parametrize(("target", "init", "options"), rows, ids=case_ids(rows))
    def test(request, runner, target, init, options):
        assert_passes(*run_case(runner, styles, target, init, _placed(request, files, options)))

    return test


def plants_test(styles: str, rows: Sequence[tuple], files: str | None = None) -> Callable[..., None]:
    """A test that each (target, init, options, entry) row of `rows` is named `entry` by experiment, a case a row (ids:
    case_ids); `files` as passing_test's."""

    @pytest.mark.parametrize(("target", "init", "options", "entry"), rows, ids=case_ids(rows))
    def test(request, runner, target, init, options, entry):
        assert_named(*run_case(runner, styles, target, init, _placed(request, files, options)), entry)

    return test


def _placed(request, files: str | None, options: Sequence[str]) -> tuple[str, ...]:
    """The options with the placeholders the `files` fixture maps replaced by its paths."""
    if files is None:
        return tuple(options)
    paths = request.getfixturevalue(files)
    return tuple(paths.get(o, o) for o in options)


def saved(tmp_path: Path, name: str, array) -> str:
    """`array` (numpy, or a torch tensor on the CPU) saved as `tmp_path/name` for --mask or --bias: the path."""
    path = tmp_path / name
    np.save(path, array if isinstance(array, np.ndarray) else array.numpy())
    return str(path)
