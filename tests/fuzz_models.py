"""Model folders for the fuzzed command line (tests/test_fuzz_cli.py): good ones of several families, and the
broken ones issue 18 found: config.json damaged, absurd or nested deep, a folder asking to run its own code
(config.json's or tokenizer_config.json's `auto_map`), weights that disagree with their config, a config of
another family on BERT weights; a vision tower (tests/tiny_vision.py) with pictures good and bad (truncated, not
an image, a header declaring past Pillow's bomb limit). `head_argv` draws `attnscope head` invocations over them,
and COLUMNS values (sensible and nonsense) are drawn for every invocation.

A folder's own code, if it ever ran, would write RAN beside itself: the fuzz asserts it never does.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

from hypothesis import strategies as st

EVIL = """import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("the folder's own code ran")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evilnet"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""

# name -> (the good folder it is made from, what to do to its config.json: a dict to merge, or raw text)
BROKEN = {
    "not_json": ("llama", "{not json"),
    "a_list": ("llama", "[1, 2]"),
    "nested_deep": ("llama", "[" * 100_000 + "]" * 100_000),
    "nested_past_bound": ("bert", {"extra": json.loads('{"a":' * 100 + "1" + "}" * 100)}),
    "no_heads": ("llama", {"num_attention_heads": None}),
    "heads_as_text": ("llama", {"num_attention_heads": "4"}),
    "zero_heads": ("gpt2", {"n_head": 0}),
    "layers_1e12": ("llama", {"num_hidden_layers": 10**12}),
    "heads_1e30": ("bert", {"num_attention_heads": 10**30}),
    "width_2e40": ("gemma2", {"hidden_size": 2**40}),
    "vocab_1e10": ("gpt2", {"vocab_size": 10**10}),
    "beyond_int64": ("bert", {"pad_token_id": 2**64}),
    "more_layers": ("llama", {"num_hidden_layers": 5}),
    "kv_not_dividing": ("llama", {"num_key_value_heads": 3}),
    "rope_unknown": ("llama", {"rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}),
    "act_unknown": ("llama", {"hidden_act": "mish"}),
    # weights that disagree with their config
    "head_dim_wrong": ("gemma2", {"head_dim": 8}),
    "kv_heads_wrong": ("llama", {"num_key_value_heads": 1}),
    "width_wrong": ("llama", {"hidden_size": 48}),
    "gpt2_width_wrong": ("gpt2", {"n_embd": 32}),
    "t5_on_bert": ("bert", {"model_type": "t5", "architectures": ["T5Model"]}),
    # a folder asking to run its own code
    "remote_config": ("bert", {"model_type": "evilnet", "architectures": ["EvilModel"],
                               "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}}),
    "remote_tokenizer": ("bert", "tokenizer"),
}
GOOD = ("bert", "gpt2", "llama", "gemma2")
TEXTS = ["The cat sat on the mat.", "the dog ran " * 4]
BAD_TEXTS = ["", "caf\udce9", "x" * 3]
COLUMNS = ["80", "80", "80", "100", "0", "-1", "abc", "", "100000", "20", "5", "1000"]


def write_model_corpus(root: Path) -> dict[str, Path]:
    """Every folder of GOOD (tiny random models, tests/tiny_models.py) and BROKEN, by name; the vision tower
    `vit` and the pictures, `image:NAME`."""
    from tiny_models import build
    from tiny_vision import build as build_tower
    from tiny_vision import draw

    folders = {}
    for family in GOOD:
        folders[family] = root / family
        build(family, folders[family])
    for name, (source, change) in BROKEN.items():
        folder = root / name
        shutil.copytree(folders[source], folder)
        folders[name] = folder
        config = folder / "config.json"
        if change == "tokenizer":
            path = folder / "tokenizer_config.json"
            settings = json.loads(path.read_text())
            settings |= {"tokenizer_class": "EvilTokenizer",
                         "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}
            path.write_text(json.dumps(settings))
        elif isinstance(change, str):
            config.write_text(change)
        else:
            merged = json.loads(config.read_text()) | change
            config.write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
        (folder / "evil.py").write_text(EVIL)
    build_tower("vit", root / "vit")
    folders["vit"] = root / "vit"
    pictures = root / "pictures"
    pictures.mkdir()
    good = draw(pictures / "cat.png").read_bytes()
    header = b"IHDR" + struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)  # 10^10 pixels declared
    bomb = (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + header + struct.pack(">I", zlib.crc32(header))
            + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))
    for name, data in (("cat.png", good), ("cut.png", good[: len(good) // 2]), ("text.png", b"not a picture"),
                       ("bomb.png", bomb)):
        (pictures / name).write_bytes(data)
        folders[f"image:{name}"] = pictures / name
    return folders


def ran_code(folders: dict[str, Path]) -> list[Path]:
    return [folder / "RAN" for folder in folders.values() if (folder / "RAN").exists()]


@st.composite
def head_argv(draw, folders: dict[str, Path], sometimes, pick):
    """`attnscope head` on a good folder most of the time, a broken one often; good positions mostly."""
    name = draw(st.sampled_from([*GOOD, *BROKEN, "vit", "vit", "vit"]))
    argv = ["head", "--model", str(folders[name]), "--layer", pick(draw, ["0", "1"], ["3", "-1", "99"]),
            "--head", pick(draw, ["0", "3"], ["4", "-1", "999"])]
    if name == "vit" or sometimes(draw, 12):  # a picture, good most of the time for the tower
        image = pick(draw, ["cat.png"], ["cut.png", "text.png", "bomb.png"], odds=3)
        argv += ["--image", str(folders[f"image:{image}"])] if name != "vit" or not sometimes(draw, 8) else []
        argv += ["--query", pick(draw, ["p(1,2)", "0"], ["p(9,9)", "99"], odds=3)] if sometimes(draw) else []
        argv += ["--all-layers"] if sometimes(draw) else []
    if sometimes(draw, 2) or name.startswith("remote"):
        argv += ["--text", pick(draw, TEXTS, BAD_TEXTS, odds=6)]
        argv += ["--all-heads"] if sometimes(draw, 4) else []
    return argv + (["--json"] if sometimes(draw, 3) else [])
