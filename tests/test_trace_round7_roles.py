"""What `attnscope trace` feeds code that takes its inputs or its mask another way than trace draws them first
(issue 41, held-out round 8; tests/trace_styles_round7_roles.py):

- inputs in another order than (query, key, value) (OpenNMT's `forward(key, value, query, mask)`, the memory first):
  each input's role read from the data flow (the scores' left operand, their right, the pattern's partner), names a
  first guess; each projection's role is the role of the input it reads, never the order it was registered in;
- an optional memory (`key_value_states=None`, Whisper's `xa=None`) fed for cross-attention where --nk asks for
  keys of another length, when the code takes its keys and values from it;
- a mask the code checks, asserts or views as `[n_batch, 1, n_Q, n_K]` is given so after a key padding file;
- a boolean mask the code casts to floats before SDPA adds it (OLMo's `bias.to(dtype)`) is given 0 / -inf;
- in a decode step, a mask the code cuts as `mask[:, :, n_K - n_Q:n_K, :n_K]` out of one over the whole sequence
  is given `[n_batch, 1, n_K, n_K]`; a cache of keys before RoPE, which the code rotates with the new ones once
  joined, is a convention (a note, exit 0), and the mistakes behind it are still named by experiment.

Each correct style is checked apart from attnscope against F.scaled_dot_product_attention or a float64 formula,
and each planted bug changes its output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_columns_weights import ALIGNED
from test_trace_command import user_module
from tracecases import run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round7_roles.py")
styles = user_module(STYLES)


@pytest.fixture(scope="module")
def padding(tmp_path_factory) -> str:
    """Key padding [n_batch=2, n_K=9], True = may attend: the first sequence's last 3 keys padded, the second's last."""
    mask = np.ones((2, 9), dtype=bool)
    mask[0, 6:] = False
    mask[1, 8] = False
    path = tmp_path_factory.mktemp("roles") / "pad.npy"
    np.save(path, mask)
    return str(path)


def _keys() -> torch.Tensor:
    keys = torch.ones(2, 9, dtype=torch.bool)
    keys[0, 6:] = False
    keys[1, 8] = False
    return keys


def _run(runner, target: str, *args: str) -> tuple[int, dict]:
    return run_case(runner, STYLES, target, options=args)


def _clean(code: int, out: dict) -> None:
    assert code == 0 and out["first_divergence"] is None, (out["first_divergence"], out.get("error"))
    assert {row["status"] for row in out["alignment"]} <= ALIGNED, out["alignment"]


def _named(code: int, out: dict, entry: str) -> dict:
    assert code == 1, out.get("error")
    found = out["first_divergence"]
    assert found["experiment"] == entry, found
    assert found["evidence"].startswith("by experiment"), found
    return found


def _heads(t: torch.Tensor, h: int = 4) -> torch.Tensor:
    return t.view(*t.shape[:-1], h, -1).transpose(1, 2)


def _merged(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def _sdpa(layer_q, layer_k, layer_v, layer_o, x, memory, allowed=None, h=4) -> torch.Tensor:
    """F.scaled_dot_product_attention on the module's projections, in float64."""
    q, k, v = (_heads(layer(t).double(), h) for layer, t in ((layer_q, x), (layer_k, memory), (layer_v, memory)))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return layer_o(_merged(y).float())


def _mutants_differ(make, inputs, state, bugs) -> None:
    base = make(None).eval()
    base.load_state_dict(state)
    for bug in bugs:
        mutant = make(bug).eval()
        mutant.load_state_dict(state)
        changed, kept = mutant(*inputs), base(*inputs)
        changed, kept = (t[0] if isinstance(t, tuple) else t for t in (changed, kept))  # (out, weights)
        assert not torch.allclose(changed, kept, atol=1e-3), bug


# --- the styles, apart from attnscope -----------------------------------------------------------------------------


