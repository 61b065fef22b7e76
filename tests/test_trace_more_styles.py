"""`attnscope trace` on six code styles of docs/examples/more_styles.py that no other test holds (issue 41's
held-out measure): GQA as a 5-D matmul without a repeat, a config's rope_theta handed to a RotaryEmbedding, a decode
step joining a KV cache, heads folded into the batch with a [B, 1, n_K] padding mask added by baddbmm, RoPE
frequencies of the model's own base kept as a buffer, and x-transformers' weightless Attend (key padding [b, n], a
causal mask aligned lower-right). Each correct version exits 0 and is checked, apart from
attnscope, against F.scaled_dot_product_attention holding its weights; each planted bug exits 1 with the catalog
entry whose rerun reproduces it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from transformers.models.llama.modeling_llama import rotate_half

STYLES = Path(__file__).resolve().parent.parent / "docs" / "examples" / "more_styles.py"
TARGET = str(STYLES)
CAUSAL = ("--causal",)
DECODE = ("--causal", "lower-right", "--cache", "3")


@pytest.fixture(scope="module")
def padding(tmp_path_factory) -> tuple[str, ...]:
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)  # [n_batch, 1, 1, n_K]: keys 4, 5 and 5 padded
    keep[0, ..., 4:] = False
    keep[1, ..., 5:] = False
    path = tmp_path_factory.mktemp("pad") / "pad.pt"
    torch.save(keep, path)
    return ("--mask", str(path), "--batch", "2", "--nq", "6")


SIZED = ("--heads", "4", "--dk", "8", "--dv", "8")  # Attend takes q, k, v [b, h, n, d]


def args_of(style: str, padding: tuple[str, ...]) -> tuple[str, ...]:
    return {"GroupedMatmul": CAUSAL, "ThetaAttention": (*CAUSAL, "--rope"), "CachedDecode": DECODE,
            "PaddedBaddbmm": padding, "FixedTheta": (*CAUSAL, "--rope"),
            "Attend": (*SIZED, *CAUSAL, "--init", "causal=True"),
            "AttendPadded": (*SIZED, *padding, "--nk", "6"), "FlashPadded": CAUSAL}[style]


def target(style: str) -> str:
    return f"{TARGET}:{'Attend' if style == 'AttendPadded' else style}"  # AttendPadded: Attend given key padding


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    B, T, _ = t.shape
    return t.view(B, T, n, -1).transpose(1, 2)  # [B, T, n·d] -> [B, n, T, d]


def rope(t: torch.Tensor, base: float) -> torch.Tensor:
    d = t.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat([torch.outer(torch.arange(t.shape[-2], dtype=torch.float64), inv)] * 2, -1).float()
    return t * emb.cos() + rotate_half(t) * emb.sin()


def merged(y: torch.Tensor) -> torch.Tensor:
    return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)


# --- the correct versions: PyTorch's attention holding their weights --------------------------------------------


def test_each_correct_style_is_pytorchs_attention():
    m = user_module(TARGET)
    torch.manual_seed(0)
    x = torch.randn(2, 6, 48)
    with torch.no_grad():
        g = m.GroupedMatmul().eval()  # 6 query heads on 2 key/value heads: head h reads h // 3
        q, k, v = heads(g.wq(x), 6), heads(g.wk(x), 2), heads(g.wv(x), 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(g(x), g.wo(merged(y)), rtol=1e-5, atol=1e-5)

        t = m.ThetaAttention().eval()
        q, k, v = heads(t.q_proj(x), 3), heads(t.k_proj(x), 3), heads(t.v_proj(x), 3)
        y = F.scaled_dot_product_attention(rope(q, 500000.0), rope(k, 500000.0), v, is_causal=True)
        torch.testing.assert_close(t(x), t.o_proj(merged(y)), rtol=1e-5, atol=1e-5)

        f = m.FixedTheta().eval()
        q, k, v = (heads(p, 3) for p in f.qkv(x).split(48, dim=-1))
        y = F.scaled_dot_product_attention(rope(q, 1e6), rope(k, 1e6), v, is_causal=True)
        torch.testing.assert_close(f(x), f.proj(merged(y)), rtol=1e-5, atol=1e-5)

        c = m.CachedDecode().eval()
        x40 = torch.randn(2, 4, 40)
        cache = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)
        q, k, v = (heads(p, 5) for p in c.c_attn(x40).split(40, dim=-1))
        k, v = torch.cat([cache[0], k], -2), torch.cat([cache[1], v], -2)
        lower_right = torch.ones(4, 7, dtype=torch.bool).tril(3)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right)
        torch.testing.assert_close(c(x40, cache), c.c_proj(merged(y)), rtol=1e-5, atol=1e-5)

        p = m.PaddedBaddbmm().eval()
        x32 = torch.randn(2, 6, 32)
        keep = torch.ones(2, 1, 6, dtype=torch.bool)
        keep[0, :, 4:] = False
        q, k, v = heads(p.to_q(x32), 4), heads(p.to_k(x32), 4), heads(p.to_v(x32), 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        torch.testing.assert_close(p(x32, keep), p.to_out(merged(y)), rtol=1e-5, atol=1e-5)

        fp = m.FlashPadded().eval()  # its own causal mask and key padding [B, S]
        x32 = torch.randn(2, 6, 32)
        keep = torch.ones(2, 6, dtype=torch.bool)
        keep[0, 3] = False
        q, k, v = (heads(t, 4) for t in fp.Wqkv(x32).split(32, dim=-1))
        allowed = torch.ones(6, 6, dtype=torch.bool).tril() & keep[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        torch.testing.assert_close(fp(x32, keep), fp.out_proj(merged(y)), rtol=1e-5, atol=1e-5)
        wrong = m.FlashPadded(bug="on_queries").eval()
        wrong.load_state_dict(fp.state_dict())  # the bug alone differs: query 3 of the first sequence sees no key
        assert not torch.allclose(wrong(x32, keep)[0, 4:], fp(x32, keep)[0, 4:])

        a = m.Attend(causal=True).eval()  # 6 queries on 9 keys: query i sees keys 0 to 3 + i
        q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 8)
        keys = torch.ones(2, 9, dtype=torch.bool)
        keys[1, 7:] = False
        allowed = torch.ones(6, 9, dtype=torch.bool).tril(3) & keys[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        torch.testing.assert_close(a(q, k, v, keys), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["GroupedMatmul", "ThetaAttention", "CachedDecode", "PaddedBaddbmm", "FixedTheta",
                                   "Attend", "AttendPadded", "FlashPadded"])
def test_each_correct_style_exits_0(runner, padding, style):
    result, out = trace(runner, target(style), *args_of(style, padding))
    assert result.exit_code == 0, result.output
    assert out["first_divergence"] is None
    if style == "GroupedMatmul":  # the 5-D scores line up as the reference's, n_head viewed as n_kv_head, n_group
        rows = {row["reference"]: row for row in out["alignment"]}
        assert rows["scores"]["status"] == "permuted" and "n_kv_head, n_group" in rows["scores"]["layout"]
    if style == "ThetaAttention":
        assert any("RoPE base 500000, read from your module" in n for n in out["notes"])
    if style == "Attend":  # 6 queries on 9 keys, masked to the last key: --causal's upper-left is not its own
        assert any("aligned lower-right" in n and "A convention, not a mistake" in n for n in out["notes"])
    if style == "FlashPadded":  # only --causal: trace pads a key itself, in the module's mask and the reference's
        assert any("key_padding_mask" in n and "padded by trace" in n for n in out["notes"]), out["notes"]
    if style == "FixedTheta":
        # its inv_freq buffer says the base (declared._inv_freq_base): the module's own, read from it
        assert any("RoPE base 1e+06, read from your module" in n for n in out["notes"]), out["notes"]


# --- planted bugs: each named by the experiment that reproduces it -----------------------------------------------


BUGS = [
    ("GroupedMatmul", "noscale", "scale.none", "scores"),
    ("GroupedMatmul", "tril1", "mask.off_by_one", "masked_scores"),
    ("GroupedMatmul", "axis", "softmax.axis", "attention"),
    ("GroupedMatmul", "v_is_k", "kv.values_from_keys", "x_raw"),
    ("GroupedMatmul", "group_order", "gqa.group_order", "scores"),
    ("ThetaAttention", "forgot_base", "rope.base", "Q_rot"),
    ("ThetaAttention", "scale_d_model", "scale.d_model", "scores"),
    ("ThetaAttention", "rope_on_v", "rope.on_values", "V_split"),
    ("CachedDecode", "cache_order", "cache.order", "K_cat"),
    ("CachedDecode", "upper_left", "mask.upper_left", "masked_scores"),
    ("CachedDecode", "kv_swapped", "kv.swapped", "scores"),
    ("PaddedBaddbmm", "on_queries", "mask.on_queries", "masked_scores"),
    ("PaddedBaddbmm", "merge", "heads.merge_without_transpose", "x_rsh2"),
    ("PaddedBaddbmm", "noscale", "scale.none", "masked_scores"),  # the mask added in the scores' own baddbmm
    ("AttendPadded", "on_queries", "mask.on_queries", "masked_scores"),
    ("Attend", "scale_twice", "scale.twice", "scores"),  # read under its lower-right mask
    ("FlashPadded", "on_queries", "mask.on_queries", "masked_scores"),  # only --causal: a key trace padded shows it
]


@pytest.mark.parametrize(("style", "bug", "entry", "step"), BUGS, ids=[f"{b[0]}-{b[1]}" for b in BUGS])
def test_each_planted_bug_is_named_by_experiment(runner, padding, style, bug, entry, step):
    args = args_of(style, padding)
    init = f"bug={bug!r}" + (", causal=True" if "causal=True" in args else "")
    args = tuple(a for a in args if a not in ("--init", "causal=True"))
    result, out = trace(runner, target(style), "--init", init, *args)
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == (step, entry), first
    assert first["evidence"].startswith("by experiment: ") and "to tolerance" in first["evidence"], first


@pytest.fixture(scope="module")
def padding_2d(tmp_path_factory) -> tuple[str, ...]:
    keep = torch.ones(2, 6, dtype=torch.bool)  # [n_batch, n_K], flash-attn's key_padding_mask: keys 4, 5 and 5 padded
    keep[0, 4:] = False
    keep[1, 5:] = False
    path = tmp_path_factory.mktemp("pad2d") / "pad.pt"
    torch.save(keep, path)
    return ("--mask", str(path), "--batch", "2", "--nq", "6")


@pytest.mark.parametrize(("style", "causal"), [("PaddedBaddbmm", ()), ("FlashPadded", CAUSAL)])
def test_a_two_dimensional_mask_file_is_key_padding(runner, padding_2d, style, causal):
    """--mask [n_batch, n_K] (was: 'does not broadcast') is key padding [n_batch, 1, 1, n_K]: each correct style
    exits 0, the file's padding given to the code in its own shape (with --causal as well: the rule is the code's
    own), and a padding on the queries is named."""
    result, out = trace(runner, f"{TARGET}:{style}", *padding_2d, *causal)
    assert result.exit_code == 0, result.output
    assert out["first_divergence"] is None
    assert any("[n_batch, n_K] = [2, 6], read as key padding [2, 1, 1, 6]" in n for n in out["notes"]), out["notes"]
    result, out = trace(runner, f"{TARGET}:{style}", "--init", "bug='on_queries'", *padding_2d, *causal)
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == ("masked_scores", "mask.on_queries"), first


@pytest.mark.parametrize(("style", "causal"), [("PaddedBaddbmm", ()), ("FlashPadded", CAUSAL)])
def test_a_padding_file_gives_n_batch_where_no_flag_does(runner, padding_2d, style, causal):
    """In self-attention a 2-D file whose rows are not its columns is key padding, never [n_Q, n_K]: its first axis
    is n_batch without --batch (was: 'mask of shape [2, 6] does not broadcast to the scores' shape [3, .., 6, 6]',
    exit 2), as a 4-D file's is."""
    args = tuple(a for a in padding_2d if a not in ("--batch", "2"))
    result, out = trace(runner, f"{TARGET}:{style}", *args, *causal)
    assert result.exit_code == 0, result.output
    assert out["params"]["sizes"]["n_batch"] == 2, out["params"]
    assert any("read as key padding [2, 1, 1, 6]" in n for n in out["notes"]), out["notes"]


