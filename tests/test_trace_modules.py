"""`attnscope trace` on attention as today's code writes it (issue 23): nanoGPT's fused projection, LLaMA-style
grouped-query attention with RoPE, F.scaled_dot_product_attention and nn.MultiheadAttention inside a module,
decoders that mask by themselves, masks in every convention, dropout in training mode. Each correct module
exits 0, each with a planted bug exits 1 at the right step with the right diagnosis.

The modules are written here as their authors write them. That the correct ones are correct is checked against
references that share no code with attnscope: torch.nn.MultiheadAttention and F.scaled_dot_product_attention
holding the same weights, and transformers' own LlamaAttention (eager), LlamaRotaryEmbedding,
apply_rotary_pos_emb and repeat_kv.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import line_of, trace, user_module, write

from attnscope.cli import app

DOCS = Path(__file__).resolve().parent.parent / "docs" / "examples"
NANOGPT = (DOCS / "nanogpt.py").read_text()  # nanoGPT's model.py, its config and CausalSelfAttention, unchanged
GPT = "--init", "config=GPTConfig(n_embd=64, n_head=4)"


def nanogpt(tmp_path, old: str = "", new: str = "", flash: bool = True) -> str:
    body = NANOGPT.replace(old, new) if old else NANOGPT
    assert not old or old in NANOGPT, old
    if not flash:
        body = body.replace("self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')",
                            "self.flash = False")
    path = tmp_path / "model.py"
    path.write_text(body)
    return f"{path}:CausalSelfAttention"


def no_vague_dims(out) -> list[str]:
    return [f"{s['name']} {s['dims']}" for s in out["steps"] if any("|" in d or "?" in d for d in s["dims"])]


# --- nanoGPT: a fused projection, a config dataclass, F.scaled_dot_product_attention or its own mask --------------


@pytest.mark.parametrize("flash", [True, False])
def test_nanogpt_aligns_and_is_nn_multiheadattention_with_its_weights(tmp_path, runner, flash):
    target = nanogpt(tmp_path, flash=flash)
    result, out = trace(runner, target, *GPT, "--causal")
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row for row in out["alignment"]}
    assert {row["status"] for row in rows.values()} == {"equal"}, rows
    assert "c_attn[0:64]" in out["reference"] and "o=c_proj" in out["reference"]
    assert "split as its output is split at line" in out["reference"]
    assert rows["attention"]["recomputed"] is flash and rows["x"]["recomputed"] is False
    assert out["params"]["init"] == {"config": "GPTConfig(n_embd=64, n_head=4)"}
    assert no_vague_dims(out) == []
    dims: dict[str, list[str]] = {}
    for step in out["steps"]:
        dims.setdefault(step["name"], step["dims"])  # the first tensor bound to each name
    assert dims["#0"] == ["n_batch", "n_Q", "3·d_feat"] and dims["k"] == ["n_batch", "n_K", "d_feat"]

    # independently: nanoGPT's module is torch.nn.MultiheadAttention holding c_attn and c_proj, causal
    module_file = user_module(target.rsplit(":", 1)[0])
    torch.manual_seed(0)
    module = module_file.CausalSelfAttention(module_file.GPTConfig(n_embd=64, n_head=4)).eval()
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(module.c_attn.weight)
        mha.in_proj_bias.copy_(module.c_attn.bias)
        mha.out_proj.weight.copy_(module.c_proj.weight)
        mha.out_proj.bias.copy_(module.c_proj.bias)
        x = torch.randn(2, 7, 64)
        causal = torch.ones(7, 7, dtype=torch.bool).triu(1)  # True = masked, nn.MultiheadAttention's way
        torch.testing.assert_close(module(x), mha(x, x, x, attn_mask=causal)[0], rtol=1e-5, atol=1e-5)


def test_nanogpt_without_causal_is_told_its_own_mask(tmp_path, runner):
    result, out = trace(runner, nanogpt(tmp_path), *GPT)
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "attention" and first["user"] == "(attention)"
    assert "your code masks by itself" in first["diagnosis"] and "causal mask (upper-left)" in first["diagnosis"]
    assert "describe it with --causal" in first["diagnosis"]
    assert first["line"] == 1 + next(i for i, text in enumerate(NANOGPT.splitlines())
                                     if "scaled_dot_product_attention(q, k, v" in text)


@pytest.mark.parametrize(("flash", "old", "new", "words"), [
    (False, "(1.0 / math.sqrt(k.size(-1)))", "(1.0 / k.size(-1))", "divided by d_head = 16, not √d_head"),
    (True, "is_causal=True)", "is_causal=True, scale=1.0)", "√16 = 4 = √d_head times too large"),
])
def test_nanogpt_with_a_planted_scale_bug_diverges_at_scores(tmp_path, runner, flash, old, new, words):
    result, out = trace(runner, nanogpt(tmp_path, old, new, flash), *GPT, "--causal")
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "scores" and words in first["diagnosis"], first
    assert first["user"] == ("(scores)" if flash else "att")


FUSED = """
class FusedGQA(nn.Module):
    '''One projection for q, k and v of grouped-query attention, split by widths (Mistral-style Wqkv).'''

    def __init__(self, d_model=64, n_heads=8, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.Wqkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model)

    def forward(self, x):
        b, n, _ = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.Wqkv(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, n, -1))


