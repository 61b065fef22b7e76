"""Reading and writing tensor files: every format, the refusals, and atomic saving."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from attnscope import load_tensor, save_tensors
from attnscope.errors import UsageError


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
    with pytest.raises(UsageError, match="--force"):
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
    with pytest.raises(OSError):
        save_tensors({"Q": q}, target)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_file(tmp_path, q, monkeypatch):
    import safetensors.torch

    target = tmp_path / "out.safetensors"
    target.write_bytes(b"old")
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
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
