"""A family attnscope has no page for, traced through transformers' attention interface with only layers 0..L
built and loaded (models/nopage/truncated.py), against transformers' whole model: from_pretrained, then
output_attentions, on the same checkpoint and text.

    python benchmarks/bench_interface.py [--runs 5]

The checkpoint: GPT-NeoX shaped as Pythia-410M (hidden 1024, 24 layers, 16 heads, intermediate 4096,
vocabulary 50304, partial rotary 0.25; 405M parameters, float32, random weights, 1.6 GB of safetensors shards),
written once to ~/.cache/attnscope-bench/pythia-410m-shaped, one shard in memory at a time. The race:
`attnscope head --layer 1 --head 0 --text ...` against `GPTNeoXForCausalLM.from_pretrained(attn_implementation=
"eager")` + `output_attentions=True`, fresh processes in turns (_measure.py), medians of wall time and peak RSS.
Before timing it checks once that both give the same pattern (max |diff| printed).
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

BUILD = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
config = GPTNeoXConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048, tie_word_embeddings=False)
with torch.device("meta"):
    shapes = {k: tuple(v.shape) for k, v in GPTNeoXForCausalLM(config).state_dict().items()}
groups = {}
for key in shapes:
    part = key.split(".")
    groups.setdefault(int(part[2]) // 4 if part[1] == "layers" else -1, []).append(key)
generator = torch.Generator().manual_seed(0)
weight_map, total = {}, 0
for i, (group, keys) in enumerate(sorted(groups.items())):
    name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    tensors = {k: (torch.ones(shapes[k]) if "norm.weight" in k else torch.randn(shapes[k], generator=generator) * 0.02)
               for k in keys}
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    total += sum(t.numel() * 4 for t in tensors.values())
    weight_map.update(dict.fromkeys(keys, name))
    del tensors
(folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
config.architectures = ["GPTNeoXForCausalLM"]
config.save_pretrained(folder)
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.train_from_iterator([sys.argv[2]] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
print(sum(torch.Size(s).numel() for s in shapes.values()))
"""


def pythia_shaped() -> Path:
    folder = CACHE / "pythia-410m-shaped"
    done = folder / ".complete"
    if not done.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"building a Pythia-410M-shaped GPT-NeoX checkpoint in {folder} (once) ...", file=sys.stderr)
        done.write_text(python_output(BUILD, str(folder), TEXT))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    attnscope = shutil.which("attnscope") or f"{Path(PYTHON).parent}/attnscope"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    folder = pythia_shaped()
    print(f"machine: {machine()}; median of {args.runs} runs after 1 warm-up, fresh process each\n")
    print("| checkpoint | route | median wall (s) | median peak RSS (MiB) | time ratio | memory ratio |")
    print("|---|---|---|---|---|---|")
    race(f"GPT-NeoX, Pythia-410M's shape ({(folder / '.complete').read_text().strip()} params), layer 1 head 0",
         [attnscope, "head", "--model", str(folder), "--layer", "1", "--head", "0", "--text", TEXT],
         [PYTHON, "-c", REFERENCE, str(folder), TEXT, "GPTNeoXForCausalLM", "1", "0"], args.runs, env,
         (None, 0.5))


if __name__ == "__main__":
    main()
