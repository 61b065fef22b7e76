"""`attnscope trace` names the cause of each planted bug of issue 29 (part B): masks of the wrong pattern (a causal
band off by one, the diagonal hidden, anticausal, a forgotten window, key padding applied on the queries), ALiBi,
qk-norm, RoPE applied to the values, heads split without the transpose or merged with the wrong permute, and
float16 scores that overflow. Each bug is one line changed in one plain multi-head attention written here; the
correct module exits 0 (with --causal, --window, --mask or --rope as it needs), each buggy one exits 1 at the
step where it goes wrong, with its cause named.

That the correct module is correct is checked against torch.nn.MultiheadAttention holding its weights.
"""

from __future__ import annotations

import pytest
import torch
from test_trace_command import line_of, trace, user_module, write
from torch_mha import holding

from attnscope.cli import app

BASE = '''import math
import torch
import torch.nn as nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((angle, angle), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def alibi_slopes(n_head):
    start = 2 ** (-8 / n_head)
    return torch.tensor([start ** (h + 1) for h in range(n_head)])


class Attention(nn.Module):
    def __init__(self, d_feat=32, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.d_head = d_feat // n_head
        self.q_proj = nn.Linear(d_feat, d_feat)
        self.k_proj = nn.Linear(d_feat, d_feat)
        self.v_proj = nn.Linear(d_feat, d_feat)
        self.o_proj = nn.Linear(d_feat, d_feat)
        self.q_norm = nn.LayerNorm(self.d_head)
        self.k_norm = nn.LayerNorm(self.d_head)
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.3)
            self.q_proj.weight.mul_(1.0)  # LARGE

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)  # [B, n_head, T, d_head]
        k = self.k_proj(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)
        pass  # ROTATE
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # [B, n_head, T, T]
        pass  # BIAS
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = scores.softmax(dim=-1)
        y = weights @ v  # [B, n_head, T, d_head]
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, d_feat]
        return self.o_proj(y)
'''

CAUSAL = "allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))"
ROTATE, BIAS = "pass  # ROTATE", "pass  # BIAS"
SCORES = "scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)"
LARGE = "self.q_proj.weight.mul_(300.0); self.k_proj.weight.mul_(300.0)"
WINDOW = "allowed = torch.tril(torch.ones(T, T, dtype=torch.bool)) & torch.triu(torch.ones(T, T, dtype=torch.bool), -2)"


def module(tmp_path, *changes: tuple[str, str], name: str = "mine.py") -> str:
    body = BASE
    for old, new in changes:
        assert old in body, old
        body = body.replace(old, new)
    return f"{write(tmp_path, body, name)}:Attention"


def padding(tmp_path) -> str:
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)  # [n_batch, 1, 1, n_K]: keys 4, 5 and 5 are padding
    keep[0, ..., 4:] = False
    keep[1, ..., 5:] = False
    torch.save(keep, tmp_path / "pad.pt")
    return str(tmp_path / "pad.pt")


def diverges(runner, target: str, *args: str) -> dict:
    result, out = trace(runner, target, *args)
    assert result.exit_code == 1, result.output
    return out["first_divergence"]


def test_the_correct_module_is_nn_multiheadattention_and_aligns(tmp_path, runner):
    target = module(tmp_path)
    result, out = trace(runner, target, "--causal")
    assert result.exit_code == 0, result.output
    mine = user_module(target.rsplit(":", 1)[0]).Attention().eval()
    mha = holding(mine.q_proj, mine.k_proj, mine.v_proj, mine.o_proj, 4)
    with torch.no_grad():
        x = torch.randn(2, 5, 32)
        masked = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = masked out, nn.MultiheadAttention's way
        torch.testing.assert_close(mine(x), mha(x, x, x, attn_mask=masked)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("args", "changes"), [
    (("--window", "3"), [(CAUSAL, WINDOW)]),
    (("--batch", "2", "--nq", "6", "--mask", "PAD"), [(CAUSAL, "allowed = mask.view(B, 1, 1, T)")]),
    (("--causal", "--rope"), [(ROTATE, "q, k = rope(q), rope(k)")]),
    (("--causal",), [("self.q_proj.weight.mul_(1.0)", LARGE)]),  # large, in float32
])
def test_the_correct_variants_exit_0(tmp_path, runner, args, changes):
    args = tuple(padding(tmp_path) if a == "PAD" else a for a in args)
    result, out = trace(runner, module(tmp_path, *changes), *args)
    assert result.exit_code == 0, result.output


