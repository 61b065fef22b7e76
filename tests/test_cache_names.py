"""A forward's cache under the name the installed transformers gives it (models/nopage/cache_names.py): `cache`
from transformers 5.2x, `past_key_values` before (removed in 5.40)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnscope.models.nopage.cache_names import cache_keyword, cache_of


class Old(torch.nn.Module):
    def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> None: ...


class New(torch.nn.Module):
    def forward(self, input_ids: Any = None, cache: Any = None, use_cache: bool = False) -> None: ...


@dataclass
class OldOutput:
    past_key_values: Any = None


@dataclass
class NewOutput:
    cache: Any = None


def test_the_name_the_forward_takes_and_returns() -> None:
    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    held = object()
    assert cache_of(OldOutput(held)) is held and cache_of(NewOutput(held)) is held
    assert cache_of(object()) is None


def test_the_installed_release_decodes_with_it_without_a_deprecation_warning(recwarn: Any) -> None:
    """One greedy step of transformers' own LLaMA over the cache its prompt returned, handed back under the name
    asked: the same logits as the whole sequence at once, and no FutureWarning about the name."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50)
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], **{cache_keyword(model): cache_of(out)}, use_cache=True)
        whole = model(input_ids=ids)
    torch.testing.assert_close(step.logits[0, -1], whole.logits[0, -1], atol=1e-5, rtol=1e-5)
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]