def test_input_order_styles_against_sdpa():
    torch.manual_seed(0)
    enc, dec = torch.randn(2, 9, 32), torch.randn(2, 6, 32)
    pad = ~_keys()
    module = styles.MemoryFirst().eval()
    expected = _sdpa(module.q_lin, module.k_lin, module.v_lin, module.out_lin, dec, enc, ~pad[:, None, None, :])
    torch.testing.assert_close(module(enc, dec, pad), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.MemoryFirst(bug=bug), (enc, dec, pad), module.state_dict(), ["no_scale"])

    module = styles.KeyValueQuery().eval()
    key, value, query = torch.randn(2, 9, 32), torch.randn(2, 9, 32), torch.randn(2, 6, 32)
    allowed = torch.rand(2, 6, 9) > 0.3
    allowed[..., 0] = True
    lin = module.linears
    q, k, v = (_heads(layer(t).double()) for layer, t in ((lin[2], query), (lin[0], key), (lin[1], value)))
    expected = lin[3](_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])).float())
    torch.testing.assert_close(module(key, value, query, allowed.int()), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.KeyValueQuery(bug=bug), (key, value, query, allowed.int()),
                    module.state_dict(), ["kv_swapped", "softmax_axis"])

    k, v, q = torch.randn(2, 9, 8), torch.randn(2, 9, 8), torch.randn(2, 6, 8)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    torch.testing.assert_close(styles.kvq_attention(k, v, q, allowed).double(), expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(styles.kvq_attention_twice(k, v, q, allowed), styles.kvq_attention(k, v, q, allowed))


def test_mask_shape_styles_against_sdpa():
    torch.manual_seed(1)
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    allowed = _keys()[:, None, None, :].expand(2, 1, 6, 9)
    additive = torch.zeros(2, 1, 6, 9).masked_fill(~allowed, float("-inf"))
    module = styles.SizeChecked().eval()
    expected = _sdpa(module.q_proj, module.k_proj, module.v_proj, module.out_proj, x, memory, allowed)
    torch.testing.assert_close(module(x, memory, additive), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.SizeChecked(bug=bug), (x, memory, additive), module.state_dict(),
                    ["values_from_keys"])
    with pytest.raises(ValueError, match="Attention mask should be of size"):
        module(x, memory, additive[:, :, :1])

    module = styles.AssertedMask().eval()
    wk, wv = module.to_kv.weight.chunk(2)
    q, k, v = (_heads(F.linear(t, w).double()) for t, w in ((x, module.to_q.weight), (memory, wk), (memory, wv)))
    expected = module.to_out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)).float())
    torch.testing.assert_close(module(x, memory, allowed), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.AssertedMask(bug=bug), (x, memory, allowed), module.state_dict(), ["twice"])

    module = styles.ViewedMask().eval()
    expected = _sdpa(module.wq, module.wk, module.wv, module.wo, x, memory, allowed)
    torch.testing.assert_close(module(x, memory, additive), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.ViewedMask(bug=bug), (x, memory, additive), module.state_dict(), ["merge"])


def test_optional_memory_styles_against_sdpa():
    torch.manual_seed(2)
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    allowed = _keys()[:, None, None, :]
    module = styles.KeyValueStates().eval()
    expected = _sdpa(module.q_proj, module.k_proj, module.v_proj, module.out_proj, x, memory, allowed)
    torch.testing.assert_close(module(x, memory, allowed)[0], expected, atol=1e-5, rtol=1e-4)
    self_attention = _sdpa(module.q_proj, module.k_proj, module.v_proj, module.out_proj, x, x)
    torch.testing.assert_close(module(x)[0], self_attention, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.KeyValueStates(bug=bug), (x, memory, allowed), module.state_dict(),
                    ["values_from_keys"])

    module = styles.AudioCross().eval()
    expected = _sdpa(module.query, module.key, module.value, module.out, x, memory)
    torch.testing.assert_close(module(x, memory), expected, atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.AudioCross(bug=bug), (x, memory), module.state_dict(), ["kv_swapped"])


