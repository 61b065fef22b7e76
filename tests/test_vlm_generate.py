"""--generate N with --image (models/vision/vlm_generate.py, runs/vlm.py): greedy decoding after a prompt that holds
an image, for every VLM family attnscope reads (tests/tiny_vlm.py), held against transformers' own
`generate(do_sample=False, output_attentions=True, return_dict_in_generate=True)` on the eager VLM with the same
processor output: the same new ids, and each step's row of every layer equal (atol 1e-5); Gemma 3's image block
both ways in the prefill only, Qwen's M-RoPE decode positions from rope_deltas; the command line's JSON, terminal
and --check. And a prompt past the long-input threshold (models/vision/vlm_long.py): `--rows A:B` exact against
eager output_attentions, computed in blocks."""

from __future__ import annotations

import os

import pytest
import torch
from cli_main import run_main
from tiny_models import cached_builder
from tiny_vlm import NAMES, TEXT, build, image

from attnscope.models.config import read_config
from attnscope.models.vision import vlm
from attnscope.models.vision.image import read_image

ATOL = 1e-5
N_NEW = 4


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    return image(tmp_path_factory.mktemp("picture") / "cat.png")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def _theirs(model, inputs: dict) -> tuple[list[int], list[tuple]]:
    """transformers' greedy decoding on the eager VLM: the new ids, and each step's attentions (every layer's
    `[1, n_head, n_Q, keys its cache holds]`)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                             output_attentions=True, return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), list(out.attentions)


def _ours(folder, config, tokens, layer: int):
    """attnscope's decode steps for layer `layer`: the family page's `generate` from the model's embeddings, or
    transformers' forward through the attention interface (Qwen's M-RoPE)."""
    from attnscope.models.forward.stream import generate
    from attnscope.models.vision import vlm_generate, vlm_run

    if vlm.VLM_TYPES[config.model_type] is None:
        return vlm_generate.through_interface(folder, config, tokens, layer, N_NEW)[2]
    model = vlm_run.text_family(folder, config, tokens)
    with model.checkpoint:
        return generate(model, tokens.ids, N_NEW, layer)


@pytest.mark.parametrize("name", NAMES)
def test_every_step_of_every_layer_equals_generate(name, built, picture):
    folder, model = built(name)
    config = read_config(folder)
    tokens = vlm.place(folder, config, TEXT, read_image(picture))
    ids, attentions = _theirs(model, tokens.inputs)
    n = len(tokens.ids)
    for layer in range(len(attentions[0])):
        steps = _ours(folder, config, tokens, layer)
        assert [step.token_id for step in steps] == ids, (name, layer)
        for t, step in enumerate(steps):
            row = attentions[t][layer][0, :, -1]  # [n_head, keys the cache holds]
            assert step.position == n + t and step.attention.shape[-1] == n + t
            held = step.attention[:, -row.shape[-1]:]
            assert torch.allclose(held, row, atol=ATOL), f"{name} layer {layer} step {t}: {(held - row).abs().max()}"
            # the keys a sliding (or chunked) cache has let go carry no weight
            assert torch.allclose(held.sum(-1), torch.ones(held.shape[0]), atol=ATOL)


def test_gemma3_decodes_causally_after_a_both_ways_prefill(built, picture):
    """The prompt's image tokens read each other both ways; a new token's row is causal and windowed (transformers
    drops token_type_ids after the first step): its mask from vlm_gemma3.image_mask against a float64 rule."""
    from attnscope.models.vision.vlm_gemma3 import image_mask

    folder, _ = built("gemma3")
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(picture))
    blocks, n = tokens.blocks(), len(tokens.ids)
    first = tokens.image.index(True)
    prefill = image_mask(blocks, None)
    assert bool(prefill[first, first + 3]) and not bool(prefill[first - 1, first])  # image both ways, text causal
    for start in (n, n + 2):  # a decode step's row over every key so far
        step = image_mask(blocks, 4, start, 1)[0]  # [start + 1]
        keys = torch.arange(start + 1, dtype=torch.float64)
        assert torch.equal(step, (keys <= start) & (keys > start - 4))


@pytest.mark.parametrize("name", ["llava_mistral", "qwen3_vl"])
def test_command_line_json_check_and_terminal(name, built, picture):
    folder, model = built(name)
    args = ("head", "--model", str(folder), "--layer", "1", "--head", "2", "--text", TEXT, "--image", str(picture),
            "--generate", "3")
    out = run_main(*args, "--check", "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["check_passed"] is True
    assert [c["name"] for c in data["check"]] == ["layer 1", "generated ids"] + [f"step {t} layer 1" for t in range(3)]
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(picture))
    ids, attentions = _theirs(model, tokens.inputs)
    steps = data["decode_steps"]
    assert [s["token_id"] for s in steps] == ids[:3]
    image_keys = data["image_tokens"]
    shares = torch.tensor(data["decode_image_share"], dtype=torch.float64)  # [n_new, n_head]
    for t, step in enumerate(steps):
        row = attentions[t][1][0, :, -1].double()  # eager's [n_head, keys held]
        ours = torch.tensor(step["attention"], dtype=torch.float64)
        assert torch.allclose(ours[:, -row.shape[-1]:], row, atol=ATOL)
        expected = torch.stack([ours[:, k] for k in image_keys], dim=-1).sum(-1)  # the row's sum over the image
        assert torch.allclose(shares[t], expected, atol=1e-6)
    overlays = data["image"]["overlays"]
    assert len(overlays) == 1 + 3 and "new token" in overlays[-1]["title"]
    cells = torch.tensor(overlays[-1]["patches"], dtype=torch.float64).flatten()  # head 2's row over the 2 x 2
    assert torch.allclose(cells, torch.tensor(steps[-1]["attention"][2], dtype=torch.float64)[image_keys], atol=1e-6)
    terminal = run_main(*args)
    assert terminal.code == 0, terminal.stderr
    assert "each new token's weight on the image" in terminal.stdout and "generated 3 tokens" in terminal.stdout
    assert terminal.stdout.count("the row that chose new token") == 3  # each drawn over the image's grid
    assert max(len(line) for line in terminal.stdout.splitlines()) <= 80


def test_svg_draws_each_new_tokens_row(built, picture, tmp_path):
    folder, _ = built("gemma3")
    svg = tmp_path / "decode.svg"
    out = run_main("head", "--model", str(folder), "--layer", "2", "--text", TEXT, "--image", str(picture),
                   "--generate", "2", "--svg", str(svg))
    assert out.code == 0, out.stderr
    drawn = svg.read_text()
    assert drawn.count('data-overlay="') == 3 and drawn.count("the row that chose new token") == 2


def test_generate_refusals(built, picture):
    folder, _ = built("llava")
    for args, said in ((["--generate", "5000"], "--generate 5000: give how many new tokens"),
                       (["--generate", "-1"], "--generate")):
        out = run_main("head", "--model", str(folder), "--text", TEXT, "--image", str(picture), *args)
        assert out.code == 2 and len(out.error_lines) == 1 and said in out.stderr, (args, out.stderr)


# --- a long prompt with an image (--rows A:B): head h in blocks of rows, the rows asked exact -----------------

REAL_LONG = os.environ.get("ATTNSCOPE_LONG_TESTS") == "1"  # the real threshold, a 2,100-token text (seconds more)


@pytest.fixture
def long_prompt(monkeypatch):
    """The text that makes the prompt long: past the real LONG_TOKENS with ATTNSCOPE_LONG_TESTS=1, else TEXT with
    the threshold lowered to 8 tokens and blocks of 3 rows, so that blocks cut through the image's tokens."""
    from attnscope.models.forward import long

    if REAL_LONG:
        return " ".join([TEXT] * 300)
    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 3)
    return TEXT


