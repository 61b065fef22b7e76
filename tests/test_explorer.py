"""The explorer page's data, without a browser (tests/test_page.py drives it in one): the packing of the weights
(exact to the decimals shown, read back as the page reads it), fitting a run that is too large, the patterns of
each kind of attention step, and a page that holds nothing a tag or a script could break out of."""

from __future__ import annotations

import ast
import json
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from attnscope.views import explorer, packing
from attnscope.views.explorer import Head, Layer, Page, page_html
from attnscope.views.sources import add_pattern

ROOT = Path(__file__).resolve().parents[1]


def meta_and_blobs(page: str) -> tuple[dict, dict[str, str]]:
    meta = json.loads(re.search(r'<script type="application/json" id="attnscope-meta">(.*?)</script>', page,
                                re.S).group(1))  # type: ignore[union-attr]
    blobs = dict(re.findall(r'<script type="application/octet-stream" id="attnscope-([^"]+)">(.*?)</script>', page,
                            re.S))
    return meta, blobs


def read_back(page: str, layer: int = 0, head: int = 0, key: str = "attention") -> np.ndarray:
    meta, blobs = meta_and_blobs(page)
    ref = meta["layers"][layer]["heads"][head][key]
    return packing.unpack(blobs[ref["group"]], ref)


@pytest.mark.parametrize("decimals", [4, 3, 2])
def test_packed_weights_are_the_weights_rounded_to_the_decimals_shown(decimals):
    A = torch.softmax(torch.randn(7, 11, dtype=torch.float64) * 3, dim=-1)
    A[2, 3] = float("nan")
    packer = packing.Packer(exp=-decimals)
    ref = packer.add("g", A)
    back = packing.unpack(packer.blobs()["g"], ref)
    expected = np.array([[float(f"{v:.{decimals}f}") if v == v else np.nan for v in row] for row in A.tolist()])
    assert np.isnan(back[2, 3]) and np.isnan(expected[2, 3])
    close = np.isclose(back, expected, rtol=0, atol=1e-12) | np.isnan(expected)
    ties = np.isclose(np.abs(A.numpy() * 10**decimals % 1), 0.5, atol=1e-9)  # half-way: either way is right
    assert (close | ties).all()


def test_values_beyond_the_range_of_one_unit_take_a_coarser_unit():
    values = np.array([[-3.0, 0.5, 12000.0]])  # a user's "attention" that is not one (trace of a wrong tensor)
    q, lo, exp = packing.quantize(values, -4)
    assert exp > -4 and (lo + q.astype(np.int64)).max() * 10.0**exp == pytest.approx(12000, abs=10.0**exp)
    packer = packing.Packer()
    ref = packer.add("g", values)
    assert np.allclose(packing.unpack(packer.blobs()["g"], ref), values, atol=10.0 ** ref["exp"] / 2)


def test_a_page_over_its_budget_gives_up_a_decimal_and_says_so(monkeypatch):
    A = torch.softmax(torch.randn(4, 40, 40) * 2, dim=-1)
    page = Page("t", queries=[f"q{i}" for i in range(40)], keys=[f"k{i}" for i in range(40)],
                layers=[Layer(3, [Head(h, A[h]) for h in range(4)])])
    full = page_html(page)
    assert meta_and_blobs(full)[0]["decimals"] == 4 and meta_and_blobs(full)[0]["decimals_note"] == ""
    packed = sum(len(b) for b in meta_and_blobs(full)[1].values())
    monkeypatch.setattr(explorer, "DATA_BUDGET", packed - 1)
    smaller = page_html(page)
    meta, blobs = meta_and_blobs(smaller)
    assert meta["decimals"] < 4 and sum(map(len, blobs.values())) <= packed - 1
    assert f"weights shown to {meta['decimals']} decimals" in meta["decimals_note"]
    assert np.allclose(read_back(smaller, 0, 1), A[1].numpy(), atol=0.5 * 10.0 ** -meta["decimals"] + 1e-12)


def test_a_run_too_large_for_a_page_is_pooled_to_fit(monkeypatch):
    monkeypatch.setattr(explorer, "MAX_CELLS", 100)
    monkeypatch.setattr(explorer, "POOLED_SIDE", 4)
    A = torch.softmax(torch.randn(10, 12, dtype=torch.float64), dim=-1)
    page = Page("t", queries=[str(i) for i in range(10)], keys=[str(j) for j in range(12)],
                layers=[Layer(0, [Head(0, A)])])
    html = page_html(page)
    head = meta_and_blobs(html)[0]["layers"][0]["heads"][0]
    assert head["attention"] is None and head["pool"] == [3, 3]
    expected = np.zeros((4, 4))  # each cell: the mean over its queries of their total weight on its keys
    for i in range(4):
        rows = A[3 * i: 3 * i + 3].numpy()
        for j in range(4):
            expected[i, j] = rows[:, 3 * j: 3 * j + 3].sum(axis=1).mean()
    assert np.allclose(read_back(html, key="attention_pooled"), expected, atol=0.5e-4 + 1e-12)
    assert np.allclose(expected.sum(axis=1), 1.0)  # a pooled row still sums to 1
    assert "pooled to at most 4 x 4 cells" in html