def _rotated(x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [.., n, d] rotated at `positions` in float64: pairs (2i, 2i + 1), or (i, i + d/2)."""
    x = x.double()
    d = x.shape[-1]
    angle = positions.double()[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones_like(angle), angle)
    if interleaved:
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2)) * turn).flatten(-2)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat((z.real, z.imag), -1)


def test_decode_styles_against_sdpa():
    """A decode step after 3 positions: the cache holds keys before RoPE, rotated with the new ones at positions
    0 .. 9, the queries at 3 .. 9; the mask cut out of one over all 10 positions."""
    torch.manual_seed(3)
    x, n, past = torch.randn(2, 7, 32), 7, 3
    whole = torch.ones(10, 10, dtype=torch.bool).tril()[None, None].expand(2, 1, 10, 10)
    lower_right = whole[:, :, past:]
    module = styles.CachedBeforeRope().eval()
    cache = (torch.randn(2, 2, past, 8), torch.randn(2, 2, past, 8))
    q, k, v = module.att_proj(x).split(module.fused_dims, dim=-1)
    q, k, v = _heads(q), _heads(k, 2), _heads(v, 2)
    k, v = torch.cat((cache[0], k), dim=-2), torch.cat((cache[1], v), dim=-2)
    q, k = _rotated(q, torch.arange(past, past + n), False), _rotated(k, torch.arange(past + n), False)
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
                                       attn_mask=lower_right)
    bias = torch.zeros(2, 1, 10, 10).masked_fill(~whole, float("-inf"))
    torch.testing.assert_close(module(x, bias, cache), module.attn_out(_merged(y).float()), atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.CachedBeforeRope(bug=bug), (x, bias, cache), module.state_dict(),
                    ["query_positions", "d_model"])

    module = styles.JoinThenRotate().eval()
    cache = (torch.randn(2, 4, past, 8), torch.randn(2, 4, past, 8))
    k = torch.cat((cache[0], _heads(module.wk(x))), dim=-2)
    v = torch.cat((cache[1], _heads(module.wv(x))), dim=-2).double()
    q = _rotated(_heads(module.wq(x)), torch.arange(past, past + n), True)
    y = F.scaled_dot_product_attention(q, _rotated(k, torch.arange(past + n), True), v, attn_mask=lower_right)
    torch.testing.assert_close(module(x, whole, cache), module.wo(_merged(y).float()), atol=1e-5, rtol=1e-4)
    _mutants_differ(lambda bug: styles.JoinThenRotate(bug=bug), (x, whole, cache), module.state_dict(),
                    ["no_scale"])


# --- trace ----------------------------------------------------------------------------------------------------------

PADDED = ("--batch", "2", "--nq", "6", "--nk", "9", "--mask", "PAD")  # PAD: the padding file


def _filled(args: tuple[str, ...], padding: str) -> list[str]:
    return [padding if a == "PAD" else a for a in args]


@pytest.mark.parametrize(("target", "extra"), [
    ("MemoryFirst", PADDED), ("KeyValueQuery", ("--nq", "6", "--nk", "9")),
    ("KeyValueQuery", ("--nq", "7", "--nk", "7", "--causal")),
    ("kvq_attention", ("--nq", "6", "--nk", "9", "--causal", "--heads", "2")),
])
def test_inputs_read_by_role(runner, padding, target, extra):
    code, out = _run(runner, target, *_filled(extra, padding))
    _clean(code, out)
    said = " ".join(out["notes"])
    assert "inputs by role" in said and "not by their order in the signature" in said, said
    if target == "KeyValueQuery":  # linears.2 projects the queries: matched by the input it reads
        assert "q=linears.2, k=linears.0, v=linears.1, o=linears.3" in out["reference"], out["reference"]


@pytest.mark.parametrize(("target", "bug", "entry", "extra"), [
    ("MemoryFirst", "no_scale", "scale.none", PADDED),
    ("KeyValueQuery", "kv_swapped", "kv.swapped", ("--nq", "6", "--nk", "9")),
    ("KeyValueQuery", "softmax_axis", "softmax.axis", ("--nq", "6", "--nk", "9", "--causal")),
    ("AudioCross", "kv_swapped", "kv.swapped", ("--nq", "6", "--nk", "9")),
])
def test_input_order_bugs_named(runner, padding, target, bug, entry, extra):
    _named(*_run(runner, target, "--init", f"bug='{bug}'", *_filled(extra, padding)), entry)


def test_function_bug_named_with_inputs_by_role(runner):
    _named(*_run(runner, "kvq_attention_twice", "--nq", "6", "--nk", "9", "--heads", "2"), "scale.twice")


@pytest.mark.parametrize("target", ["SizeChecked", "AssertedMask", "ViewedMask", "KeyValueStates"])
def test_padding_file_given_as_the_code_takes_it(runner, padding, target):
    code, out = _run(runner, target, *_filled(PADDED, padding))
    _clean(code, out)
    said = " ".join(out["notes"])
    if target != "KeyValueStates":
        assert "[n_batch, 1, n_Q, n_K]" in said, said
    else:
        assert "key_value_states: the memory your code takes its keys and values from" in said, said


@pytest.mark.parametrize(("target", "bug", "entry"), [
    ("SizeChecked", "values_from_keys", "kv.values_from_keys"), ("AssertedMask", "twice", "scale.twice"),
    ("ViewedMask", "merge", "heads.merge_without_transpose"),
    ("KeyValueStates", "values_from_keys", "kv.values_from_keys"),
])
def test_mask_shape_bugs_named(runner, padding, target, bug, entry):
    _named(*_run(runner, target, "--init", f"bug='{bug}'", *_filled(PADDED, padding)), entry)


def test_optional_memory_stays_self_attention_without_nk(runner):
    code, out = _run(runner, "AudioCross", "--causal")
    _clean(code, out)
    assert not any("the memory your code takes" in note for note in out["notes"]), out["notes"]


def test_mask_cast_to_floats_is_given_additive(runner):
    code, out = _run(runner, "CachedBeforeRope", "--rope", "--causal")
    _clean(code, out)
    assert any("additive float" in n and "cast to floats" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("target", "extra"), [
    ("CachedBeforeRope", ()), ("JoinThenRotate", ()), ("JoinThenRotate", ("--rope-pairing", "interleaved"))])
def test_decode_step_cache_before_rope_is_a_convention(runner, target, extra):
    code, out = _run(runner, target, "--rope", "--causal", "--cache", "3", *extra)
    _clean(code, out)
    said = " ".join(out["notes"])
    assert "[n_batch, 1, n_K, n_K]" in said and "keys before RoPE" in said and "A convention" in said, said


@pytest.mark.parametrize(("target", "bug", "entry", "extra"), [
    ("CachedBeforeRope", "query_positions", "rope.positions", ("--cache", "3")),
    ("CachedBeforeRope", "d_model", "scale.d_model", ()),
    ("JoinThenRotate", "no_scale", "scale.none", ("--cache", "3")),
])
def test_decode_bugs_named(runner, target, bug, entry, extra):
    _named(*_run(runner, target, "--init", f"bug='{bug}'", "--rope", "--causal", *extra), entry)