class NeoX(nn.Module):
    '''GPT-NeoX's query_key_value: per head, [n_head, 3, head_size].'''

    def __init__(self, hidden_size=48, num_attention_heads=4):
        super().__init__()
        self.num_attention_heads, self.head_size = num_attention_heads, hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, n, self.num_attention_heads, 3 * self.head_size)
        qkv = qkv.permute(0, 2, 1, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_size), dim=-1)
        return self.dense((w @ v).transpose(1, 2).reshape(b, n, -1))
"""


@pytest.mark.parametrize(("name", "words"), [("FusedGQA", "split as its output is split at line"),
                                             ("NeoX", "split per head, [n_head, 3, d_head]")])
def test_fused_projections_split_by_their_recorded_parts_or_per_head(tmp_path, runner, name, words):
    path = write(tmp_path, FUSED)
    result, out = trace(runner, f"{path}:{name}", *(["--causal"] if name == "FusedGQA" else []))
    assert result.exit_code == 0, result.output
    assert words in out["reference"]
    assert {row["status"] for row in out["alignment"]} <= {"equal", "permuted", "unseen"}
    if name == "FusedGQA":
        assert out["params"]["sizes"]["n_kv_head"] == 2
        rows = {row["reference"]: row["status"] for row in out["alignment"]}
        assert rows["K_rep"] == rows["V_rep"] == "unseen"  # enable_gqa repeats inside the kernel
    assert no_vague_dims(out) == []


# --- --init calls the file's own classes, nothing else -------------------------------------------------------


@pytest.mark.parametrize(("init", "message"), [
    ("config=GPTConfig(n_embd=64, n_head=torch.float32)", "attribute access (torch.float32) is not allowed"),
    ("config=nn.Transformer(2, 3)", "is called through an attribute"),
    ("config=dataclass(n_embd=64)", "dataclass is not one of its classes (model.py defines CausalSelfAttention, "
                                    "GPTConfig)"),
    ("config=GPTConfig(n_embd=64, n_head=5)", "AssertionError"),
    ("config=GPTConfig(n_embd=64, heads=4)", "TypeError"),
])
def test_init_refuses_what_is_not_a_call_of_its_own_classes(tmp_path, init, message):
    from cli_main import run_main

    outcome = run_main("trace", nanogpt(tmp_path), "--init", init)
    assert outcome.code == (1 if "Error" in message else 2), outcome.stderr  # a class of theirs raising: exit 1
    assert len(outcome.error_lines) == 1 and message in outcome.stderr, outcome.stderr


def test_init_names_a_config_class_when_the_constructor_needs_one(tmp_path):
    from cli_main import run_main

    outcome = run_main("trace", nanogpt(tmp_path))
    assert outcome.code == 2
    assert 'needs config: give it with --init "config=..., e.g. --init "config=GPTConfig(...)"' in outcome.stderr \
        or 'e.g. --init "config=GPTConfig(...)"' in outcome.stderr, outcome.stderr


# --- LLaMA-style: grouped-query attention and RoPE --------------------------------------------------------------

# LLMs-from-scratch's GroupedQueryAttention (ch05/07): RoPE tables passed in, a boolean mask True = masked,
# scores masked before they are scaled.
FROM_SCRATCH = """
def apply_rope(x, cos, sin):
    batch_size, num_heads, seq_len, head_dim = x.shape
    x1 = x[..., : head_dim // 2]
    x2 = x[..., head_dim // 2 :]
    cos = cos[:seq_len, :].unsqueeze(0).unsqueeze(0)
    sin = sin[:seq_len, :].unsqueeze(0).unsqueeze(0)
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rotated = (x * cos) + (rotated * sin)
    return x_rotated.to(dtype=x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, num_kv_groups):
        super().__init__()
        self.d_out, self.num_heads, self.num_kv_groups = d_out, num_heads, num_kv_groups
        self.head_dim = d_out // num_heads
        self.group_size = num_heads // num_kv_groups
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out, bias=False)

    def forward(self, x, mask, cos, sin):
        b, num_tokens, d_in = x.shape
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        keys = apply_rope(keys, cos, sin)
        queries = apply_rope(queries, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores = attn_scores.masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)
"""
SCRATCH = "--init", "d_in=64, d_out=64, num_heads=8, num_kv_groups=2", "--rope", "--causal"


def scratch(old: str = "", new: str = "") -> str:
    assert not old or old in FROM_SCRATCH, old
    return FROM_SCRATCH.replace(old, new) if old else FROM_SCRATCH


def transformers_attention(module, theta: float, names=("W_query", "W_key", "W_value", "out_proj")):
    """transformers' own LlamaAttention (eager) holding the module's weights, and its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, rope_theta=theta,
                         attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    attention = LlamaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for mine, theirs in zip(("q_proj", "k_proj", "v_proj", "o_proj"), names, strict=True):
            getattr(attention, mine).weight.copy_(module.get_submodule(theirs).weight)
    return attention, LlamaRotaryEmbedding(config)


def test_llama_style_gqa_with_rope_aligns_and_is_transformers_llama_attention(tmp_path, runner):
    path = write(tmp_path, scratch())
    result, out = trace(runner, f"{path}:GroupedQueryAttention", *SCRATCH)
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["Q_rot"] == rows["K_rot"] == rows["K_rep"] == rows["attention"] == rows["x"] == "equal"
    assert rows["scores"] == "unseen"  # masked before scaled: the scaled unmasked scores never exist
    assert out["params"]["sizes"]["n_kv_head"] == 2 and "n_kv_head=2" in out["reference"]
    assert any("True = masked out" in n for n in out["notes"])  # masked_fill(mask, ...) read as such
    cos = next(s for s in out["steps"] if s["name"] == "cos")
    assert cos["dims"] == ["n_K", "d_head"] and "half-split" in cos["op"]
    assert no_vague_dims(out) == []

    # independently: the module is transformers' LlamaAttention with the same weights (causal, rope_theta 10000)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    module_file = user_module(path)
    torch.manual_seed(0)
    module = module_file.GroupedQueryAttention(64, 64, 8, 2).eval()
    attention, rotary = transformers_attention(module, 10000.0)
    x = torch.randn(2, 7, 64)
    cos, sin = rotary(x, torch.arange(7)[None])
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        mine = module(x, torch.ones(7, 7, dtype=torch.bool).triu(1), cos[0], sin[0])
        torch.testing.assert_close(mine, attention(x, (cos, sin), causal)[0], rtol=1e-5, atol=1e-5)
        q = module.W_query(x).view(2, 7, 8, 8).transpose(1, 2)
        k = module.W_key(x).view(2, 7, 2, 8).transpose(1, 2)
        q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(repeat_kv(k_rot, 4), k_rot.repeat_interleave(4, dim=1))


# the tables' first halves turning the pairs (2i, 2i + 1): the code lays its half-split tables out interleaved
# itself (GLM's), a convention unless --rope-pairing half-split says its weights are laid out for half-split pairs
INTERLEAVED = """    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
    x_rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)"""
HALF_SPLIT_TURN = """    rotated = torch.cat((-x2, x1), dim=-1)
    x_rotated = (x * cos) + (rotated * sin)"""


@pytest.mark.parametrize(("old", "new", "step", "words", "asked"), [
    (HALF_SPLIT_TURN, INTERLEAVED, "Q_rot", "pairs RoPE's coordinates interleaved", ("--rope-pairing", "half-split")),
    ("keys = keys.repeat_interleave(self.group_size, dim=1)", "keys = keys.repeat(1, self.group_size, 1, 1)",
     "K_rep", "key/value heads repeated in the wrong order", ()),
])
def test_llama_style_planted_bugs_are_named(tmp_path, runner, old, new, step, words, asked):
    body = scratch(old, new)
    path = write(tmp_path, body)
    result, out = trace(runner, f"{path}:GroupedQueryAttention", *SCRATCH, *asked)
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert first["reference"] == step and words in first["diagnosis"], first


def test_llama_style_that_rotates_after_the_head_repeat_passes(tmp_path, runner):
    """Keys repeated for the query heads, then rotated (lit-gpt's order): RoPE turns every head alike, so the numbers
    are the reference's; a note, exit 0."""
    rotate_first = """        keys = apply_rope(keys, cos, sin)
        queries = apply_rope(queries, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)"""
    repeat_first = """        keys = keys.repeat_interleave(self.group_size, dim=1)
        keys = apply_rope(keys, cos, sin)
        queries = apply_rope(queries, cos, sin)"""
    path = write(tmp_path, scratch(rotate_first, repeat_first))
    result, out = trace(runner, f"{path}:GroupedQueryAttention", *SCRATCH)
    assert result.exit_code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert any("RoPE after the head repeat" in n and "not a mistake" in n for n in out["notes"]), out["notes"]


def test_llama_style_that_lays_its_tables_out_interleaved_passes(tmp_path, runner):
    """The same interleaved turn of the tables' first halves, no pairing asked: the code's convention (GLM's)."""
    path = write(tmp_path, scratch(HALF_SPLIT_TURN, INTERLEAVED))
    result, out = trace(runner, f"{path}:GroupedQueryAttention", *SCRATCH)
    assert result.exit_code == 0 and out["first_divergence"] is None, out["first_divergence"]
    assert any("which your code lays out interleaved itself" in n for n in out["notes"]), out["notes"]


# A LLaMA-style layer that makes its own RoPE tables from rope_theta, and takes a KV cache and the position of the
# first new token for a decode step (Meta's start_pos).
DECODER = """
class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, rope_theta=10000.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward(self, x, attention_mask=None, past_key_value=None, start_pos=0):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(start_pos, start_pos + n).float()
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = self.head_dim // 2
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))
"""
LAYER = "--init", "dim=64, n_heads=8, n_kv_heads=2"


def test_a_decode_step_with_a_cache_aligns_and_is_transformers_math(tmp_path, runner):
    path = write(tmp_path, DECODER)
    result, out = trace(runner, f"{path}:Attention", *LAYER, "--rope", "--cache", "5")
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["K_cat"] == rows["V_cat"] == rows["x"] == "equal" and rows["attention"] == "equal"
    sizes = out["params"]["sizes"]
    assert sizes["n_cache"] == 5 and sizes["n_K"] == 5 + sizes["n_Q"]
    assert "causal lower-right" in out["reference"] and "after 5 cached positions" in out["reference"]
    assert no_vague_dims(out) == []

    # independently: the decode step is transformers' apply_rotary_pos_emb at positions 5.., the cache in front,
    # repeat_kv, and F.scaled_dot_product_attention with the lower-right causal mask
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    module_file = user_module(path)
    torch.manual_seed(0)
    module = module_file.Attention(64, 8, 2).eval()
    attention, rotary = transformers_attention(module, 10000.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    x, cached = torch.randn(2, 3, 64), (torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    allowed = torch.ones(3, 8, dtype=torch.bool).tril(5)
    cos, sin = rotary(x, torch.arange(5, 8)[None])
    with torch.no_grad():
        q = module.q_proj(x).view(2, 3, 8, 8).transpose(1, 2)
        k = module.k_proj(x).view(2, 3, 2, 8).transpose(1, 2)
        v = module.v_proj(x).view(2, 3, 2, 8).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = repeat_kv(torch.cat([cached[0], k], 2), 4), repeat_kv(torch.cat([cached[1], v], 2), 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        expected = module.o_proj(y.transpose(1, 2).reshape(2, 3, 64))
        torch.testing.assert_close(module(x, allowed, cached, 5), expected, rtol=1e-5, atol=1e-5)


def test_a_decode_step_that_forgets_the_offset_is_named(tmp_path, runner):
    body = DECODER.replace("torch.arange(start_pos, start_pos + n)", "torch.arange(n)")
    path = write(tmp_path, body)
    result, out = trace(runner, f"{path}:Attention", *LAYER, "--rope", "--cache", "5")
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "Q_rot" and "positions not offset in a decode step" in first["diagnosis"]
    assert "after 5 cached positions they sit at 5 to" in first["diagnosis"]
    assert first["line"] == line_of(body, "q = q * cos")


def test_the_wrong_rope_base_is_fitted_and_named(tmp_path, runner):
    path = write(tmp_path, DECODER)
    result, out = trace(runner, f"{path}:Attention", "--init", "dim=64, n_heads=8, n_kv_heads=2, rope_theta=500000.0",
                        "--rope", "--rope-base", "1000000", "--causal")  # told another base than the code's
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "Q_rot"
    assert "rotates with RoPE base 500000 where the reference uses 1e+06" in first["diagnosis"]
    assert "--rope-base 500000" in first["diagnosis"]

    # told no base, the base is the one --init hands its __init__ (rope_theta=500000, which it keeps only as inv_freq),
    # a note; told --rope-base 500000, it aligns: the module is transformers' LLaMA with rope_theta 500000
    result, out = trace(runner, f"{path}:Attention", "--init", "dim=64, n_heads=8, n_kv_heads=2, rope_theta=500000.0",
                        "--rope", "--causal")
    assert result.exit_code == 0, result.output
    assert any("RoPE base 500000, read from your module" in note for note in out["notes"]), out["notes"]
    result, out = trace(runner, f"{path}:Attention", "--init", "dim=64, n_heads=8, n_kv_heads=2, rope_theta=500000.0",
                        "--rope", "--rope-base", "500000", "--causal")
    assert result.exit_code == 0, result.output
    module_file = user_module(path)
    torch.manual_seed(0)
    module = module_file.Attention(64, 8, 2, rope_theta=500000.0).eval()
    attention, rotary = transformers_attention(module, 500000.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    x = torch.randn(2, 7, 64)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = attention(x, rotary(x, torch.arange(7)[None]), causal)[0]
        torch.testing.assert_close(module(x, torch.ones(7, 7, dtype=torch.bool).tril()), expected, rtol=1e-5,
                                   atol=1e-5)


def test_rope_options_are_checked(tmp_path):
    from cli_main import run_main

    path = write(tmp_path, DECODER)
    for args, message in ((["--rope-base", "500000"], "add --rope"), (["--rope", "--rope-base", "1"], "above 1"),
                          (["--cache", "3", "--causal", "upper-left"], "drop --causal upper-left"),
                          (["--kv-heads", "4"], "--kv-heads 4 but the module's key projection makes 2"),
                          (["--window", "0"], "--window")):
        outcome = run_main("trace", f"{path}:Attention", *LAYER, *args)
        assert outcome.code == 2 and len(outcome.error_lines) == 1 and message in outcome.stderr, (args, outcome.stderr)
    scratch_path = write(tmp_path, FROM_SCRATCH, "scratch.py")
    outcome = run_main("trace", f"{scratch_path}:GroupedQueryAttention", *SCRATCH[:2], "--causal")
    assert outcome.code == 2 and "takes RoPE's tables (cos, sin): add --rope" in outcome.stderr, outcome.stderr


# --- kernels inside: F.scaled_dot_product_attention and nn.MultiheadAttention ------------------------------------

KERNELS = """
class SdpaModule(nn.Module):
    def __init__(self, d_model=48, n_heads=4, n_kv_heads=4, causal=True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.causal = n_heads, n_kv_heads, causal
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, n_kv_heads * self.head_dim)
        self.v = nn.Linear(d_model, n_kv_heads * self.head_dim)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x, attn_mask=None):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=self.causal and attn_mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class Wrapped(nn.Module):
    def __init__(self, d_feat=48, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.mha = nn.MultiheadAttention(d_feat, n_head, batch_first=True)

    def forward(self, query, key, value, mask=None):
        out, weights = self.mha(query, key, value, attn_mask=mask)
        return out
"""


@pytest.mark.parametrize(("init", "args"), [
    ("causal=True", ["--causal"]),
    ("causal=False", ["--causal", "lower-right", "--nq", "5"]),
    ("n_kv_heads=2", ["--causal"]),
    ("causal=False", ["--mask", "MASK", "--nq", "6"]),
])
def test_a_module_calling_f_scaled_dot_product_attention_aligns(tmp_path, runner, init, args):
    import numpy as np

    np.save(tmp_path / "mask.npy", np.random.default_rng(0).random((6, 6)) > 0.3)
    path = write(tmp_path, KERNELS)
    args = [str(tmp_path / "mask.npy") if a == "MASK" else a for a in args]
    result, out = trace(runner, f"{path}:SdpaModule", "--init", init, *args)
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row for row in out["alignment"]}
    assert rows["scores"]["user"] == "(scores)" and rows["scores"]["status"] == "equal"
    assert rows["attention"]["recomputed"] and rows["x_raw"]["user"] == "y" and not rows["x_raw"]["recomputed"]
    if "n_kv_heads=2" in init:
        assert rows["K_rep"]["status"] == "unseen" and out["params"]["sizes"]["n_kv_head"] == 2
    assert any("without materializing them" in n for n in out["notes"])


def test_f_scaled_dot_product_attention_with_is_causal_and_no_option_is_told_its_own_mask(tmp_path, runner):
    path = write(tmp_path, KERNELS)
    result, out = trace(runner, f"{path}:SdpaModule")
    assert result.exit_code == 1
    assert "masks by itself" in out["first_divergence"]["diagnosis"]
    assert "--causal" in out["first_divergence"]["diagnosis"]


def test_a_wrapped_nn_multiheadattention_aligns_with_its_mask_read_true_masked(tmp_path, runner):
    path = write(tmp_path, KERNELS)
    result, out = trace(runner, f"{path}:Wrapped", "--causal")
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row for row in out["alignment"]}
    assert rows["Q_feat"]["recomputed"] and rows["Q_feat"]["status"] == "permuted"  # [n_Q, n_batch, d_feat]
    assert rows["x"]["user"] == "out" and not rows["x"]["recomputed"] and rows["x"]["status"] == "equal"
    assert "in_proj_weight[0:48]" in out["reference"] and "o=mha.out_proj" in out["reference"]
    assert any("True = masked out (nn.MultiheadAttention's convention)" in n for n in out["notes"])
    assert no_vague_dims(out) == []


def test_a_wrapped_nn_multiheadattention_given_the_wrong_value_diverges_at_v_feat(tmp_path, runner):
    body = KERNELS.replace("self.mha(query, key, value, attn_mask=mask)", "self.mha(query, key, key, attn_mask=mask)")
    path = write(tmp_path, body)
    result, out = trace(runner, f"{path}:Wrapped")
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "V_feat" and first["user"] == "(V_feat)"


# --- decoders that mask by themselves, and masks in every convention ---------------------------------------------

OWN_MASK = """
class Decoder(nn.Module):
    def __init__(self, d_model=40, n_heads=5, block_size=32, window=None):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        allowed = torch.tril(torch.ones(block_size, block_size))
        if window is not None:
            allowed = allowed - torch.tril(torch.ones(block_size, block_size), diagonal=-window)
        self.register_buffer("tril", allowed)

    def forward(self, x):
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        wei = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        return self.out((wei @ v).transpose(1, 2).reshape(B, T, C))
"""


@pytest.mark.parametrize(("init", "given", "told"), [
    ("window=None", ["--causal"], "--causal"),
    ("window=3", ["--window", "3"], "--causal --window 3"),
])
def test_a_decoder_masking_by_itself_aligns_when_described_and_is_told_otherwise(tmp_path, runner, init, given, told):
    path = write(tmp_path, OWN_MASK)
    result, out = trace(runner, f"{path}:Decoder", "--init", init, *given)
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row for row in out["alignment"]}
    assert rows["masked_scores"]["user"] == "wei" and rows["masked_scores"]["status"] == "equal"
    result, out = trace(runner, f"{path}:Decoder", "--init", init)
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "attention" and f"describe it with {told} " in first["diagnosis"], first


MASKS = """
def attend(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, -1e9)
    return scores.softmax(-1) @ v


def masked(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


def additive(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores + mask
    return scores.softmax(-1) @ v


def where(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = torch.where(mask, scores, float("-inf"))
    return scores.softmax(-1) @ v


def bert(q, k, v, attention_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores + (1.0 - attention_mask) * -10000.0
    return scores.softmax(-1) @ v
"""


@pytest.mark.parametrize(("name", "words"), [
    ("attend", "boolean, True = may attend"), ("masked", "boolean, True = masked out"),
    ("additive", "additive float, 0 = may attend, -inf = masked"), ("where", "boolean, True = may attend"),
    ("bert", "float 0/1, 1 = may attend"),
])
def test_a_mask_is_given_in_the_convention_the_code_reads_and_the_note_says_which(tmp_path, runner, name, words):
    path = write(tmp_path, MASKS)
    result, out = trace(runner, f"{path}:{name}", "--causal")
    assert result.exit_code == 0, result.output
    note = next(n for n in out["notes"] if words in n)
    assert "as your code reads it" in note
    told = {"attend": "masked_fill(mask == 0", "masked": "masked_fill(mask, float", "additive": "scores + mask",
            "where": "torch.where(mask"}
    if name in told:  # the op that told it, by its line
        assert f"line {line_of(MASKS, told[name])}" in note, note


@pytest.mark.parametrize("name", ["additive", "attend", "masked"])
def test_a_float_mask_file_of_0_and_minus_inf_is_given_each_way(tmp_path, runner, name):
    import numpy as np

    rng = np.random.default_rng(1)
    np.save(tmp_path / "add.npy", np.where(rng.random((6, 9)) > 0.3, 0.0, -np.inf).astype(np.float32))
    path = write(tmp_path, MASKS)
    result, out = trace(runner, f"{path}:{name}", "--mask", str(tmp_path / "add.npy"))
    assert result.exit_code == 0, result.output
    mask = next(s for s in out["steps"] if s["name"] == "mask")
    assert mask["dtype"] == "float32"  # shown as given; handed to the code as it reads it


def test_a_float_bias_cannot_be_given_to_code_that_reads_a_boolean(tmp_path):
    import numpy as np
    from cli_main import run_main

    np.save(tmp_path / "bias.npy", np.random.default_rng(0).standard_normal((6, 9)).astype(np.float32))
    outcome = run_main("trace", f"{write(tmp_path, MASKS)}:attend", "--mask", str(tmp_path / "bias.npy"))
    assert outcome.code == 2 and "--mask holds a float bias" in outcome.stderr, outcome.stderr


# --- --train: the seed tutorial's bug is still the one named ----------------------------------------------------


def test_the_tutorial_in_training_mode_still_names_its_sqrt_d_feat_bug(runner):
    example = str(DOCS / "my_attention.py")
    result, out = trace(runner, f"{example}:MultiHeadedAttention", "--init", "d_feat=200, n_head=5", "--train")
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "scores" and first["user"] == "scores"
    assert first["line"] == 1 + next(i for i, line in enumerate(Path(example).read_text().splitlines())
                                     if "np.sqrt(K.size()[-1])" in line)
    assert "divided by √d_feat, not √d_head" in first["diagnosis"]
    assert first["ratio"] == pytest.approx(1 / math.sqrt(5), rel=1e-4)
    assert any("dropout in training mode" in n and "zeroed" in n for n in out["notes"])


GQA_FUNCTIONS = """
def fused_gqa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def repeated(q, k, v):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v
"""


@pytest.mark.parametrize("name", ["fused_gqa", "repeated"])
def test_a_function_with_fewer_key_value_heads_aligns_with_kv_heads(tmp_path, runner, name):
    path = write(tmp_path, GQA_FUNCTIONS)
    result, out = trace(runner, f"{path}:{name}", "--heads", "4", "--kv-heads", "2")
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["out"] == "equal" and rows["K_rep"] == ("unseen" if name == "fused_gqa" else "equal")
    k = next(s for s in out["steps"] if s["name"] == "key" or s["name"] == "k")
    assert k["dims"] == ["n_batch", "n_kv_head", "n_K", "d_K"]

    # independently: F.scaled_dot_product_attention(enable_gqa=True) on the same inputs
    sizes = out["params"]["sizes"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sizes["n_batch"], 4, sizes["n_Q"], sizes["d_K"], generator=g)
    kk = torch.randn(sizes["n_batch"], 2, sizes["n_K"], sizes["d_K"], generator=g)
    v = torch.randn(sizes["n_batch"], 2, sizes["n_K"], sizes["d_V"], generator=g)
    mine = getattr(user_module(path), name)(q, kk, v)
    torch.testing.assert_close(mine, F.scaled_dot_product_attention(q, kk, v, enable_gqa=True), rtol=1e-5, atol=1e-6)


def test_a_mask_compared_with_a_threshold_is_read_either_way(tmp_path, runner):
    path = write(tmp_path, MASKS.replace("masked_fill(mask == 0, -1e9)", "masked_fill(mask < 0.5, -1e9)")
                 .replace('masked_fill(mask, float("-inf"))', 'masked_fill(mask > 0, float("-inf"))'))
    for name, words in (("attend", "True = may attend"), ("masked", "True = masked out")):
        result, out = trace(runner, f"{path}:{name}", "--causal")
        assert result.exit_code == 0, result.output
        assert any(words in n and "as your code reads it" in n for n in out["notes"]), out["notes"]


# --- a module with no weights: traced as a function is (issue 36, new-user 1) ----------------------------------

WEIGHTLESS = (DOCS / "textbook.py").read_text() + """

class Unscaled(ScaledDotProductAttention):
    def forward(self, q, k, v, mask=None):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
"""


def test_a_weightless_module_taking_q_k_v_is_traced_as_a_function(tmp_path, runner):
    """The tutorial's ScaledDotProductAttention: --dk/--dv/--heads size its inputs, the reference is sdpa (it
    was refused --dk, then 'cannot tell d_feat', then 'pass --heads', then 'no reference')."""
    path = write(tmp_path, WEIGHTLESS)
    result, out = trace(runner, f"{path}:ScaledDotProductAttention", "--dk", "6", "--dv", "5", "--heads", "2",
                        "--causal")
    assert result.exit_code == 0, result.output
    assert out["params"]["sizes"]["d_K"] == 6 and out["params"]["sizes"]["d_V"] == 5
    assert {row["reference"] for row in out["alignment"]} >= {"scores", "masked_scores", "attention", "out"}
    assert {row["status"] for row in out["alignment"]} == {"equal"}
    assert any("has no weights" in note for note in out["notes"]), out["notes"]
    result, out = trace(runner, f"{path}:Unscaled")
    assert result.exit_code == 1 and out["first_divergence"]["reference"] == "scores"
    result = runner.invoke(app, ["trace", f"{path}:Unscaled", "--d-feat", "8"])
    assert result.exit_code == 2 and "has no weights" in result.stderr and "--dk" in result.stderr


# --- after a divergence: each step with the tensor where it stands in the data flow (issue 36, new-user 4) -------

# Grouped-query attention as a port writes it: 4 query heads share 2 key/value heads, repeated for them, RoPE in the
# half-split form, a chained merge. TILED repeats the heads in the wrong order: .repeat tiles them (0, 1, 0, 1).
GQA = """
def spin(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class KVGroups(nn.Module):
    def __init__(self, width, heads, kv_heads, rope=False):
        super().__init__()
        self.heads, self.kv_heads, self.size, self.rope = heads, kv_heads, width // heads, rope
        self.to_q = nn.Linear(width, width, bias=False)
        self.to_k = nn.Linear(width, kv_heads * self.size, bias=False)
        self.to_v = nn.Linear(width, kv_heads * self.size, bias=False)
        self.to_out = nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, self.size).transpose(1, 2)
        k = self.to_k(x).view(b, n, self.kv_heads, self.size).transpose(1, 2)
        v = self.to_v(x).view(b, n, self.kv_heads, self.size).transpose(1, 2)
        if self.rope:
            inv = 10000.0 ** (-torch.arange(0, self.size, 2).float() / self.size)
            angle = torch.outer(torch.arange(n).float(), inv)
            cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
            q, k = spin(q, cos, sin), spin(k, cos, sin)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        w = torch.softmax(q @ k.transpose(-2, -1) / self.size ** 0.5 + torch.full((n, n), float("-inf")).triu(1), -1)
        return self.to_out((w @ v).transpose(1, 2).reshape(b, n, -1))
"""
TILED = GQA.replace("k.repeat_interleave(self.heads // self.kv_heads, dim=1)",
                    "k.repeat(1, self.heads // self.kv_heads, 1, 1)").replace(
    "v.repeat_interleave(self.heads // self.kv_heads, dim=1)", "v.repeat(1, self.heads // self.kv_heads, 1, 1)")
KV = "--init", "width=32, heads=4, kv_heads=2", "--causal"


def test_a_correct_gqa_module_still_aligns(tmp_path, runner):
    path = write(tmp_path, GQA)
    result, out = trace(runner, f"{path}:KVGroups", *KV)
    assert result.exit_code == 0, result.output
    rows = {row["reference"]: row["status"] for row in out["alignment"]}
    assert rows["K_rep"] == rows["V_rep"] == rows["x_raw"] == rows["x_rsh1"] == rows["x"] == "equal"


@pytest.mark.parametrize("rope", [False, True])
def test_heads_tiled_diverge_at_k_rep_named_and_later_steps_pair_with_their_own_lines(tmp_path, runner, rope):
    """Before: x_raw lined up with the repeated values (a named tensor of its shape) and x_rsh2 and x both with the
    output; with RoPE the reference was not told of, the cause read 'none of the usual causes fits'."""
    path = write(tmp_path, TILED)
    result, out = trace(runner, f"{path}:KVGroups", "--init", f"width=32, heads=4, kv_heads=2, rope={rope}",
                        "--causal")
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert first["reference"] == "K_rep" and first["line"] == line_of(TILED, "k = k.repeat(")
    assert "key/value heads repeated in the wrong order" in first["diagnosis"], first
    # with RoPE untold, the tiling is named by experiment beside it (pairs.py), the RoPE said first with its flag
    assert ("describe it with --rope" in first["diagnosis"]) == rope and first["experiment"] == "gqa.tiled", first
    lines = {row["reference"]: row["line"] for row in out["alignment"]}
    assert lines["V_rep"] == line_of(TILED, "v = v.repeat(")
    assert lines["scores"] == lines["attention"] == line_of(TILED, "w = torch.softmax(")
    merge = line_of(TILED, "return self.to_out(")
    assert lines["x_raw"] == lines["x_rsh1"] == lines["x_rsh2"] == lines["x"] == merge
    users = {row["reference"]: row["user"] for row in out["alignment"]}
    picked = [next(s["op"] for s in out["steps"] if s["name"] == users[step] and s["line"] == merge)
              for step in ("x_raw", "x_rsh1", "x_rsh2", "x")]
    assert ["@" in picked[0], "transpose" in picked[1], "reshape" in picked[2], "to_out" in picked[3]] == [True] * 4, (
        picked)
    claimed = [(row["user"], row["line"]) for row in out["alignment"] if row["user"] is not None]
    assert len(claimed) == len(set(claimed)), claimed  # no tensor lined up with two steps


def test_the_tutorials_merge_permute_x_rsh1_is_lined_up(runner):
    example = DOCS / "my_attention.py"
    result, out = trace(runner, f"{example}:MultiHeadedAttention", "--init", "d_feat=200, n_head=5")
    assert result.exit_code == 1 and out["first_divergence"]["reference"] == "scores"
    row = next(row for row in out["alignment"] if row["reference"] == "x_rsh1")
    assert row["user"] == "x_rsh1" and row["status"] == "differs"
    assert row["line"] == 1 + next(i for i, line in enumerate(example.read_text().splitlines()) if "x_rsh1 =" in line)
    result, out = trace(runner, f"{example}:FixedAttention", "--init", "d_feat=200, n_head=5")
    assert result.exit_code == 0, result.output
    row = next(row for row in out["alignment"] if row["reference"] == "x_rsh1")
    made = next(s["op"] for s in out["steps"] if s["name"] == row["user"] and s["line"] == row["line"])
    assert row["status"] == "equal" and ".permute(0, 2, 1, 3)" in made, (row, made)
