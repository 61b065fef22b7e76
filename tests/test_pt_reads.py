"""Each tensor file is opened once per command (tensors/opened.py): a `.pt`'s pickle unpickled once however many
flags name it and whether the memory guard or the run reads it first; never kept from one command to the next."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from attnscope import load_tensor
from attnscope.errors import ResourceError
from attnscope.runs.mha import MhaOptions, run_mha
from attnscope.runs.sdpa import SdpaOptions, run_sdpa
from attnscope.tensors.opened import one_read


def _counting(monkeypatch, module, name: str) -> list[str]:
    """Every call of module.name from here on (torch.load by its map_location)."""
    calls: list[str] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(str(kwargs.get("map_location")))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _saved(path: Path, seed: int, shape: tuple[int, ...] = (2, 5, 8)) -> torch.Tensor:
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    torch.save(tensor, path)
    return tensor


def test_sdpa_with_one_file_three_times_unpickles_it_once(tmp_path, monkeypatch):
    x = _saved(tmp_path / "x.pt", 0)
    spec = str(tmp_path / "x.pt")
    calls = _counting(monkeypatch, torch, "load")
    result = run_sdpa(SdpaOptions(q=spec, k=spec, v=spec, check=True))
    assert calls == ["meta"]  # the guard's header and the three flags' data: one unpickling, the data mapped
    assert torch.allclose(result.trace["out"], F.scaled_dot_product_attention(x, x, x), atol=1e-6)
    assert not result.check_failed
    Q, K, V = (result.trace[name] for name in ("Q", "K", "V"))
    assert Q is not K and K is not V  # three tensors, as three flags give, on the data held once
    assert result.kv_cache_bytes == 2 * x.numel() * x.element_size()


def test_sdpa_with_three_files_unpickles_each_once(tmp_path, monkeypatch):
    q, k, v = (_saved(tmp_path / f"{name}.pt", seed) for seed, name in enumerate("qkv"))
    calls = _counting(monkeypatch, torch, "load")
    result = run_sdpa(SdpaOptions(q=str(tmp_path / "q.pt"), k=str(tmp_path / "k.pt"), v=str(tmp_path / "v.pt"),
                                  causal="upper-left"))
    assert calls == ["meta"] * 3
    assert torch.allclose(result.trace["out"], F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


def test_sdpa_names_in_one_file_and_a_mask_read_once_each(tmp_path, monkeypatch):
    """`FILE:NAME` for Q, K and V out of one dict, and a mask in a file of its own: two files, two unpicklings."""
    tensors = {name: torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(i))
               for i, name in enumerate("qkv")}
    torch.save(tensors, tmp_path / "qkv.pt")
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(9)) > 0.3
    mask.fill_diagonal_(True)
    torch.save(mask, tmp_path / "mask.pt")
    calls = _counting(monkeypatch, torch, "load")
    spec = str(tmp_path / "qkv.pt")
    result = run_sdpa(SdpaOptions(q=f"{spec}:q", k=f"{spec}:k", v=f"{spec}:v", mask=str(tmp_path / "mask.pt")))
    assert calls == ["meta", "meta"]
    expected = F.scaled_dot_product_attention(tensors["q"], tensors["k"], tensors["v"], attn_mask=mask)
    assert torch.allclose(result.trace["out"], expected, atol=1e-6)


def test_meta_reads_the_pickle_once_too(tmp_path, monkeypatch):
    _saved(tmp_path / "x.pt", 0)
    spec = str(tmp_path / "x.pt")
    calls = _counting(monkeypatch, torch, "load")
    result = run_sdpa(SdpaOptions(q=spec, k=spec, v=spec, meta=True))
    assert calls == ["meta"] and result.trace["out"].device.type == "meta"


def test_mha_with_one_file_three_times_unpickles_it_once(tmp_path, monkeypatch):
    """One file for --q, --k and --v: read once, and the run the same as with three files holding the same
    tensor (each read on its own), checked against torch.nn.MultiheadAttention."""
    x = _saved(tmp_path / "x.pt", 1, (2, 6, 16))
    for name in "qkv":
        torch.save(x.clone(), tmp_path / f"{name}.pt")
    spec = str(tmp_path / "x.pt")
    calls = _counting(monkeypatch, torch, "load")
    once = run_mha(MhaOptions(q=spec, k=spec, v=spec, heads=4, check=True))
    assert calls == ["meta"]
    assert once.comparisons and not once.check_failed
    calls.clear()
    apart = run_mha(MhaOptions(q=str(tmp_path / "q.pt"), k=str(tmp_path / "k.pt"), v=str(tmp_path / "v.pt"),
                               heads=4))
    assert calls == ["meta"] * 3
    assert torch.equal(once.trace["x"], apart.trace["x"])
    assert torch.equal(once.trace["Q_feat"], apart.trace["Q_feat"])


def test_latent_mha_with_one_file_twice_unpickles_it_once(tmp_path, monkeypatch):
    """mha --kv-lora-rank with --q and --k one file: read once, the run the same as with two files."""
    from attnscope.runs.latent import run_latent

    x = _saved(tmp_path / "x.pt", 2, (1, 6, 16))
    torch.save(x.clone(), tmp_path / "k.pt")
    spec = str(tmp_path / "x.pt")
    calls = _counting(monkeypatch, torch, "load")
    once = run_latent(MhaOptions(q=spec, k=spec, heads=2, kv_lora_rank=4))
    assert calls == ["meta"]
    apart = run_latent(MhaOptions(q=spec, k=str(tmp_path / "k.pt"), heads=2, kv_lora_rank=4))
    assert torch.equal(once.trace["x"], apart.trace["x"])


def test_a_file_rewritten_between_two_commands_is_read_afresh(tmp_path, monkeypatch):
    """Two commands in one process (a notebook): the second reads the file as it is now, even rewritten with
    the same size and its modification time put back (nothing of the first command's reading is kept)."""
    path = tmp_path / "x.pt"
    first = _saved(path, 3)
    stat = path.stat()
    spec = str(path)
    out = run_sdpa(SdpaOptions(q=spec, k=spec, v=spec)).trace["out"].clone()
    second = _saved(path, 4)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    calls = _counting(monkeypatch, torch, "load")
    again = run_sdpa(SdpaOptions(q=spec, k=spec, v=spec)).trace["out"]
    assert calls == ["meta"]
    assert torch.allclose(out, F.scaled_dot_product_attention(first, first, first), atol=1e-6)
    assert torch.allclose(again, F.scaled_dot_product_attention(second, second, second), atol=1e-6)


def test_outside_a_command_every_load_reads_the_file(tmp_path, monkeypatch):
    """`load_tensor` from Python: no command around it, nothing kept; the file's present contents each time."""
    path = tmp_path / "x.pt"
    _saved(path, 5)
    calls = _counting(monkeypatch, torch, "load")
    load_tensor(str(path))
    second = _saved(path, 6)
    assert torch.equal(load_tensor(str(path)), second)
    assert calls == ["meta", "meta"]


def test_within_a_command_a_file_replaced_halfway_is_read_again(tmp_path, monkeypatch):
    """Known by path, device, inode, size and times: a file replaced (a new inode) between two reads in one
    command is not taken for the one read before."""
    path = tmp_path / "x.pt"
    _saved(path, 7)
    calls = _counting(monkeypatch, torch, "load")
    with one_read():
        load_tensor(str(path))
        replacement = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(8))
        torch.save(replacement, tmp_path / "new.pt")
        (tmp_path / "new.pt").replace(path)
        got = load_tensor(str(path))
        assert torch.equal(load_tensor(str(path)), replacement)
    assert torch.equal(got, replacement) and calls == ["meta", "meta"]


