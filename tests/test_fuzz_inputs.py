"""The newer input surface, fuzzed (issue 36): `anatomy` on random and broken config.json files, `diff` on random
and broken tensor files (.npy, .npz, .safetensors, .pt: truncated, bytes flipped, headers rewritten), `head --audio`
on random and broken WAV files with a tiny Whisper, `--text-file` on odd files (empty, binary, not UTF-8, one
huge line, NUL bytes, /dev/zero, a folder), and `head --model FILE.gguf` on GGUF files truncated, corrupted, with
absurd counts, unknown types and architectures. tests/test_fuzz_cli.py fuzzes the older surface; both keep the house
rules' promises, checked by `keeps_promises`:

- the exit status is 0, 1 or 2; 1 only where it is documented (diff's divergence, named on stdout) or a run-time
  error's line;
- stderr is one message at most (possibly wrapped over several lines), never a traceback nor the internal-error
  phrase; a refusal starts "attnscope: error: ";
- --json output parses strictly (no NaN, no Infinity).

CI tries a few dozen examples of each (seconds); a long run takes `ATTNSCOPE_FUZZ_EXAMPLES=N` (tests/fuzz.py), as
the older fuzz does.
"""

from __future__ import annotations

import json
import resource
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_main import INTERNAL, Outcome, run_main
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

ERROR = "attnscope: error: "


def keeps_promises(argv: list[str], outcome: Outcome, *, divergence: bool = False) -> None:
    said = outcome.stdout + outcome.stderr
    assert outcome.code in (0, 1, 2), (argv, outcome.code, outcome.stderr)
    assert INTERNAL not in outcome.stderr and "Traceback" not in said, (argv, outcome.stderr[-2000:])
    assert outcome.stderr.count("attnscope:") <= 1, (argv, outcome.stderr)
    if outcome.code == 1 and divergence and not outcome.stderr:
        assert "first divergence" in outcome.stdout or '"first_divergence"' in outcome.stdout, argv
    elif outcome.code != 0:
        assert outcome.stderr.startswith(ERROR), (argv, outcome.code, outcome.stderr)
    if "--json" in argv and outcome.code != 2 and outcome.stdout.strip():
        outcome.json()


# --- anatomy: config.json random and broken ------------------------------------------------------------------------

BASES = {
    "llama": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 3, "max_position_embeddings": 128, "rope_theta": 10000.0, "torch_dtype": "bfloat16"},
    "gemma3": {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 64,
                                                       "num_attention_heads": 4, "num_hidden_layers": 6,
                                                       "sliding_window": 16, "head_dim": 16}},
    "t5": {"model_type": "t5", "d_model": 32, "num_heads": 4, "num_layers": 2, "d_kv": 8, "is_encoder_decoder": True},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 64},
    "deepseek": {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                 "v_head_dim": 8},
    "unknown": {"model_type": "zzz", "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1},
}
KEYS = ["model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim",
        "vocab_size", "intermediate_size", "max_position_embeddings", "sliding_window", "layer_types",
        "attention_chunk_size", "rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor",
        "no_rope_layers", "kv_lora_rank", "qk_rope_head_dim", "use_qk_norm", "attn_logit_softcapping", "multi_query",
        "torch_dtype", "dtype", "is_encoder_decoder", "text_config", "encoder", "decoder", "architectures",
        "use_bidirectional_attention", "sliding_window_pattern", "max_window_layers", "layers_block_type", "d_kv"]
NUMBERS = st.one_of(st.integers(-3, 40), st.sampled_from([0, 2**63, 2**64, 10**12, 1 << 24, 1 << 40, -(2**70)]),
                    st.sampled_from([0.5, 1e308, -1e308, 1e-320, float("nan"), float("inf"), 3.0, 2.5]))
