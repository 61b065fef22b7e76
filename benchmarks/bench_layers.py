"""Across layers and at long context (docs/generation.md, docs/heads.md): three measurements.

    python benchmarks/bench_layers.py [--runs 3] [--only all-layers|long-tiny|long-1b] [--model DIR]
                                      [--at COMMIT] [--before COMMIT]

(`--model`: a 1.1B checkpoint already built, as bench_model_text.py builds it, in place of the cache's. `--at`:
the package at that commit (`git archive`) in place of this tree's, first on PYTHONPATH; `--before`: all-layers
also times the package at that commit in the same rounds. Each copy is compiled to bytecode first, as `pip install`
leaves a package and as torch's, transformers' and the floor's modules are: under PYTHONDONTWRITEBYTECODE=1 a copy
without it had its hundred modules compiled on every run, about 0.1 to 0.15 s of CPU; `--not-cached` keeps that
case.)

- all-layers: `attnscope head --all-layers` on the 1.1B LLaMA-shaped checkpoint of bench_model_text.py (every
  layer streamed), as the terminal's grid and as --json (every layer's every weight written), against
  transformers' from_pretrained + output_attentions=True on the same text; and the floor of any tool that shows
  every layer's attention: torch's, safetensors' and tokenizers' import and the model's own products with its
  weights (FLOOR), nothing else. Targets (issue 44): <= 0.15x peak memory, <= 0.45x wall time.
- long-tiny: a tiny LLaMA (2 layers of width 64, random weights, built once) on a 32,768-token text: attnscope's
  peak memory, whose target is 1.5 GiB (one head's whole pattern alone would be 4 GiB).
- long-1b: the 1.1B checkpoint on an 8,192-token text, head 0 of layer 1 in blocks and pooled, against
  transformers' sdpa forward of the same layers (layers 0 and 1, `num_hidden_layers=2`), memory and wall;
  the exact rows asked with --rows are checked against a float64 computation from transformers' own modules.
Each command runs as a fresh process, in turns (see _measure.py); medians of wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, copy_package, interleaved_medians, machine, medians, python_output  # noqa: E402
from bench_model_text import CACHE, REFERENCE, llama_1b  # noqa: E402

WORDS = "the cat sat on the mat because it was tired and the dog ran after it".split()
TEXT = " ".join(WORDS * 4)  # about 70 tokens: every layer's every head, 16 x 32 patterns

# transformers' forward of layers 0 and 1 with its sdpa attention (what a user runs for hidden states):
# argv: folder, text file.
SDPA_FORWARD = """
import sys, torch, transformers
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], num_hidden_layers=2,
                                                          attn_implementation="sdpa").eval()
ids = tokenizer(open(sys.argv[2]).read(), return_tensors="pt")["input_ids"]
with torch.no_grad():
    model.model(ids)
print(ids.shape[1])
"""

# Exact rows of layer 1, head 0, in float64, from transformers' own modules: the layer's input caught by a hook,
# its q_proj/k_proj, rotary_emb, apply_rotary_pos_emb and repeat_kv. argv: folder, text file, first row, rows.
EXACT_ROWS = """
import sys, json, torch, transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
folder, text, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=2,
                                                          attn_implementation="sdpa").eval()
ids = tokenizer(open(text).read(), return_tensors="pt")["input_ids"]
caught = {}
attention = model.model.layers[1].self_attn
attention.register_forward_hook(lambda m, args, kwargs, out: caught.update(x=kwargs["hidden_states"]),
                                with_kwargs=True)
with torch.no_grad():
    model.model(ids)
    x, n = caught["x"].double(), ids.shape[1]
    d = attention.head_dim
    q = (x @ attention.q_proj.weight.double().T).view(1, n, -1, d).transpose(1, 2)
    k = (x @ attention.k_proj.weight.double().T).view(1, n, -1, d).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x.float(), torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    scores = q[0, 0, first:first + count] @ k[0, 0].T / d ** 0.5  # [count, n]
    position = torch.arange(first, first + count)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None] > position, float("-inf"))
