"""`attnscope mask`: the grid against a plain formula, and every translation run in its own library."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from attnscope.cli import app
from attnscope.readings.maskview import view
from attnscope.readings.translations import FLASH, FLEX, HF, MHA, SDPA
from attnscope.spec import AttentionSpec

CASES = [
    {"n_Q": 5, "n_K": 8, "causal": "lower-right", "pad": 2, "window": 3},
    {"n_Q": 6, "n_K": 6, "causal": "upper-left"},
    {"n_Q": 4, "n_K": 7, "causal": "lower-right"},
    {"n_Q": 4, "n_K": 7, "causal": "upper-left", "pad": 1},
    {"n_Q": 3, "n_K": 7, "cache": 4, "window": 2},
    {"n_Q": 3, "n_K": 5, "pad": 1},
    {"n_Q": 3, "n_K": 5, "user": "bool", "causal": "upper-left"},
    {"n_Q": 4, "n_K": 4, "user": "int"},
    {"n_Q": 3, "n_K": 5, "user": "float", "causal": "lower-right"},
    {"n_Q": 3, "n_K": 4},
    # padding with causal or a window: flash-attn aligns on the unpadded lengths (issue 18)
    {"n_Q": 5, "n_K": 8, "causal": "lower-right", "pad": 2},
    {"n_Q": 6, "n_K": 6, "window": 2, "pad": 1},
    {"n_Q": 3, "n_K": 8, "causal": "lower-right", "window": 4, "pad": 5},
    {"n_Q": 4, "n_K": 6, "causal": "lower-right", "window": 2, "pad": 4},
    {"n_Q": 6, "n_K": 4, "causal": "lower-right", "pad": 1},
    {"n_Q": 4, "n_K": 4, "causal": "upper-left", "pad": 3},
    {"n_Q": 9, "n_K": 9, "chunk": 4},
    {"n_Q": 3, "n_K": 10, "cache": 7, "chunk": 4, "pad": 1},
    {"n_Q": 5, "n_K": 9, "causal": "upper-left", "chunk": 3, "user": "bool"},
    {"n_Q": 4, "n_K": 6, "causal": "lower-right", "chunk": 8, "user": "float"},
    {"n_Q": 7, "n_K": 7, "window": 4, "side": "both"},
    {"n_Q": 4, "n_K": 9, "window": 5, "side": "both", "pad": 2},
    {"n_Q": 5, "n_K": 5, "window": 1, "side": "both", "user": "bool"},
    {"n_Q": 4, "n_K": 6, "causal": "lower-right", "chunk": 8, "pad": 2},
    {"n_Q": 6, "n_K": 6, "window": 3, "side": "both", "pad": 2},
    {"n_Q": 8, "n_K": 8, "window": 5, "side": "both", "pad": 1},
    {"n_Q": 5, "n_K": 5, "window": 9, "side": "both", "pad": 4},
]


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    """flash-attn's documented rule in plain torch, as its tests' reference computes it (`attention_ref` and
    `construct_local_mask` in tests/test_flash_attn.py): q [n_batch, n_Q, n_head, d], k and v [n_batch, n_K, ...];
    causal and window aligned bottom-right on the lengths given (row i at i + sk - sq); a query that sees no key
    gets zeros."""
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        window_size = (window_size[0], 0)
    row, col = torch.arange(sq)[:, None], torch.arange(sk)
    if window_size[0] < 0 and window_size[1] < 0:
        hidden = torch.zeros(sq, sk, dtype=torch.bool)
    elif window_size[0] < 0:
        hidden = col > row + sk - sq + window_size[1]
    else:
        hidden = (col > torch.minimum(row + sk - sq + window_size[1], torch.tensor(sk))) | \
            (col < row + sk - sq - window_size[0])
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    attention = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    attention = attention.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
    return torch.einsum("bhts,bshd->bthd", attention, v)


def _user(case: dict) -> torch.Tensor | None:
    kind = case.get("user")
    if kind is None:
        return None
    generator = torch.Generator().manual_seed(0)
    seen = torch.rand(case["n_Q"], case["n_K"], generator=generator) > 0.3
    seen[:, 0] = True
    if kind == "float":
        return torch.randn(case["n_Q"], case["n_K"], generator=generator).masked_fill(~seen, float("-inf"))
    return seen if kind == "bool" else seen.to(torch.int64)


def _expected(case: dict, user: torch.Tensor | None) -> torch.Tensor:
    """The rule in plain Python: query i at position i + offset, key j at j."""
    n_Q, n_K, window, pad, chunk = case["n_Q"], case["n_K"], case.get("window"), case.get("pad", 0), case.get("chunk")
    both = case.get("side") == "both"  # |i - j| <= window // 2, no causal part
    causal = (case.get("causal") or ("lower-right" if case.get("cache") else None)
              or ("upper-left" if window or chunk else None))
    causal = None if both else causal
    offset = n_K - n_Q if causal == "lower-right" else 0
    grid = torch.ones(n_Q, n_K, dtype=torch.bool)
    for i in range(n_Q):
        for j in range(n_K):
            p = i + offset
            hidden = abs(i - j) > window // 2 if both else causal and j > p or window is not None and p - j >= window
            if hidden or j >= n_K - pad or chunk is not None and j // chunk != p // chunk:
                grid[i, j] = False
            hidden_by_user = user is not None and (user[i, j] == -torch.inf if user.is_floating_point()
                                                   else not bool(user[i, j]))
            if hidden_by_user:
                grid[i, j] = False
    return grid


def _view(case: dict, user: torch.Tensor | None):
    spec = AttentionSpec(causal=case.get("causal") or bool(case.get("cache")), window=case.get("window"),
                         cache=case.get("cache", 0), chunk=case.get("chunk"), window_side=case.get("side", "left"))
    return view(case["n_Q"], case["n_K"], spec,
                pad=case.get("pad", 0), user_mask=user)


@pytest.mark.parametrize("case", CASES)
def test_grid_is_the_rule(case):
    user = _user(case)
    assert torch.equal(torch.tensor(_view(case, user).grid), _expected(case, user))


@pytest.mark.parametrize("case", CASES)
def test_every_translation_gives_the_same_mask(case):
    user = _user(case)
    shown = _view(case, user)
    grid = torch.tensor(shown.grid)
    n_Q, n_K = case["n_Q"], case["n_K"]
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 1, n_Q, 8), torch.randn(1, 1, n_K, 8), torch.randn(1, 1, n_K, 8)
    additive = user if user is not None and user.is_floating_point() else torch.zeros(n_Q, n_K)
    wanted_mask = additive.masked_fill(~grid, float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=wanted_mask)
    base = {"torch": torch, "F": F, "q": q, "k": k, "v": v, "user_mask": user, "n_batch": 1}

    scope = dict(base)
    exec(shown.translations[SDPA], scope)
    torch.testing.assert_close(scope["out"], expected, equal_nan=True)

    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, bias=False).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(8))
    scope = {**base, "mha": mha, "q": q[0], "k": k[0], "v": v[0]}
    with torch.no_grad():
        exec(shown.translations[MHA], scope)
    rows = grid.any(dim=-1)  # nn.MultiheadAttention gives NaN where a query sees no key
    torch.testing.assert_close(scope["out"][0, rows], expected[0, 0, rows])

    scope = dict(base)
    exec(shown.translations[HF], scope)
    seen = scope["mask"][0, 0] > torch.finfo(torch.float32).min
    assert torch.equal(seen, grid) if user is None or not user.is_floating_point() else torch.equal(seen & grid, grid)

    from torch.nn.attention.flex_attention import create_mask

    scope = dict(base)
    code = shown.translations[FLEX]
    exec(code[: code.index("block_mask")], scope)
    flex = create_mask(scope["mask_mod"], 1, 1, n_Q, n_K, device="cpu")[0, 0]
    if user is not None and user.is_floating_point():  # its -inf entries come through score_mod
        flex = flex & ~torch.isneginf(user)
    assert torch.equal(flex, grid)

    code = shown.translations[FLASH]
    if not code.startswith("not expressible"):
        scope = {**base, "q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2),
                 "flash_attn_func": flash_attn_func}
        exec(code, scope)
        out = scope["out"].transpose(1, 2)  # [n_batch, n_head, n_Q, d]
        seen = grid.any(dim=-1)
        torch.testing.assert_close(out[0, 0, seen], expected[0, 0, seen])
        assert torch.equal(out[0, 0, ~seen], torch.zeros_like(out[0, 0, ~seen]))


def test_cutting_only_the_padded_keys_would_move_flash_attns_diagonal():
    """What the flash-attn snippet said before: drop the last N keys, keep every query. By flash-attn's own rule
    the diagonal then moves by N (`attnscope mask --nq 5 --nk 8 --causal lower-right --pad 2`)."""
    n_Q, n_K, pad = 5, 8, 2
    grid = torch.tensor(_view({"n_Q": n_Q, "n_K": n_K, "causal": "lower-right", "pad": pad}, None).grid)
    torch.manual_seed(2)
    q, k, v = torch.randn(1, n_Q, 1, 8), torch.randn(1, n_K, 1, 8), torch.randn(1, n_K, 1, 8)
    keys_only = flash_attn_func(q, k[:, : n_K - pad], v[:, : n_K - pad], causal=True)[:, :, 0]
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=grid)[:, 0]
    assert not torch.allclose(keys_only, expected)
    assert "q[:, :3]" in view(n_Q, n_K, AttentionSpec(causal="lower-right"), pad=pad).translations[FLASH]


def test_flash_attn_says_what_it_cannot_express():
    assert "not expressible" in view(3, 5, AttentionSpec(causal="upper-left")).translations[FLASH]
    assert "window_size=(3, 0)" in view(5, 5, AttentionSpec(window=4)).translations[FLASH]
    user = torch.ones(3, 3, dtype=torch.bool)
    assert "not expressible" in view(3, 3, AttentionSpec(), user_mask=user).translations[FLASH]
    assert "no chunked attention" in view(5, 5, AttentionSpec(chunk=4)).translations[FLASH]
    assert "plain causal here" in view(4, 4, AttentionSpec(chunk=4)).translations[FLASH]


def test_mask_command_json(runner):
    result = runner.invoke(app, ["mask", "--nq", "3", "--cache", "2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "mask" and payload["alignment"] == "lower-right"
    assert payload["mask"] == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    assert set(payload["translations"]) == {SDPA, MHA, HF, FLASH, FLEX}


def test_mask_command_table_names_the_alignment(runner):
    result = runner.invoke(app, ["mask", "--nq", "4", "--nk", "6", "--causal", "lower-right"])
    assert result.exit_code == 0, result.output
    assert "lower-right: query i sees keys j ≤ i + 2" in result.stdout
    assert "q0 ■ ■ ■ · · ·" in result.stdout


@pytest.mark.parametrize("case", [c for c in CASES if c.get("causal") == "lower-right" or c.get("cache")])
def test_the_header_says_what_the_last_row_of_the_grid_shows(case):
    """Issue 36, item 8: `--nq 4 --cache 4 --window 3` said "the last query sees all" above a grid whose q3
    sees keys 5-7 only. The header is read from the grid, whatever took keys from it (window, padding, file)."""
    shown = _view(case, _user(case))
    said = shown.describe().split("the last query sees ")[1]
    last = shown.grid[-1]
    if all(last) or not any(last):
        assert said == ("all keys" if all(last) else "no key")
    else:
        keys = {j for j, seen in enumerate(last) if seen}
        words = said.removeprefix("keys ").removeprefix("key ").replace(" and ", ", ").split(", ")
        spans = [tuple(map(int, w.split("-"))) if "-" in w else (int(w), int(w)) for w in words]
        assert keys == {j for a, b in spans for j in range(a, b + 1)}, said


def test_the_header_of_a_window_over_a_cache(runner):
    result = runner.invoke(app, ["mask", "--nq", "4", "--cache", "4", "--window", "3"])
    words = " ".join(result.stdout.split())  # the header wraps at the width
    assert "the last query sees keys 5-7" in words and "sees all" not in words
    assert "q3 · · · · · ■ ■ ■" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--nq", "2", "--nk", "9", "--cache", "3"], "n_K = 5, not 9"),
    (["--nq", "2", "--cache", "3", "--causal", "upper-left"], "aligns lower-right"),
    (["--nq", "4", "--pad", "4"], "--pad 4 must hide fewer keys"),
    (["--nq", "100000", "--nk", "100000"], "more than the"),
])
def test_mask_command_bad_input_is_one_line(runner, args, message):
    result = runner.invoke(app, ["mask", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_mask_file_of_the_wrong_shape(runner, tmp_path):
    import numpy as np

    np.save(tmp_path / "m.npy", np.ones((3, 9), dtype=bool))
    result = runner.invoke(app, ["mask", "--nq", "4", "--nk", "6", "--mask", str(tmp_path / "m.npy")])
    assert result.exit_code == 2 and "does not broadcast" in result.stderr


def test_show_mask_above_the_table_and_in_json(runner):
    args = ["sdpa", "--batch", "1", "--nq", "2", "--nk", "5", "--dk", "4", "--dv", "4", "--causal", "lower-right"]
    table = runner.invoke(app, [*args, "--show-mask"]).stdout
    assert table.index("mask [2 queries x 5 keys]") < table.index("SDPA")
    payload = json.loads(runner.invoke(app, [*args, "--show-mask", "--json"]).stdout)
    assert payload["mask"]["grid"] == [[True, True, True, True, False], [True] * 5]
    assert payload["mask"]["alignment"] == "lower-right"


@pytest.mark.parametrize("case", CASES)
def test_code_translations_fit_80_columns(case):
    """Code is not rewrapped for the terminal (the view indents it by 2): every snippet line fits 78 columns,
    FlexAttention's mask_mod included once a chunk, an offset and padding make its conjunction long."""
    shown = _view(case, _user(case))
    long = [line for library, code in shown.translations.items() if library != FLASH
            for line in code.splitlines() if len(line) > 78]
    assert not long, long
