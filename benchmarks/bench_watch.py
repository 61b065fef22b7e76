"""attnscope.watch on a LLaMA-shaped model (issue 42), each mode in a fresh process, the modes in turns, the
median of --runs runs:

- plain:      the model on SDPA, one forward, unwatched;
- watch-one:  the same forward inside `watch(model, layers=[L])`, then layer L's every head made (seen.patterns);
- watch-all:  the same inside `watch(model)`, then every layer's heads made one layer at a time;
- eager:      transformers' route: the model loaded with attn_implementation="eager", one forward with
              output_attentions=True (every layer's `[n_head, N, N]` held).

Each child times its forward (and the patterns' making apart), and reports its own peak RSS (ru_maxrss) and its
RSS once the model is loaded, so the table gives both the peak and what the run added over the loaded model.

The model: by default the 1.1B LLaMA checkpoint bench_model_text.py builds once under ~/.cache/attnscope-bench
(4.4 GB; building it takes minutes), or `--model FOLDER` (a checkpoint built elsewhere by the same builder);
`--layers K` instead builds the same LLaMA shape (d_model 2048, 32 heads, 8 KV heads) with K layers in each child
from its config (random weights, nothing written), for a loaded machine. A checkpoint's safetensors are mapped,
not read, by from_pretrained: its weights enter the RSS as the forward first touches them, so "loaded" is small
there and what a mode adds is read against plain's peak (the same weights touched, nothing watched).
`--lock FILE` runs each child under `flock FILE` (one big model in memory at a time on a shared machine).

    .venv/bin/python benchmarks/bench_watch.py --layers 4 --tokens 512 --runs 3
    .venv/bin/python benchmarks/bench_watch.py --model /work/bench-models/llama-1.1b \
        --lock /work/bench-models/.run.lock --tokens 2048 --runs 3 --pairs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import PYTHON, machine  # noqa: E402

CHILD = """
import json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM

mode, source, tokens, layer, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
impl = "eager" if mode == "eager" else "sdpa"
if source.startswith("layers="):
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=int(source[7:]),
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM._from_config(config, attn_implementation=impl).eval()
else:
    model = LlamaForCausalLM.from_pretrained(source, attn_implementation=impl, dtype=torch.float32).eval()

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
loaded = rss()
patterns, same_process = 0.0, None
with torch.no_grad():
    if mode == "plain":
        start = time.perf_counter(); model(ids); forward = time.perf_counter() - start
    elif mode == "eager":
        start = time.perf_counter(); out = model(ids, output_attentions=True); forward = time.perf_counter() - start
        assert len(out.attentions) == model.config.num_hidden_layers
    else:
        from attnscope import watch
        asked = [layer] if mode == "watch-one" else None
        with watch(model, layers=asked) as seen:
            start = time.perf_counter(); model(ids); forward = time.perf_counter() - start
        if mode == "watch-one":  # and in this one process, unwatched and watched in turns: the load hits both
            walls = {"plain": [], "watched": []}
            for _ in range(pairs):
                start = time.perf_counter(); model(ids); walls["plain"].append(time.perf_counter() - start)
                with watch(model, layers=asked):
                    start = time.perf_counter(); model(ids); walls["watched"].append(time.perf_counter() - start)
            same_process = min(walls["watched"]) / min(walls["plain"])
        start = time.perf_counter()
        for number in seen.layers:
            seen.patterns(number)  # made, then let go: one layer's [n_head, N, N] at a time
        patterns = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"forward_s": forward, "patterns_s": patterns, "peak_mib": peak, "loaded_mib": loaded,
                  "same_process": same_process}))
"""

MODES = ("plain", "watch-one", "watch-all", "eager")


def child(mode: str, source: str, tokens: int, layer: int, pairs: int, lock: str | None) -> dict:
    start = time.perf_counter()
    command = [PYTHON, "-c", CHILD, mode, source, str(tokens), str(layer), str(pairs)]
    out = subprocess.run(["flock", lock, *command] if lock else command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {mode}: {time.perf_counter() - start:.0f} s, {got}", file=sys.stderr, flush=True)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="build the LLaMA shape with this many layers "
                        "in each child instead of loading the 1.1B checkpoint")
    parser.add_argument("--model", default=None, help="a LLaMA checkpoint folder to load (default: the 1.1B one "
                        "bench_model_text.py builds under ~/.cache/attnscope-bench)")
    parser.add_argument("--lock", default=None, help="run each child under `flock LOCK` (one big model in memory "
                        "at a time on a shared machine; the lock is let go between children)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layer", type=int, default=1, help="the one layer watch-one asks for")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2, help="watch-one's unwatched and watched forwards in turns "
                        "in its one process (the wall ratio)")
    args = parser.parse_args()
    if args.model is not None:
        config = json.loads((Path(args.model) / "config.json").read_text())
        source, label = args.model, f"LLaMA checkpoint {Path(args.model).name} ({config['num_hidden_layers']} layers)"
    elif args.layers is None:
        from bench_model_text import llama_1b

        source, label = str(llama_1b()), "LLaMA 1.1B checkpoint (16 layers)"
    else:
        source, label = f"layers={args.layers}", f"LLaMA 1.1B shape, {args.layers} layers"
    load = os.getloadavg()
    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.runs):  # the modes in turns: a slow moment of the machine hits them all alike
        for mode in MODES:
            samples[mode].append(child(mode, source, args.tokens, args.layer, args.pairs, args.lock))
    med = {mode: {key: statistics.median(s[key] or 0.0 for s in got) for key in got[0]} for mode, got in
           samples.items()}
    plain = med["plain"]
    print(f"{label}, {args.tokens} tokens, float32, median of {args.runs} fresh processes per mode; {machine()}; "
          f"load average (1 min) {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("| mode | forward s | x plain | patterns s | peak RSS MiB | x plain | added over loaded MiB |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        m = med[mode]
        print(f"| {mode} | {m['forward_s']:.2f} | {m['forward_s'] / plain['forward_s']:.2f}x | "
              f"{m['patterns_s']:.2f} | {m['peak_mib']:.0f} | {m['peak_mib'] / plain['peak_mib']:.2f}x | "
              f"{m['peak_mib'] - m['loaded_mib']:.0f} |")
    print(f"watch-one in one process, its fastest watched forward over its fastest unwatched one ({args.pairs} "
          f"each, in turns), median over the runs: {med['watch-one']['same_process']:.3f}x")
    print(f"watch-all peak / eager peak: {med['watch-all']['peak_mib'] / med['eager']['peak_mib']:.2f}x; "
          f"added over loaded: {(med['watch-all']['peak_mib'] - med['watch-all']['loaded_mib']):.0f} vs "
          f"{(med['eager']['peak_mib'] - med['eager']['loaded_mib']):.0f} MiB; added over plain's peak: "
          f"{med['watch-all']['peak_mib'] - plain['peak_mib']:.0f} vs "
          f"{med['eager']['peak_mib'] - plain['peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