print(json.dumps(torch.softmax(scores, dim=-1).tolist()))
"""

# The floor of any tool that shows every layer's attention (issue 44, goal 1): start Python, import torch,
# safetensors and tokenizers, tokenize the text, and make the model's own products with its weights, read from
# the checkpoint as safetensors maps them: each layer's q, k, v, o, gate, up and down projections on n tokens (the
# last layer's q, k and v only: nothing reads its output), in float32 on torch's threads. No norm, no RoPE, no
# attention, no readings, no output. argv: folder, n_tokens, text.
FLOOR = """
import json, sys, torch, safetensors, tokenizers
from pathlib import Path
from safetensors import safe_open
folder, n = Path(sys.argv[1]), int(sys.argv[2])
tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(sys.argv[3])
n_layer = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
handles = [safe_open(str(file), framework="pt") for file in sorted(folder.glob("*.safetensors"))]
where = {key: handle for handle in handles for key in handle.keys()}
with torch.no_grad():
    for layer in range(n_layer):
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        if layer < n_layer - 1:
            names += ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        for name in names:
            key = f"model.layers.{layer}.{name}.weight"
            weight = where[key].get_tensor(key)
            torch.nn.functional.linear(torch.ones(1, n, weight.shape[1]), weight)
"""

BUILD_TINY = """
import json, sys, torch
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

