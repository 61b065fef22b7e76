"""--all-layers on a long text, the terminal's view (runs/streamed_layers.py, readings/layerdigest.py): each layer's
readings taken as the layer comes, in blocks of rows, the patterns let go. Forced here on tiny models with a
threshold of 0 and blocks of a few rows, and compared with the whole path (every layer's patterns kept, then
read: runs/beyond_layer.py) and with transformers' eager output_attentions read in float64 by formulas of the
test's own: the printed terminal the same, the statistics, sink shares and thumbnails to float64 rounding, the
rollout's last rows to float32's."""

from __future__ import annotations

import math

import pytest
import tiny_gguf
import tiny_models
import torch

from attnscope.cli import app
from attnscope.readings import layerdigest
from attnscope.runs import streamed_layers
from attnscope.runs.head import run_head
from attnscope.runs.head_result import HeadOptions

TEXT = ("The cat sat on the mat. The dog sat on the log, and the cat saw the dog. A bird sang while the cat "
        "slept on the mat by the door. The cat sat on the mat.")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (path, transformers' eager model, its tokenizer): a GGUF LLaMA (causal, grouped KV), GPT-OSS
    (learned sinks, sliding layers), Qwen 2 (a window) and BERT (both ways: nothing above the diagonal is 0)."""
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name == "gguf":
                path = tiny_gguf.write("llama", folder)
                made[name] = (path, *tiny_gguf.reference(path))
            else:
                model = tiny_models.build(name, folder)
                from transformers import AutoTokenizer

                made[name] = (folder, model, AutoTokenizer.from_pretrained(folder))
        return made[name]

    return get


def _run(path, monkeypatch, streamed: bool, cells: int = 97, layer: int = 1, head: int = 1):
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", -1 if streamed else 1 << 62)
    monkeypatch.setattr(layerdigest, "BLOCK_CELLS", cells)  # a row a block (97), or a few rows (1,500)
    return run_head(HeadOptions(model=str(path), layer=layer, head=head, text=TEXT, all_layers=True,
                                terminal_only=True))


def _rollout_last_row(attentions, drop_first: bool = False, norms=None) -> torch.Tensor:
    """Abnar & Zuidema's rollout, the last query's row, in float64 from the eager patterns (the test's own)."""
    R = None
    for index, A in enumerate(attentions):
        A = A[0].double()
        if norms is not None:
            A = A * norms[index][:, None, :]
            A = A / A.sum(-1, keepdim=True).clamp_min(1e-300)
        if drop_first:
            A = A.clone()
            A[..., 0] = 0
            total = A.sum(-1, keepdim=True)
            A = A / torch.where(total > 0, total, torch.ones_like(total))
        M = 0.5 * A.mean(0) + 0.5 * torch.eye(A.shape[-1], dtype=torch.float64)
        M = M / M.sum(-1, keepdim=True)
        R = M if R is None else M @ R
    return R[-1]


@pytest.mark.parametrize(("name", "cells"), [("gguf", 97), ("gguf", 1500), ("gpt_oss", 97), ("qwen2", 1500),
                                             ("bert", 97), ("bert", 1500)])
def test_streamed_equals_whole_path_and_eager(models, monkeypatch, name, cells):
    path, reference, tokenizer = models(name)
    whole = _run(path, monkeypatch, streamed=False)
    streamed = _run(path, monkeypatch, streamed=True, cells=cells)
    assert whole.layer_patterns is not None and streamed.layer_patterns is None  # the path each took
    assert all(isinstance(layer, layerdigest.StreamedHeads) for layer in streamed.layer_heads)
    ids = torch.tensor([whole.encoded.ids])
    with torch.no_grad():
        eager = reference(ids, output_attentions=True).attentions
    assert len(eager) == len(whole.layer_heads) == len(streamed.layer_heads)
    from attnscope.views.pooling import THUMB_COLS, THUMB_ROWS, group_size, pool

    n = ids.shape[-1]
    cells = (group_size(n, THUMB_ROWS), group_size(n, THUMB_COLS))
    for mine, theirs, ref in zip(streamed.layer_heads, whole.layer_heads, eager, strict=True):
        assert mine.attention.shape == theirs.attention.shape == ref[0].shape
        assert [h["kind"] for h in mine.heads] == [h["kind"] for h in theirs.heads]
        assert [h["kind_also"] for h in mine.heads] == [h["kind_also"] for h in theirs.heads]
        for a, b in zip(mine.heads, theirs.heads, strict=True):
            assert a["stats"].keys() == b["stats"].keys()
            for key in a["stats"]:
                assert math.isclose(a["stats"][key], b["stats"][key], rel_tol=1e-12, abs_tol=1e-12), key
        for a, b in zip(mine.sinks_share(), theirs.sinks_share(), strict=True):
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(torch.tensor(a[key], dtype=torch.float64),
                                           torch.tensor(b[key], dtype=torch.float64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mine.thumbnail, pool(theirs.attention, *cells), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mine.thumbnail, pool(ref[0], *cells), rtol=0, atol=2e-5)  # transformers'
        if mine.masked is not None or theirs.masked is not None:
            assert torch.equal(mine.masked, theirs.masked)
    for key in ("rollout", "rollout_without_first", "rollout_weighted"):
        a, b = getattr(streamed, key), getattr(whole, key)
        assert (a is None) == (b is None), key
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(streamed.rollout[0], _rollout_last_row(eager), rtol=0, atol=2e-5)
    torch.testing.assert_close(streamed.rollout_without_first[0], _rollout_last_row(eager, drop_first=True),
                               rtol=0, atol=2e-5)
    if streamed.rollout_weighted is not None:
        norms = [v.double() for v in streamed.layer_norms]
        torch.testing.assert_close(streamed.rollout_weighted[0], _rollout_last_row(eager, norms=norms),
                                   rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["gguf", "gpt_oss"])
def test_terminal_prints_the_same(models, runner, monkeypatch, name):
    """The terminal's every-layer view, streamed, is the whole path's, character for character."""
    path = models(name)[0]
    monkeypatch.setattr(layerdigest, "BLOCK_CELLS", 97)
    args = ["head", "--model", str(path), "--layer", "1", "--head", "1", "--text", TEXT, "--all-layers"]
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", 1 << 62)
    whole = runner.invoke(app, args)
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", -1)
    streamed = runner.invoke(app, args)
    assert whole.exit_code == 0 == streamed.exit_code, streamed.output
    assert "every layer, every head" in streamed.stdout and "rollout" in streamed.stdout
    assert streamed.stdout == whole.stdout


def test_json_and_save_keep_the_whole_path(models, runner, monkeypatch, tmp_path):
    """--json shows every pattern: it keeps them, whatever the length."""
    import json

    path = models("gguf")[0]
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", -1)
    result = runner.invoke(app, ["head", "--model", str(path), "--layer", "1", "--head", "1", "--text", TEXT,
                                 "--all-layers", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert len(payload["all_layers"]) == 2 and len(payload["all_layers"][0]["attention"][0]) == len(payload["tokens"])
    assert "rollout" in payload


def test_memory_guard_counts_what_a_streamed_run_holds(models, monkeypatch):
    """The guard's estimate (runs/beyond_layer.py) drops every layer's patterns and adds the rollout's chains."""
    from attnscope.models.config import read_config
    from attnscope.models.families import open_model
    from attnscope.runs import beyond_layer

    path = models("gguf")[0]
    model = open_model(path, read_config(path), command="head")
    asked = HeadOptions(model=str(path), layer=1, text=TEXT, all_layers=True, terminal_only=True)
    plan = beyond_layer.Plan(False, 1000)
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", 1 << 62)
    whole = beyond_layer.estimate_bytes(asked, model, plan)
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", -1)
    streamed = beyond_layer.estimate_bytes(asked, model, plan)
    cells = model.n_layer * model.n_head - streamed_layers.kept_cells(model)  # [n, n] float32 tensors not held
    assert whole - streamed == 4 * 1000 * 1000 * cells


@pytest.mark.parametrize(("layer", "long"), [(0, False), (1, False), (1, True)])
def test_layers_read_by_blocks_of_rows(models, runner, monkeypatch, layer, long):
    """The layers other than L run unrecorded in eager's blocks of query rows (attention/rows.py), each block's
    pattern read as it is made (layerdigest.RowsRead), here three rows a block: kinds and the terminal as the
    whole path's, the statistics within float32's rounding of them (a block's `attention @ V` sums fewer keys,
    so the layers after it move by about 1e-7), thumbnails and rollouts within 2e-5 of transformers' eager
    output_attentions. `long`: as a text past weight_threads.SHORT runs, the layers read on a thread of their own
    (layerdigest.Behind) and the forward on one thread."""
    from attnscope.attention import rows
    from attnscope.tensors import weight_threads

    path, reference, _ = models("gguf")
    if long:
        monkeypatch.setattr(weight_threads, "SHORT", 0)
        behind = layerdigest.EveryLayer.behind
        started = []
        monkeypatch.setattr(layerdigest.EveryLayer, "behind", lambda self: started.append(1) or behind(self))
    monkeypatch.setattr(rows, "BLOCK_BYTES", 4 * 4 * 64 * 3)  # 4 heads, float32, at most 64 keys: 3 rows or more
    read = []
    by_rows = layerdigest.EveryLayer.by_rows
    monkeypatch.setattr(layerdigest.EveryLayer, "by_rows", lambda self, *a: read.append(a[0]) or by_rows(self, *a))
    whole = _run(path, monkeypatch, streamed=False, layer=layer)
    streamed = _run(path, monkeypatch, streamed=True, cells=1500, layer=layer)
    assert read == [1 - layer]  # the layer that is not L went by rows
    assert len(started) == 1 if long else True  # the streamed run read its layers behind
    with torch.no_grad():
        eager = reference(torch.tensor([whole.encoded.ids]), output_attentions=True).attentions
    from attnscope.views.pooling import THUMB_COLS, THUMB_ROWS, group_size, pool

    n = len(whole.encoded.ids)
    cells = (group_size(n, THUMB_ROWS), group_size(n, THUMB_COLS))
    for mine, theirs, ref in zip(streamed.layer_heads, whole.layer_heads, eager, strict=True):
        assert [h["kind"] for h in mine.heads] == [h["kind"] for h in theirs.heads]
        for a, b in zip(mine.heads, theirs.heads, strict=True):
            for key in a["stats"]:
                assert math.isclose(a["stats"][key], b["stats"][key], rel_tol=1e-5, abs_tol=1e-6), key
        torch.testing.assert_close(mine.thumbnail, pool(ref[0], *cells), rtol=0, atol=2e-5)
    torch.testing.assert_close(streamed.rollout[0], _rollout_last_row(eager), rtol=0, atol=2e-5)
    args = ["head", "--model", str(path), "--layer", str(layer), "--head", "1", "--text", TEXT, "--all-layers"]
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", 1 << 62)
    printed = runner.invoke(app, args).stdout
    monkeypatch.setattr(streamed_layers, "STREAM_BYTES", -1)
    assert runner.invoke(app, args).stdout == printed
