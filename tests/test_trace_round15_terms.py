"""`attnscope trace` on attention that adds to (or multiplies into) its scores what it computes itself (round 15b's SAM,
Swin V2 and Q-Former, round 15a's DeBERTa-v2), in styles of its own (tests/trace_styles_round15_terms.py):

- a relative-position term added to the scores in another view of them (SAM's `attn.view(B, qh, qw, kh, kw) + rel_h
  + rel_w`) is the code's own term, the sum less q · kᵀ read back through the reshape;
- a position bias the code changes value by value after laying it out (Swin V2's 16 · sigmoid) is added with the
  values the code adds, laid out as the code first made it (its transpose still `t5.transposed` by experiment);
- a learned temperature, one a head (cosine attention's exp(logit_scale), XCiT's temperature, a divisor), is the
  code's own scale, read where no --scale is asked, and kept in every experiment's rerun;
- the softmax over the queries, where a mask adds BERT's −10000, is `softmax.axis` by experiment;
- DeBERTa's scale is read where a mistake (values from the keys) lies away from the scores;
- keys and values swapped before a qk-norm, or beside a term made from the queries, are `kv.swapped`.

Each correct style is checked against F.scaled_dot_product_attention in float64 (its term or bias the float mask, its
temperature folded into q); each plant is shown to change the output and is named by experiment.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round15_terms.py")
styles = user_module(STYLES)
KEEP = np.ones((2, 7), dtype=bool)
KEEP[0, 5:], KEEP[1, 6:] = False, False


def _grid(n, w=3):
    pos = torch.arange(n)
    return pos // w, pos % w  # each token's row and column in a grid w wide


def _fused(m, x, layer):
    q, k, v = layer(x).chunk(3, -1)
    return _heads(q, m_heads(m)), _heads(k, m_heads(m)), _heads(v, m_heads(m))


def m_heads(m):
    return next(getattr(m, a) for a in ("num_heads", "heads", "h", "n_heads", "n_head")
                if isinstance(getattr(m, a, None), int))


def _want(m, x, keep=None):
    """The style's output from its weights, in float64, by F.scaled_dot_product_attention: a term or bias its float
    mask, a temperature folded into q (scale 1)."""
    B, N, C = x.shape
    h = m_heads(m)
    if isinstance(m, styles.DecomposedRelPos):
        q, k, v = _fused(m, x, m.qkv)
        r, c = _grid(N)
        term = torch.einsum("bhid,ijd->bhij", q, m.rel_pos_h[r[:, None] - r[None, :] + 2]) + \
            torch.einsum("bhid,ijd->bhij", q, m.rel_pos_w[c[:, None] - c[None, :] + 2])
        return m.proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=term)))
    if isinstance(m, styles.FlatShaw):
        q, k, v = (_heads(f(x), h) for f in (m.to_q, m.to_k, m.to_v))
        pos = torch.arange(N)
        rel = m.rel_k.weight[(pos[None, :] - pos[:, None]).clamp(-m.max_rel, m.max_rel) + m.max_rel]
        term = torch.einsum("bhid,ijd->bhij", q, rel) / math.sqrt(m.d)
        return m.to_out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=term)))
    if isinstance(m, styles.AxialKeyPos):
        q, k, v = (_heads(f(x), h) for f in (m.query, m.key, m.value))
        r, c = _grid(N)
        term = q @ m.key_rows[r].T + q @ m.key_cols[c].T  # the key j's row and column
        return m.dense(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=term)))
    if isinstance(m, styles.ContinuousBias):
        q, k, v = _fused(m, x, m.qkv)
        bias = m.cpb_mlp(m.coords_table).reshape(-1, h)[m.index].permute(2, 0, 1)  # [h, N, N]
        return m.proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=16 * torch.sigmoid(bias))))
    if isinstance(m, styles.TanhCappedBias):
        q, k, v = (_heads(f(x), h) for f in (m.q, m.k, m.v))
        pos = torch.arange(N)
        rel = pos[None, :] - pos[:, None]
        buckets = ((rel.sign() + 1) * 2 + rel.abs().clamp(max=1)).clamp(0, 7)
        bias = m.cap * torch.tanh(m.relative_attention_bias.weight[buckets].permute(2, 0, 1) / m.cap)
        return m.o(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)))
    if isinstance(m, styles.GainedTable):
        q, k, v = _fused(m, x, m.qkv)
        bias = m.relative_position_bias_table[m.relative_position_index].permute(2, 0, 1) * m.bias_gain[:, None, None]
        return m.proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)))
    if isinstance(m, styles.ScaledCosine):
        q, k, v = _fused(m, x, m.in_proj)
        t = m.logit_scale.clamp(max=m.logit_scale_max).exp()  # [h, 1, 1]
        o = F.scaled_dot_product_attention(F.normalize(q, dim=-1) * t, F.normalize(k, dim=-1), v, scale=1.0)
        return m.out_proj(_merged(o))
    if isinstance(m, styles.LearnedTemperature):
        q, k, v = _fused(m, x, m.qkv)
        return m.proj(_merged(F.scaled_dot_product_attention(q * m.temperature, k, v, scale=1.0)))
    if isinstance(m, styles.DividedTemperature):
        q, k, v = (_heads(f(x), h) for f in (m.w_q, m.w_k, m.w_v))
        o = F.scaled_dot_product_attention(q / F.softplus(m.tau), k, v, scale=1.0, is_causal=True)
        return m.w_o(_merged(o))
    if isinstance(m, styles.CosineWithBias):
        q, k, v = (_heads(f(x), h) for f in (m.q_proj, m.k_proj, m.v_proj))
        t = m.logit_scale.clamp(max=math.log(100.0)).exp()
        bias = m.relative_position_bias_table[m.relative_position_index].permute(2, 0, 1)
        o = F.scaled_dot_product_attention(F.normalize(q, dim=-1) * t, F.normalize(k, dim=-1), v, attn_mask=bias,
                                           scale=1.0)
        return m.o_proj(_merged(o))
    padding = torch.zeros(B, 1, 1, N, dtype=x.dtype) if keep is None else \
        torch.where(torch.as_tensor(keep)[:, None, None, :], 0.0, -10000.0).to(x.dtype)
    if isinstance(m, styles.BertRelativeKey):
        q, k, v = (_heads(f(x), h) for f in (m.query, m.key, m.value))
        pos = torch.arange(N)
        rel = m.distance_embedding.weight[pos[:, None] - pos[None, :] + m.max_pos - 1]
        term = torch.einsum("bhid,ijd->bhij", q, rel) / math.sqrt(m.d)
        return _merged(F.scaled_dot_product_attention(q, k, v, attn_mask=term + padding))
    if isinstance(m, styles.AdditivePadding):  # WherePadding's too
        q, k, v = (_heads(f(x), h) for f in (m.q_lin, m.k_lin, m.v_lin))
        return m.out_lin(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=padding)))
    assert isinstance(m, styles.Disentangled)  # and its two other forms
    q, k, v = _fused(m, x, m.in_proj)
    pos = torch.arange(N)
    rel = (pos[:, None] - pos[None, :]).clamp(-m.span, m.span - 1)  # query − key
    pos_key = _heads(m.pos_proj(m.rel_embeddings)[None], h)[0]  # [h, 2·span, d]
    pos_query = _heads(m.pos_q_proj(m.rel_embeddings)[None], h)[0]
    c2p = torch.einsum("bhid,hijd->bhij", q, pos_key[:, rel + m.span])
    # key j at position j − i from query i: its row of the table read at −(j − i), clipped as the code clips it
    p2c = torch.einsum("bhjd,hijd->bhij", k, pos_query[:, (-rel.T + m.span).clamp(0, 2 * m.span - 1)])
    terms = (c2p + p2c) / math.sqrt(3 * m.d)
    return m.out(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=terms, scale=(3 * m.d) ** -0.5)))


CORRECT = [("DecomposedRelPos", 9, ()), ("FlatShaw", 7, ()), ("AxialKeyPos", 9, ()), ("ContinuousBias", 9, ()),
           ("TanhCappedBias", 7, ()), ("GainedTable", 9, ()), ("ScaledCosine", 7, ()), ("LearnedTemperature", 7, ()),
           ("DividedTemperature", 7, ("--causal",)), ("CosineWithBias", 9, ()), ("BertRelativeKey", 7, ("mask",)),
           ("AdditivePadding", 7, ("mask",)), ("WherePadding", 7, ("mask",)), ("Disentangled", 7, ()),
           ("DisentangledBmm", 7, ()), ("DisentangledEinsum", 7, ())]
PLANTS = [("DecomposedRelPos", "no_scale", "scale.none"), ("DecomposedRelPos", "softmax_axis", "softmax.axis"),
          ("DecomposedRelPos", "merge_no_transpose", "heads.merge_without_transpose"),
          ("FlatShaw", "kv_swapped", "kv.swapped"), ("AxialKeyPos", "no_scale", "scale.none"),
          ("AxialKeyPos", "merge_no_transpose", "heads.merge_without_transpose"),
          ("ContinuousBias", "bias_transposed", "t5.transposed"), ("ContinuousBias", "kv_swapped", "kv.swapped"),
          ("TanhCappedBias", "bias_transposed", "t5.transposed"), ("TanhCappedBias", "softmax_axis", "softmax.axis"),
          ("GainedTable", "bias_transposed", "t5.transposed"), ("GainedTable", "scale_twice", "scale.twice"),
          ("ScaledCosine", "values_from_keys", "kv.values_from_keys"),
          ("ScaledCosine", "softmax_axis", "softmax.axis"),
          ("LearnedTemperature", "kv_swapped", "kv.swapped"),
          ("LearnedTemperature", "merge_no_transpose", "heads.merge_without_transpose"),
          ("DividedTemperature", "values_from_keys", "kv.values_from_keys"),
          ("DividedTemperature", "softmax_axis", "softmax.axis"), ("CosineWithBias", "kv_swapped", "kv.swapped"),
          ("BertRelativeKey", "softmax_axis", "softmax.axis"), ("AdditivePadding", "softmax_axis", "softmax.axis"),
          ("WherePadding", "softmax_axis", "softmax.axis"),
          ("Disentangled", "values_from_keys", "kv.values_from_keys"),
          ("DisentangledBmm", "values_from_keys", "kv.values_from_keys"),
          ("DisentangledBmm", "merge_no_transpose", "heads.merge_without_transpose"),
          ("DisentangledEinsum", "values_from_keys", "kv.values_from_keys")]
TAKES = {name: (n, args) for name, n, args in CORRECT}


def _args(name, folder):
    n, args = TAKES[name]
    if "mask" in args:
        np.save(folder / "keep.npy", KEEP)
        return ("--nq", str(n), "--batch", "2", "--mask", str(folder / "keep.npy"))
    return ("--nq", str(n), *args)


def _input(name):
    n, args = TAKES[name]
    x = torch.randn(2, n, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if "mask" in args:
        return (x, torch.as_tensor(KEEP)), KEEP
    if "--causal" in args:
        return (x, torch.ones(n, n, dtype=torch.bool).tril()), None
    return (x,), None


def test_the_styles_are_sdpa_with_their_terms_and_the_plants_change_them():
    with torch.no_grad():
        for name, _, _ in CORRECT:
            cls = getattr(styles, name)
            m = cls().double().eval()
            given, keep = _input(name)
            want = _want(m, given[0], keep)
            assert torch.allclose(m(*given), want, atol=1e-9), name
            for style, bug, _ in PLANTS:
                if style == name:
                    assert (planted(cls, m, bug, *given) - want).abs().max() > 1e-3, (name, bug)


@pytest.mark.parametrize("name", [c[0] for c in CORRECT])
def test_terms_biases_and_temperatures_of_its_own_are_its_conventions(runner, tmp_path, name):
    result, out = trace(runner, f"{STYLES}:{name}", *_args(name, tmp_path))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["first_divergence"] is None and out["error"] is None
    notes = out["notes"]
    said = {"term": any(n.startswith("your code adds a term of its own to its scores") for n in notes),
            "bias": any(n.startswith("your code makes a position bias of its own") for n in notes),
            "temperature": any(n.startswith("your code scales its scores by a learned temperature of its own")
                               for n in notes)}
    kind = "term" if name in ("DecomposedRelPos", "FlatShaw", "AxialKeyPos", "BertRelativeKey") \
        or name.startswith("Disentangled") else "bias" if name in ("ContinuousBias", "TanhCappedBias", "GainedTable") \
        else "temperature" if name != "AdditivePadding" and name != "WherePadding" else None
    assert kind is None or said[kind], notes
    if name in ("ScaledCosine", "LearnedTemperature", "DividedTemperature", "CosineWithBias"):
        note = next(n for n in notes if n.startswith("your code scales its scores by a learned temperature"))
        assert "one a head: " in note and note.endswith("a convention, not a mistake")
        assert "your own scale per head" in out["reference"]
    if name == "CosineWithBias":
        assert said["bias"], notes


@pytest.mark.parametrize(("name", "bug", "cause"), PLANTS, ids=[f"{p[0]}-{p[1]}" for p in PLANTS])
def test_mistakes_beside_them_are_named_by_experiment(runner, tmp_path, name, bug, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", f"bug='{bug}'", *_args(name, tmp_path))
    assert result.exit_code == 1, result.stdout + result.stderr
    first = out["first_divergence"]
    assert first["experiment"] == cause, first
    assert first["evidence"].startswith("by experiment"), first


def test_a_scale_asked_for_is_the_references_not_the_temperature(runner):
    """--scale says the reference's scale: a temperature of the code's that differs from it is compared with it."""
    result, out = trace(runner, f"{STYLES}:LearnedTemperature", "--scale", "0.3")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["reference"] == "scores"
    assert not any(n.startswith("your code scales its scores by a learned temperature") for n in out["notes"])


def _shifted_windows():
    """Swin's shifted-window mask for a 6×6 image, windows of 3×3 shifted by 1: [4, 9, 9], True = may attend (the
    tokens of one window from one region of the rolled image)."""
    image = torch.zeros(6, 6)
    for i, (h, w) in enumerate((h, w) for h in (slice(0, -3), slice(-3, -1), slice(-1, None))
                               for w in (slice(0, -3), slice(-3, -1), slice(-1, None))):
        image[h, w] = i
    regions = image.view(2, 3, 2, 3).permute(0, 2, 1, 3).reshape(4, 9)
    return regions[:, None, :] == regions[:, :, None]


def test_a_mask_a_window_is_the_references_for_each_window_of_the_batch(runner, tmp_path):
    """A file [nW, N, N] for code that adds it per window (`attn.view(B // nW, nW, ..) + mask`) and a batch of two
    images' windows: row b of the batch masked by the file's row b mod nW."""
    keep = _shifted_windows()
    np.save(tmp_path / "windows.npy", keep.numpy())
    m = styles.GainedTable().double().eval()
    x = torch.randn(8, 9, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    additive = torch.zeros(4, 9, 9, dtype=torch.float64).masked_fill(~keep, -math.inf)
    with torch.no_grad():
        q, k, v = _fused(m, x, m.qkv)
        bias = m.relative_position_bias_table[m.relative_position_index].permute(2, 0, 1) * m.bias_gain[:, None, None]
        tiled = additive.repeat(2, 1, 1)[:, None]  # [8, 1, 9, 9]: batch element b, window b mod 4
        want = m.proj(_merged(F.scaled_dot_product_attention(q, k, v, attn_mask=bias + tiled)))
        assert torch.allclose(m(x, additive), want, atol=1e-9)
        assert not torch.allclose(planted(styles.GainedTable, m, "mask_after_softmax", x, additive), want, atol=1e-3)
    args = ("--nq", "9", "--batch", "8", "--mask", str(tmp_path / "windows.npy"))
    result, out = trace(runner, f"{STYLES}:GainedTable", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any("[4, n_Q, n_K], one mask a window: n_batch = 8 holds 2 groups of 4 windows" in n for n in out["notes"])
    result, out = trace(runner, f"{STYLES}:GainedTable", "--init", "bug='mask_after_softmax'", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "mask.after_softmax", out["first_divergence"]


def test_a_learned_scale_of_one_number_is_the_catalogs_where_a_mistake_gives_it(runner):
    """One learned scale for every head: a trained value is the code's own (a note, exit 0); one started at
    d_model^-0.5 (PatchTST's lsa scale planted) is the catalog's scale.d_model, not a temperature of its own."""
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        for value in (0.3, None):
            m = styles.LearnedScalarScale(value=value).double().eval()
            q, k, v = (_heads(f(x), 4) for f in (m.W_Q, m.W_K, m.W_V))
            want = m.to_out(_merged(F.scaled_dot_product_attention(q, k, v, scale=float(m.scale))))
            assert torch.allclose(m(x), want, atol=1e-9)
        wrong = styles.LearnedScalarScale(bug="scale_d_model").double().eval()  # its own start, m's weights
        wrong.load_state_dict({**m.state_dict(), "scale": wrong.scale.detach()})
        assert not torch.allclose(wrong(x), want, atol=1e-3)
    for init in ("value=None", "value=0.3"):
        result, out = trace(runner, f"{STYLES}:LearnedScalarScale", "--init", init)
        assert result.exit_code == 0, result.stdout + result.stderr
    assert any("0.3 in every head" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:LearnedScalarScale", "--init", "bug='scale_d_model'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == "scale.d_model", out["first_divergence"]