MASKS = [
    ("diagonal=1", (), "allowed = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=1)",
     "the causal band is off by 1: each query also sees the next key"),
    ("hidden diagonal", (), "allowed = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1)",
     "it masks the diagonal: no query may see its own key"),
    ("triu", (), "allowed = torch.triu(torch.ones(T, T, dtype=torch.bool))", "an anticausal mask"),
    ("no window", ("--window", "3"), CAUSAL, "the sliding window is missing"),
    ("padding on queries", ("--batch", "2", "--nq", "6", "--mask", "PAD"), "allowed = mask.view(B, 1, T, 1)",
     "a key-padding mask applied on the queries"),
]


@pytest.mark.parametrize(("bug", "args", "line", "words"), MASKS, ids=[m[0] for m in MASKS])
def test_a_mask_of_the_wrong_pattern_is_named_from_the_users_masked_scores(tmp_path, runner, bug, args, line, words):
    """The mask is applied on the line after the scores; the cause is read from the masked tensor that line
    makes, not called 'the mask is not applied'."""
    args = tuple(padding(tmp_path) if a == "PAD" else a for a in args) or ("--causal",)
    changes = [(CAUSAL, line)] if line != CAUSAL else []
    first = diverges(runner, module(tmp_path, *changes), *args)
    assert first["reference"] == "masked_scores", first
    assert words in first["diagnosis"] and "not applied" not in first["diagnosis"], first


@pytest.mark.parametrize(("args", "changes", "step", "words"), [
    (("--causal",), [(BIAS, "scores = scores + alibi_slopes(self.n_head)[:, None, None] * torch.arange(T)")],
     "masked_scores", "adds ALiBi's bias"),
    (("--causal",), [(BIAS, "scores = scores + alibi_slopes(self.n_head).flip(0)[:, None, None] * torch.arange(T)")],
     "masked_scores", "which are not ALiBi's for 4 heads"),
    # the norm on one side only: the module's norms read as its qk-norm, the keys' left out by experiment
    (("--causal",), [(ROTATE, "q = self.q_norm(q)")], "K_normed", "the keys never normalized"),
    # the values' split is paired with the v the code rotates: the divergence is said at its rotation
    (("--causal", "--rope"), [(ROTATE, "q, k, v = rope(q), rope(k), rope(v)")], "V_split",
     "RoPE applied to the values"),
    (("--causal",), [("q = self.q_proj(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)",
                      "q = self.q_proj(x).view(B, self.n_head, T, self.d_head)")],
     "Q_split", "heads split without the transpose: your q"),
    (("--causal",), [("y = y.transpose(1, 2).contiguous().view(B, T, C)",
                      "y = y.permute(0, 2, 3, 1).reshape(B, T, C)")],
     "x_rsh2", "heads merged with the wrong permute: your y"),
    (("--causal",), [("self.q_proj.weight.mul_(1.0)", LARGE),
                     (SCORES, "scores = (q.half() @ k.half().transpose(-2, -1)).float() / math.sqrt(self.d_head)")],
     "scores", "float16 overflows"),
], ids=["alibi", "alibi-slopes", "q-norm-only", "rope-on-v", "split", "merge", "float16"])
def test_each_planted_bug_is_named_at_its_step(tmp_path, runner, args, changes, step, words):
    first = diverges(runner, module(tmp_path, *changes), *args)
    assert step is None or first["reference"] == step, first
    assert words in first["diagnosis"] and "none of the usual causes fits" not in first["diagnosis"], first


