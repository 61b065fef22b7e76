"""Files, fuzzed (issue 43): GGUF headers made hostile (arrays of every type and count, nested arrays, long
strings and keys, counts and offsets rewritten, tokenizer values of the wrong type), Ollama stores laid out
every way (names with control characters or 300 characters, manifests nested, empty or garbage, blobs that are
folders, pipes, no GGUF, missing, or links inside and outside the store) and output paths of every kind (links to
a device node, a pipe, a folder, a file, nothing; --force or not), each run through `attnscope.cli.main`.

Each example keeps the promises of tests/test_fuzz_inputs.py (`keeps_promises`: exit 0, 1 or 2, one message, no
traceback, no internal error, strict JSON), and:

- no file outside the run's inputs and outputs is touched: a folder of sentinels (a GGUF, a device node, a pipe)
  keeps every name, kind, inode, size and byte; no temporary `.part` file is left anywhere;
- a store whose files lead outside it is refused, never read;
- each run's CPU time stays under 5 s, and the process's peak resident set grows by less than 1 GiB.

A few dozen examples each by default; `ATTNSCOPE_FUZZ_EXAMPLES=N` for a long run (tests/fuzz.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import stat
import struct
import time
from pathlib import Path

import pytest
from cli_main import run_main
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_inputs import keeps_promises
from test_trust_files import _bpe_tokenizer, _gguf

MAX_CPU = 5.0  # seconds of CPU a run may take, refusal or not
MAX_GROWTH = 1 << 30  # bytes the process's peak resident set may grow by in one run


def bounded_run(*argv: str, env: dict[str, str] | None = None):
    """`run_main`, with its CPU time and the growth of the peak resident set checked."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.process_time()
    outcome = run_main(*argv, env=env)
    spent = time.process_time() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    assert spent < MAX_CPU, (argv, spent)
    assert grown < MAX_GROWTH, (argv, grown)
    keeps_promises(list(argv), outcome)
    return outcome


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder`, not following links: its kind, inode, size, device and bytes (regular files)."""
    seen = {}
    for path in sorted(folder.rglob("*")):
        info = os.lstat(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else ""
        seen[str(path.relative_to(folder))] = (stat.S_IFMT(info.st_mode), info.st_ino, info.st_size, info.st_rdev,
                                               digest)
    return seen


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny GGUF with a byte-level BPE tokenizer, and a folder of sentinels outside every run."""
    base = tmp_path_factory.mktemp("base")
    model = _gguf(base / "model.gguf", tokenizer=_bpe_tokenizer(["a b"]))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "other.gguf").write_bytes(model.read_bytes())
    (outside / "secret.json").write_text(json.dumps({"model_type": "llama", "secret": "s3cr3t"}))
    (outside / "folder").mkdir()
    os.mkfifo(outside / "pipe")
    try:
        os.mknod(outside / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:  # not root: a link to /dev/null stands for the device
        (outside / "null").symlink_to("/dev/null")
    return model.read_bytes(), outside


def _no_part_files(*folders: Path) -> None:
    for folder in folders:
        assert not [p for p in folder.rglob("*.part")], folder


# --- GGUF headers made hostile ---------------------------------------------------------------------------------------

def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


COUNTS = st.one_of(st.integers(0, 70), st.sampled_from([(1 << 21) - 1, (1 << 21) + 1, 1 << 32, 2**63, 2**64 - 1]))


@st.composite
def hostile_value(draw, depth: int = 0) -> bytes:
    """A value type and its bytes: arrays of any item type and count (the count may say more than is there),
    arrays nested past the limit, strings of any declared length."""
    kind = draw(st.sampled_from([0, 4, 6, 7, 8, 9, 9, 9, 13, 2**31]))
    if kind == 8:
        text = draw(st.binary(max_size=20))
        length = draw(st.one_of(st.just(len(text)), st.sampled_from([1 << 16, (1 << 16) + 1, 2**63])))
        return struct.pack("<I", 8) + struct.pack("<Q", length) + text
    if kind != 9:
        return struct.pack("<I", kind) + draw(st.binary(min_size=0, max_size=8))
    item = draw(st.sampled_from([0, 5, 6, 8, 9, 12, 13]))
    count = draw(COUNTS)
    if item == 9 and depth < 6 and draw(st.booleans()):
        inner = b"".join(draw(hostile_value(depth + 1))[4:] for _ in range(min(count, 3)))
        return struct.pack("<IIQ", 9, 9, count) + inner
    filler = {0: 1, 5: 4, 6: 4, 8: 8, 9: 12, 12: 8, 13: 4}[item]
    there = draw(st.integers(0, min(count, 200)))
    body = bytes(filler * there) if item != 8 else b"".join(_key(b"ab") for _ in range(there))
    return struct.pack("<IIQ", 9, item, count) + body


@st.composite
def hostile_gguf(draw, model: bytes) -> bytes:
    """The tiny model's file with hostile entries added to its metadata (kv_count raised to match, or not), a
    tokenizer value retyped, or a count, offset or length rewritten."""
    data = bytearray(model)
    how = draw(st.sampled_from(["add", "add", "retype", "counts", "cut"]))
    if how == "add":  # new entries right after the fixed header, before the real ones
        entries = [_key(draw(st.sampled_from([b"junk", b"llama.attention.head_count", b"tokenizer.ggml.merges",
                                              b"tokenizer.ggml.tokens", b"general.alignment", b"\x1b[31m"])))
                   + draw(hostile_value()) for _ in range(draw(st.integers(1, 3)))]
        kv_count = struct.unpack_from("<Q", data, 16)[0] + draw(st.sampled_from([len(entries), 0, 1 << 40]))
        data[16:24] = struct.pack("<Q", kv_count)
        return bytes(data[:24]) + b"".join(entries) + bytes(data[24:])
    if how == "retype":  # a tokenizer key's array of strings said to be numbers, or the other way round
        key = draw(st.sampled_from([b"tokenizer.ggml.merges", b"tokenizer.ggml.tokens", b"tokenizer.ggml.token_type"]))
        at = bytes(data).find(_key(key)) + len(_key(key)) + 4
        data[at:at + 4] = struct.pack("<I", draw(st.sampled_from([0, 4, 6, 8, 9, 12])))
        return bytes(data)
    if how == "counts":
        at = draw(st.sampled_from([8, 16]))
        data[at:at + 8] = struct.pack("<Q", draw(st.sampled_from([1 << 16, (1 << 16) + 1, 1 << 17, 1 << 18, 2**63])))
        return bytes(data)
    return bytes(data[: draw(st.integers(24, len(data) - 1))])


@fuzz_settings(20)
@given(data=st.data())
def test_hostile_gguf_headers_keep_the_promises(world, tmp_path_factory, data):
    model, outside = world
    before = _snapshot(outside)
    path = tmp_path_factory.mktemp("hostile") / "model.gguf"
    path.write_bytes(data.draw(hostile_gguf(model)))
    command = data.draw(st.sampled_from([["anatomy", str(path)], ["head", "--model", str(path)],
                                         ["head", "--model", str(path), "--text", "ab cd", "--json"]]))
    bounded_run(*command)
    assert _snapshot(outside) == before


# --- Ollama stores laid out every way ------------------------------------------------------------------------------

NAMES = st.one_of(st.sampled_from(["tiny:q8", "tiny", "me/tiny:q8", "a/b/c/tiny:q8", "tiny:", ":q8", "../tiny",
                                   "tiny:..", "t" * 300, "tiny:" + "q" * 300, "\x1b[31mtiny", "ti\x00ny",
                                   "tiny\u202e"]),
                  st.text(max_size=12))


@st.composite
def store(draw, root: Path, model: bytes, outside: Path) -> tuple[bool, bool]:
    """An Ollama store at `root` for ollama:tiny:q8 laid out some way; returns (whether reading it reaches a path
    that leads outside, whether it holds the model readably)."""
    blobs, library = root / "blobs", root / "manifests" / "registry.ollama.ai" / "library"
    blobs.mkdir(parents=True)
    library.mkdir(parents=True)
    blob_kind = draw(st.sampled_from(["model", "model", "json", "folder", "pipe", "missing", "link-in", "link-out",
                                      "link-dev", "link-folder-out", "empty"]))
    content = {"json": (outside / "secret.json").read_bytes(), "empty": b""}.get(blob_kind, model)
    digest = hashlib.sha256(content).hexdigest()
    blob = blobs / f"sha256-{digest}"
    if blob_kind in ("model", "json", "empty"):
        blob.write_bytes(content)
    elif blob_kind == "folder":
        blob.mkdir()
    elif blob_kind == "pipe":
        os.mkfifo(blob)
    elif blob_kind == "link-in":
        (blobs / "real").write_bytes(model)
        blob.symlink_to(blobs / "real")
    elif blob_kind != "missing":
        blob.symlink_to({"link-out": outside / "other.gguf", "link-dev": outside / "null",
                         "link-folder-out": outside / "folder"}[blob_kind])
    manifest_kind = draw(st.sampled_from(["good", "good", "good", "nested", "garbage", "no-layer", "bad-digest",
                                          "folder", "pipe", "link-out", "huge"]))
    manifest = library / "tiny" / "q8"
    manifest.parent.mkdir()
    good = json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]})
    text = {"good": good, "nested": "[" * 100_000, "garbage": "\x00\xff{", "no-layer": '{"layers": []}',
            "bad-digest": good.replace("sha256:", "sha256:../"), "huge": " " * (1 << 21) + good}.get(manifest_kind)
    if text is not None:
        manifest.write_text(text)
    elif manifest_kind == "folder":
        manifest.mkdir()
    elif manifest_kind == "pipe":
        os.mkfifo(manifest)
    else:
        (outside / "manifest").write_text(good)
        manifest.symlink_to(outside / "manifest")
    leaves = blob_kind in ("link-out", "link-dev", "link-folder-out")
    if draw(st.booleans()):  # blobs/ itself moved outside, behind a link
        moved = outside / f"blobs-of-{root.parent.name}"  # mktemp's name: one per example
        blobs.rename(moved)
        blobs.symlink_to(moved)
        leaves = True
    # a manifest that leads outside is refused; a blob that does, once a good manifest names it
    reached = manifest_kind == "link-out" or (leaves and manifest_kind in ("good", "link-out"))
    return reached, blob_kind in ("model", "link-in") and manifest_kind == "good" and not leaves


@fuzz_settings(20)
@given(data=st.data())
def test_ollama_stores_keep_the_promises(world, tmp_path_factory, data):
    model, outside = world
    root = tmp_path_factory.mktemp("ollama") / "models"
    reached, readable = data.draw(store(root, model, outside))
    before = _snapshot(outside)
    name = data.draw(st.one_of(st.just("tiny:q8"), NAMES))
    command = data.draw(st.sampled_from([["anatomy", f"ollama:{name}"], ["head", "--model", f"ollama:{name}"],
                                         ["head", "--model", f"ollama:{name}", "--text", "ab cd"]]))
    outcome = bounded_run(*command, env={"OLLAMA_MODELS": str(root)})
    assert "\x1b" not in outcome.wrapped and "s3cr3t" not in outcome.stdout + outcome.stderr
    if name == "tiny:q8" and reached:
        assert outcome.code == 2 and "outside the Ollama store" in outcome.stderr, outcome.stderr
    if name == "tiny:q8" and readable:
        assert outcome.code == 0, outcome.stderr
    assert _snapshot(outside) == before


# --- output paths of every kind ------------------------------------------------------------------------------------

TARGETS = ["missing", "file", "link-file", "link-missing", "link-device", "link-pipe", "link-folder", "pipe",
           "folder", "link-chain-device", "link-dangling-folder"]


@fuzz_settings(25)
@given(data=st.data())
def test_output_paths_keep_the_promises(world, tmp_path_factory, data):
    _, outside = world
    before = _snapshot(outside)
    here = tmp_path_factory.mktemp("out")
    option, ending = data.draw(st.sampled_from([("--save", ".pt"), ("--save", ".npz"), ("--save", ".safetensors"),
                                                ("--svg", ".svg"), ("--html", ".html")]))
    kind = data.draw(st.sampled_from(TARGETS))
    target = here / f"out{ending}"
    pointed = {"link-file": here / f"real{ending}", "link-missing": here / f"new{ending}",
               "link-device": outside / "null", "link-pipe": outside / "pipe", "link-folder": outside / "folder",
               "link-dangling-folder": here / "gone" / f"x{ending}"}.get(kind)
    if kind == "file":
        target.write_text("old")
    elif kind == "pipe":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    elif kind == "link-chain-device":
        (here / "hop").symlink_to(outside / "null")
        target.symlink_to(here / "hop")
    elif pointed is not None:
        if kind == "link-file":
            pointed.write_text("old")
        target.symlink_to(pointed)
    force = data.draw(st.booleans())
    argv = ["sdpa", "--nq", "2", "--nk", "3", "--dk", "4", option, str(target), *(["--force"] if force else [])]
    outcome = bounded_run(*argv)
    _no_part_files(here, outside)
    assert _snapshot(outside) == before
    written = Path(os.path.realpath(target))
    if outcome.code == 0:
        assert stat.S_ISREG(os.stat(written).st_mode) and written.is_relative_to(here)
        assert target.is_symlink() == (kind.startswith("link"))
    if kind in ("link-device", "link-pipe", "link-folder", "pipe", "folder", "link-chain-device"):
        assert outcome.code == 2, (kind, outcome.stderr)
    if kind in ("file", "link-file") and not force:
        assert outcome.code == 2 and "--force" in outcome.stderr
