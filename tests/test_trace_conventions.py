"""`attnscope trace` reads conventions from the code (issue 41, part A): a fused q/k/v weight's rows whatever its
layout, RoPE's pairing, rotary fraction and first position, a mask argument in the shape the code takes it, the
code's own mask never intersected with trace's, no output projection, a bidirectional local window. Each module of
docs/examples/code_styles.py is correct: it exits 0, a note where its convention differs, and it is checked, apart from
attnscope, against F.scaled_dot_product_attention (or transformers' own module) holding its weights. Bugs planted
in them still diverge: a convention never explains a mistake away.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from transformers.models.llama.modeling_llama import rotate_half

STYLES = Path(__file__).resolve().parent.parent / "docs" / "examples" / "code_styles.py"
ALIGNED = {"equal", "permuted", "unseen"}


def styles():
    return user_module(str(STYLES))


def clean(out) -> bool:
    return {row["status"] for row in out["alignment"]} <= ALIGNED and out["first_divergence"] is None


def planted(tmp_path, old: str, new: str) -> str:
    body = STYLES.read_text()
    assert old in body, old
    path = tmp_path / "planted.py"
    path.write_text(body.replace(old, new))
    return str(path)


def sdpa_heads(x, wq, wk, wv, bq, bk, bv, n_head, n_kv, **kwargs):
    """q, k, v [B, heads, T, d_head] from weight rows, then F.scaled_dot_product_attention; merged [B, T, H·d]."""
    B, T, _ = x.shape
    d = wq.shape[0] // n_head
    q = F.linear(x, wq, bq).view(B, T, n_head, d).transpose(1, 2)
    k = F.linear(x, wk, bk).view(B, T, n_kv, d).transpose(1, 2)
    v = F.linear(x, wv, bv).view(B, T, n_kv, d).transpose(1, 2)
    rope = kwargs.pop("rope", None)
    if rope is not None:
        q, k = rope(q), rope(k)
    y = F.scaled_dot_product_attention(q, k, v, enable_gqa=n_kv != n_head, **kwargs)
    return y.transpose(1, 2).reshape(B, T, -1)


def rows_of(linear, index):
    return linear.weight[index], (linear.bias[index] if linear.bias is not None else None)


def half_split_rope(positions, rot, base=10000.0):
    """transformers' rotate_half RoPE on the first `rot` coordinates at `positions`."""
    inv = 1.0 / (base ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([torch.outer(positions.float(), inv)] * 2, dim=-1)

    def apply(t):
        r, p = t[..., :rot], t[..., rot:]
        return torch.cat([r * emb.cos() + rotate_half(r) * emb.sin(), p], dim=-1)
    return apply


# --- each style, correct: exit 0, and the module is what an independent reference computes ------------------------


def neox(m, x):
    H, d = m.num_attention_heads, m.head_size
    grid = torch.arange(3 * H * d).view(H, 3, d)  # GPT-NeoX: [n_head, 3, d_head]
    w = [rows_of(m.query_key_value, grid[:, i].reshape(-1)) for i in range(3)]
    y = sdpa_heads(x, w[0][0], w[1][0], w[2][0], w[0][1], w[1][1], w[2][1], H, H, is_causal=True,
                   rope=half_split_rope(torch.arange(x.shape[1]), m.rotary_ndims))
    return m.dense(y)


def litgpt(m, x):
    G, H, d = m.n_query_groups, m.n_head, m.head_size
    grid = torch.arange((H + 2 * G) * d).view(G, H // G + 2, d)  # litgpt: [n_group, q_per_kv + 2, d_head]
    q, k, v = grid[:, : H // G].reshape(-1), grid[:, -2].reshape(-1), grid[:, -1].reshape(-1)
    y = sdpa_heads(x, m.attn.weight[q], m.attn.weight[k], m.attn.weight[v], None, None, None, H, G, is_causal=True)
    return m.proj(y)


def falcon(m, x):
    H, d = m.num_heads, m.head_dim
    w = m.query_key_value.weight
    y = sdpa_heads(x, w[: H * d], w[H * d: H * d + d], w[H * d + d:], None, None, None, H, 1, is_causal=True)
    return m.dense(y)


def flash(m, x):
    H, d = m.num_heads, m.head_dim
    w = [rows_of(m.Wqkv, slice(i * H * d, (i + 1) * H * d)) for i in range(3)]
    return m.out_proj(sdpa_heads(x, w[0][0], w[1][0], w[2][0], w[0][1], w[1][1], w[2][1], H, H, is_causal=True))


def bert(m, x):
    """transformers' own BertSelfAttention (eager) holding the module's weights."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = BertConfig(hidden_size=64, num_attention_heads=4, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    theirs = BertSelfAttention(config).eval()
    theirs.load_state_dict(m.state_dict())
    return theirs(x)[0]


def grouped(m, x):
    return m.wo(sdpa_heads(x, m.wq.weight, m.wk.weight, m.wv.weight, None, None, None, m.n_heads, m.n_kv_heads,
                           is_causal=True))


def params(m, x):
    """x @ W with W [d_in, d_out] is F.linear with the weight Wᵀ."""
    y = sdpa_heads(x, m.W_Q.T, m.W_K.T, m.W_V.T, None, None, None, m.n_heads, m.n_heads)
    return y @ m.W_O


def t5(m, x):
    return m.o(sdpa_heads(x, m.q.weight, m.k.weight, m.v.weight, None, None, None, m.n_heads, m.n_heads, scale=1.0))


def meta(m, x):
    """Meta's pairing (2i, 2i + 1) in reals: the even and odd coordinates turned together."""
    T, d = x.shape[1], m.head_dim
    angle = torch.outer(torch.arange(T).float(), 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)))

    def rope(t):
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1).flatten(-2)
    return m.wo(sdpa_heads(x, m.wq.weight, m.wk.weight, m.wv.weight, None, None, None, m.n_heads, m.n_heads,
                           is_causal=True, rope=rope))


