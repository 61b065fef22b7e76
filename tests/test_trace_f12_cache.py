"""`attnscope trace` reads a decode step's cache in the forms code takes it besides one `(k, v)` in one parameter
(tests/trace_styles_f12_cache.py):

- the keys and the values as two parameters (`past_key, past_value`; `k_cache, v_cache` sequence-major): before,
  "--cache 3 runs a decode step, which needs a module whose forward takes x and a cache" (exit 2);
- a dict (`cache["k"]`; `layer_past.get("key")`, heads folded into the batch): before, "your code raised TypeError:
  tuple indices must be integers or slices, not str" (exit 1);
- GPTBigCode's keys and values joined on the last axis (`layer_past` [n_batch, n_cache, 2·d_head], multi-query;
  [n_batch, n_head, n_cache, 2·d_head]): before, "expected Tensor as element 0 in argument 0, but got tuple" (exit 1);
- a cache the module holds itself, written at the new positions (gpt-fast's KVCache buffers at `input_pos`, the whole
  buffer attended under the mask; `index_copy_` at `input_pos`; torchtune's KVCache counting its own positions in
  `cache_pos`; Meta-like plain attributes at `start_pos` with its own RoPE table): before, "--cache 3 runs a decode
  step, which needs a module whose forward takes x and a cache";
- multi-head latent attention (DeepSeek-V2/V3's MLA) in a decode step, its cache every head's keys and values expanded
  (a tuple `past_key_value`; DeepSeek's inference k_cache, v_cache held at start_pos): before, refused ("... whose
  reference trace builds for self-attention without a cache").

Each correct style passes with a note that says how its cache was read; its join in the wrong order is `cache.order`,
SDPA's `is_causal=True` (or a mask of the square's diagonal) in a decode step `mask.upper_left`, and a third plant of
each style its own cause, all by experiment. Each style is checked apart from attnscope against
F.scaled_dot_product_attention in float64, and each planted bug shown to change its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from test_trace_round7_heldcache import _decode64  # SDPA over the cache joined, lower-right, kv heads repeated

STYLES = str(Path(__file__).resolve().parent / "trace_styles_f12_cache.py")
styles = user_module(STYLES)


def _heads(t, h):  # [B, T, h·d] -> [B, h, T, d], float64
    return t.double().view(*t.shape[:2], h, -1).transpose(1, 2)


def _lin(layer, x):
    return F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())


def _out(y, layer):  # [B, H, T, D] -> the output projection of [B, T, H·D]
    return _lin(layer, y.transpose(1, 2).flatten(2))


def _bugs_change(make, bugs, call):
    for bug in bugs:
        torch.manual_seed(1)
        right = make().eval()
        torch.manual_seed(1)
        wrong = make(bug=bug).eval()
        assert not torch.allclose(call(wrong), call(right), atol=1e-3), (make.__name__, bug)


def test_the_cache_forms_are_sdpa_over_the_joined_cache_and_the_bugs_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g)
    cache = (torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 4, 3, 8, generator=g))  # [B, H, N, D]
    lower_right = torch.zeros(5, 8).masked_fill(~torch.ones(5, 8, dtype=torch.bool).tril(3), float("-inf"))
    with torch.no_grad():
        torch.manual_seed(1)
        m = styles.PastKeyValueArgs().eval()
        want = _out(_decode64(*(_heads(_lin(p, x), 4) for p in (m.q_proj, m.k_proj, m.v_proj)), cache), m.o_proj)
        assert torch.allclose(m(x, lower_right, *cache).double(), want, atol=1e-5)
        _bugs_change(styles.PastKeyValueArgs, ("new_first", "is_causal", "no_scale"), lambda f: f(x, lower_right,
                                                                                                    *cache))

        gqa = (torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g))
        seq = tuple(t.transpose(1, 2).contiguous() for t in gqa)  # [B, N, H_kv, D]
        torch.manual_seed(1)
        s = styles.SeqMajorArgs().eval()
        want = _out(_decode64(_heads(_lin(s.wq, x), 4), _heads(_lin(s.wk, x), 2), _heads(_lin(s.wv, x), 2), gqa),
                    s.wo)
        assert torch.allclose(s(x, *seq).double(), want, atol=1e-5)
        _bugs_change(styles.SeqMajorArgs, ("new_first", "is_causal", "tiled"), lambda f: f(x, *seq))

        torch.manual_seed(1)
        d = styles.DictCache().eval()
        as_dict = {"k": cache[0], "v": cache[1]}
        want = _out(_decode64(*(_heads(_lin(p, x), 4) for p in (d.to_q, d.to_k, d.to_v)), cache), d.to_out)
        assert torch.allclose(d(x, as_dict).double(), want, atol=1e-5)
        _bugs_change(styles.DictCache, ("new_first", "is_causal", "no_scale"), lambda f: f(x, as_dict))

        torch.manual_seed(1)
        p = styles.LayerPastDict().eval()
        folded = {"key": cache[0].reshape(8, 3, 8), "value": cache[1].reshape(8, 3, 8)}  # [B·H, N, D]
        want = _out(_decode64(*(_heads(_lin(f, x), 4) for f in (p.q_proj, p.k_proj, p.v_proj)), cache), p.out_proj)
        assert torch.allclose(p(x, folded).double(), want, atol=1e-5)
        _bugs_change(styles.LayerPastDict, ("new_first", "upper_left", "no_scale"), lambda f: f(x, folded))

        mqa = (torch.randn(2, 1, 3, 8, generator=g), torch.randn(2, 1, 3, 8, generator=g))  # one key/value head
        fused = torch.cat(mqa, dim=-1).squeeze(1)  # [B, N, 2·D]
        torch.manual_seed(1)
        b = styles.FusedMQACache().eval()
        q, k, v = _lin(b.c_attn, x).split((32, 8, 8), dim=-1)
        want = _out(_decode64(_heads(q, 4), _heads(k, 1), _heads(v, 1), mqa), b.c_proj)
        assert torch.allclose(b(x, fused).double(), want, atol=1e-5)
        _bugs_change(styles.FusedMQACache, ("new_first", "is_causal", "no_scale"), lambda f: f(x, fused))

        joined = torch.cat(cache, dim=-1)  # [B, H, N, 2·D]
        torch.manual_seed(1)
        h = styles.FusedHeadsCache().eval()
        k, v = _lin(h.to_kv, x).chunk(2, dim=-1)
        want = _out(_decode64(_heads(_lin(h.to_q, x), 4), _heads(k, 4), _heads(v, 4), cache), h.to_out)
        assert torch.allclose(h(x, joined).double(), want, atol=1e-5)
        _bugs_change(styles.FusedHeadsCache, ("new_first", "is_causal", "values_first"), lambda f: f(x, joined))


# each form in two styles: one with its join in the wrong order and SDPA's is_causal (or the square's diagonal), the
# other with a third mistake of its own
FORMS = [("PastKeyValueArgs", "past_key, past_value: your code takes its cache as two parameters",
          (("new_first", "cache.order"), ("is_causal", "mask.upper_left"))),
         ("SeqMajorArgs", "k_cache, v_cache: your code keeps its cache as [n_batch, n_cache, n_kv_head, d_head]",
          (("tiled", "gqa.tiled"),)),
         ("LayerPastDict", "layer_past: your code reads its cache as a dict, layer_past['key'] and "
          "layer_past['value']", (("new_first", "cache.order"), ("upper_left", "mask.upper_left"))),
         ("DictCache", "cache: your code reads its cache as a dict, cache['k'] and cache['v']",
          (("no_scale", "scale.none"),)),
         ("FusedMQACache", "layer_past: your code keeps its cache as [n_batch·n_kv_head, n_cache, 2·d_head] (keys "
          "and values joined on the last axis", (("new_first", "cache.order"), ("is_causal", "mask.upper_left"))),
         ("FusedHeadsCache", "layer_past: your code keeps its cache as [n_batch, n_kv_head, n_cache, 2·d_head]",
          (("values_first", "kv.swapped"),))]


@pytest.mark.parametrize(("name", "said", "plants"), FORMS, ids=[f[0] for f in FORMS])
def test_a_cache_in_another_form_passes_and_its_mistakes_are_named_by_experiment(runner, name, said, plants):
    args = (f"{STYLES}:{name}", "--causal", "--cache", "3")
    result, out = trace(runner, *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(said in n for n in out["notes"]), out["notes"]
    _named(runner, args, plants)


def _named(runner, args, plants):
    for planted, named in plants:
        result, out = trace(runner, *args, "--init", f"bug={planted!r}")
        assert result.exit_code == 1, result.stdout + result.stderr
        first = out["first_divergence"]
        assert first["experiment"] == named and first["evidence"].startswith("by experiment"), (planted, first)


def _rope64(t, start):  # [B, H, T, D] half-split at positions start .. start + T - 1, base 10000, float64
    d = t.shape[-1]
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(start, start + t.shape[2], dtype=torch.float64), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin


def test_the_held_caches_are_sdpa_over_the_cache_they_hold_and_the_bugs_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g)
    gqa = (torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g))  # [B, H_kv, N, D]
    full = (torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 4, 3, 8, generator=g))
    input_pos = torch.arange(3, 8)
    allowed = torch.ones(5, 8, dtype=torch.bool).tril(3)

    def holding(make, cache, axis, bug=None):  # the module, its cache at positions 0 .. 2 of a room 8 long
        torch.manual_seed(1)
        m = make(bug=bug).eval()
        owner, names = (m.kv_cache, ("k_cache", "v_cache")) if make is styles.GptFastHeld else (m, ("cache_k",
                                                                                                   "cache_v"))
        for name, part in zip(names, cache, strict=True):
            held = part.transpose(1, 2) if axis == 1 else part
            room = torch.cat([held, held.new_zeros(*held.shape[:axis], 5, *held.shape[axis + 1:])], dim=axis)
            setattr(owner, name, room)
        return m

    with torch.no_grad():
        m = holding(styles.GptFastHeld, gqa, 2)
        q, k, v = _lin(m.wqkv, x).split([32, 16, 16], dim=-1)
        want = _out(_decode64(_heads(q, 4), _heads(k, 2), _heads(v, 2), gqa), m.wo)
        assert torch.allclose(m(x, allowed, input_pos).double(), want, atol=1e-5)
        for bug in ("is_causal", "tiled"):
            wrong = holding(styles.GptFastHeld, gqa, 2, bug)
            assert not torch.allclose(wrong(x, allowed, input_pos), m(x, allowed, input_pos), atol=1e-3), bug

        i = holding(styles.IndexCopyHeld, full, 2)
        want = _out(_decode64(*(_heads(_lin(p, x), 4) for p in (i.q_proj, i.k_proj, i.v_proj)), full), i.output_proj)
        assert torch.allclose(i(x, mask=allowed, input_pos=input_pos).double(), want, atol=1e-5)
        for bug in ("new_first", "is_causal", "no_scale"):
            right, wrong = holding(styles.IndexCopyHeld, full, 2), holding(styles.IndexCopyHeld, full, 2, bug)
            assert not torch.allclose(wrong(x, mask=allowed, input_pos=input_pos),
                                      right(x, mask=allowed, input_pos=input_pos), atol=1e-3), bug

        def counting(bug=None):  # torchtune's: its cache_pos moved 3 on, as after 3 positions
            torch.manual_seed(1)
            c = styles.CountingHeld(bug=bug).eval()
            c.kv_cache.k_cache[:, :, :3], c.kv_cache.v_cache[:, :, :3] = gqa
            c.kv_cache.k_cache, c.kv_cache.v_cache = c.kv_cache.k_cache[:, :, :8], c.kv_cache.v_cache[:, :, :8]
            c.kv_cache.cache_pos.add_(3)
            return c

        c = counting()
        want = _out(_decode64(*(_heads(_lin(p, x), n) for p, n in ((c.q_proj, 4), (c.k_proj, 2), (c.v_proj, 2))),
                              gqa), c.output_proj)
        assert torch.allclose(c(x, mask=allowed).double(), want, atol=1e-5)
        for bug in ("is_causal", "no_scale"):
            assert not torch.allclose(counting(bug)(x, mask=allowed), counting()(x, mask=allowed), atol=1e-3), bug

        s = holding(styles.StartPosHeld, gqa, 1)
        q, k = _rope64(_heads(_lin(s.wq, x), 4), 3), _rope64(_heads(_lin(s.wk, x), 2), 3)
        want = _out(_decode64(q, k, _heads(_lin(s.wv, x), 2), gqa), s.wo)
        assert torch.allclose(s(x, start_pos=3).double(), want, atol=1e-5)
        for bug in ("new_first", "upper_left", "no_offset"):
            right, wrong = holding(styles.StartPosHeld, gqa, 1), holding(styles.StartPosHeld, gqa, 1, bug)
            assert not torch.allclose(wrong(x, start_pos=3), right(x, start_pos=3), atol=1e-3), bug


HELD = [("GptFastHeld", (), "kv_cache.k_cache, kv_cache.v_cache", "[n_batch, n_kv_head, n_cache, d_head]",
         (("tiled", "gqa.tiled"),)),
        ("IndexCopyHeld", (), "cache_k, cache_v", "[n_batch, n_kv_head, n_cache, d_head]",
         (("is_causal", "mask.upper_left"), ("no_scale", "scale.none"))),
        ("CountingHeld", (), "kv_cache.k_cache, kv_cache.v_cache", "[n_batch, n_kv_head, n_cache, d_head]",
         (("is_causal", "mask.upper_left"),)),
        ("StartPosHeld", ("--rope",), "cache_k, cache_v", "[n_batch, n_cache, n_kv_head, d_head]",
         (("new_first", "cache.order"), ("no_offset", "rope.positions")))]


@pytest.mark.parametrize(("name", "more", "names", "layout", "plants"), HELD, ids=[h[0] for h in HELD])
def test_a_cache_the_module_holds_is_read_from_what_it_writes(runner, name, more, names, layout, plants):
    args = (f"{STYLES}:{name}", *more, "--causal", "--cache", "3")
    result, out = trace(runner, *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith(f"{names}: your module holds its cache itself, {layout}") for n in out["notes"]), \
        out["notes"]
    _named(runner, args, plants)


def _pairs64(t, start):  # [.., T, d] interleaved pairs (0, 1), (2, 3), ... at positions start .., base 10000
    d = t.shape[-1]
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(start, start + t.shape[-2], dtype=torch.float64), inv)
    even, odd = t[..., 0::2], t[..., 1::2]
    return torch.stack([even * angles.cos() - odd * angles.sin(), even * angles.sin() + odd * angles.cos()],
                       -1).flatten(-2)


def _norm64(t, norm):
    t = t.double()
    return norm.weight.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps)


def test_the_latent_styles_are_sdpa_over_the_expanded_cache_and_the_bugs_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g)
    cache = (torch.randn(2, 4, 3, 12, generator=g), torch.randn(2, 4, 3, 6, generator=g))  # d_K 12, d_V 6
    with torch.no_grad():
        torch.manual_seed(1)
        m = styles.LatentDecode().eval()
        q = _heads(_lin(m.q_proj, x), 4)
        latent, k_pe = _lin(m.kv_a_proj_with_mqa, x).split([12, 4], dim=-1)
        k_nope, v = _heads(_lin(m.kv_b_proj, _norm64(latent, m.kv_a_layernorm)), 4).split([8, 6], dim=-1)
        k = torch.cat([k_nope, _rope64(k_pe[:, None], 3).expand(-1, 4, -1, -1)], -1)
        q = torch.cat([q[..., :8], _rope64(q[..., 8:], 3)], -1)
        want = _out(_decode64(q, k, v, cache), m.o_proj)
        assert torch.allclose(m(x, cache).double(), want, atol=1e-5)
        _bugs_change(styles.LatentDecode, ("new_first", "is_causal", "scale_hidden"), lambda f: f(x, cache))

        def holding(bug=None):
            torch.manual_seed(1)
            h = styles.LatentHeld(bug=bug).eval()
            h.k_cache[:, :3], h.v_cache[:, :3] = cache[0].transpose(1, 2), cache[1].transpose(1, 2)  # [B, N, H, D]
            return h

        h = holding()
        q = _lin(h.wq_b, _norm64(_lin(h.wq_a, x), h.q_norm)).view(2, 5, 4, 12).transpose(1, 2)
        latent, k_pe = _lin(h.wkv_a, x).split([12, 4], dim=-1)
        k_nope, v = _heads(_lin(h.wkv_b, _norm64(latent, h.kv_norm)), 4).split([8, 6], dim=-1)
        k = torch.cat([k_nope, _pairs64(k_pe[:, None], 3).expand(-1, 4, -1, -1)], -1)
        q = torch.cat([q[..., :8], _pairs64(q[..., 8:], 3)], -1)
        want = _out(_decode64(q, k, v, cache), h.wo)
        assert torch.allclose(holding()(x, start_pos=3).double(), want, atol=1e-5)
        for bug in ("new_first", "upper_left", "softmax_queries"):
            assert not torch.allclose(holding(bug)(x, start_pos=3), holding()(x, start_pos=3), atol=1e-3), bug


LATENT = [("LatentDecode", "past_key_value: multi-head latent attention in a decode step",
           (("new_first", "cache.order"), ("scale_hidden", "scale.d_model"))),
          ("LatentHeld", "k_cache, v_cache: multi-head latent attention in a decode step",
           (("upper_left", "mask.upper_left"), ("softmax_queries", "softmax.axis")))]


@pytest.mark.parametrize(("name", "said", "plants"), LATENT, ids=[lat[0] for lat in LATENT])
def test_latent_attention_in_a_decode_step_is_handed_the_keys_and_values_its_latents_expand_into(runner, name, said,
                                                                                                  plants):
    args = (f"{STYLES}:{name}", "--rope", "--causal", "--cache", "3")
    result, out = trace(runner, *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith(said) for n in out["notes"]), out["notes"]
    assert "LatentAttention" in out["reference"], out["reference"]
    _named(runner, args, plants)
