"""`attnscope head --layer 1 --text ...` on a Qwen3-0.6B-shaped checkpoint (its own forward: layers 0 and 1 only,
layer 1 traced) against transformers' `AutoModelForCausalLM.from_pretrained` + `output_attentions=True` on the same
checkpoint and text: the race of bench_model_text.py, on today's most downloaded decoder.

    python benchmarks/bench_qwen3_text.py [--runs 5] [--dtype bfloat16|float32]

The checkpoint has Qwen3-0.6B's config (28 layers, width 1024, 16 query and 8 key/value heads of 128, qk-norm,
151,936-token vocabulary, tied embeddings, RoPE base 1M) and random weights, in the dtype asked for (bfloat16, as
Qwen/Qwen3-0.6B ships, by default), written once to ~/.cache/attnscope-bench/qwen3-0.6b-<dtype> in shards, one
shard in memory at a time, with a small BPE tokenizer of Qwen2Tokenizer's class. transformers loads it in that
dtype (`dtype="auto"`, its default); attnscope computes in float32. Before timing, the race checks once that both
give the same pattern and prints the largest difference (bfloat16's precision on transformers' side).
Targets: <= 0.25x transformers' peak memory and <= 0.5x its time, medians of fresh processes run in turns.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, machine, python_output  # noqa: E402
from bench_model_text import CACHE, REFERENCE, TEXT, race  # noqa: E402

# Qwen/Qwen3-0.6B's config.json, weights drawn at random (std 0.02, norms at 1), saved shard by shard.
BUILD_QWEN3 = """
import json, sys, torch
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

folder, dtype = Path(sys.argv[1]), getattr(torch, sys.argv[2])
folder.mkdir(parents=True, exist_ok=True)
sys.path.insert(0, sys.argv[3])
from _checkpoint import write_random_shards

config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype=sys.argv[2])
params = write_random_shards(folder, Qwen3ForCausalLM, config, layers_per_shard=7, dtype=dtype)
config.architectures = ["Qwen3ForCausalLM"]
config.save_pretrained(folder)
corpus = ["The cat sat on the mat because it was tired, and the dog ran after it."] * 10
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
spec = json.loads(bpe.to_str())["model"]
merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
Qwen2Tokenizer(vocab=spec["vocab"], merges=merges).save_pretrained(folder)
print(params)
"""


def qwen3_06b(dtype: str) -> Path:
    folder = CACHE / f"qwen3-0.6b-{dtype}"
    done = folder / ".complete"
    if not done.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"building a Qwen3-0.6B-shaped checkpoint ({dtype}) in {folder} (once) ...", file=sys.stderr)
        done.write_text(python_output(BUILD_QWEN3, str(folder), dtype, str(Path(__file__).parent)))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    folder = qwen3_06b(args.dtype)
    print(f"machine: {machine()}; median of {args.runs} runs after 1 warm-up, fresh process each\n")
    print("| checkpoint | route | median wall (s) | median peak RSS (MiB) | time ratio | memory ratio |")
    print("|---|---|---|---|---|---|")
    params = int((folder / ".complete").read_text())
    race(f"Qwen3-0.6B-shaped ({params / 1e6:.0f}M params, {args.dtype}), layer 1 head 0",
         [attnscope, "head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT],
         [PYTHON, "-c", REFERENCE, str(folder), TEXT, "AutoModelForCausalLM", "1", "0"], args.runs, env, (0.5, 0.25))


if __name__ == "__main__":
    main()
