"""Files, links, GGUF and Ollama (issue 43, items 1, 2, 3, 5, 6 and 25): each test failed before its fix.

- Outputs (--save, --svg, --html, save_tensors) write through a link only to a regular file: a link to a device
  node, a pipe or a folder is refused in one message, the node is left as it was and no temporary file is made.
- An Ollama store's manifests and blobs are read only inside the store (every link resolved); a blob that is a
  folder, no GGUF or missing is named as what it is, and never parsed as a config.json nor quoted.
- A GGUF header's long arrays are left in the file (never materialized), and counts no real file has are refused
  before any loop: the work of a refusal stays small (benchmarks/bench_gguf_hostile.py measures 200 MB files).
- What crashed (a 300-character Ollama name, a manifest nested 200,000 deep, merges stored as numbers) and what
  misled (folder advice for a GGUF, "truncated" for a damaged header, a RoPE message naming no file, an escape
  sequence echoed raw, the weight dump's "config.json's head_dim" for a GGUF) is one message, exit 2.

References share no attnscope code: the gguf package's GGUFReader for the header, os.stat for what is on disk,
tracemalloc for what a read allocates, torch.load for what was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_main import assert_usage_error, run_main

TEXT = "the cat sat"
SDPA = ["sdpa", "--nq", "2", "--nk", "3", "--dk", "4"]


# --- item 1: a device replaced through a link -------------------------------------------------------------------

def _device(tmp_path: Path) -> Path:
    """A character device node to point a link at: our own copy of /dev/null's (1, 3) in tmp where we may make
    one (root), else /dev/null itself, which the refusal must leave as it is."""
    node = tmp_path / "devices" / "null"
    node.parent.mkdir()
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError):
        return Path("/dev/null")
    return node


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("option, name", [("--save", "out.pt"), ("--save", "out.safetensors"), ("--svg", "out.svg"),
                                          ("--html", "out.html")])
def test_a_link_to_a_device_is_refused_and_the_node_kept(tmp_path, option, name):
    device = _device(tmp_path)
    link = tmp_path / name
    link.symlink_to(device)
    before = os.stat(device)
    around = _files(device.parent) if device.parent != Path("/dev") else None
    outcome = run_main(*SDPA, option, str(link), "--force")
    assert_usage_error(outcome, f"{option} {link}", "character device", "not a regular file")
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert link.is_symlink() and os.readlink(link) == str(device)
    if around is not None:
        assert _files(device.parent) == around  # no temporary file beside the node
    assert _files(tmp_path) == {name, "devices"}


def test_a_pipe_and_a_link_to_a_folder_are_refused(tmp_path):
    pipe = tmp_path / "pipe.pt"
    os.mkfifo(pipe)
    assert_usage_error(run_main(*SDPA, "--save", str(pipe), "--force"), "is a pipe, not a regular file")
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "page.html").symlink_to(folder)
    assert_usage_error(run_main(*SDPA, "--html", str(tmp_path / "page.html"), "--force"), "folder")
    assert _files(folder) == set() and _files(tmp_path) == {"pipe.pt", "folder", "page.html"}


def test_save_tensors_refuses_a_link_to_a_device_and_writes_through_a_link_to_a_file(tmp_path):
    from attnscope import AttnscopeError, save_tensors

    device = _device(tmp_path)
    (tmp_path / "x.pt").symlink_to(device)
    with pytest.raises(AttnscopeError, match="character device"):
        save_tensors({"a": torch.ones(2)}, tmp_path / "x.pt", force=True)
    assert stat.S_ISCHR(os.stat(device).st_mode)
    real = tmp_path / "real.pt"
    real.write_bytes(b"old")
    (tmp_path / "y.pt").symlink_to(real)
    save_tensors({"a": torch.arange(3.0)}, tmp_path / "y.pt", force=True)
    assert (tmp_path / "y.pt").is_symlink()
    torch.testing.assert_close(torch.load(real)["a"], torch.arange(3.0))


def test_the_check_is_made_again_before_the_name_is_taken(tmp_path, monkeypatch):
    """A target that becomes a device between the first check and the publishing is still refused (os.replace
    would replace the node)."""
    from attnscope import AttnscopeError, save_tensors
    from attnscope.tensors import save

    device = _device(tmp_path)
    target = tmp_path / "late.pt"
    real_write = save._write

    def swapped(path, *args):  # the run computes; meanwhile the name becomes a link to a device
        real_write(path, *args)
        target.unlink(missing_ok=True)
        target.symlink_to(device)

    monkeypatch.setattr(save, "_write", swapped)
    with pytest.raises(AttnscopeError, match="character device"):
        save_tensors({"a": torch.ones(2)}, target, force=True)
    assert stat.S_ISCHR(os.stat(device).st_mode) and target.is_symlink()
    assert _files(tmp_path) == {"late.pt", "devices"}


# --- GGUF files written here: gguf.GGUFWriter, weights off their init -------------------------------------------

def _gguf(path: Path, *, kv: dict | None = None, tokenizer: dict | None = None, d_head: int | None = None,
          arch: str = "llama") -> Path:
    """A one-layer LLaMA GGUF (4 heads, d_model 32) with llama.cpp's keys, `kv` added (name -> (kind, value)),
    `tokenizer` as tokenizer.ggml.* (name -> (kind, value)); `d_head` sets attention.key_length."""
    import gguf

    rng = np.random.default_rng(0)
    n_head, d_model = 4, 32
    width = n_head * (d_head or d_model // n_head)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.embedding_length", d_model)
    writer.add_uint32(f"{arch}.attention.head_count", n_head)
    writer.add_uint32(f"{arch}.context_length", 64)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if d_head:
        writer.add_uint32(f"{arch}.attention.key_length", d_head)
        writer.add_uint32(f"{arch}.attention.value_length", d_head)
    pairs = {**(kv or {}), **{f"tokenizer.ggml.{k}": v for k, v in (tokenizer or {}).items()}}
    for key, (kind, value) in pairs.items():
        writer.add_key_value(key, value, kind)
    shapes = {"attn_q": (width, d_model), "attn_k": (width, d_model), "attn_v": (width, d_model),
              "attn_output": (d_model, width), "ffn_gate": (64, d_model), "ffn_up": (64, d_model),
              "ffn_down": (d_model, 64), "attn_norm": (d_model,), "ffn_norm": (d_model,)}
    writer.add_tensor("token_embd.weight", rng.normal(size=(32, d_model)).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.normal(size=d_model)).astype(np.float32))
    for name, shape in shapes.items():
        writer.add_tensor(f"blk.0.{name}.weight", (0.3 * rng.normal(size=shape) + 0.05).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bpe_tokenizer(merges) -> dict:
    import gguf

    V = gguf.GGUFValueType
    tokens = ["<|endoftext|>", *"abcdefghijklmn", "Ġ", "ab"]
    return {"model": (V.STRING, "gpt2"), "pre": (V.STRING, "smollm"), "tokens": (V.ARRAY, tokens),
            "token_type": (V.ARRAY, [3] + [1] * (len(tokens) - 1)), "merges": (V.ARRAY, merges),
            "bos_token_id": (V.UINT32, 0), "eos_token_id": (V.UINT32, 0)}


# --- items 2 and 6: Ollama's store ---------------------------------------------------------------------------------

def _store(tmp_path: Path, blob_bytes: bytes, name: str = "tiny", tag: str = "q8") -> tuple[Path, Path, Path]:
    """An Ollama store under tmp_path/store: a manifest naming one model blob of `blob_bytes`. Returns (store,
    manifest, blob)."""
    store = tmp_path / "store"
    digest = hashlib.sha256(blob_bytes).hexdigest()
    blob = store / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(blob_bytes)
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(blob_bytes)}]}))
    return store, manifest, blob


@pytest.fixture
def model_bytes(tmp_path_factory):
    return _gguf(tmp_path_factory.mktemp("model") / "m.gguf").read_bytes()


def test_a_store_reads_its_own_files_and_links_inside_it(tmp_path, model_bytes, monkeypatch):
    store, manifest, blob = _store(tmp_path, model_bytes)
    moved = store / "blobs" / "elsewhere-in-the-store"
    blob.rename(moved)
    blob.symlink_to(moved)  # a link that stays in the store is followed
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    direct = run_main("anatomy", str(moved), "--json")
    through = run_main("anatomy", "ollama:tiny:q8", "--json")
    assert direct.code == 0 and through.code == 0, through.stderr
    assert through.json()["layers"] == direct.json()["layers"]


@pytest.mark.parametrize("where", ["blob", "blobs", "library", "manifest"])
def test_links_that_leave_the_store_are_refused(tmp_path, model_bytes, monkeypatch, where):
    """A blob, blobs/, the library folder or a manifest linked outside the store: refused, the outside file
    never read (an outside GGUF would have been shown as the model)."""
    store, manifest, blob = _store(tmp_path, model_bytes)
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = {"blob": blob, "blobs": blob.parent, "library": manifest.parent.parent, "manifest": manifest}[where]
    (outside / moved.name).parent.mkdir(exist_ok=True)
    moved.rename(outside / moved.name)
    moved.symlink_to(outside / moved.name)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    for command in (["anatomy", "ollama:tiny:q8"], ["head", "--model", "ollama:tiny:q8"]):
        assert_usage_error(run_main(*command), "leads outside the Ollama store")


def test_a_blob_linked_to_dev_zero_or_a_folder_is_named_as_what_it_is(tmp_path, model_bytes, monkeypatch):
    store, _, blob = _store(tmp_path, model_bytes)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    blob.unlink()
    blob.symlink_to("/dev/zero")
    outcome = run_main("head", "--model", "ollama:tiny:q8")
    assert_usage_error(outcome, "leads outside the Ollama store", "/dev/zero")
    assert "missing" not in outcome.stderr
    blob.unlink()
    blob.mkdir()
    outcome = run_main("anatomy", "ollama:tiny:q8")
    assert_usage_error(outcome, "is a folder, not a file")
    assert "missing" not in outcome.stderr
    blob.rmdir()
    assert_usage_error(run_main("anatomy", "ollama:tiny:q8"), "is missing; pull it again")


def test_a_blob_that_is_no_gguf_is_never_parsed_nor_quoted(tmp_path, monkeypatch):
    secret = "hunter2-do-not-print"
    store, _, _ = _store(tmp_path, json.dumps({"model_type": "llama", "password": secret}).encode())
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    for command in (["anatomy", "ollama:tiny:q8"], ["head", "--model", "ollama:tiny:q8", "--text", TEXT]):
        outcome = run_main(*command)
        assert_usage_error(outcome, "is not a GGUF file")
        assert secret not in outcome.stdout + outcome.stderr and "config.json" not in outcome.stderr


# --- item 5: internal errors -----------------------------------------------------------------------------------------

def test_a_name_of_300_characters_and_a_manifest_200000_deep(tmp_path, model_bytes, monkeypatch):
    store, manifest, _ = _store(tmp_path, model_bytes)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    for model in (f"ollama:{'a' * 300}", f"ollama:tiny:{'t' * 300}"):
        assert_usage_error(run_main("head", "--model", model), "at most 255 bytes")
        assert_usage_error(run_main("anatomy", model), "at most 255 bytes")
    manifest.write_text("[" * 200_000 + "]" * 200_000)
    assert_usage_error(run_main("head", "--model", "ollama:tiny:q8"), "is not an Ollama manifest")


def test_merges_stored_as_numbers_are_refused_with_text(tmp_path):
    import gguf

    path = _gguf(tmp_path / "m.gguf", tokenizer={**_bpe_tokenizer([]), "merges": (gguf.GGUFValueType.ARRAY, [1, 2])})
    outcome = run_main("head", "--model", str(path), "--text", TEXT)
    assert_usage_error(outcome, "tokenizer.ggml.merges is not a list of strings")
    good = _gguf(tmp_path / "good.gguf", tokenizer=_bpe_tokenizer(["a b"]))
    assert run_main("head", "--model", str(good), "--text", "ab cd").code == 0


# --- item 3: bounded work for hostile arrays -----------------------------------------------------------------------

def _hostile(path: Path, item: int, count: int, body: bytes, arch: bool = True) -> Path:
    """A GGUF whose metadata holds one array `junk` of `count` entries of type `item`, then `body`."""
    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2 if arch else 1)
    head += key("general.architecture") + struct.pack("<I", 8) + key("llama") if arch else b""
    path.write_bytes(head + key("junk") + struct.pack("<IIQ", 9, item, count) + body)
    return path


def _allocated(read) -> tuple[object, int]:
    tracemalloc.start()
    try:
        got = read()
    except Exception as exc:  # noqa: BLE001 - the refusal is what we measure
        got = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return got, peak


def test_an_array_that_fills_the_file_is_left_in_it(tmp_path):
    """32 MiB of uint8 values: stepped over, not turned into a list (16 bytes of memory per byte of file before)."""
    from attnscope.models.gguf.header import read_header

    path = _hostile(tmp_path / "h.gguf", 0, 32 << 20, bytes(32 << 20))
    header, peak = _allocated(lambda: read_header(path))
    assert peak < 1 << 20, peak
    assert len(header.metadata["junk"]) == 32 << 20 and not isinstance(header.metadata["junk"], list)
    assert_usage_error(run_main("anatomy", str(path)), "the metadata has no llama.")


@pytest.mark.parametrize("item, width", [(8, 8), (9, 12)])  # strings, arrays of arrays
def test_counts_no_real_file_has_are_refused_before_any_walk(tmp_path, item, width):
    from attnscope.models.gguf.header import MAX_ENTRIES, read_header

    count = MAX_ENTRIES + 1
    body = bytes(8 * count) if item == 8 else struct.pack("<IQ", 0, 0) * count
    path = _hostile(tmp_path / "h.gguf", item, count, body)
    refused, peak = _allocated(lambda: read_header(path))
    assert "no model's header does" in str(refused) and peak < 1 << 20, (refused, peak)


def test_many_keys_and_long_names_are_refused_at_once(tmp_path):
    from attnscope.models.gguf.header import MAX_KEYS, read_header

    path = tmp_path / "keys.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, MAX_KEYS + 1) + bytes(13 * (MAX_KEYS + 1)))
    refused, peak = _allocated(lambda: read_header(path))
    assert "no model has more than" in str(refused) and peak < 1 << 20
    long_key = tmp_path / "key.gguf"
    long_key.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 20) + bytes((1 << 20) + 16))
    refused, peak = _allocated(lambda: read_header(long_key))
    assert "at most 65,535" in str(refused) and peak < 1 << 19, (refused, peak)


def test_lazy_values_equal_gguf_reader(tmp_path):
    """Arrays past 64 entries (numbers, strings) and a long text are left in the file and read back, when asked,
    as GGUFReader reads them."""
    import gguf
    from gguf import GGUFReader

    from attnscope.models.gguf.header import LAZY_TYPES, read_header

    V = gguf.GGUFValueType
    kv = {"x.floats": (V.ARRAY, [float(i) / 7 for i in range(300)]), "x.ints": (V.ARRAY, list(range(-100, 200))),
          "x.words": (V.ARRAY, [f"w{i}é" for i in range(200)]), "x.text": (V.STRING, "long " * 20_000),
          "x.short": (V.ARRAY, [1, 2, 3])}
    path = _gguf(tmp_path / "lazy.gguf", kv=kv)
    ours, theirs = read_header(path), GGUFReader(path)
    for key in kv:
        value = ours.metadata[key]
        assert isinstance(value, LAZY_TYPES) == (key != "x.short"), key
        got = value.values() if isinstance(value, LAZY_TYPES) else value
        assert got == pytest.approx(theirs.fields[key].contents()) if key == "x.floats" else \
            got == theirs.fields[key].contents(), key


# --- item 6: messages that misled ----------------------------------------------------------------------------------

def test_a_split_without_its_first_shard_says_so(tmp_path, model_bytes):
    folder = tmp_path / "split"
    folder.mkdir()
    for no in (2, 3):
        (folder / f"m-0000{no}-of-00003.gguf").write_bytes(model_bytes)
    for model in (folder / "m-00002-of-00003.gguf", folder):
        outcome = run_main("head", "--model", str(model))
        assert_usage_error(outcome, "shard 2 of 3", "shard 1 (m-00001-of-00003.gguf)", "download every shard")
        assert "config.json" not in outcome.stderr


def test_bad_metadata_gets_advice_for_a_gguf(tmp_path):
    import gguf

    path = _gguf(tmp_path / "m.gguf", kv={"llama.attention.head_count_kv": (gguf.GGUFValueType.UINT32, 3)})
    outcome = run_main("head", "--model", str(path))
    assert_usage_error(outcome, "GGUF file's metadata")
    assert "config.json" not in outcome.stderr and "save_pretrained" not in outcome.stderr


def test_a_damaged_complete_header_is_not_called_truncated(tmp_path, model_bytes):
    """A tensor's offset rewritten far past the end: damaged. The same file cut short: truncated."""
    from gguf import GGUFReader

    path = tmp_path / "m.gguf"
    path.write_bytes(model_bytes)
    tensor = GGUFReader(path).tensors[2]
    at = tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape) + 4  # its offset
    damaged = bytearray(model_bytes)
    damaged[at:at + 8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(damaged))
    outcome = run_main("head", "--model", str(path))
    assert_usage_error(outcome, "header is damaged", tensor.name)
    assert "truncated" not in outcome.stderr
    path.write_bytes(model_bytes[:-100])
    assert_usage_error(run_main("head", "--model", str(path)), "the file is truncated")


