"""`attnscope trace` on round 13a's SD3 and Segformer forms, in styles of its own (tests/trace_styles_r13_flow.py):
qk-norm gains read from the norms the run calls (a module holding more norms than its self-attention uses:
diffusers' norm_added_q/k, a memory's pair), and keys and values read from a tensor the module makes from its input
(Segformer's and PVT's spatial reduction, a pooled memory), with a declared projection the run never calls. Each
correct style is checked against SDPA on float64 formulas; each plant is shown to change the output and is named by
experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r13_flow.py")
styles = user_module(STYLES)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _heads(t, b, h=4):
    return t.reshape(b, t.shape[1], h, -1).transpose(1, 2)


def _merged(y):
    return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)


def _reduced(m, x, h, w, conv, norm):
    """LayerNorm(Conv2d(x as an image)), float64, [b, n_K, d]."""
    image = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)
    made = F.conv2d(image, conv.weight, conv.bias, stride=conv.stride).flatten(2).transpose(1, 2)
    centred = made - made.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias


def _want(m, x):
    b = x.shape[0]
    if isinstance(m, (styles.DiffusersNormed, styles.LayerNormed)):
        q, k, v = (_heads(f(x), b) for f in (m.to_q, m.to_k, m.to_v))
        if isinstance(m, styles.LayerNormed):
            q, k = ((t - t.mean(-1, keepdim=True)) for t in (q, k))
            q = _rms(q, 1e-6) * m.norm_q.weight + m.norm_q.bias
            k = _rms(k, 1e-6) * m.norm_k.weight + m.norm_k.bias
        else:
            q, k = _rms(q, 1e-6) * m.norm_q.weight, _rms(k, 1e-6) * m.norm_k.weight
        return m.to_out[0](_merged(F.scaled_dot_product_attention(q, k, v)))
    if isinstance(m, styles.T5Normed):
        q, k, v = (_heads(f(x), b) for f in (m.q, m.k, m.v))
        q, k = _rms(q, 1e-6) * m.q_layernorm.weight, _rms(k, 1e-6) * m.k_layernorm.weight
        return m.o(_merged(F.scaled_dot_product_attention(q, k, v)))
    if isinstance(m, styles.ProjNormed):
        q, k = _rms(m.q_proj(x), 1e-6) * m.q_norm.weight, _rms(m.k_proj(x), 1e-6) * m.k_norm.weight
        q, k, v = _heads(q, b), _heads(k, b), _heads(m.v_proj(x), b)
        return m.o_proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    if isinstance(m, styles.GainNormed):
        q, k, v = (_heads(t, b) for t in m.qkv(x).chunk(3, -1))
        q, k = _rms(q, 1e-6) * m.qn.gain, _rms(k, 1e-6) * m.kn.gain
        return m.proj(_merged(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    if isinstance(m, styles.BareRmsGain):
        q, k, v = (_heads(f(x), b) for f in (m.wq, m.wk, m.wv))
        q, k = _rms(q, 1e-6) * m.q_gain, _rms(k, 1e-6) * m.k_gain
        return m.wo(_merged(F.scaled_dot_product_attention(q, k, v)))
    if isinstance(m, styles.L2Scaled):
        q, k, v = (_heads(f(x), b) for f in (m.to_q, m.to_k, m.to_v))
        q = q / q.pow(2).sum(-1, keepdim=True).sqrt() * m.qk_norm_q_scale
        k = k / k.pow(2).sum(-1, keepdim=True).sqrt() * m.qk_norm_k_scale
        return m.to_out(_merged(F.scaled_dot_product_attention(q, k, v)))
    if isinstance(m, styles.BareLayerGain):
        q, k, v = (_heads(f(x), b) for f in (m.W_Q, m.W_K, m.W_V))
        q, k = ((t - t.mean(-1, keepdim=True)) for t in (q, k))
        q, k = _rms(q, 1e-5) * m.q_w + m.q_b, _rms(k, 1e-5) * m.k_w + m.k_b
        return m.W_O(_merged(F.scaled_dot_product_attention(q, k, v)))
    if isinstance(m, styles.ReducedSelfAttention):
        memory = _reduced(m, x, 4, 4, m.sr, m.layer_norm)
        q, k, v = _heads(m.query(x), b), _heads(m.key(memory), b), _heads(m.value(memory), b)
        return _merged(F.scaled_dot_product_attention(q, k, v))
    if isinstance(m, styles.PvtAttention):
        memory = _reduced(m, x, 4, 4, m.sr, m.norm)
        k, v = m.kv(memory).chunk(2, -1)
        q, k, v = _heads(m.q(x), b), _heads(k, b), _heads(v, b)
        return m.proj(_merged(F.scaled_dot_product_attention(q, k, v)))
    memory = F.adaptive_avg_pool1d(x.transpose(1, 2), m.memory).transpose(1, 2)
    q, k, v = _heads(m.to_q(x), b), _heads(m.to_k(memory), b), _heads(m.to_v(memory), b)
    return m.to_out(_merged(F.scaled_dot_product_attention(q, k, v)))


NORMED = [("DiffusersNormed", (), "kv_swapped", "kv.swapped"),
          ("DiffusersNormed", (), "dropout_on", "dropout.left_on"),
          ("DiffusersNormed", (), "split_no_permute", "heads.split_without_permute"),
          ("ProjNormed", ("--causal",), "split_no_permute", "heads.split_without_permute"),
          ("T5Normed", (), "softmax_axis", "softmax.axis"),
          ("ProjNormed", ("--causal",), "scale_d_model", "scale.d_model"),
          ("GainNormed", ("--causal",), "scale_none", "scale.none"),
          ("LayerNormed", (), "kv_swapped", "kv.swapped"),
          ("BareRmsGain", (), "kv_swapped", "kv.swapped"),
          ("L2Scaled", (), "softmax_axis", "softmax.axis"),
          ("BareLayerGain", (), "scale_d_model", "scale.d_model")]
IMAGE = ("--forward", "height=4, width=4", "--nq", "16")
REDUCED = [("ReducedSelfAttention", IMAGE, "v_from_k", "kv.values_from_keys"),
           ("ReducedSelfAttention", IMAGE, "softmax_axis", "softmax.axis"),
           ("PvtAttention", ("--forward", "H=4, W=4", "--nq", "16"), "softmax_axis", "softmax.axis"),
           ("PooledMemory", (), "v_from_k", "kv.values_from_keys"),
           ("PooledMemory", (), "scale_d_model", "scale.d_model")]


@pytest.mark.parametrize(("name", "options", "bug", "cause"), NORMED + REDUCED)
def test_the_styles_are_sdpa_and_the_plants_change_them(name, options, bug, cause):
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    m = getattr(styles, name)().double().eval()
    given = {"height": 4, "width": 4} if name == "ReducedSelfAttention" else {"H": 4, "W": 4} \
        if name == "PvtAttention" else {}
    with torch.no_grad():
        want = _want(m, x)
        assert (m(x, **given) - want).abs().max() < 1e-5  # the norms take their variance in float32
        wrong = getattr(styles, name)(bug=bug).double().eval()
        wrong.load_state_dict(m.state_dict())
        torch.manual_seed(0)
        assert (wrong(x, **given) - want).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "options", "bug", "cause"), NORMED)
def test_the_gains_of_the_norms_the_run_calls_are_read_and_the_plant_named(runner, name, options, bug, cause):
    """Two norms more than the self-attention calls (diffusers' norm_added_q/k, a memory's pair), or gains the
    attention module holds itself (`F.rms_norm(q, (d,)) * self.q_gain`, x-transformers' per-head scale after an
    l2norm, an inline LayerNorm's gain and bias): the reference takes the gains the run applies, with --qk-norm and
    without (read from the code)."""
    over = "the whole projection" if name == "ProjNormed" else "d_head"
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert any(n.startswith(f"your code normalizes q and k before the scores (qk-norm over {over}")
               for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--qk-norm", "proj" if name == "ProjNormed" else "head")
    assert result.exit_code == 0, result.stdout + result.stderr
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


@pytest.mark.parametrize(("name", "options", "bug", "cause"), REDUCED)
def test_keys_from_a_tensor_the_module_makes_are_its_input_side(runner, name, options, bug, cause):
    n_K = 3 if name == "PooledMemory" else 4
    result, out = trace(runner, f"{STYLES}:{name}", *options)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == n_K, out["params"]
    assert any(n.startswith("your key and value projections") and f"n_K = {n_K} where the input has" in n
               for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--init", f"bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


@pytest.mark.parametrize("made", ["x.transpose(1, 2).reshape(b, n, d)", "x[:, :-1]"])
def test_keys_from_the_input_laid_out_anew_are_no_input_side(runner, tmp_path, made):
    """Keys and values read from the input's tokens scrambled by a view or cut by a slice (no weight of the module's
    made them, no pooling): a mistake the line-up shows, never read as the keys' input."""
    path = tmp_path / "scrambled.py"
    path.write_text(Path(STYLES).read_text().split("class DiffusersRMSNorm")[0] + '''
class Scrambled(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        _trained(self)

    def forward(self, x):
        b, n, d = x.shape
        kv = MADE
        q, k, v = self.to_q(x), self.to_k(kv), self.to_v(kv)
        q, k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2) for t in (q, k, v))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
'''.replace("MADE", made))
    result, out = trace(runner, f"{path}:Scrambled")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert not any(n.startswith("your key and value projections") for n in out["notes"]), out["notes"]
