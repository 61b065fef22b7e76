"""`attnscope trace --forward "..."`: more keyword arguments for the forward, read as --init is (initargs.py)."""

from __future__ import annotations

import pytest
from test_trace_command import trace, write

FLAGGED = """
class Flagged(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, use_cache=True, scale_by=None):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.n_head, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if use_cache:
            k = k * 2.0  # a path the run should not take
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, d))
"""


def test_forward_arguments_are_given_to_the_forward(tmp_path, runner):
    path = write(tmp_path, FLAGGED)
    result, _ = trace(runner, f"{path}:Flagged", "--init", "d=32, n_head=4")
    assert result.exit_code == 1, result.output  # its default takes the other path
    result, out = trace(runner, f"{path}:Flagged", "--init", "d=32, n_head=4", "--forward", "use_cache=False")
    assert result.exit_code == 0, result.output
    assert "--forward: use_cache=False" in out["notes"]


@pytest.mark.parametrize("given, said", [
    ("nope=1", "takes no argument 'nope'"),
    ("x=1", "x is the input trace feeds"),
    ("use_cache=os.getenv('X')", "attribute"),
    ("use_cache=", "write keyword arguments"),
    ("False", "keyword arguments only"),
    ("scale_by=Flagged(1, 1)", None),  # a class of the file: built, given as it is (their forward then fails)
])
def test_a_bad_forward_argument_is_one_line_exit_2(tmp_path, runner, given, said):
    path = write(tmp_path, FLAGGED)
    result, _ = trace(runner, f"{path}:Flagged", "--init", "d=32, n_head=4", "--forward", given)
    if said is None:
        assert result.exit_code in (0, 1), result.output
        return
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("attnscope: error: --forward") and said in result.stderr, result.stderr