@pytest.mark.parametrize("style", ["FixedTheta", "ThetaAttention"])
def test_a_base_asked_for_is_the_references_even_the_default(runner, style):
    """--rope-base 10000 typed is told apart from no --rope-base: the code's own base (a buffer of 1e6, a config's
    500000) is then a bug, rope.base, not a convention read from the code or the module."""
    result, out = trace(runner, f"{TARGET}:{style}", "--causal", "--rope", "--rope-base", "10000")
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == ("Q_rot", "rope.base"), first
    assert out["params"]["rope_base_asked"] is True
    assert not any("A convention, not a mistake" in n for n in out["notes"])
    result, out = trace(runner, f"{TARGET}:{style}", "--causal", "--rope")  # not asked: the code's or module's own
    assert result.exit_code == 0 and out["params"]["rope_base_asked"] is False


def test_an_alignment_asked_for_is_the_references_even_the_default(runner):
    """--causal upper-left typed is told apart from a bare --causal: Attend's lower-right mask on 6 queries and 9 keys
    is then the divergence (the note says the alignment the code has), not a convention."""
    args = (*SIZED, "--init", "causal=True", "--nq", "6", "--nk", "9")
    result, out = trace(runner, f"{TARGET}:Attend", *args, "--causal", "upper-left")
    assert result.exit_code == 1, result.output
    assert out["first_divergence"]["reference"] == "masked_scores"
    assert out["params"]["causal_asked"] is True
    assert any("aligned lower-right" in n and "--causal upper-left asks" in n for n in out["notes"]), out["notes"]
    assert not any("A convention, not a mistake" in n for n in out["notes"])
    result, out = trace(runner, f"{TARGET}:Attend", *args, "--causal")  # bare: the alignment is the code's own
    assert result.exit_code == 0 and out["params"]["causal_asked"] is False
    result, out = trace(runner, f"{TARGET}:Attend", *args, "--causal", "lower-right")
    assert result.exit_code == 0 and out["params"]["causal_asked"] is True