SCALARS = st.one_of(NUMBERS, st.booleans(), st.none(),
                    st.sampled_from(["", "llama", "full_attention", "sliding_attention", "yarn", "float16", "\udcff",
                                     "x" * 300]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                           max_leaves=12)


@st.composite
def config_text(draw) -> bytes:
    config = json.loads(json.dumps(BASES[draw(st.sampled_from(sorted(BASES)))]))
    for _ in range(draw(st.integers(0, 4))):
        holder = config["text_config"] if "text_config" in config and draw(st.booleans()) else config
        if isinstance(holder, dict):
            holder[draw(st.sampled_from(KEYS))] = draw(JSON_VALUES)
    if draw(st.integers(0, 9)) == 0:  # a value nested deep, past the model reader's 64 or just within it
        depth = draw(st.sampled_from([63, 64, 65, 200]))
        config["extra"] = json.loads("[" * depth + "]" * depth)
    text = json.dumps(config, allow_nan=True).encode("utf-8", "surrogatepass")
    damage = draw(st.integers(0, 9))
    if damage == 0:
        text = text[: draw(st.integers(0, len(text)))]
    elif damage == 1:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + draw(st.binary(min_size=1, max_size=4)) + text[at + 1:]
    return text


@fuzz_settings(40)
@given(text=config_text(), tokens=st.sampled_from([None, "1", "4096", "0", str(2**64)]),
       dtype=st.sampled_from([None, "bf16", "float8_e4m3fn", "int4"]), as_json=st.booleans())
def test_anatomy_of_any_config_keeps_the_promises(tmp_path_factory, text, tokens, dtype, as_json):
    folder = tmp_path_factory.mktemp("anatomy")
    (folder / "config.json").write_bytes(text)
    argv = ["anatomy", str(folder)] + (["--tokens", tokens] if tokens else []) + (["--dtype", dtype] if dtype else [])
    argv += ["--json"] if as_json else []
    outcome = run_main(*argv)
    keeps_promises(argv, outcome)
    assert outcome.code != 1, (argv, outcome.stderr)  # anatomy reads a file: nothing fails at run time


# --- diff: tensor files random and broken --------------------------------------------------------------------------

def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    suffix = path.suffix
    if suffix == ".safetensors":
        save_file(tensors, str(path), metadata={"attnscope": json.dumps({n: {"dims": ["n_Q", "d_K"][: t.dim()]}
                                                                         for n, t in tensors.items()})})
    elif suffix == ".npz":
        np.savez(path, **{n: t.numpy() for n, t in tensors.items()})
    elif suffix == ".npy":
        np.save(path, next(iter(tensors.values())).numpy())
    else:
        torch.save(tensors, path)


def _rewrite_safetensors_header(data: bytes, draw) -> bytes:
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = draw(st.sampled_from(["shape", "data_offsets", "dtype"]))
    header[name][field] = draw(st.one_of(st.lists(st.integers(-2, 2**40), max_size=3),
                                         st.sampled_from(["F32", "F8_E4M3", "C64", "Q4", 7, None])))
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


@st.composite
def tensor_pair(draw, folder: Path) -> tuple[Path, Path]:
    suffix = draw(st.sampled_from([".safetensors", ".npz", ".npy", ".pt"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int64, torch.bool]))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 3)))
    base = torch.randn(shape, generator=generator)
    a = {"q": base.to(dtype), "scores": (base * 2).to(dtype)}
    b = {name: (t + (draw(st.sampled_from([0.0, 0.0, 1e-3, 1.0])) if t.is_floating_point() else 0)).to(dtype)
         for name, t in a.items()}
    paths = folder / f"a{suffix}", folder / f"b{suffix}"
    _write(paths[0], a)
    _write(paths[1], b)
    data = paths[1].read_bytes()
    damage = draw(st.sampled_from(["none", "truncate", "flip", "header", "random", "empty"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif damage == "flip" and data:
        mutable = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data) - 1))
            mutable[at] ^= draw(st.integers(1, 255))
        data = bytes(mutable)
    elif damage == "header" and suffix == ".safetensors":
        data = _rewrite_safetensors_header(data, draw)
    elif damage == "header" and suffix == ".npy":
        data = data.replace(str(tuple(shape)).encode(), str(tuple(draw(st.lists(st.integers(0, 9), max_size=3))))
                            .encode(), 1)
    elif damage == "random":
        data = draw(st.binary(max_size=300))
    elif damage == "empty":
        data = b""
    paths[1].write_bytes(data)
    return paths if draw(st.booleans()) else paths[::-1]