def from_one(m, x):
    """Positions 0 on: the same attention as the module's 1 on (scores depend on i − j alone)."""
    return m.wo(sdpa_heads(x, m.wq.weight, m.wk.weight, m.wv.weight, None, None, None, m.n_heads, m.n_heads,
                           is_causal=True, rope=half_split_rope(torch.arange(x.shape[1]), m.head_dim)))


def local(m, x):
    C, i = x.shape[-1], torch.arange(x.shape[1])
    w = [rows_of(m.qkv, slice(j * C, (j + 1) * C)) for j in range(3)]
    band = (i[:, None] - i[None, :]).abs() <= m.window
    return m.proj(sdpa_heads(x, w[0][0], w[1][0], w[2][0], w[0][1], w[1][1], w[2][1], m.n_heads, m.n_heads,
                             attn_mask=band))


def nanogpt(m, x):
    C = x.shape[-1]
    w = [rows_of(m.c_attn, slice(j * C, (j + 1) * C)) for j in range(3)]
    return m.c_proj(sdpa_heads(x, w[0][0], w[1][0], w[2][0], w[0][1], w[1][1], w[2][1], m.n_heads, m.n_heads,
                               is_causal=True))


def thirds(m, x):
    C = x.shape[-1]
    w = [rows_of(m.qkv, slice(j * C, (j + 1) * C)) for j in range(3)]
    return m.out(sdpa_heads(x, w[0][0], w[1][0], w[2][0], w[0][1], w[1][1], w[2][1], 4, 4, is_causal=True))


def kv_groups(m, x):
    grid = torch.arange(2 * m.g * m.d).view(m.g, 2, m.d)  # [n_kv_head, 2, d_head]
    wk, wv = m.kv.weight[grid[:, 0].reshape(-1)], m.kv.weight[grid[:, 1].reshape(-1)]
    return m.o(sdpa_heads(x, m.q.weight, wk, wv, None, None, None, m.h, m.g, is_causal=True))


CASES = [
    ("NeoXAttention", ("--causal", "--rope"), "rotates the first 4 of each head's 16 coordinates", neox),
    ("LitGPTAttention", ("--causal",), "looked up in the projection's output", litgpt),
    ("FalconAttention", ("--causal",), None, falcon),
    ("FlashMHA", ("--causal", "--init", "causal=True"),
     "[n_batch, n_K] key padding, keys 3, 4 of the first sequence padded by trace", flash),
    ("BertSelfAttention", (), "no output projection", bert),
    ("GroupedEinsum", ("--causal",), None, grouped),
    ("T5Attention", ("--scale", "1"), None, t5),
    ("ParamAttention", (), "q=W_Q, k=W_K, v=W_V, o=W_O", params),
    ("MetaRope", ("--rope", "--causal"), "pairs RoPE's coordinates interleaved", meta),
    ("RopeFrom1", ("--rope", "--causal"), "counts positions from 1", from_one),
    ("LocalWindow", ("--window", "4", "--window-side", "both"), None, local),
    ("TrilBuffer", ("--causal",), None, nanogpt),
    ("BufferAndMask", ("--causal",), "your code masks by itself", nanogpt),
    ("DictCfg", ("--causal",), None, thirds),
    ("FusedKVGroups", ("--causal",), "k=kv[0:16, 32:48], v=kv[16:32, 48:64]", kv_groups),
    ("NoHeadsSaid", ("--causal",), "n_head = 4, read from the queries your code hands the scores", thirds),
]


