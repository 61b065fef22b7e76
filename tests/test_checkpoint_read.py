"""Checkpoint.tensor maps a safetensors tensor's own pages, privately (not through safetensors' map of the whole
file, whose pages would stay resident): it must give exactly what safetensors' own reader gives, for every dtype,
never write to the file, and refuse a truncated file in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnscope.errors import UsageError
from attnscope.models.checkpoint import Checkpoint


def test_whole_tensors_equal_safetensors_own_reader(tmp_path):
    tensors = {"a": torch.randn(7, 5), "b": torch.randn(3, 4).to(torch.bfloat16), "c": torch.randn(6).half(),
               "d": torch.arange(10, dtype=torch.int64).reshape(2, 5), "e": torch.tensor([True, False, True]),
               "f": torch.randn(2, 3, 4).double(), "g": torch.tensor(3.5), "h": torch.empty(0, 4)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with Checkpoint.open(tmp_path) as checkpoint, safe_open(str(tmp_path / "model.safetensors"), "pt") as theirs:
        for key in tensors:
            raw = checkpoint._read(key)
            assert raw.dtype == tensors[key].dtype and torch.equal(raw, theirs.get_tensor(key)), key
            assert checkpoint.tensor(key).dtype == torch.float32
            torch.testing.assert_close(checkpoint.tensor(key), theirs.get_tensor(key).float(), rtol=0, atol=0)


def test_truncated_file_is_one_line(tmp_path):
    save_file({"a": torch.randn(64, 64)}, tmp_path / "model.safetensors")
    with Checkpoint.open(tmp_path) as checkpoint:
        checkpoint.tensor("a")  # the header is read while the file is whole
        path = tmp_path / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
        with pytest.raises(UsageError, match="ends inside tensor a; the file is truncated"):
            checkpoint.tensor("a")


def test_a_tensor_written_to_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(3, 1000), "b": torch.zeros(5)}, path)
    before = path.read_bytes()
    with Checkpoint.open(tmp_path) as checkpoint:
        weight = checkpoint.tensor("a")
        weight.mul_(7)  # a family that scales a weight in place (a norm's 1 + w) writes its own copy
        assert torch.equal(weight, torch.full((3, 1000), 7.0))
        assert torch.equal(checkpoint.tensor("a"), torch.ones(3, 1000))
    assert path.read_bytes() == before


def test_a_downloaded_shard_index_is_read_or_refused_in_one_line(tmp_path):
    """hub's shard list (what to fetch next): the shards an index names, once each; an index that is not JSON,
    nested past any settings file, not an object or missing is one ResourceError naming it."""
    from attnscope.errors import ResourceError
    from attnscope.models.hub import _shards

    good = tmp_path / "model.safetensors.index.json"
    good.write_text('{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s1.safetensors"}}')
    assert _shards(good) == ["s1.safetensors", "s2.safetensors"]
    for name, text in (("bad", "not json"), ("deep", "[" * 100_000), ("list", "[1, 2]"), ("missing", None)):
        path = tmp_path / f"{name}.json"
        if text is not None:
            path.write_text(text)
        with pytest.raises(ResourceError, match=f"{name}.json: not a shard index"):
            _shards(path)
