"""The pieces of `attnscope trace`: --init parsing, sizes and axis names, layouts, Linear roles, the recorder's
names for the user's tensors."""

from __future__ import annotations

import re
import textwrap
from itertools import combinations

import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from attnscope.errors import UsageError
from attnscope.runs.trace import TraceOptions, run_trace
from attnscope.usertrace import load
from attnscope.usertrace.align import compare, layouts
from attnscope.usertrace.record import Record
from attnscope.usertrace.reference import role_of
from attnscope.usertrace.sizes import AxisNames, choose_sizes

# --- --init -------------------------------------------------------------------------------------------


def test_init_reads_literals_only():
    assert load.parse_init("d_feat=200, n_head=5, dropout=0.1, name='x', sizes=(1, 2), on=True, none=None") == {
        "d_feat": 200, "n_head": 5, "dropout": 0.1, "name": "x", "sizes": (1, 2), "on": True, "none": None}
    assert load.parse_init("") == {} and load.parse_init(None) == {}
    for bad, message in (("n=__import__('os').system('true')", "not a Python literal"), ("200", "keyword arguments"),
                         ("**{'a': 1}", "** is not allowed"), ("a=", "keyword arguments"),
                         ("a=[x for x in y]", "not a Python literal")):
        with pytest.raises(UsageError, match=message.replace("*", r"\*")):
            load.parse_init(bad)


CONFIGS = """
from dataclasses import dataclass


@dataclass
class GPTConfig:
    n_embd: int = 768
    n_head: int = 12
    bias: bool = True


class Rope:
    def __init__(self, base=10000.0, dims=(0, 1)):
        self.base, self.dims = base, dims


def helper(x):
    return x


Imported = torch.nn.Linear
"""


def _classes(tmp_path):
    path = _write(tmp_path, CONFIGS)
    return load.own_classes(load.import_file(load.parse_spec(f"{path}:GPTConfig")[0]))


def test_init_calls_a_transformers_config_the_file_imports(tmp_path):
    """HF code copied as it is builds from transformers' own config (`GraniteAttention(config: GraniteConfig)`): a
    PretrainedConfig subclass the file imports may be called; transformers' other classes may not."""
    from transformers import GraniteConfig

    from attnscope.usertrace.initargs import build, parse_init

    path = _write(tmp_path, "from transformers import GraniteConfig, GraniteModel, PretrainedConfig\n")
    classes = load.own_classes(load.import_file(load.parse_spec(f"{path}:GraniteConfig")[0]))
    assert set(classes) == {"GraniteConfig"}, classes
    built = build(parse_init("config=GraniteConfig(hidden_size=64, num_attention_heads=4, attention_multiplier=0.1)",
                             classes, "user_code.py"))["config"]
    assert isinstance(built, GraniteConfig) and built.hidden_size == 64 and built.attention_multiplier == 0.1
    refused = re.escape("GraniteModel is not one of its classes (it imports GraniteConfig)")
    with pytest.raises(UsageError, match=refused):
        parse_init("model=GraniteModel(1)", classes, "user_code.py")
    # the refusal says which callable classes the file defines and which it imports
    path = _write(tmp_path, "from transformers import GraniteConfig\nclass Mine:\n    pass\n")
    classes = load.own_classes(load.import_file(load.parse_spec(f"{path}:Mine")[0]))
    with pytest.raises(UsageError, match=re.escape("(user_code.py defines Mine; it imports GraniteConfig)")):
        parse_init("x=Other(1)", classes, "user_code.py")


def test_init_calls_the_files_own_classes_with_literal_arguments(tmp_path):
    from attnscope.usertrace.initargs import ClassCall, build, parse_init

    classes = _classes(tmp_path)
    assert set(classes) == {"GPTConfig", "Rope"}  # not torch.nn.Linear, which it only imports
    values = parse_init("config=GPTConfig(n_embd=64, n_head=4), rope=Rope(5e5, dims=[2, 3]), n=(GPTConfig(),)",
                        classes, "user_code.py")
    assert isinstance(values["config"], ClassCall) and repr(values["config"]) == "GPTConfig(n_embd=64, n_head=4)"
    built = build(values)
    assert built["config"] == classes["GPTConfig"](n_embd=64, n_head=4, bias=True)
    assert built["rope"].base == 5e5 and built["rope"].dims == [2, 3]
    assert built["n"] == (classes["GPTConfig"](),)


@pytest.mark.parametrize(("text", "message"), [
    ("config=helper(1)", "helper is not one of its classes (user_code.py defines GPTConfig, Rope)"),
    ("config=Imported(2, 3)", "Imported is not one of its classes"),
    ("config=nn.Transformer(2, 3)", "is called through an attribute"),
    ("config=GPTConfig(n_embd=torch.float32)", "attribute access (torch.float32) is not allowed"),
    ("config=GPTConfig(n_embd=x)", "is not a Python literal"),
    ("config=GPTConfig(*[1])", "* and ** are not allowed"),
    ("config=GPTConfig(**{'n_embd': 1})", "* and ** are not allowed"),
    ("config=GPTConfig(n_embd=1 + 1)", "is not a Python literal"),
    ("config=__import__('os')", "__import__ is not one of its classes"),
    ("config=GPTConfig(n_embd=helper(1))", "helper is not one of its classes"),
    ("config=(lambda: 1)()", "is not a Python literal"),
    ("config=GPTConfig()()", "is not a Python literal"),
])
def test_init_refuses_every_other_call_name_and_attribute(tmp_path, text, message):
    from attnscope.usertrace.initargs import parse_init

    with pytest.raises(UsageError, match=re.escape(message)):
        parse_init(text, _classes(tmp_path), "user_code.py")


