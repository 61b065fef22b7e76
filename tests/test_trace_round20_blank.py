"""`attnscope trace` never lines a step up with a tensor whose cells still hold what memory held: DeepSeek-V2's naive
MLA (round 20) makes its keys with `new_empty` and fills them by slices, and with RoPE left out its K_full row was
compared with the empty tensor itself, a max |diff| of 1e+13 one run and 5e+31 the next. A style of our own that
fills grouped keys and values head by head into `new_empty` tensors (tests/trace_styles_round20_blank.py), checked
against F.scaled_dot_product_attention in float64; the recorder's count of written cells (usertrace/blank.py) and
align.candidates' rule, each on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import assert_named, assert_passes, run_case

from attnscope.usertrace.align import best_equal, best_scaled, best_shifted, candidates
from attnscope.usertrace.blank import Unwritten
from attnscope.usertrace.record import Record

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round20_blank.py")
styles = user_module(STYLES)


def _module(bug: str = "") -> torch.nn.Module:
    torch.manual_seed(4)
    module = styles.LoopedGroups(bug=bug).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module


def test_the_style_is_attention():
    module, x = _module(), torch.randn(2, 5, 16, dtype=torch.float64)
    q = module.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)
    k, v = (t.view(2, 5, 2, 4).transpose(1, 2) for t in (module.k_proj(x), module.v_proj(x)))
    attended = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.allclose(module(x), module.o_proj(attended.transpose(1, 2).reshape(2, 5, 16)), atol=1e-10)
    for bug in ("no_scale", "tiled"):
        assert (_module(bug)(x) - module(x)).abs().max() > 1e-3, bug


@pytest.mark.parametrize(("bug", "entries"), [("", ()), ("no_scale", ("scale.none",)),
                                               ("tiled", ("gqa.tiled", "gqa.group_order"))])
def test_keys_filled_head_by_head(runner, bug, entries):
    """Query head i reading key head i % n_kv_head is both entries' mistake, the same numbers (a loop is neither a
    .repeat nor a grouped einsum): either is the right name."""
    code, out = run_case(runner, STYLES, "LoopedGroups", f"bug={bug!r}" if bug else None)
    if not entries:
        assert_passes(code, out)
        return
    found = out["first_divergence"]
    assert found is not None and found["experiment"] in entries, found
    assert_named(code, out, found["experiment"])


def test_a_blank_tensor_is_no_stand_in():
    """Of two tensors of K's shape, the one still holding memory's values (huge here, as uninitialised memory can
    be) is never the candidate; the written one is."""
    reference = torch.randn(2, 3, 4)
    blank = Record(0, "new_empty", "new_empty", torch.full((2, 3, 4), 1e30), 1, [], "method", True, 0, (),
                   ["key_states"], details={"unwritten": True})
    written = Record(1, "__setitem__", "__setitem__", reference + 1, 2, [], "operator", False, 0, (0,),
                     ["key_states"])
    found = candidates([blank, written], reference, "K_full")
    assert [m.record.index for m in found] == [1]


@pytest.mark.parametrize(("index", "whole"), [((slice(None), 0), False), ((torch.tensor([0, 1]),), True),
                                              ((Ellipsis, 0), False)])
def test_cells_written_by_index(index, whole):
    made = torch.empty(2, 3)
    cells = Unwritten()
    cells.made("new_empty", made)
    cells.written("__setitem__", [made, index, 0.0], made)
    assert cells.blank(made) == (not whole)
    cells.written("__setitem__", [made, (slice(None), slice(1, None)), 0.0], made)
    assert not cells.blank(made)
    cells.made("empty", other := torch.empty(3))
    cells.written("fill_", [other, 0.0], other)
    assert not cells.blank(other)


def test_a_blank_tensor_equal_to_a_step_is_no_stand_in_either():
    """Freed memory may hold a tensor of the reference's own (the same shape, computed a moment before): a
    `new_empty` result, or a slice of it, whose cells are not yet written then equals a step exactly. It stands for
    none, whether equal, equal times a number, or shifted by a constant per row (a CI run of the MLA tests, under
    load: Q_pe_rot lined up with `key_states[..., d_nope:]` before its copy_, the divergence then named at K_full)."""
    reference = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    blank = Record(0, "__getitem__", "__getitem__", reference.clone(), 1, [], "operator", False, 0, (),
                   details={"unwritten": True})
    assert best_equal([blank], reference, None) is None
    assert best_scaled([blank], reference * 0.5) is None
    assert best_shifted([blank], reference + torch.arange(3.0)[None, :, None], -1) is None
    written = Record(1, "copy_", "copy_", reference.clone(), 2, [], "method", False, 0, (0,))
    assert best_equal([blank, written], reference, None).record.index == 1


def test_cells_of_a_view():
    """A view of an uninitialised tensor is blank where the cells it covers are; a write through a view writes
    those cells alone (DeepSeek-V2's key_states[..., :d_nope].copy_(k_nope), then key_states[..., d_nope:])."""
    made = torch.empty(2, 4, 9, 12)
    cells = Unwritten()
    cells.made("new_empty", made)
    nope, rope = made[..., :8], made[..., 8:]
    assert cells.blank(nope) and cells.blank(rope)
    cells.written("copy_", [nope], nope.copy_(torch.zeros(2, 4, 9, 8)))
    assert not cells.blank(made[..., :8]) and cells.blank(made[..., 8:]) and cells.blank(made)
    cells.written("__setitem__", [rope, (Ellipsis, slice(0, 2)), 0.0], rope)
    assert cells.blank(made[..., 10:]) and not cells.blank(made[..., 8:10])
    cells.written("copy_", [made[..., 10:]], made[..., 10:])
    assert not cells.blank(made) and not cells.blank(made.transpose(1, 2))