@fuzz_settings(40)
@given(data=st.data())
def test_diff_of_any_pair_of_files_keeps_the_promises(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("diff")
    a, b = data.draw(tensor_pair(folder))
    argv = ["diff", str(a), str(b)]
    argv += data.draw(st.sampled_from([[], [], ["--atol", "1e-2"], ["--rtol", "0"], ["--atol", "nan"]]))
    argv += ["--json"] if data.draw(st.booleans()) else []
    outcome = run_main(*argv)
    keeps_promises(argv, outcome, divergence=True)


# --- head --audio: WAV files random and broken, with a tiny Whisper -------------------------------------------------

@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from tiny_encdec import build

    folder = tmp_path_factory.mktemp("whisper")
    build("whisper", folder)
    return folder


@st.composite
def wav_bytes(draw, folder: Path) -> bytes:
    from tiny_encdec import write_wav

    path = write_wav(folder / "w.wav", seconds=draw(st.sampled_from([0.0, 0.01, 0.3, 2.5])),
                     rate=draw(st.sampled_from([16000, 16000, 8000, 1])), channels=draw(st.integers(1, 3)),
                     width=draw(st.integers(1, 4)))
    data = path.read_bytes()
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip_header", "size", "random", "empty"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif damage == "flip_header":
        at = draw(st.integers(0, min(43, len(data) - 1)))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    elif damage == "size":  # the RIFF or the data chunk's declared size, past the file
        at = draw(st.sampled_from([4, 40]))
        data = data[:at] + struct.pack("<I", draw(st.sampled_from([0, 2**31, 2**32 - 1]))) + data[at + 4:]
    elif damage == "random":
        data = b"RIFF" + draw(st.binary(max_size=200))
    elif damage == "empty":
        data = b""
    return data


@fuzz_settings(15)
@given(data=st.data())
def test_head_audio_on_any_wav_keeps_the_promises(whisper, tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("wav")
    (folder / "in.wav").write_bytes(data.draw(wav_bytes(folder)))
    argv = ["head", "--model", str(whisper), "--audio", str(folder / "in.wav"), "--layer", "0", "--head", "0"]
    argv += data.draw(st.sampled_from([[], ["--attention", "encoder"], ["--attention", "cross"]]))
    argv += ["--json"] if data.draw(st.booleans()) else []
    outcome = run_main(*argv)
    keeps_promises(argv, outcome)


# --- --text-file: odd files -------------------------------------------------------------------------------------------

ODD_TEXTS = {
    "empty": b"", "spaces": b"   \n\t\n", "binary": bytes(range(256)) * 4, "latin1": "café naïve".encode("latin-1"),
    "nul": b"the cat\x00sat", "bom": "\ufeffthe cat sat".encode(), "utf16": "the cat sat".encode("utf-16"),
    "crlf": b"the cat\r\nsat on\r\nthe mat\r\n", "huge_line": b"the cat sat " * 3000,
    "surrogates": "x \udcff y".encode("utf-8", "surrogatepass"), "good": b"The cat sat on the mat.",
}


@pytest.fixture(scope="module")
def text_world(tmp_path_factory):
    from tiny_models import build

    root = tmp_path_factory.mktemp("texts")
    for name, data in ODD_TEXTS.items():
        (root / f"{name}.txt").write_bytes(data)
    (root / "folder.txt").mkdir()
    build("gpt2", root / "gpt2")
    build("bert", root / "bert")
    return root


@fuzz_settings(25)
@given(data=st.data())
def test_text_file_of_any_kind_keeps_the_promises(text_world, data):
    root = text_world
    name = data.draw(st.sampled_from([*ODD_TEXTS, "folder", "missing", "/dev/zero", "/dev/null"]))
    path = name if name.startswith("/dev/") else str(root / f"{name}.txt")
    command, model = data.draw(st.sampled_from([("head", "gpt2"), ("bert", "bert"), ("head", "bert")]))
    argv = [command, "--model", str(root / model), "--text-file", path, "--layer", "0", "--head", "0"]
    argv += ["--json"] if data.draw(st.booleans()) else []
    outcome = run_main(*argv)
    keeps_promises(argv, outcome)



# --- head --model FILE.gguf: GGUF files truncated, corrupted, with absurd counts, unknown types and architectures ----

@pytest.fixture(scope="module")
def gguf_world(tmp_path_factory):
    """A tiny Qwen 2 GGUF (tests/tiny_gguf.py), and where its header keeps each tensor's type and first dimension."""
    from gguf import GGUFReader
    from tiny_gguf import write

    path = write("qwen2", tmp_path_factory.mktemp("gguf"), "Q4_0")
    tensors = []
    for tensor in GGUFReader(path).tensors:  # each tensor's info: name, n_dims, dims, type, offset
        at = tensor.field.offset + 8 + len(tensor.name.encode()) + 4
        tensors.append((at, at + 8 * len(tensor.shape)))  # its first dimension, its type
    return path.read_bytes(), tensors


@st.composite
def gguf_bytes(draw, world) -> bytes:
    data, tensors = world
    mutable = bytearray(data)
    damage = draw(st.sampled_from(["truncate", "magic", "version", "counts", "type", "dims", "arch", "flip", "none"]))
    if damage == "truncate":  # in the header, the tensor table or the tensor data
        return data[: draw(st.one_of(st.integers(0, 4096), st.integers(0, len(data) - 1)))]
    if damage == "magic":
        mutable[:4] = draw(st.binary(min_size=4, max_size=4))
    elif damage == "version":
        mutable[4:8] = struct.pack("<I", draw(st.sampled_from([0, 1, 4, 2**16, 2**31, 3 << 24])))
    elif damage == "counts":  # tensor_count or kv_count, absurd or just off
        at = draw(st.sampled_from([8, 16]))
        mutable[at:at + 8] = struct.pack("<Q", draw(st.sampled_from([2**63, 2**40, 10**6, 0, 1, 500])))
    elif damage in ("type", "dims"):
        dim, kind = draw(st.sampled_from(tensors))
        if damage == "type":  # unknown ids, and known ones no reader dequantizes (Q8_1, Q8_K, I32)
            mutable[kind:kind + 4] = struct.pack("<I", draw(st.sampled_from([9, 15, 26, 99, 2**31, 40])))
        else:
            mutable[dim:dim + 8] = struct.pack("<Q", draw(st.sampled_from([0, 1, 33, 2**20, 2**45, 2**64 - 1])))
    elif damage == "arch":  # general.architecture: another llama.cpp architecture, or none it has
        name = draw(st.sampled_from([b"mamba", b"bert\x00", b"\xff\xfeqwe", b"gpt2\x20"]))
        mutable = bytearray(data.replace(b"qwen2", name, 1))
    elif damage == "flip":
        for _ in range(draw(st.integers(1, 6))):
            at = draw(st.integers(0, min(len(data), 8192) - 1))
            mutable[at] ^= draw(st.integers(1, 255))
    return bytes(mutable)


@fuzz_settings(30)
@given(data=st.data())
def test_gguf_of_any_damage_keeps_the_promises(gguf_world, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("gguf-damaged") / "model.gguf"
    path.write_bytes(data.draw(gguf_bytes(gguf_world)))
    argv = ["head", "--model", str(path), "--layer", "1"]
    argv += data.draw(st.sampled_from([["--text", "The cat sat on the mat."], [],
                                       ["--text", "The cat sat", "--all-layers"]]))
    argv += ["--json"] if data.draw(st.booleans()) else []
    peak, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.process_time()
    outcome = run_main(*argv)
    spent = time.process_time() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    keeps_promises(argv, outcome)
    if outcome.code:  # a refusal is cheap (issue 43's campaign): under 5 s of CPU and 1 GiB more memory
        assert spent < 5.0 and grown < 1 << 30, (argv, spent, grown)
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # nothing written beside the file


@pytest.mark.parametrize("damage", ["magic", "version", "tensor_count", "kv_count", "truncated", "type", "arch"])
def test_gguf_damage_is_named_in_one_line(gguf_world, tmp_path, damage):
    """Each damage the issue names, refused with exit 2 and what was wrong, before anything is allocated."""
    data, tensors = gguf_world
    mutable = bytearray(data)
    words = {"magic": "not the GGUF magic", "version": "GGUF version 7", "tensor_count": "more than its",
             "kv_count": "more than its", "truncated": "truncated", "type": "ggml type 99",
             "arch": "architecture 'mamba'"}[damage]
    if damage == "magic":
        mutable[:4] = b"GGML"
    elif damage == "version":
        mutable[4:8] = struct.pack("<I", 7)
    elif damage in ("tensor_count", "kv_count"):
        at = 8 if damage == "tensor_count" else 16
        mutable[at:at + 8] = struct.pack("<Q", 2**62)
    elif damage == "truncated":
        mutable = mutable[: len(data) - 100]
    elif damage == "type":
        mutable[tensors[3][1]:tensors[3][1] + 4] = struct.pack("<I", 99)
    else:
        mutable = bytearray(data.replace(b"qwen2", b"mamba", 1))
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(mutable))
    outcome = run_main("head", "--model", str(path), "--text", "The cat sat")
    assert outcome.code == 2 and len(outcome.error_lines) == 1 and words in outcome.stderr, outcome.stderr
    assert "Traceback" not in outcome.stderr