SPLITS = [(f"{r} = self.{r}_proj(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)",
           f"{r} = self.{r}_proj(x).view(B, self.n_head, T, self.d_head)") for r in "qkv"]


@pytest.mark.parametrize(("change", "step"), [
    (SPLITS[0], "Q_split"), (SPLITS[1], "K_split"), (SPLITS[2], "V_split"),
    (("view(B, T, self.n_head, self.d_head).transpose(1, 2)  # [B",
      "view(B, T, self.n_head, self.d_head).reshape(B, self.n_head, T, self.d_head)  # [B"), "Q_split"),
], ids=["q", "k", "v", "reshape-for-transpose"])
def test_heads_split_without_the_transpose_diverge_at_the_split_line(tmp_path, runner, change, step):
    """The projection's output holds Q_split's numbers in a layout, but the user's view of it is not Q_split: the
    header, the line-up row and the cause all name the split step at the view's line, not the scores."""
    line = line_of(BASE, change[0])
    target = module(tmp_path, change)
    result, out = trace(runner, target, "--causal")
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert (first["reference"], first["user"], first["line"]) == (step, step[0].lower(), line), first
    assert first["diagnosis"].startswith(f"heads split without the transpose: your {step[0].lower()} (line {line})")
    row = next(r for r in out["alignment"] if r["reference"] == step)
    assert (row["status"], row["user"], row["line"]) == ("differs", step[0].lower(), line), row
    text = runner.invoke(app, ["trace", target, "--causal"]).output
    assert f"first divergence: {step} at your {step[0].lower()} (line {line})" in text, text


# --- the reference's options for correct code of another convention (issue 29, what was left) ---------------

TIMM_RMS = [("nn.LayerNorm(self.d_head)", "nn.RMSNorm(self.d_head, eps=1e-6)"),
            ("                norm.bias.normal_(0.0, 0.3)\n", ""), (ROTATE, "q, k = self.q_norm(q), self.k_norm(k)")]
TIMM_LN = [(ROTATE, "q, k = self.q_norm(q), self.k_norm(k)")]  # timm's default norm_layer=nn.LayerNorm, with bias
BLOOM = (BIAS, "scores = scores + alibi_slopes(self.n_head)[:, None, None] * torch.arange(T)")
T5 = [(SCORES, "scores = q @ k.transpose(-2, -1)"),
      (BIAS, "scores = scores + 0.1 * (torch.arange(T)[None, :] - torch.arange(T)[:, None]).float()")]


def t5_bias(tmp_path) -> str:
    torch.save(0.1 * (torch.arange(6)[None, :] - torch.arange(6)[:, None]).float(), tmp_path / "bias.pt")
    return str(tmp_path / "bias.pt")


@pytest.mark.parametrize(("args", "changes"), [
    (("--causal", "--alibi"), [BLOOM]),  # BLOOM's m_h · j: the reference's −m_h · (i − j) plus a row constant
    (("--causal", "--qk-norm"), TIMM_RMS),  # timm's qk_norm=True with norm_layer=RmsNorm: the user's weights taken
    (("--causal", "--qk-norm", "head"), TIMM_LN),  # timm's default nn.LayerNorm: its weights and biases taken
    (("--causal", "--qk-norm", "head", "--rope"),
     [*TIMM_RMS[:2], (ROTATE, "q, k = rope(self.q_norm(q)), rope(self.k_norm(k))")]),
    (("--causal", "--scale", "1", "--position-bias", "BIAS", "--batch", "2", "--nq", "6"), T5),
], ids=["alibi", "qk-norm", "qk-norm-layernorm", "qk-norm-rope", "t5-bias-scale"])
def test_code_of_another_convention_exits_0_with_the_option_that_describes_it(tmp_path, runner, args, changes):
    args = tuple(t5_bias(tmp_path) if a == "BIAS" else a for a in args)
    result, out = trace(runner, module(tmp_path, *changes), *args)
    assert result.exit_code == 0, result.output
    assert out["first_divergence"] is None


