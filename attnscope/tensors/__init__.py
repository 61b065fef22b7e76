"""Tensor files: reading one tensor (.npy .npz .safetensors .pt/.pth) from its header first, saving many
atomically, and statistics of a tensor of any size. Errors are one line a user can act on.

Modules: formats (each format's header: names, shapes, dtypes, sizes), load (`load_tensor`), save
(`save_tensors`, `check_writable`, and `write_text` for the --svg/--html exports), stats (`tensor_stats`, `preview`).
"""

from attnscope.tensors.formats import HeaderUnreadable
from attnscope.tensors.load import LOAD_FORMATS, load_tensor, split_spec
from attnscope.tensors.save import SAVE_FORMATS, check_writable, save_tensors, write_text
from attnscope.tensors.stats import STATS_CHUNK, preview, tensor_stats

__all__ = ["LOAD_FORMATS", "HeaderUnreadable", "SAVE_FORMATS", "STATS_CHUNK", "check_writable", "load_tensor",
           "preview", "save_tensors", "split_spec", "tensor_stats", "write_text"]
