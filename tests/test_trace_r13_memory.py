"""`attnscope trace` on cross-attention whose keys and values read an input of another width than the queries'
(round 13b's Perceiver gaps), with styles of its own (tests/trace_styles_r13_memory.py):

- --nk for a memory parameter defaulting to None whose key/value projection reads another width (a fused `to_kv`,
  nothing said before a run): the memory is tried at each width the module's weights hold, kept where the key and
  value projections read it; so is a memory the code raises without (transformers' Perceiver `inputs=None`);
- a module whose one input feeds its keys and values alone, its queries its own latents of another width (a
  Q-Former's query tokens, an attention pool through nn.MultiheadAttention(kdim=..)): the input gets the width a
  layer of the module reads, --d-feat that width is accepted, --nk its length;
- a mask given to the mask parameter the code reads (transformers' Perceiver reads inputs_mask in cross-attention,
  never attention_mask).

Each correct style is checked against transformers' module, F.scaled_dot_product_attention or a float64 formula;
each plant is shown to change the output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r13_memory.py")
styles = user_module(STYLES)


def _moved(module, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module.double().eval()


def _heads(t, h=4):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def _merged(t):
    return t.transpose(1, 2).flatten(2)


def _planted(cls, ours, bug, *args, **kw):
    wrong = cls(bug=bug).double().eval()
    wrong.load_state_dict(ours.state_dict())
    return wrong(*args, **kw)


def test_the_styles_are_their_references_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x, feats = torch.randn(2, 5, 32, generator=g, dtype=torch.float64), torch.randn(
        2, 7, 16, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    with torch.no_grad():
        io = _moved(styles.IOCrossAttend())
        k, v = io.to_kv(feats).chunk(2, -1)
        want = io.proj(_merged(F.scaled_dot_product_attention(_heads(io.to_q(x)), _heads(k), _heads(v))))
        assert torch.allclose(io(x, features=feats), want, atol=1e-10)
        assert (_planted(styles.IOCrossAttend, io, "v_from_k", x, features=feats) - want).abs().max() > 1e-2

        from transformers import PerceiverConfig
        from transformers.models.perceiver.modeling_perceiver import PerceiverAttention

        pc = _moved(styles.PerceiverCrossAttention())
        hf = PerceiverAttention(PerceiverConfig(attention_probs_dropout_prob=0.0), is_cross_attention=True,
                                qk_channels=32, v_channels=32, num_heads=4, q_dim=32, kv_dim=16,
                                use_query_residual=False).double().eval()
        hf.load_state_dict({("output." if n.startswith("dense") else "self.") + n: t
                            for n, t in pc.state_dict().items()})
        additive = (~keep)[:, None, None, :].double() * -1e9
        want = hf(x, inputs=feats, inputs_mask=additive)[0]
        assert torch.allclose(pc(x, inputs=feats, inputs_mask=additive)[0], want, atol=1e-10)
        assert (_planted(styles.PerceiverCrossAttention, pc, "no_scale", x, inputs=feats, inputs_mask=additive)[0]
                - want).abs().max() > 1e-2

        media = torch.randn(2, 7, 24, generator=g, dtype=torch.float64)
        fl = _moved(styles.MaskedCrossAttention())
        k, v = fl.to_kv(media).chunk(2, -1)
        q = fl.to_q(F.layer_norm(x, (32,), fl.norm.weight, fl.norm.bias))
        want = fl.to_out(_merged(F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v))))
        assert torch.allclose(fl(x, media), want, atol=1e-10)
        assert (_planted(styles.MaskedCrossAttention, fl, "no_scale", x, media) - want).abs().max() > 1e-2

        qf = _moved(styles.QFormerPool())
        q = qf.query(qf.query_tokens.expand(2, -1, -1))
        attend = keep[:, None, None, :]
        want = qf.dense(_merged(F.scaled_dot_product_attention(_heads(q), _heads(qf.key(feats)),
                                                               _heads(qf.value(feats)), attn_mask=attend)))
        assert torch.allclose(qf(feats, keep.long()), want, atol=1e-10)
        assert (_planted(styles.QFormerPool, qf, "no_scale", feats, keep.long()) - want).abs().max() > 1e-2

        bert = _moved(styles.BertCrossSelfAttention())  # transformers 4.x's BertSelfAttention(is_cross_attention)
        enc = torch.randn(2, 7, 24, generator=g, dtype=torch.float64)
        want = bert.output(_merged(F.scaled_dot_product_attention(
            _heads(bert.query(x)), _heads(bert.key(enc)), _heads(bert.value(enc)), attn_mask=additive)))
        unread = torch.randn(2, 1, 1, 5, generator=g, dtype=torch.float64)
        got = bert(x, attention_mask=unread, encoder_hidden_states=enc, encoder_attention_mask=additive)
        assert torch.allclose(got, want, atol=1e-10)

        pma = _moved(styles.SeedPool())
        q = pma.fc_q(pma.S.expand(2, -1, -1))
        want = pma.fc_o(_merged(F.scaled_dot_product_attention(_heads(q, 2), _heads(pma.fc_k(feats), 2),
                                                               _heads(pma.fc_v(feats), 2))))
        assert torch.allclose(pma(feats), want, atol=1e-10)

        pool = _moved(styles.AttentionPool())
        a = pool.attn
        b_q, b_k, b_v = a.in_proj_bias.chunk(3)
        q = pool.queries.expand(2, -1, -1) @ a.q_proj_weight.T + b_q
        k, v = feats @ a.k_proj_weight.T + b_k, feats @ a.v_proj_weight.T + b_v
        want = a.out_proj(_merged(F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), attn_mask=attend)))
        assert torch.allclose(pool(feats, key_padding_mask=~keep), want, atol=1e-10)


@pytest.fixture(scope="module")
def pad(tmp_path_factory):
    keep = np.ones((2, 9), dtype=bool)
    keep[0, 7:], keep[1, 4:] = False, False
    path = tmp_path_factory.mktemp("r13") / "pad.npy"
    np.save(path, keep)
    return str(path)


def _memory_noted(out, memory, n_K):
    return any(n.startswith(f"{memory}: the memory your code takes its keys and values from (cross-attention, "
                            f"n_K = {n_K}), read from its data flow") for n in out["notes"])


@pytest.mark.parametrize(("name", "args", "memory"), [
    ("IOCrossAttend", ("--nk", "9"), "features"),  # behind attn_bias=None, read by a fused to_kv of 16
    ("IOCrossAttend", (), None),  # raised with features None (to_kv on the queries' width)
    ("PerceiverCrossAttention", ("--nk", "9"), None),  # inputs fed up front: key reads kv_dim, not q_dim
])
def test_a_memory_of_another_width_is_read_from_the_data_flow(runner, name, args, memory):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    n_K = out["params"]["sizes"]["n_K"]
    assert out["params"]["sizes"]["d_kv_in"] == 16 and (n_K == 9 or not args)
    assert memory is None or _memory_noted(out, memory, n_K), out["notes"]


@pytest.mark.parametrize(("name", "args", "n_Q"), [
    ("QFormerPool", (), 4),
    ("SeedPool", ("--nk", "9"), 3),  # 2 heads of 8, read from the queries before their split (16), not 32 / 8
    ("QFormerPool", ("--nk", "9"), 4),
    ("QFormerPool", ("--init", "hidden_size=32, encoder_width=16", "--d-feat", "16"), 4),  # the input's width
    ("AttentionPool", ("--nk", "9"), 3),
])
def test_latents_read_an_input_of_the_width_its_layers_read(runner, name, args, n_Q):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    sizes = out["params"]["sizes"]
    assert (sizes["n_Q"], sizes["d_feat"], sizes["d_kv_in"]) == (n_Q, 32, 16), sizes
    assert "--nk" not in args or sizes["n_K"] == 9
    assert sizes["n_head"] == (2 if name == "SeedPool" else 4), sizes
    said = [n for n in out["notes"] if n.startswith("your queries come from your module's own")]
    assert said and "(d_kv_in = 16, the width their projections read; d_feat = 32" in said[0], out["notes"]


@pytest.mark.parametrize(("name", "mask"), [
    ("PerceiverCrossAttention", "inputs_mask"),  # its attention_mask is left unread in cross-attention
    ("BertCrossSelfAttention", "encoder_attention_mask"),  # the same
    ("QFormerPool", "image_attention_mask"),
    ("AttentionPool", "key_padding_mask"),
])
def test_a_padding_mask_of_the_memory_goes_where_the_code_reads_it(runner, pad, name, mask):
    result, out = trace(runner, f"{STYLES}:{name}", "--batch", "2", "--mask", pad, "--nk", "9")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == 9
    assert any(n.startswith(f"{mask}: ") for n in out["notes"]), out["notes"]


@pytest.mark.parametrize(("name", "args", "cause"), [
    ("IOCrossAttend", ("--init", "bug='v_from_k'", "--nk", "9"), "kv.values_from_keys"),
    ("PerceiverCrossAttention", ("--init", "bug='no_scale'"), "scale.none"),
    ("MaskedCrossAttention", ("--init", "bug='no_scale'"), "scale.none"),
    ("QFormerPool", ("--init", "bug='no_scale'"), "scale.none"),
])
def test_mistakes_beside_an_input_of_another_width_are_named_by_experiment(runner, name, args, cause):
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def test_nk_is_still_refused_for_self_attention_and_d_feat_for_a_width_no_layer_reads(runner):
    result, _ = trace(runner, f"{STYLES}:PlainSelf", "--nk", "5")
    assert result.exit_code == 2
    assert "PlainSelf.forward(x) takes one tensor (self-attention), so n_K = n_Q; drop --nk" in result.stderr
    result, _ = trace(runner, f"{STYLES}:QFormerPool", "--init", "hidden_size=32", "--d-feat", "20")
    assert result.exit_code == 2
    assert "--d-feat 20 but the module's Linear layers read 16 or 32 features; drop --d-feat" in result.stderr
