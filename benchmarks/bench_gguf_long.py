"""Every layer on a long text, on the GGUF file the tests use (issue 44, goal 3): SmolLM2-135M-Instruct, Q4_1.

    python benchmarks/bench_gguf_long.py [--runs 3] [--words 1000] [--warmup 0] [--at COMMIT] [--before COMMIT]

- attnscope: `attnscope head --model FILE --layer 1 --head 0 --text-file TEXT --all-layers` (the terminal's
  view: every layer's heads, their kinds, the sinks grid and the rollout's last row, each layer read as it comes
  and let go: runs/streamed_layers.py; --json is not timed: it writes every layer's every weight, 30 x 9 x 1,230²
  numbers, some 4 GB of text);
- transformers: `AutoTokenizer` and `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` (eager; the
  whole file dequantized first), then the forward with `output_attentions=True` on the same text.
Targets: attnscope's terminal view <= 0.5x the wall of transformers, in <= 1 GiB. The text: `--words` words drawn
from a fixed vocabulary with a fixed seed (1,000 words are 1,230 tokens with SmolLM2's tokenizer), written once.
Each command runs as a fresh process, in turns (see _measure.py); medians of wall time and peak RSS. `--at`: the
package at that commit (`git archive`, first on PYTHONPATH) in place of this tree's (a tree others are editing need
not run); `--before`: the same command on the package at that commit too, in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, copy_package, interleaved_medians, machine, python_output  # noqa: E402
from bench_gguf import TRANSFORMERS, smollm2  # noqa: E402

VOCABULARY = ("the capital of France is Paris and the capital of Italy is Rome while a river runs through each "
              "city and people walk along its banks in the evening talking about history art food and the "
              "weather Mediterranean archaeologists Renaissance cathedral boulevard aqueduct Lombardy Provence "
              "sculptures").split()
TARGET = (0.5, 1024)  # x wall of transformers, MiB

# transformers' GGUF route on a text file: argv folder, file name, text file (TRANSFORMERS reads argv[3] as text)
TRANSFORMERS_FILE = TRANSFORMERS.replace("sys.argv[3]", "open(sys.argv[3]).read()")
COUNT = """
import sys
from transformers import AutoTokenizer
print(len(AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])(open(sys.argv[3]).read())["input_ids"]))
"""


def text_file(words: int) -> Path:
    """`words` words of VOCABULARY, drawn with seed 0, a comma after every 11th and a full stop after every 25th
    (1,000 words: 1,230 tokens)."""
    path = Path(tempfile.gettempdir()) / f"attnscope-bench-gguf-{words}-words.txt"
    if not path.is_file():
        draw = random.Random(0)
        path.write_text(" ".join(draw.choice(VOCABULARY) + ("," if i % 11 == 10 else "") + ("." if i % 25 == 24 else "")
                                 for i in range(words)))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--words", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=0, help="runs of each command not counted (cold caches)")
    parser.add_argument("--at", metavar="COMMIT", help="time the package at COMMIT in place of this tree's")
    parser.add_argument("--before", metavar="COMMIT", help="also time the package at COMMIT, in the same rounds")
    args = parser.parse_args()
    with TemporaryDirectory() as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, tmp: Path) -> None:
    path, text = smollm2(), text_file(args.words)
    tokens = python_output(COUNT, str(path.parent), path.name, str(text))
    attnscope = str(Path(PYTHON).with_name("attnscope"))
    ours = [attnscope, "head", "--model", str(path), "--layer", "1", "--head", "0", "--text-file", str(text),
            "--all-layers"]
    at = ["env", f"PYTHONPATH={copy_package(tmp / 'at', args.at)}"] if args.at else []
    commands = {"transformers": [PYTHON, "-c", TRANSFORMERS_FILE, str(path.parent), path.name, str(text)],
                "attnscope --all-layers": at + ours}
    if args.before:
        commands[f"attnscope at {args.before}"] = ["env", f"PYTHONPATH={copy_package(tmp / 'before', args.before)}",
                                                   *ours]
    before = os.getloadavg()
    got = interleaved_medians(commands, args.runs, warmup=args.warmup)
    load = ", ".join(f"{a:.1f}-{b:.1f}" for a, b in zip(before, os.getloadavg(), strict=True))
    print(f"{machine()}; {path.name}; {args.words} words, {tokens} tokens; median of {args.runs} runs; load "
          f"average (1, 5, 15 min) before-after: {load}")
    base = got["transformers"]
    print(f"{'':30} {'wall':>8} {'peak RSS':>10} {'x wall':>7} {'x memory':>9}")
    print(f"{'transformers':30} {base.seconds:7.2f}s {base.peak_mib:7.0f} MiB")
    if args.at:
        print(f"attnscope: the package at {args.at}")
    for name in [name for name in commands if name != "transformers"]:
        sample = got[name]
        met = "met" if sample.seconds / base.seconds <= TARGET[0] and sample.peak_mib <= TARGET[1] else "MISSED"
        print(f"{name:30} {sample.seconds:7.2f}s {sample.peak_mib:7.0f} MiB {sample.seconds / base.seconds:6.2f}x "
              f"{sample.peak_mib / base.peak_mib:8.2f}x  <= {TARGET[0]}x, <= {TARGET[1]} MiB: {met}")


if __name__ == "__main__":
    main()