def test_a_legacy_pt_three_times_is_read_whole_once(tmp_path, monkeypatch):
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(10))
    torch.save(x, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    spec = str(tmp_path / "old.pt")
    calls = _counting(monkeypatch, torch, "load")
    result = run_sdpa(SdpaOptions(q=spec, k=spec, v=spec))
    assert calls == ["cpu"]  # the guard counts its size on disk (no header), the run reads it whole, once
    assert torch.allclose(result.trace["out"], F.scaled_dot_product_attention(x, x, x), atol=1e-6)
    assert result.trace["Q"] is not result.trace["K"]


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors"])
def test_other_formats_read_each_tensor_once(tmp_path, monkeypatch, suffix):
    """Their headers parsed once and each tensor's data read once: three flags hold one copy, as three tensors."""
    from attnscope.tensors import load as load_module

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(11))
    path = tmp_path / f"x{suffix}"
    if suffix == ".npy":
        np.save(path, x.numpy())
    elif suffix == ".npz":
        np.savez(path, x=x.numpy())
    else:
        save_file({"x": x}, path)
    headers: list[Path] = []
    real = load_module.READERS[suffix]
    monkeypatch.setitem(load_module.READERS, suffix, lambda path: headers.append(path) or real(path))
    with one_read():
        tensors = [load_tensor(str(path)) for _ in range(3)]
    assert len(headers) == 1 and all(torch.equal(t, x) for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # read once: one copy of the data
    assert tensors[0] is not tensors[1]
    outside = [load_tensor(str(path)) for _ in range(2)]  # no command around them: each load reads the file again
    assert len(headers) == 3 and all(torch.equal(t, x) for t in outside)
    assert outside[0].untyped_storage().data_ptr() != outside[1].untyped_storage().data_ptr()  # nothing kept


def test_the_guard_counts_a_file_named_twice_once(tmp_path, monkeypatch):
    """`--q x.pt --k ./x.pt`: one file, read once, held once: counted once against the memory left."""
    from attnscope.runs.memory import guard_files

    x = _saved(tmp_path / "x.pt", 12, (4, 64, 64))
    _saved(tmp_path / "y.pt", 13, (4, 64, 64))
    size = x.numel() * x.element_size()
    monkeypatch.chdir(tmp_path)
    with one_read():
        guard_files(["x.pt", "./x.pt", str(tmp_path / "x.pt")], int(1.5 * size))
        with pytest.raises(ResourceError, match="the input files hold"):
            guard_files(["x.pt", "y.pt"], int(1.5 * size))


def test_on_the_command_line_one_file_three_times_is_read_once(tmp_path, monkeypatch):
    """`attnscope sdpa --q x.pt --k x.pt --v x.pt --check --values --json` as a shell runs it (cli.main): exit 0,
    one unpickling, `out` as PyTorch's, --check passing."""
    from cli_main import run_main

    x = _saved(tmp_path / "x.pt", 14, (1, 4, 8))
    spec = str(tmp_path / "x.pt")
    calls = _counting(monkeypatch, torch, "load")
    outcome = run_main("sdpa", "--q", spec, "--k", spec, "--v", spec, "--check", "--values", "--json")
    assert outcome.code == 0, outcome.stderr
    assert calls == ["meta"]
    data = outcome.json()
    assert isinstance(data, dict) and data["check"] and all(c["passed"] for c in data["check"])
    out = next(t for t in data["tensors"] if t["name"] == "out")
    assert torch.allclose(torch.tensor(out["values"]), F.scaled_dot_product_attention(x, x, x), atol=1e-6)