@pytest.mark.parametrize(("name", "args", "words", "reference"), CASES, ids=[c[0] for c in CASES])
def test_each_correct_style_exits_0_and_is_the_independent_reference(runner, name, args, words, reference):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.output
    assert clean(out), out["alignment"]
    said = out["reference"] + " ".join(out["notes"])
    assert words is None or words in said, said

    torch.manual_seed(0)
    module = getattr(styles(), name)(**({"causal": True} if name == "FlashMHA" else {})).eval()
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(module, x), rtol=1e-5, atol=1e-5)


def test_a_fused_layout_is_solved_not_read_by_width(runner):
    """litgpt's per-KV-group rows: q of group g are rows g·(q_per_kv + 2)·d_head ...; width-based splitting read
    q | k | v blocks and diverged at Q_feat."""
    result, out = trace(runner, f"{STYLES}:LitGPTAttention", "--causal")
    assert result.exit_code == 0
    assert "q=attn[0:32, 64:96], k=attn[32:48, 96:112], v=attn[48:64, 112:128]" in out["reference"]


def test_a_window_the_reference_was_not_told_of_names_the_flags_that_describe_it(runner):
    result, out = trace(runner, f"{STYLES}:LocalWindow")
    assert result.exit_code == 1
    assert "describe it with --window 4 --window-side both" in out["first_divergence"]["diagnosis"]


def test_no_axis_is_named_from_a_coincidence_of_sizes(runner):
    """litgpt's key/value heads are read only once the code ran (its fused projection): the run is made again with
    sizes that avoid them, so the group axis reads n_kv_head, never n_batch."""
    result, out = trace(runner, f"{STYLES}:LitGPTAttention", "--causal")
    assert result.exit_code == 0
    sizes = out["params"]["sizes"]
    assert sizes["n_batch"] != 2
    view = next(s for s in out["steps"] if s["op"].startswith("line") and "view" in s["op"])
    assert view["dims"][:3] == ["n_batch", "n_Q", "n_kv_head"], view


def test_padding_masks_in_the_codes_own_shape_and_convention(runner, tmp_path):
    """A [n_batch, 1, 1, n_K] padding file is given to flash-attn's key_padding_mask as [n_batch, n_K], to diffusers'
    attention_mask as a float [n_batch, 1, n_K] it adds (baddbmm), to BERT's as 2-D 0/1; each lines up, the padded
    keys masked as the reference masks them."""
    import numpy as np

    pad = np.ones((2, 1, 1, 5), dtype=bool)
    pad[1, ..., 3:] = False
    np.save(tmp_path / "pad.npy", pad)
    for name, shape, how in (("FlashMHA", "[n_batch, n_K] key padding", "masks where the mask is False"),
                             ("DiffusersAttention", "[n_batch, 1, n_K] key padding", "baddbmm"),
                             ("BertSelfAttention", "[n_batch, n_K] key padding", "builds its own bias")):
        result, out = trace(runner, f"{STYLES}:{name}", "--batch", "2", "--nq", "5", "--mask",
                            str(tmp_path / "pad.npy"))
        assert result.exit_code == 0, (name, result.output)
        assert clean(out)
        notes = " ".join(out["notes"])
        assert shape in notes and how in notes, (name, notes)

    # independently: diffusers' module with an additive [B, 1, n_K] mask is F.scaled_dot_product_attention's
    torch.manual_seed(0)
    m = styles().DiffusersAttention().eval()
    x = torch.randn(2, 5, 64)
    allowed = torch.from_numpy(pad).reshape(2, 1, 5)
    additive = torch.zeros(2, 1, 5).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        expected = m.to_out[0](sdpa_heads(x, m.to_q.weight, m.to_k.weight, m.to_v.weight, None, None, None, 4, 4,
                                          attn_mask=allowed[:, None]))
        torch.testing.assert_close(m(x, attention_mask=additive), expected, rtol=1e-5, atol=1e-5)