# --- sizes and names of axes --------------------------------------------------------------------------


@fuzz_settings(40)
@given(d_head=st.integers(1, 64), n_head=st.integers(1, 16))
def test_chosen_sizes_are_distinct_and_no_product_of_two(d_head, n_head):
    fixed = {"d_feat": d_head * n_head, "n_head": n_head, "d_head": d_head}
    sizes = choose_sizes(fixed, ["n_batch", "n_Q", "n_K"], {})
    chosen = [sizes[n] for n in ("n_batch", "n_Q", "n_K")]
    taken = list(fixed.values())
    assert len(set(chosen)) == 3 and not set(chosen) & set(taken) and 1 not in chosen
    everything = taken + chosen
    products = {a * b for a, b in combinations(everything, 2) if 1 not in (a, b)}
    assert not set(chosen) & products
    names = AxisNames(sizes)
    for name in ("n_batch", "n_Q", "n_K"):
        assert names.name(sizes[name]) == name


def test_axis_names_mark_ambiguity_and_products():
    names = AxisNames({"n_batch": 2, "n_Q": 6, "n_K": 6, "d_feat": 200, "n_head": 5, "d_head": 40})
    assert names.dims((2, 5, 6, 6)) == ("n_batch", "n_head", "n_Q|n_K", "n_Q|n_K")
    assert names.dims((10, 6, 40)) == ("n_batch·n_head", "n_Q|n_K", "d_head")
    assert names.dims((1, 7)) == ("1", "?")


# --- layouts ------------------------------------------------------------------------------------------


def _record(tensor: torch.Tensor) -> Record:
    return Record(0, "op", "op", tensor, 1, [], "method", True, 0, ())


@fuzz_settings(40)
@given(st.permutations([0, 1, 2, 3]))
def test_a_permuted_tensor_is_found_with_its_layout(order):
    reference = torch.randn(2, 3, 5, 7)
    [match] = compare(_record(reference.permute(*order).contiguous()), reference)[:1]
    assert match.equal and match.layout.order == tuple(order) and not match.layout.merged


def test_merged_axes_are_a_layout_but_a_swap_of_equal_sizes_is_not():
    reference = torch.randn(2, 5, 6, 40)  # [n_batch, n_head, n_Q, d_head]
    merged = reference.reshape(10, 6, 40)  # nn.MultiheadAttention's [n_batch·n_head, n_Q, d_head]
    assert compare(_record(merged), reference)[0].equal
    heads_last = reference.permute(0, 2, 1, 3).reshape(2, 6, 200)
    match = compare(_record(heads_last), reference)[0]
    assert match.equal and match.layout.merged
    square = torch.randn(2, 6, 6)
    assert not any(m.equal for m in compare(_record(square.transpose(1, 2).contiguous()), square))
    assert any(m.equal for m in compare(_record(square.transpose(1, 2).contiguous()), square, swaps=True))
    assert layouts((2, 3), (3, 2)) and not layouts((2, 3), (5,))


def test_very_negative_scores_stand_for_minus_infinity():
    reference = torch.tensor([[0.5, float("-inf")], [0.25, 1.0]])
    assert compare(_record(torch.tensor([[0.5, -1e9], [0.25, 1.0]])), reference)[0].equal
    assert not compare(_record(torch.tensor([[0.5, 3.0], [0.25, 1.0]])), reference)[0].equal


# --- Linear roles -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), [
    ("W_q", "q"), ("q_proj", "q"), ("query", "q"), ("to_q", "q"), ("attn.wq", "q"), ("W_k", "k"), ("key", "k"),
    ("v_proj", "v"), ("value", "v"), ("W_o", "o"), ("out_proj", "o"), ("to_out.0", "o"), ("o_proj", "o"),
    ("output.dense", "o"), ("linears.0", None), ("qkv", None), ("c_attn", None), ("fc1", None)])
def test_linear_roles_from_names(name, role):
    assert role_of(name) == role