folder = Path(sys.argv[1])
corpus = [sys.argv[2]] * 10
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.Metaspace()
bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
spec = json.loads(bpe.to_str())["model"]
merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
tokenizer = LlamaTokenizer(vocab=spec["vocab"], merges=merges, add_bos_token=True)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=65536)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(folder)
tokenizer.save_pretrained(folder)
"""


def text_file(tokens: int) -> Path:
    """A text of about `tokens` tokens (one word is one token for these tokenizers), written once."""
    path = CACHE / f"text-{tokens}.txt"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(tokens - 2)))
    return path


def tiny_llama() -> Path:
    folder = CACHE / "llama-tiny-64k"
    if not (folder / "config.json").is_file():
        python_output(BUILD_TINY, str(folder), " ".join(WORDS))
    return folder


def row(label: str, route: str, seconds: float, mib: float, ratios: str = "") -> None:
    print(f"| {label} | {route} | {seconds:.2f} | {mib:.0f} | {ratios} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=("all-layers", "long-tiny", "long-1b"))
    parser.add_argument("--model", type=Path, help="the 1.1B checkpoint's folder (default: built once in the cache)")
    parser.add_argument("--at", metavar="COMMIT", help="time the package at COMMIT in place of this tree's")
    parser.add_argument("--before", metavar="COMMIT", help="all-layers: also time the package at COMMIT")
    parser.add_argument("--not-cached", action="store_true",
                        help="leave the copies of --at and --before without bytecode (compiled on every run where "
                        "PYTHONDONTWRITEBYTECODE is set)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, tmp: Path) -> None:
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    def copy(into: Path, commit: str) -> str:
        folder = copy_package(into, commit)
        if not args.not_cached:  # as an installed package: its bytecode written once (see the docstring)
            subprocess.run([PYTHON, "-m", "compileall", "-q", folder], check=True, capture_output=True)
        return folder

    if args.at:
        env["PYTHONPATH"] = copy(tmp / "at", args.at)
    before = ["env", f"PYTHONPATH={copy(tmp / 'before', args.before)}"] if args.before else []
    cached = "" if not (args.at or args.before) else (
        "; the copies without bytecode" if args.not_cached else "; the copies compiled to bytecode first")
    print(f"machine: {machine()}; median of {args.runs} runs after 1 warm-up, fresh process each{cached}\n")
    print("| measurement | route | median wall (s) | median peak RSS (MiB) | ratios (time, memory) |")
    print("|---|---|---|---|---|")
    if args.only in (None, "all-layers"):
        folder = args.model or llama_1b()
        ours = [attnscope, "head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT,
                "--all-layers", "--json"]
        reference = [PYTHON, "-c", REFERENCE, str(folder), TEXT, "AutoModelForCausalLM", "1", "0"]
        mine = json.loads(subprocess.run(ours, capture_output=True, text=True, env=env, check=True).stdout)
        theirs = json.loads(subprocess.run(reference, capture_output=True, text=True, env=env, check=True).stdout)
        diff = max(abs(a - b) for ra, rb in zip(mine["all_layers"][1]["attention"][0], theirs, strict=True)
                   for a, b in zip(ra, rb, strict=True))
        n_tokens = len(mine["token_ids"])
        floor = [PYTHON, "-c", FLOOR, str(folder), str(n_tokens), TEXT]
        commands = {"attnscope": ours[:-1], "attnscope --json": ours, "transformers": reference,
                    "floor: import + the products": floor}
        if before:
            commands.update({f"attnscope at {args.before}": before + ours[:-1],
                             f"attnscope --json at {args.before}": before + ours})
        got = interleaved_medians(commands, runs=args.runs, env=env)
        t = got["transformers"]
        label = f"--all-layers, LLaMA 1.1B, {n_tokens} tokens"
        for route in (name for name in commands if name != "transformers"):  # the grid; every weight as JSON
            a = got[route]
            said = "(no tool can go below it)" if route.startswith("floor") else "(targets 0.45x, 0.15x)"
            row(label, route, a.seconds, a.peak_mib, f"{a.seconds / t.seconds:.2f}x, {a.peak_mib / t.peak_mib:.2f}x "
                + said)
        row(label, "transformers", t.seconds, t.peak_mib, f"layer 1 head 0 agrees to {diff:.1e}")
    if args.only in (None, "long-tiny"):
        folder, text = tiny_llama(), text_file(32768)
        ours = [attnscope, "head", "--model", str(folder), "--layer", "1", "--head", "0", "--text-file", str(text)]
        alone = medians(ours + ["--json"], runs=args.runs, env=env)
        n = len(json.loads(subprocess.run(ours + ["--json"], capture_output=True, text=True, env=env,
                                          check=True).stdout)["token_ids"])
        row(f"a tiny LLaMA at {n:,} tokens, layer 1 head 0", "attnscope", alone.seconds, alone.peak_mib,
            "target: under 1536 MiB")
    if args.only in (None, "long-1b"):
        folder, text = args.model or llama_1b(), text_file(8192)
        first, count = 4000, 4
        ours = [attnscope, "head", "--model", str(folder), "--layer", "1", "--head", "0", "--text-file", str(text),
                "--rows", f"{first}:{first + count}", "--json"]
        mine = json.loads(subprocess.run(ours, capture_output=True, text=True, env=env, check=True).stdout)
        exact = json.loads(python_output(EXACT_ROWS, str(folder), str(text), str(first), str(count)))
        diff = max(abs(a - b) for ra, rb in zip(mine["rows"]["attention"], exact, strict=True)
                   for a, b in zip(ra, rb, strict=True))
        reference = [PYTHON, "-c", SDPA_FORWARD, str(folder), str(text)]
        got = interleaved_medians({"attnscope": ours, "transformers": reference}, runs=args.runs, env=env)
        a, t = got["attnscope"], got["transformers"]
        label = f"LLaMA 1.1B at {len(mine['token_ids']):,} tokens, layer 1 head 0"
        row(label, "attnscope (blocks, pooled)", a.seconds, a.peak_mib,
            f"{a.seconds / t.seconds:.2f}x, {a.peak_mib / t.peak_mib:.2f}x")
        row(label, "transformers sdpa, layers 0-1", t.seconds, t.peak_mib,
            f"rows {first}-{first + count - 1} against float64: max abs diff {diff:.1e}")


if __name__ == "__main__":
    main()