@pytest.mark.parametrize(("args", "changes", "words"), [
    (("--causal",), [BLOOM], "describe it with --alibi"),
    (("--causal", "--alibi"), [], "adds no position bias"),
    (("--causal", "--alibi"), [(BIAS, BLOOM[1].replace("n_head)", "n_head).flip(0)"))], "which are not ALiBi's"),
    (("--causal",), T5[:1], "times too large: not divided by √d_head (where that is your model's, T5's, --scale 1"),
], ids=["alibi-untold", "alibi-absent", "alibi-slopes-told", "scale-untold"])
def test_without_the_option_the_cause_is_named(tmp_path, runner, args, changes, words):
    first = diverges(runner, module(tmp_path, *changes), *args)
    assert words in first["diagnosis"], first


@pytest.mark.parametrize("changes", [[(ROTATE, "q, k = self.q_norm(q), self.k_norm(k)")], TIMM_RMS, TIMM_LN],
                         ids=["qk-norm", "qk-norm-rms", "qk-norm-layernorm"])
def test_the_codes_own_qk_norm_is_read_as_its_convention(tmp_path, runner, changes):
    """q and k both normalized by the module's own norms, without --qk-norm: the code's convention (timm's
    qk_norm=True, Qwen3), read by rerunning the reference with it (usertrace/ownnorm.py's read), a note and exit 0
    (it was a cause, "describe it with --qk-norm head"); the norm on one side only stays a bug (q-norm-only)."""
    result, out = trace(runner, module(tmp_path, *changes), "--causal")
    assert result.exit_code == 0, result.output
    assert out["first_divergence"] is None and out["params"]["qk_norm_read"] == "head"
    assert any("read as its own convention" in note for note in out["notes"]), out["notes"]


def test_a_layernorm_qk_norm_takes_the_users_eps_and_a_mixed_one_is_refused_in_one_line(tmp_path, runner):
    """nn.LayerNorm(d_head, eps=1e-3) lines up only with its own eps; a LayerNorm q_norm beside an RMSNorm
    k_norm is no one qk-norm: one line, exit 2."""
    eps = ("nn.LayerNorm(self.d_head)", "nn.LayerNorm(self.d_head, eps=1e-3)")
    result, out = trace(runner, module(tmp_path, eps, *TIMM_LN), "--causal", "--qk-norm")
    assert result.exit_code == 0, result.output
    mixed = ("self.k_norm = nn.LayerNorm(self.d_head)", "self.k_norm = nn.RMSNorm(self.d_head)")
    result, _ = trace(runner, module(tmp_path, mixed, ("norm.bias.normal_(0.0, 0.3)", "pass"), *TIMM_LN),
                      "--causal", "--qk-norm")
    assert result.exit_code == 2, result.output
    assert "your q_norm is a LayerNorm and your k_norm a RMSNorm" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "words"), [
    (("--alibi", "--position-bias", "BIAS"), "two position biases"),
    (("--scale", "inf"), "--scale inf"),
    (("--qk-norm", "--layout", "col"), "--layout col"),
])
def test_bad_reference_options_are_one_line_exit_2(tmp_path, runner, args, words):
    args = tuple(t5_bias(tmp_path) if a == "BIAS" else a for a in args)
    result, _ = trace(runner, module(tmp_path), "--causal", *args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_the_other_rope_pairing_is_named_from_the_references_own(tmp_path, runner):
    """Half-split code traced with --rope-pairing interleaved: the reference pairs interleaved, and says so."""
    first = diverges(runner, module(tmp_path, (ROTATE, "q, k = rope(q), rope(k)")), "--causal", "--rope",
                     "--rope-pairing", "interleaved")
    assert first["reference"] == "Q_rot", first
    assert "pairs RoPE's coordinates half-split" in first["diagnosis"], first
    assert "where the reference pairs them interleaved" in first["diagnosis"], first