# --- what the recorder names --------------------------------------------------------------------------


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "user_code.py"
    path.write_text("import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                    + textwrap.dedent(body))
    return str(path)


NAMING = """
def split(x, n_head):
    b, n, d = x.shape
    return x.view(b, n, n_head, d // n_head).transpose(1, 2)


class Chunked(nn.Module):
    def __init__(self, d_feat, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_feat, 3 * d_feat)
        self.q, self.k, self.v = nn.Linear(d_feat, d_feat), nn.Linear(d_feat, d_feat), nn.Linear(d_feat, d_feat)
        self.out = nn.Linear(d_feat, d_feat)

    def forward(self, x, attn_mask=None, dropout_p=0.1):
        a, b, c = self.qkv(x).chunk(3, dim=-1)
        Q_split = split(self.q(x), self.n_head)
        K_split = split(self.k(x), self.n_head)
        V_split = split(self.v(x), self.n_head)
        results = {}
        results["scores"] = Q_split @ K_split.transpose(-2, -1) / math.sqrt(Q_split.shape[-1])
        if attn_mask is not None:
            results["scores"] = results["scores"].masked_fill(~attn_mask, float("-inf"))
        self.attn = F.dropout(results["scores"].softmax(-1), dropout_p, self.training)
        merged = (self.attn @ V_split).transpose(1, 2).flatten(2)
        return self.out(merged)


chunked = Chunked(12, 3)
"""


def test_names_come_from_assignments_helpers_tuples_attributes_and_dict_keys(tmp_path):
    path = _write(tmp_path, NAMING)
    run = run_trace(TraceOptions(target=f"{path}:Chunked", init="d_feat=12, n_head=3", causal="upper-left"))
    names = [s.name for s in run.steps]
    assert {"a", "b", "c", "Q_split", "K_split", "V_split", "results['scores']", "self.attn", "merged",
            "return"} <= set(names)
    assert "matched by name" in run.reference and "q=q, k=k, v=v, o=out" in run.reference
    assert run.divergence is None, run.divergence
    assert any("dropout_p = 0.0" in n for n in run.notes)
    assert any("attn_mask: boolean, True = may attend" in n for n in run.notes)


def test_a_module_instance_runs_as_it_is(tmp_path):
    path = _write(tmp_path, NAMING)
    run = run_trace(TraceOptions(target=f"{path}:chunked"))
    assert run.divergence is None and run.params["kind"] == "module"
    with pytest.raises(UsageError, match="--init builds a class"):
        run_trace(TraceOptions(target=f"{path}:chunked", init="d_feat=4"))


def test_a_mask_file_is_passed_as_it_is(tmp_path):
    import numpy as np

    path = _write(tmp_path, NAMING)
    mask = np.tril(np.ones((6, 6), dtype=np.int64))  # 0/1 integers: read as boolean, 1 = may attend
    np.save(tmp_path / "mask.npy", mask)
    run = run_trace(TraceOptions(target=f"{path}:Chunked", init="d_feat=12, n_head=3", nq=6,
                                 mask=str(tmp_path / "mask.npy")))
    given = next(s for s in run.steps if s.name == "mask")
    assert given.tensor.dtype == torch.bool and torch.equal(given.tensor, torch.from_numpy(mask).bool())
    assert run.divergence is None


GROUPED = """
class GQA(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x, attention_mask=None):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        attn = F.softmax(scores.float(), dim=-1).type_as(q)
        out = (attn @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)
"""


def test_grouped_query_attention_aligns_with_its_kv_heads_named(tmp_path):
    """LLaMA's layout: fewer key/value heads, repeated for the queries (the reference's K_split keeps them)."""
    path = _write(tmp_path, GROUPED)
    run = run_trace(TraceOptions(target=f"{path}:GQA", init="d_model=48, n_heads=6, n_kv_heads=2", causal="upper-left"))
    assert run.divergence is None, run.divergence
    assert run.params["sizes"]["n_kv_head"] == 2
    k = next(s for s in run.steps if s.name == "k")
    assert k.dims == ("n_batch", "n_kv_head", "n_K", "d_head")


def test_a_width_of_zero_leaves_sizes_to_choose():
    """A module built with a width of 0 (`--init "d=0"`): 0 times any size is 0, which once made every size
    clash and the search never end; the zero names no axis and the sizes are chosen as without it."""
    sizes = choose_sizes({"d_feat": 0, "n_head": 4}, ["n_batch", "n_Q"], {})
    assert sizes == choose_sizes({"n_head": 4}, ["n_batch", "n_Q"], {}) | {"d_feat": 0}


def test_a_cast_to_anothers_dtype_takes_no_values_from_it(tmp_path):
    """`self.rel.to(q)`, `w.type_as(q)`: q lends a dtype and a device. A parameter cast so has no parent (before,
    q was recorded as the parent of the cast parameter, as if the table were made from the queries)."""
    from attnscope.usertrace.record import Recorder

    path = tmp_path / "cast_code.py"
    path.write_text(textwrap.dedent("""
        import torch
        def attend(x, rel, gain):
            q = x * 2
            bias = rel.to(q)
            g = gain.type_as(q)
            return q @ q.transpose(0, 1) + bias * g
        """))
    module = load.import_file(path)
    x, rel, gain = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    recorder = Recorder(path, {id(x): "x", id(rel): "rel", id(gain): "gain"}, {}, None)
    with recorder:
        module.attend(x, rel, gain)
    parents = {r.call: r.parents for r in recorder.records}
    assert parents["to"] == () and parents["type_as"] == (), parents