@pytest.mark.parametrize("name", ["gemma3", "llava_mistral", "llama4"])
def test_long_prompt_rows_equal_eager(name, built, picture, long_prompt):
    """Every row of head 1 at the last layer (Gemma 3's full layer: the image block both ways across blocks of rows;
    Llama 4's tiles and chunked layers; Mistral's window), computed in blocks, against eager output_attentions."""
    folder, model = built(name)
    tokens = vlm.place(folder, read_config(folder), long_prompt, read_image(picture))
    n = len(tokens.ids)
    with torch.no_grad():
        theirs = model(**tokens.inputs, output_attentions=True).attentions
    L = len(theirs) - 1
    rows = (0, n) if n < 100 else (n - 40, n)
    out = run_main("head", "--model", str(folder), "--layer", str(L), "--head", "1", "--text", long_prompt,
                   "--image", str(picture), "--rows", f"{rows[0]}:{rows[1]}", "--check", "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["check_passed"] is True and data["tokens"] == tokens.labels
    exact = torch.tensor(data["rows"]["attention"], dtype=torch.float64)  # [n_rows, n_tokens]
    assert torch.allclose(exact, theirs[L][0, 1, rows[0]:rows[1]].double(), atol=ATOL)
    pooled = torch.tensor(data["attention_pooled"], dtype=torch.float64)
    assert torch.allclose(pooled.sum(-1), torch.ones(pooled.shape[0], dtype=torch.float64), atol=1e-6)
    assert any("each row's weight on the image's tokens" in note for note in data["notes"])
    image_keys = data["image_tokens"]
    assert image_keys == [i for i, on in enumerate(tokens.image) if on] and "image_share" not in data
    expected = exact[:, image_keys].sum(-1)  # each exact row's weight on the image
    assert torch.allclose(torch.tensor(data["rows_image_share"], dtype=torch.float64), expected, atol=1e-6)


def test_long_prompt_refusals(built, picture, long_prompt):
    cases = [("gemma3", ["--generate", "2"], "drop --generate"), ("gemma3", ["--all-layers"], "drop --all-layers"),
             ("qwen3_vl", ["--rows", "0:2"], "drop --rows")]
    for name, args, said in cases:
        folder, _ = built(name)
        out = run_main("head", "--model", str(folder), "--text", long_prompt, "--image", str(picture), *args)
        assert out.code == 2 and len(out.error_lines) == 1 and said in out.stderr, (name, args, out.stderr)


def test_rows_on_a_short_prompt_is_refused(built, picture):
    folder, _ = built("llava")
    out = run_main("head", "--model", str(folder), "--text", TEXT, "--image", str(picture), "--rows", "0:2")
    assert out.code == 2 and len(out.error_lines) == 1 and "drop --rows" in out.stderr, out.stderr


def test_page_draws_a_new_tokens_row_over_the_image(built, picture, tmp_path, monkeypatch):
    """The explorer page in a real browser (tests/browser.py): a generated token picked on the decode timeline
    paints its row over the image, the share the title states equal to --json's decode_image_share; a query picked
    after it is drawn again."""
    import re
    import shutil

    from browser import browser, chromium, open_page

    found = chromium()
    assert found is not None, "no Chromium: apt-get install chromium, or set ATTNSCOPE_CHROMIUM"
    folder, _ = built("gemma3")
    monkeypatch.chdir(tmp_path)  # the page names the image as given
    shutil.copy(picture, tmp_path / "cat.png")
    args = ["head", "--model", str(folder), "--text", TEXT, "--image", "cat.png", "--layer", "2", "--head", "1",
            "--generate", "3"]
    data = run_main(*args, "--json").json()
    page_file = tmp_path / "page.html"
    assert run_main(*args, "--html", str(page_file)).code == 0
    with browser(found) as context:
        opened = open_page(context, page_file)
        page = opened.page
        assert not opened.errors
        page.get_by_test_id("decode-steps").locator("tbody tr").nth(2).click()
        page.wait_for_function("document.querySelector('[data-testid=overlay-title]').textContent"
                               ".startsWith('the row that chose')")
        title = page.inner_text("[data-testid=overlay-title]")
        step = data["decode_steps"][2]
        assert title.startswith(f"the row that chose new token {step['position']} “{step['token']}”"), title
        share = re.search(r": ([0-9.]+) of its weight on the 2 × 2 patches", title)
        assert share, title
        assert float(share.group(1)) == pytest.approx(data["decode_image_share"][2][1], abs=2e-3)
        search = page.locator("[data-testid=token-search]")
        search.fill("mat")
        search.press("Enter")
        assert page.inner_text("[data-testid=overlay-title]").startswith("query "), "a query picked: its row"


def test_check_decodes_plain_greedy_whatever_the_generation_config(built, picture, tmp_path):
    """A checkpoint's generation_config.json with a repetition penalty (Qwen2.5-VL's has 1.05): attnscope decodes
    plain argmax, and --check's reference does too (eager generate's own ids without the penalty)."""
    import json
    import shutil

    folder, model = built("llava")  # its tiny model repeats one token: a penalty would change the ids
    copy = tmp_path / "llava-penalty"
    shutil.copytree(folder, copy)
    settings = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**settings, "repetition_penalty": 5.0}))
    out = run_main("head", "--model", str(copy), "--layer", "1", "--text", TEXT, "--image", str(picture),
                   "--generate", "3", "--check", "--json")
    assert out.code == 0, out.stderr
    data = out.json()
    assert data["check_passed"] is True
    tokens = vlm.place(folder, read_config(folder), TEXT, read_image(picture))
    ids, _ = _theirs(model, tokens.inputs)  # the original folder's config: no penalty
    assert [s["token_id"] for s in data["decode_steps"]] == ids[:3]
    with torch.no_grad():
        penalised = model.generate(**tokens.inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                   repetition_penalty=5.0)[0, len(tokens.ids):].tolist()
    assert penalised != ids[:3]  # the penalty would have changed them