def test_attention_steps_become_batch_elements_and_heads():
    page = Page("t")
    A = torch.softmax(torch.randn(3, 2, 5, 4, 6), dim=-1)  # [n_batch, n_head, extra, n_Q, n_K]
    add_pattern(page, A, ("n_batch", "n_head", "n_extra", "n_Q", "n_K"))
    assert [layer.label for layer in page.layers] == ["batch element 0", "batch element 1", "batch element 2"]
    assert page.axis == "batch element" and [h.label for h in page.layers[2].heads] == ["head 0", "head 1"]
    assert torch.equal(page.layers[2].heads[1].attention, A[2, 1, 0])
    assert page.queries == [f"q{i}" for i in range(4)] and page.keys == [f"k{j}" for j in range(6)]
    assert "index 0 of n_extra" in page.notes[-1]
    column = Page("t")
    add_pattern(column, A[0, 0, 0].T, ("n_K", "n_Q"))  # the column layout: drawn with queries as rows
    assert column.layers[0].label == "attention" and column.layers[0].heads[0].label == "attention"
    assert torch.equal(column.layers[0].heads[0].attention, A[0, 0, 0])
    meta = Page("t")
    add_pattern(meta, torch.empty(2, 3, 4, device="meta"), ("n_batch", "n_Q", "n_K"))
    assert meta.layers == [] and "--meta" in meta.notes[0]


def test_every_head_gets_its_kind_from_its_statistics():
    from attnscope.readings.headstats import describe, head_stats, kind

    n = 6
    previous = torch.zeros(n, n)
    previous[0, 0] = 1
    previous[torch.arange(1, n), torch.arange(n - 1)] = 1
    page = Page("t")
    add_pattern(page, torch.stack([previous, torch.full((n, n), 1 / n)])[None], ("n_batch", "n_head", "n_Q", "n_K"),
                describe=describe)
    assert [h.kind for h in page.layers[0].heads] == ["previous-token", "broad"]
    assert page.layers[0].heads[0].stats == head_stats(previous).as_dict() and kind(head_stats(previous))


def test_nothing_in_the_data_can_end_a_script_or_open_a_tag():
    evil = ["</script><script>alert(1)</script>", "<!--", "a\u2028b", "&amp;"]
    page = Page("</title><b>x", header=["<i>h</i>"], queries=evil, keys=evil,
                layers=[Layer(0, [Head(0, torch.full((4, 4), 0.25))])])
    html = page_html(page)
    assert html.count("<script") == html.count("</script>") == 3  # the data's two elements and the script
    assert "<b>x" not in html and "<i>h</i>" not in html
    assert meta_and_blobs(html)[0]["queries"] == evil
    offline = html.replace("http://www.w3.org/2000/svg", "")
    assert not re.search(r"https?://", offline) and "default-src 'none'" in html


def test_the_page_assets_ship_with_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1]
    patterns = ast.literal_eval(re.search(r'^"attnscope\.views" = (\[.*?\])', section, re.M).group(1))  # type: ignore[union-attr]
    assets = [p for p in resources.files("attnscope.views").joinpath("assets").iterdir() if p.name != "__pycache__"]
    assert assets and all(any(Path("assets", a.name).match(p) for p in patterns) for a in assets)


def test_the_keys_a_mask_forbids_are_in_the_page_data():
    """sdpa's -inf in masked_scores become each head's `masked` (one packed mask shared by the heads that share
    it); a run without a mask has none, and an allowed weight of 0 is not masked."""
    from attnscope import sdpa
    from attnscope.views.sources import from_trace

    Q, K = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    text = page_html(from_trace(sdpa(Q, K, K.clone(), causal=True)))
    meta, _ = meta_and_blobs(text)
    refs = [h["masked"] for layer in meta["layers"] for h in layer["heads"]]
    assert len(refs) == 6 and all(r == refs[0] for r in refs)  # packed once
    assert np.array_equal(read_back(text, 1, 2, "masked"), np.triu(np.ones((5, 5)), 1))
    meta, _ = meta_and_blobs(page_html(from_trace(sdpa(Q, K, K.clone()))))
    assert all(h["masked"] is None for layer in meta["layers"] for h in layer["heads"])


def test_another_layer_takes_the_traced_layers_mask_only_where_its_weights_agree():
    from attnscope.views.sources import _same_mask

    masked = torch.ones(4, 4, dtype=torch.bool).triu(1).expand(2, -1, -1)  # [n_head, n_Q, n_K]
    causal = torch.softmax(torch.randn(2, 4, 4).masked_fill(masked, float("-inf")), -1)
    assert _same_mask(causal, masked) is masked
    assert _same_mask(torch.softmax(torch.randn(2, 4, 4), -1), masked) is None  # a layer that sees every key
    assert _same_mask(causal, None) is None