def test_a_module_without_weights_takes_key_padding(runner, tmp_path):
    """x-transformers' Attend: q, k, v [n_batch, n_head, n, d] and a [n_batch, n_K] key-padding mask."""
    import numpy as np

    pad = np.ones((2, 1, 1, 9), dtype=bool)
    pad[1, ..., 6:] = False
    np.save(tmp_path / "pad.npy", pad)
    result, out = trace(runner, f"{STYLES}:Attend", "--heads", "4", "--batch", "2", "--nk", "9", "--mask",
                        str(tmp_path / "pad.npy"))
    assert result.exit_code == 0, result.output
    assert clean(out) and any("[n_batch, n_K] key padding" in n for n in out["notes"])
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 8)
    keys = torch.from_numpy(pad).reshape(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(styles().Attend().eval()(q, k, v, keys), F.scaled_dot_product_attention(
            q, k, v, attn_mask=keys[:, None, None, :]), rtol=1e-5, atol=1e-5)


def test_column_form_function_lines_up(runner):
    result, out = trace(runner, f"{STYLES}:attention_cols", "--layout", "col")
    assert result.exit_code == 0, result.output
    assert clean(out)
    Q, K, V = torch.randn(2, 8, 6), torch.randn(2, 8, 9), torch.randn(2, 5, 9)
    expected = F.scaled_dot_product_attention(Q.mT, K.mT, V.mT).mT
    torch.testing.assert_close(styles().attention_cols(Q, K, V), expected, rtol=1e-5, atol=1e-5)


def test_a_plain_function_with_a_mask_lines_up(runner):
    result, out = trace(runner, f"{STYLES}:attention", "--causal")
    assert result.exit_code == 0, result.output
    assert clean(out)
    q, k, v = torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 5)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(styles().attention(q, k, v, causal), F.scaled_dot_product_attention(
        q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


# --- planted bugs: a convention never explains one away -------------------------------------------------------------


BUGS = [
    ("BufferAndMask", ("--causal", "--init", "diagonal=1"), None, None, "masked_scores"),  # hidden by intersection
    ("MetaRope", ("--rope", "--causal", "--rope-pairing", "half-split"), None, None, "Q_rot"),
    ("NeoXAttention", ("--causal", "--rope"), "k_rot = k_rot * cos + rotate_half(k_rot) * sin",
     "k_rot = k_rot * 1.0", "K_rot"),  # only q rotated: no fraction, pairing or start explains it
    ("LitGPTAttention", ("--causal",), "q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)",
     "q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)\n        v = k", None),  # values taken from the keys
    ("LocalWindow", ("--window", "4", "--window-side", "both"), "<= self.window", "<= self.window + 1",
     "masked_scores"),
    ("GroupedEinsum", ("--causal",), "view(B, T, self.n_kv_heads, g, self.head_dim)",
     "view(B, T, g, self.n_kv_heads, self.head_dim).transpose(2, 3)", None),  # query heads grouped the other way
    ("RopeFrom1", ("--rope", "--causal"), "k = k * emb.cos()", "k = k * emb.cos().flip(0)", "K_rot"),
]


@pytest.mark.parametrize(("name", "args", "old", "new", "step"), BUGS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BUGS)])
def test_planted_bugs_still_diverge(runner, tmp_path, name, args, old, new, step):
    path = planted(tmp_path, old, new) if old else str(STYLES)
    result, out = trace(runner, f"{path}:{name}", *args)
    assert result.exit_code == 1, result.output
    assert out["first_divergence"] is not None
    assert step is None or out["first_divergence"]["reference"] == step, out["first_divergence"]
    assert not any("A convention, not a mistake" in n for n in out["notes"])  # never a clean convention


def test_the_bug_planted_is_a_bug_by_the_independent_reference():
    """The tril(diagonal=1) buffer differs from causal attention (so exit 1 above is no false alarm)."""
    torch.manual_seed(0)
    m = styles().BufferAndMask(diagonal=1).eval()
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert not torch.allclose(m(x), nanogpt(m, x), atol=1e-4)
        assert math.isfinite(float(m(x).abs().max()))