def test_a_rope_scaling_message_names_the_file(tmp_path):
    import gguf

    path = _gguf(tmp_path / "m.gguf", kv={"llama.rope.scaling.type": (gguf.GGUFValueType.STRING, "wavy")})
    for command in (["head", "--model", str(path)], ["anatomy", str(path)]):
        assert_usage_error(run_main(*command), str(path), "'wavy'", "linear and yarn")


def test_an_escape_in_a_name_is_never_echoed_raw(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    for command in (["head", "--model", "ollama:\x1b[31mred\x1b[0m"], ["anatomy", "ollama:x\u202etag"]):
        outcome = run_main(*command)
        assert outcome.code == 2 and "\x1b" not in outcome.wrapped and "\u202e" not in outcome.wrapped
        assert "\\x1b[31mred" in outcome.stderr or "\\u202e" in outcome.stderr, outcome.stderr


def test_a_query_of_no_token_is_refused_before_the_forward(tmp_path, monkeypatch):
    import tiny_vision

    from attnscope.models.vision import tower

    folder = tmp_path / "vit"
    tiny_vision.build("vit", folder)
    image = tiny_vision.draw(tmp_path / "cat.png")

    def forward(*args, **kwargs):
        raise AssertionError("the forward ran before --query was checked")

    monkeypatch.setattr(tower, "run", forward)
    assert_usage_error(run_main("head", "--model", str(folder), "--image", str(image), "--query", "p(9,9)"),
                       "--query 'p(9,9)' names no token")


# --- item 25: the weight dump names where d_head comes from ----------------------------------------------------------

def test_the_weight_dump_says_d_head_is_the_files_metadata(tmp_path):
    path = _gguf(tmp_path / "m.gguf", d_head=16)
    outcome = run_main("head", "--model", str(path))
    assert outcome.code == 0, outcome.stderr
    assert "d_head is the GGUF's llama.attention.key_length, not d_model / heads = 8" in outcome.stdout
    assert "config.json" not in outcome.stdout


def test_a_device_or_a_pipe_as_the_model_is_named_and_never_opened(tmp_path):
    pipe = tmp_path / "model.gguf"
    os.mkfifo(pipe)  # opening it for reading would wait for ever
    assert_usage_error(run_main("head", "--model", str(pipe)), "is a pipe, not a regular file")
    assert_usage_error(run_main("anatomy", str(pipe)), "is a pipe, not a regular file")
    assert_usage_error(run_main("head", "--model", "/dev/zero"), "is a character device")


def test_short_string_arrays_count_against_the_bound_too(tmp_path, monkeypatch):
    """Arrays of up to 64 strings are read at once, and count toward the strings a header may walk: many keys of
    64 strings each would otherwise walk 65,536 x 64 (the bound lowered here to keep the file small)."""
    from attnscope.models.gguf import header

    monkeypatch.setattr(header, "MAX_ENTRIES", 1000)
    one = struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 64) + struct.pack("<Q", 0) * 64
    path = tmp_path / "many.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 20) + one * 20)
    with pytest.raises(Exception, match="more than 1,000 strings"):
        header.read_header(path)
