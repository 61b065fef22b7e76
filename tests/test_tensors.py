"""Reading and writing tensor files: every format, the refusals, and atomic saving."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from attnscope import load_tensor, save_tensors
from attnscope.errors import ResourceError, UsageError


@pytest.fixture()
def q():
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)


def test_every_format_loads_the_same_tensor(tmp_path, q):
    np.save(tmp_path / "q.npy", q.numpy())
    np.savez(tmp_path / "qk.npz", q=q.numpy(), k=(q * 2).numpy())
    save_file({"q": q, "k": q * 2}, tmp_path / "qk.safetensors")
    torch.save(q, tmp_path / "q.pt")
    torch.save({"q": q, "k": q * 2}, tmp_path / "qk.pth")
    for spec in ("q.npy", "qk.npz:q", "qk.safetensors:q", "q.pt", "qk.pth:q"):
        assert torch.equal(load_tensor(str(tmp_path / spec)), q), spec
    assert torch.equal(load_tensor(str(tmp_path / "qk.npz:k")), q * 2)


def test_float64_and_integer_dtypes_are_kept_on_load(tmp_path):
    np.save(tmp_path / "d.npy", np.ones((2, 2)))
    np.save(tmp_path / "i.npy", np.ones((2, 2), dtype=np.int32))
    assert load_tensor(str(tmp_path / "d.npy")).dtype == torch.float64
    assert load_tensor(str(tmp_path / "i.npy")).dtype == torch.int32


def test_file_that_would_run_code_is_refused(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (print, ("this must never run",))

    torch.save({"q": RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(UsageError, match="would run code"):
        load_tensor(str(tmp_path / "evil.pt"))
    with open(tmp_path / "evil.npy", "wb") as handle:
        np.save(handle, np.array([RunsCode()], dtype=object), allow_pickle=True)
    with pytest.raises(UsageError, match="would run code"):
        load_tensor(str(tmp_path / "evil.npy"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("q.txt", b"1 2 3", "unknown tensor file type"),
        ("q.npy", b"not numpy at all", "not a .npy file"),
        ("q.npz", b"not a zip", "not a .npz file"),
        ("q.safetensors", b"\x00\x01garbage", "not a valid .safetensors file"),
        ("q.pt", pickle.dumps([1, 2]) + b"junk", "not"),
    ],
)
def test_wrong_kind_of_file_is_one_clear_error(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load_tensor(str(tmp_path / name))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"nope\.npy: no such file"):
        load_tensor(str(tmp_path / "nope.npy"))


def test_several_tensors_need_a_name(tmp_path, q):
    np.savez(tmp_path / "qk.npz", q=q.numpy(), k=q.numpy())
    with pytest.raises(UsageError, match="choose one with FILE:NAME"):
        load_tensor(str(tmp_path / "qk.npz"))
    with pytest.raises(UsageError, match="no tensor named 'v'"):
        load_tensor(str(tmp_path / "qk.npz:v"))


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
def test_save_round_trips_by_name(tmp_path, suffix, q):
    target = tmp_path / f"steps{suffix}"
    view = q.transpose(1, 2)  # a non-contiguous view, as Q_split is
    save_tensors({"Q": q, "Q_t": view}, target, metadata={"Q": {"dims": ["a", "b", "c"]}})
    for name, tensor in (("Q", q), ("Q_t", view)):
        assert torch.equal(load_tensor(f"{target}:{name}"), tensor)
    if suffix == ".safetensors":
        assert set(load_file(target)) == {"Q", "Q_t"}


def test_save_refuses_to_overwrite_without_force(tmp_path, q):
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"precious")
    with pytest.raises(UsageError, match="pass force=True to replace it"):  # a Python caller's words
        save_tensors({"Q": q}, target)
    assert target.read_bytes() == b"precious"
    save_tensors({"Q": q}, target, force=True)
    assert torch.equal(load_tensor(f"{target}:Q"), q)


def test_failed_save_leaves_no_file_behind(tmp_path, q, monkeypatch):
    import safetensors.torch

    def broken_save(tensors, path, metadata=None):
        with open(path, "wb") as handle:  # fail halfway through the file, as a full disk would
            handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    target = tmp_path / "out.safetensors"
    with pytest.raises(ResourceError, match=r"out\.safetensors: could not write it \(disk full\)") as caught:
        save_tensors({"Q": q}, target)
    assert ".part" not in str(caught.value)  # the target is named, not the temporary file
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_file(tmp_path, q, monkeypatch):
    import safetensors.torch

    target = tmp_path / "out.safetensors"
    target.write_bytes(b"old")
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(ResourceError, match="disk full"):
        save_tensors({"Q": q}, target, force=True)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


def test_save_rejects_unknown_suffix_and_missing_folder(tmp_path, q):
    with pytest.raises(UsageError, match="unknown file type"):
        save_tensors({"Q": q}, tmp_path / "out.csv")
    with pytest.raises(UsageError, match="does not exist"):
        save_tensors({"Q": q}, tmp_path / "no" / "out.npz")


def test_stats_agree_with_torch_on_a_large_permuted_view():
    from attnscope.tensors import STATS_CHUNK, tensor_stats

    tensor = (torch.randn(3, 700, 1100) * 3 + 1).permute(2, 0, 1)  # > STATS_CHUNK elements, not contiguous
    assert tensor.numel() > STATS_CHUNK
    stats = tensor_stats(tensor)
    values = tensor.double()
    for key, expected in (("min", values.min()), ("max", values.max()), ("mean", values.mean()),
                          ("std", values.std())):
        assert stats[key] == pytest.approx(float(expected), rel=1e-9, abs=1e-9), key


def test_stats_count_nan_and_inf_and_skip_them():
    from attnscope.tensors import tensor_stats

    stats = tensor_stats(torch.tensor([1.0, float("nan"), float("-inf"), 3.0]))
    assert (stats["nan"], stats["inf"], stats["min"], stats["max"], stats["mean"]) == (1, 1, 1.0, 3.0, 2.0)


def test_file_larger_than_available_memory_is_refused(tmp_path, q, monkeypatch):
    from attnscope import cost
    from attnscope.errors import ResourceError

    np.save(tmp_path / "q.npy", q.numpy())
    monkeypatch.setattr(cost, "available_memory", lambda: 10)
    with pytest.raises(ResourceError, match="more than the 10 B of memory"):
        load_tensor(str(tmp_path / "q.npy"))


def test_saved_file_gets_the_usual_permissions(tmp_path, q):
    import os
    import stat

    umask = os.umask(0o022)
    try:
        fresh = save_tensors({"Q": q}, tmp_path / "fresh.safetensors")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        kept = tmp_path / "kept.npz"
        kept.write_bytes(b"old")
        kept.chmod(0o640)
        save_tensors({"Q": q}, kept, force=True)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o640
    finally:
        os.umask(umask)


# --- issue 8: odd files, headers only, and saves that keep their promise ---------------------------------


def test_damaged_npz_is_one_clear_error(tmp_path, q):
    np.savez(tmp_path / "q.npz", q=q.numpy())
    data = bytearray((tmp_path / "q.npz").read_bytes())
    data[200] ^= 0xFF  # inside the array's bytes: the CRC no longer matches
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    with pytest.raises(UsageError, match="damaged .npz archive .*CRC"):
        load_tensor(str(tmp_path / "bad.npz"))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("make", "words"), [
    (lambda q: q.to_sparse(), "sparse tensor .*to_dense"),
    (lambda q: torch.quantize_per_tensor(q, 0.1, 0, torch.qint8), "quantized tensor .*dequantize"),
    (lambda q: q.to(torch.float8_e4m3fn), "float8_e4m3fn"),
    (lambda q: torch.empty(q.shape, device="meta"), "meta tensor"),
    (lambda q: torch.complex(q, q), "complex numbers"),
])
def test_tensors_attention_cannot_use_are_refused(tmp_path, q, make, words):
    torch.save(make(q), tmp_path / "t.pt")
    with pytest.raises(UsageError, match=words):
        load_tensor(str(tmp_path / "t.pt"))


def test_complex_and_float8_are_refused_in_numpy_and_safetensors_files(tmp_path, q):
    np.save(tmp_path / "c.npy", q.numpy() + 1j)
    np.savez(tmp_path / "c.npz", c=q.numpy() + 1j)
    save_file({"f8": q.to(torch.float8_e5m2)}, tmp_path / "f8.safetensors")
    for spec, words in (("c.npy", "complex numbers"), ("c.npz", "complex numbers"), ("f8.safetensors", "float8")):
        with pytest.raises(UsageError, match=words):
            load_tensor(str(tmp_path / spec))
        with pytest.raises(UsageError, match=words):
            load_tensor(str(tmp_path / spec), meta=True)


def test_big_endian_npy_is_converted(tmp_path, q):
    np.save(tmp_path / "be.npy", q.numpy().astype(">f4"))
    np.savez(tmp_path / "be.npz", q=q.numpy().astype(">f8"))
    assert torch.equal(load_tensor(str(tmp_path / "be.npy")), q)
    assert torch.equal(load_tensor(str(tmp_path / "be.npz")), q.double())


def test_meta_reads_shape_and_dtype_from_every_format(tmp_path, q, monkeypatch):
    from attnscope import cost

    np.save(tmp_path / "q.npy", q.numpy())
    np.savez_compressed(tmp_path / "qk.npz", q=q.numpy(), k=q.double().numpy())
    save_file({"q": q.half()}, tmp_path / "q.safetensors")
    torch.save({"q": q.bfloat16()}, tmp_path / "q.pt")
    torch.save(torch.empty(3, 4, device="meta"), tmp_path / "shape.pt")
    monkeypatch.setattr(cost, "available_memory", lambda: 10)  # reading any data would be refused
    for spec, dtype in (("q.npy", torch.float32), ("qk.npz:k", torch.float64), ("q.safetensors", torch.float16),
                        ("q.pt", torch.bfloat16)):
        shape = load_tensor(str(tmp_path / spec), meta=True)
        assert (shape.device.type, shape.shape, shape.dtype) == ("meta", q.shape, dtype), spec
    assert load_tensor(str(tmp_path / "shape.pt"), meta=True).shape == (3, 4)


def test_meta_refuses_a_legacy_pt_it_would_have_to_read_whole(tmp_path, q):
    torch.save(q, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(UsageError, match="legacy format"):
        load_tensor(str(tmp_path / "old.pt"), meta=True)
    assert torch.equal(load_tensor(str(tmp_path / "old.pt")), q)


def test_a_legacy_pt_counts_by_its_size_before_it_is_read(tmp_path, monkeypatch):
    """Its header cannot be read apart from its data, so the guard of the input files counts the file's size
    (what torch.load would bring into memory) against --max-memory before anything is loaded."""
    from cli_main import run_main

    from attnscope.tensors import formats

    torch.save(torch.randn(2, 512, 1024), tmp_path / "old.pt", _use_new_zipfile_serialization=False)  # 4 MiB
    loads = []
    real = formats._torch_load
    monkeypatch.setattr(formats, "_torch_load", lambda path, mmap: loads.append(mmap) or real(path, mmap=mmap))
    spec = str(tmp_path / "old.pt")
    outcome = run_main("sdpa", "--q", spec, "--k", spec, "--v", spec, "--max-memory", "3MB")
    assert outcome.code == 1 and "the input files hold about 4.0 MiB, more than --max-memory" in outcome.stderr
    assert False not in loads  # only the mapping attempt: the data was never read


def test_compressed_npz_counts_by_its_inflated_size(tmp_path, monkeypatch):
    from attnscope import cost
    from attnscope.errors import ResourceError

    np.savez_compressed(tmp_path / "zeros.npz", z=np.zeros((1000, 1000)))  # 8 MB inflated, a few KB on disk
    assert (tmp_path / "zeros.npz").stat().st_size < 100_000
    monkeypatch.setattr(cost, "available_memory", lambda: 1_000_000)
    with pytest.raises(ResourceError, match="holds 7.6 MiB"):
        load_tensor(str(tmp_path / "zeros.npz"))


def test_truncated_safetensors_is_named_before_reading(tmp_path, q):
    save_file({"q": q}, tmp_path / "q.safetensors")
    data = (tmp_path / "q.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(UsageError, match="truncated"):
        load_tensor(str(tmp_path / "cut.safetensors"), meta=True)


def test_messages_about_names_and_folders_are_whole(tmp_path, q):
    torch.save(q, tmp_path / "t.pt")
    with pytest.raises(UsageError, match=r"holds a single unnamed tensor; drop ':q'$"):
        load_tensor(f"{tmp_path / 't.pt'}:q")
    with pytest.raises(UsageError, match="is a folder; give a tensor file"):
        load_tensor(str(tmp_path))


def test_a_file_that_appears_during_the_run_is_never_replaced(tmp_path, q, monkeypatch):
    from attnscope.tensors import save as save_module

    target = tmp_path / "out.safetensors"
    real_write = save_module._write

    def write_while_another_appears(path, suffix, tensors, metadata):
        real_write(path, suffix, tensors, metadata)
        target.write_bytes(b"someone else's")  # created after the check, before the file is published

    monkeypatch.setattr(save_module, "_write", write_while_another_appears)
    with pytest.raises(UsageError, match="appeared there while the run was computing; it was kept"):
        save_tensors({"Q": q}, target)
    assert target.read_bytes() == b"someone else's"
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]  # no .part left
    save_tensors({"Q": q}, target, force=True)  # with force: replaced, atomically
    assert torch.equal(load_tensor(f"{target}:Q"), q)


def test_save_onto_a_symlink_writes_through_it(tmp_path, q):
    real = tmp_path / "real.npz"
    link = tmp_path / "link.npz"
    link.symlink_to(real)  # dangling: the file it names is created
    save_tensors({"Q": q}, link)
    assert link.is_symlink() and torch.equal(load_tensor(f"{real}:Q"), q)
    with pytest.raises(UsageError, match="exists"):
        save_tensors({"Q": q}, link)
    save_tensors({"Q": q * 2}, link, force=True)
    assert link.is_symlink() and torch.equal(load_tensor(f"{real}:Q"), q * 2)


def test_a_folder_the_os_will_not_write_into_is_refused_first(tmp_path, q, monkeypatch):
    import os
    import tempfile

    from attnscope.tensors import check_writable

    if os.geteuid() == 0:  # root: os.access says yes under /proc, where no file can be made
        with pytest.raises(UsageError, match=r"--save /proc/out.npz: cannot create a file in /proc"):
            check_writable("/proc/out.npz")

    def refused(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(UsageError, match=r"out.npz: cannot create a file in .*\(Read-only file system\)"):
        save_tensors({"Q": q}, tmp_path / "out.npz")


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_signal_during_save_leaves_no_part_file(tmp_path, signame):
    """In a child process, the writer sends itself the signal halfway through the file: the child exits with
    128 + the signal's number and leaves nothing behind, as Ctrl-C does."""
    import signal
    import subprocess
    import sys

    code = f"""
import os, signal, torch
from attnscope.tensors import save as save_module
signal.signal(signal.{signame}, signal.SIG_DFL)  # as a terminal leaves it (under nohup SIGHUP comes ignored)
def write(path, suffix, tensors, metadata):
    with open(path, "wb") as handle:
        handle.write(b"half")
    os.kill(os.getpid(), signal.{signame})
    raise AssertionError("the signal should have ended the save")
save_module._write = write
save_module.save_tensors({{"Q": torch.ones(2)}}, {str(tmp_path / "out.safetensors")!r})
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 128 + getattr(signal, signame), child.stderr
    assert list(tmp_path.iterdir()) == []


# --- a .pt file's pickle is read once ------------------------------------------------------------------------


def _counting_loads(monkeypatch) -> list[str]:
    """Every torch.load call from here on, by its map_location."""
    calls: list[str] = []
    real = torch.load

    def counted(*args, **kwargs):
        calls.append(str(kwargs.get("map_location")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    return calls


def _awkward_tensors() -> dict[str, torch.Tensor]:
    """Views sharing one storage at offsets, strides of a transpose, a negative view, a parameter, empty and
    0-d tensors, half precisions: what a .pt can hold that a plain contiguous tensor does not show."""
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    return {"q": base, "t": base.t(), "rows": base[2:5], "cols": base[:, 3:7], "step": base[::2, 1::3],
            "neg": torch.complex(base, base).conj().imag, "param": torch.nn.Parameter(base * 3),
            "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5), "half": base.half(),
            "bf16": (base * 5).bfloat16(), "ints": torch.arange(12).reshape(3, 4)[:, 1:]}


def test_a_pt_file_is_unpickled_once_and_reads_as_torch_load_does(tmp_path, monkeypatch):
    from attnscope.tensors.saved import read_saved

    tensors = _awkward_tensors()
    torch.save(tensors, tmp_path / "all.pt")
    torch.save(tensors["t"], tmp_path / "one.pth")
    reference = torch.load(tmp_path / "all.pt", weights_only=True)  # torch's own reading, unmapped
    assert reference["neg"].is_neg()  # the file keeps the negative bit: the read must honour it
    calls = _counting_loads(monkeypatch)
    for name, expected in reference.items():
        calls.clear()
        got = load_tensor(f"{tmp_path / 'all.pt'}:{name}")
        assert calls == ["meta"], name  # one read of the pickle, onto the meta device; the data mapped
        assert (got.shape, got.dtype, got.stride()) == (expected.shape, expected.dtype, expected.stride()), name
        assert torch.equal(got, expected), name
        calls.clear()
        shape = load_tensor(f"{tmp_path / 'all.pt'}:{name}", meta=True)
        assert calls == ["meta"] and (shape.device.type, shape.shape, shape.dtype) == ("meta", expected.shape,
                                                                                       expected.dtype)
    calls.clear()
    assert torch.equal(load_tensor(str(tmp_path / "one.pth")), torch.load(tmp_path / "one.pth"))
    assert len(calls) == 2  # ours, then the reference's
    calls.clear()
    run = read_saved(str(tmp_path / "all.pt"))  # every entry and the metadata from one read
    assert calls == ["meta"]
    for name, expected in reference.items():
        assert torch.equal(run.load(name), expected), name
    assert calls == ["meta"]  # reading the data unpickles nothing again


def test_a_saved_run_in_pt_reads_its_metadata_from_the_same_load(tmp_path, monkeypatch):
    from cli_main import run_main

    from attnscope.tensors.saved import read_saved

    target = tmp_path / "run.pt"
    outcome = run_main("sdpa", "--nq", "3", "--dk", "4", "--causal", "--save", str(target))
    assert outcome.code == 0, outcome.stderr
    reference = torch.load(target, weights_only=True)
    calls = _counting_loads(monkeypatch)
    run = read_saved(str(target))
    assert calls == ["meta"]
    assert run.meta == reference["__attnscope__"] and list(run.meta) == list(run.entries)
    for name in run.entries:
        assert torch.equal(run.load(name), reference[name]), name


def test_a_pt_saved_on_the_other_byte_order_is_swapped_as_torch_load_swaps_it(tmp_path, monkeypatch):
    """A file whose `byteorder` record names the other order, its data swapped to match: torch.load swaps each
    storage back on reading (`storage.byteswap(dtype)` in torch/serialization.py). Read onto the meta device,
    the swap of a meta storage is a segmentation fault (torch 2.13): such a file is read by torch's mapped load."""
    import sys
    import zipfile

    tensors = {"q": torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), "d": torch.arange(5.0).double()}
    torch.save(tensors, tmp_path / "native.pt")
    other = "big" if sys.byteorder == "little" else "little"
    sizes = {}
    with zipfile.ZipFile(tmp_path / "native.pt") as archive:
        for name, tensor in tensors.items():
            sizes[archive.read(f"native/data/{list(tensors).index(name)}")] = tensor.element_size()
        with zipfile.ZipFile(tmp_path / "swapped.pt", "w", zipfile.ZIP_STORED) as new:
            for info in archive.infolist():
                data = archive.read(info.filename)
                if info.filename.endswith("/byteorder"):
                    data = other.encode()
                elif "/data/" in info.filename and data in sizes:
                    size = sizes[data]
                    data = b"".join(data[i:i + size][::-1] for i in range(0, len(data), size))
                new.writestr(info, data)
    reference = torch.load(tmp_path / "swapped.pt", weights_only=True)
    calls = _counting_loads(monkeypatch)
    for name, tensor in tensors.items():
        assert torch.equal(reference[name], tensor)  # the file is what torch reads as the original
        calls.clear()
        assert torch.equal(load_tensor(f"{tmp_path / 'swapped.pt'}:{name}"), tensor), name
        assert calls == ["cpu"]
        assert load_tensor(f"{tmp_path / 'swapped.pt'}:{name}", meta=True).shape == tensor.shape
