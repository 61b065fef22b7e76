"""`attnscope trace` runs code whose RoPE tables are an optional parameter it never reads on its config (HF Zamba2's
`position_embeddings=None`, read only under `use_mem_rope`; a NoPE layer's `cos=None, sin=None`; gpt-fast's
`freqs_cis` rotated only where given): without --rope they are left None and the reference rotates nothing (it
refused them before, asking for --rope, which would have rotated where the code does not); where the code raises
on None, one line asks for --rope. And an output projection that writes another width than the projections read
(Zamba's shared block reads cat(hidden, embeddings), 2·d_model, and writes d_model; diffusers' `out_dim`) is held
as it is, its bias too, where it was refused. A low-rank adapter added to a projection's output (Zamba2-1.2B's,
peft's LoRA) is folded into that projection's weight (usertrace/adapters.py). Styles of our own
(tests/trace_styles_round25_unusedtables.py), each checked against F.scaled_dot_product_attention in float64."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from _trace_ref import sdpa
from test_trace_command import trace, user_module
from tracecases import assert_passes, passing_test, plants_test, run_case

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round25_unusedtables.py")
styles = user_module(STYLES)
ZSCALE = ("--scale", "0.3535533905932738")  # (head_dim / 2) ** -0.5, head_dim = 16


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.SharedBlockAttention().double()
    mask = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected = m.o_proj(sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 2, scale=8 ** -0.5, causal=True))
    torch.testing.assert_close(m(x, mask), expected)
    assert expected.shape[-1] == 16  # o_proj writes half of what q_proj reads
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.NoPEGatedLayer().double()
    q, k, v = m.qkv(x).chunk(3, -1)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(m(x, attn_mask=causal), m.proj(sdpa(q, k, v, 3, causal=True)))
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    m = styles.OptionalFreqsAttention().double()
    torch.testing.assert_close(m(x, mask=causal), m.to_out(sdpa(m.to_q(x), m.to_k(x), m.to_v(x), 2, causal=True)))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.EinsumOutDim().double()
    B, N, _ = x.shape
    q, k, v = (t.reshape(B, N, 2, -1).transpose(1, 2) for t in (x @ m.w_q, x @ m.w_k, x @ m.w_v))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, -1)
    torch.testing.assert_close(m(x), out @ m.w_o)


def _folded(linear: torch.nn.Linear, *chain: torch.nn.Linear, factor: float = 1.0) -> torch.Tensor:
    """W + factor·W_B·W_A, in float64, written out apart from attnscope's fold."""
    product = chain[0].weight
    for layer in chain[1:]:
        product = layer.weight @ product
    return linear.weight + factor * product


def test_the_adapter_styles_are_attention_over_the_summed_weights():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    m = styles.SharedBlockAttention(adapters=True).double()
    q_ad, k_ad, v_ad = m.adapters[m.layer]
    q, k, v = (x @ _folded(p, *ad).T for p, ad in ((m.q_proj, q_ad), (m.k_proj, k_ad), (m.v_proj, v_ad)))
    torch.testing.assert_close(m(x, torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)[None, None]),
                               m.o_proj(sdpa(q, k, v, 2, scale=8 ** -0.5, causal=True)))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    m = styles.PeftLoraAttention().double().eval()
    causal = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)
    q = F.linear(x, _folded(m.q_proj.base_layer, m.q_proj.lora_A, m.q_proj.lora_B, factor=3.0),
                 m.q_proj.base_layer.bias)
    v = F.linear(x, _folded(m.v_proj.base_layer, m.v_proj.lora_A, m.v_proj.lora_B, factor=3.0),
                 m.v_proj.base_layer.bias)
    torch.testing.assert_close(m(x, causal), m.out_proj(sdpa(q, m.k_proj(x), v, 4, causal=True)))
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    m = styles.AdapterFirstAttention().double()
    k = F.linear(x, _folded(m.wk, m.k_down, m.k_up), m.k_up.weight @ m.k_down.bias + m.k_up.bias)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(m(x, mask), m.wo(sdpa(m.wq(x), k, m.wv(x), 3, causal=True)))


CORRECT = [("SharedBlockAttention", None, ("--causal", *ZSCALE)),
           ("NoPEGatedLayer", None, ("--causal",)),
           ("OptionalFreqsAttention", None, ("--causal",)),
           ("EinsumOutDim", None, ()),
           ("SharedBlockAttention", "adapters=True", ("--causal", *ZSCALE)),
           ("PeftLoraAttention", None, ("--causal",)),
           ("AdapterFirstAttention", None, ("--causal",))]
PLANTS = [("SharedBlockAttention", "bug='no_scale'", ("--causal", *ZSCALE), "scale.none"),
          ("SharedBlockAttention", "bug='merge_no_transpose'", ("--causal", *ZSCALE), "heads.merge_without_transpose"),
          ("NoPEGatedLayer", "bug='softmax_axis'", ("--causal",), "softmax.axis"),
          ("OptionalFreqsAttention", "bug='values_from_keys'", ("--causal",), "kv.values_from_keys"),
          ("EinsumOutDim", "bug='scale_d_head'", (), "scale.d_head")]


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    for name, init, _, _ in PLANTS:
        more = {"adapters": True} if "adapters" in init else {}
        good, bad = getattr(styles, name)(**more).eval(), getattr(styles, name)(bug=init.split("'")[1], **more).eval()
        width = {"SharedBlockAttention": 32, "NoPEGatedLayer": 24, "OptionalFreqsAttention": 12,
                 "AdapterFirstAttention": 24}.get(name, 16)
        x = torch.randn(2, 7, width)
        assert (good(x) - bad(x)).abs().max() > 1e-3, (name, init)


test_correct_styles_pass = passing_test(STYLES, CORRECT)
test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_unread_tables_are_left_none_with_a_note(runner):
    code, out = run_case(runner, STYLES, "NoPEGatedLayer", None, ("--causal",))
    assert_passes(code, out)
    assert any("cos, sin = None, its default" in note for note in out["notes"]), out["notes"]


def test_tables_the_code_reads_ask_for_rope(runner):
    for target, init in (("SharedBlockAttention", "config=BlockConfig(use_mem_rope=True)"),
                         ("NoPEGatedLayer", "use_rope=True")):
        result, _ = trace(runner, f"{STYLES}:{target}", "--init", init, "--causal")
        assert result.exit_code == 2, result.stdout + result.stderr
        assert "raised without them" in result.stderr and "add --rope" in result.stderr, result.stderr


def test_tables_given_under_rope_rotate_alike(runner):
    assert_passes(*run_case(runner, STYLES, "SharedBlockAttention", "config=BlockConfig(use_mem_rope=True)",
                            ("--causal", "--rope", *ZSCALE)))
