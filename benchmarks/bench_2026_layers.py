"""One 2026 layer at 2,048 tokens against transformers' whole eager forward of the same model (issue 44, goal 4):
a linear (gated DeltaNet) layer of a Qwen3-Next-shaped model and an indexer layer of a DeepSeek-V3.2-shaped one,
both random (tests' recipes: tests/tiny_linear.py, tests/tiny_indexer.py, every weight drawn off its init) at
sizes of a few tens of millions of parameters, built once into a cache folder.

    python benchmarks/bench_2026_layers.py [--runs 3] [--tokens 2048] [--only linear|indexer]

- attnscope: `attnscope head --model FOLDER --layer L --text TEXT` (layer 0: a linear layer, its exact matrix M
  and the check of M @ V against the recurrence; DeepSeek's layer 1: the first with experts, its indexer);
- transformers: `AutoModelForCausalLM.from_pretrained(FOLDER, attn_implementation="eager")`, the tokenizer, and
  the whole forward on the same text (no output_attentions: a linear layer has no attention weights to give).
Each command a fresh process, in turns, median of the runs (_measure.py). Target: attnscope <= 0.5x the wall.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

TARGET = 0.5
CACHE = Path("/tmp/attnscope-bench-2026")
TESTS = Path(__file__).parents[1] / "tests"
# name -> (builder code run in a subprocess: argv folder; the layer shown)
BUILD = {
    "linear": (f"""
import sys; sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
import tiny_linear
tiny_linear.build("qwen3_next", Path(sys.argv[1]), hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                  max_position_embeddings=4096, num_hidden_layers=8,
                  layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                  + ["full_attention"])
""", 0),
    "indexer": (f"""
import sys; sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
import tiny_indexer
tiny_indexer.build(Path(sys.argv[1]), "v32", hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                   num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256,
                   q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                   max_position_embeddings=4096, index_topk=256, index_head_dim=64, index_n_heads=8)
""", 1),
}
TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
logging.set_verbosity_error()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager").eval()
with torch.no_grad():
    model(**tokenizer(open(sys.argv[2]).read(), return_tensors="pt"))
"""
# argv folder, tokens wanted, text file to write: words added until the tokenizer counts that many tokens
TEXT = """
import sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
words = "the quick brown fox jumps over the lazy dog while a cat sleeps on the warm mat by the door".split()
text, i = "", 0
while len(tokenizer(text)["input_ids"]) < int(sys.argv[2]):
    text += (" " if text else "") + words[i % len(words)]
    i += 1
while len(tokenizer(text)["input_ids"]) > int(sys.argv[2]):
    text = text[:-1]
open(sys.argv[3], "w").write(text)
print(len(tokenizer(text)["input_ids"]))
"""
PARAMS = """
import math, sys
from pathlib import Path
from safetensors import safe_open
total = 0
for path in Path(sys.argv[1]).glob("*.safetensors"):
    with safe_open(path, "pt") as tensors:
        total += sum(math.prod(tensors.get_slice(key).get_shape()) for key in tensors.keys())
print(total)
"""


def prepare(name: str, tokens: int) -> tuple[Path, Path, int, str]:
    code, layer = BUILD[name]
    folder = CACHE / name
    if not (folder / "config.json").exists():
        python_output(code, str(folder))
    text = CACHE / f"{name}-{tokens}.txt"
    counted = python_output(TEXT, str(folder), str(tokens), str(text))
    params = int(python_output(PARAMS, str(folder)))
    return folder, text, layer, f"{params / 1e6:.0f}M parameters, {counted} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--only", choices=list(BUILD))
    args = parser.parse_args()
    attnscope = str(Path(PYTHON).with_name("attnscope"))
    commands, about = {}, {}
    for name in [args.only] if args.only else list(BUILD):
        folder, text, layer, about[name] = prepare(name, args.tokens)
        commands[f"{name}: transformers"] = [PYTHON, "-c", TRANSFORMERS, str(folder), str(text)]
        commands[f"{name}: attnscope"] = [attnscope, "head", "--model", str(folder), "--layer", str(layer),
                                          "--text", text.read_text()]
    got = interleaved_medians(commands, args.runs, warmup=args.warmup)
    print(f"{machine()}; median of {args.runs} runs")
    for name, what in about.items():
        base, ours = got[f"{name}: transformers"], got[f"{name}: attnscope"]
        ratio = ours.seconds / base.seconds
        print(f"{name} ({what}): transformers {base.seconds:.2f} s {base.peak_mib:.0f} MiB, attnscope "
              f"{ours.seconds:.2f} s {ours.peak_mib:.0f} MiB: {ratio:.2f}x (<= {TARGET}x: "
              f"{'met' if ratio <= TARGET else 'MISSED'})")


if __name__ == "__main__":
    main()