def test_no_tensor_names_the_key_value_heads_twice(runner):
    """4 query heads on 2 key/value heads: n_group = n_kv_head = 2, so q viewed [B, T, n_kv, n_group, d] and its 5-D
    scores were named [.., n_kv_head, n_kv_head, ..] by size alone; the group axis is n_group, settled by where the
    tensor comes from, and the module still exits 0."""
    result, out = trace(runner, f"{TARGET}:GroupedMatmul", "--init", "dim=32, n_heads=4, n_kv_heads=2", *CAUSAL)
    assert result.exit_code == 0, result.output
    grouped = [s for s in out["steps"] if len(s["dims"]) == 5 and "1" not in s["dims"]]
    assert len(grouped) >= 6
    for step in grouped:
        assert step["dims"].count("n_kv_head") == 1 and "n_group" in step["dims"], (step["op"], step["dims"])
    n_group = out["params"]["sizes"]["n_head"] // out["params"]["sizes"]["n_kv_head"]
    chosen = ("n_batch", "n_Q", "n_K")
    assert all(out["params"]["sizes"][d] != n_group for d in chosen)


def test_the_group_size_is_kept_from_the_chosen_sizes():
    from attnscope.usertrace.inputs import _group

    assert _group({"n_head": 6, "n_kv_head": 2}, {}) == (3,)
    assert _group({"n_head": 8}, {"n_kv_head": 2}) == (4,)  # key/value heads read from the run (litgpt)
    assert _group({"n_head": 4}, {}) == () and _group({"n_head": 4, "n_kv_head": 4}, {}) == ()


def test_key_padding_without_the_causal_rule_is_said_so(runner):
    """flash-attn's MHA built without causal=True, traced with --causal: its key_padding_mask gets a key trace padded,
    and the code masks that key alone, so the message says the rule is missing (not a causal band 'off by n')."""
    styles = str(STYLES.parent / "code_styles.py")
    result, out = trace(runner, f"{styles}:FlashMHA", *CAUSAL)
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert first["reference"] == "masked_scores" and "only the key padding is applied" in first["diagnosis"], first


def test_a_base_unlike_the_modules_own_names_the_modules():
    """The module's rope_theta is the reference's base where --rope-base says none, and the message says so."""
    from typer.testing import CliRunner

    from attnscope.cli import app

    result = CliRunner().invoke(app, ["trace", f"{TARGET}:ThetaAttention", "--init", "bug='forgot_base'", "--causal",
                                      "--rope"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "rotates with RoPE base 10000 where your module says 500000" in text
