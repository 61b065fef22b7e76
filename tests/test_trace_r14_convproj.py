"""`attnscope trace` on convolutional and pooled projections (round 14a's CvT), in styles of its own
(tests/trace_styles_r14_convproj.py): each of q, k and v read through a tensor of its own the module makes from its
input (a depthwise convolution, a norm, a pooling before the role's Linear; a class token kept aside and joined
back) is that role's input side, a convention: n_K is the keys' length, and each plant is named by experiment. Each
correct style is checked against SDPA in float64; each plant is shown to change the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module

STYLES = str(Path(__file__).resolve().parent / "trace_styles_r14_convproj.py")
styles = user_module(STYLES)

CVT = ("--forward", "h=4, w=4", "--nq", "17")


def _heads(t, h=4):
    return t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2)


def _merged(y):
    return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)


def _bn(t, bn):
    shape = (1, -1, 1, 1)
    return (t - bn.running_mean.view(shape)) / torch.sqrt(bn.running_var.view(shape) + bn.eps) \
        * bn.weight.view(shape) + bn.bias.view(shape)


def _ln(t, norm):
    centred = t - t.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias


def _want(m, x, avg=False):
    """The style's output from its weights, in float64, the attention by SDPA."""
    b, n, d = x.shape
    if isinstance(m, styles.ConvProjection):
        cls, rest = x[:, :1], x[:, 1:]
        image = rest.transpose(1, 2).reshape(b, d, 4, 4)
        sides = []
        for conv in (m.conv_proj_q, m.conv_proj_k, m.conv_proj_v):
            if conv is None:
                made = image
            elif avg:
                made = F.avg_pool2d(image, 3, stride=2, padding=1, ceil_mode=True)
            else:
                made = _bn(F.conv2d(image, conv[0].weight, stride=conv[0].stride, padding=1, groups=d), conv[1])
            sides.append(torch.cat((cls, made.flatten(2).transpose(1, 2)), 1))
        q, k, v = (_heads(f(t)) for f, t in zip((m.proj_q, m.proj_k, m.proj_v), sides, strict=True))
        return m.proj(_merged(F.scaled_dot_product_attention(q, k, v)))
    if isinstance(m, styles.SeparableConvProjection):
        seq = x.transpose(1, 2)
        sides = [_ln(F.conv1d(seq, c.weight, c.bias, stride=c.stride, padding=1, groups=d).transpose(1, 2), nm)
                 for c, nm in ((m.q_conv, m.q_norm), (m.k_conv, m.k_norm), (m.v_conv, m.v_norm))]
        q, k, v = (_heads(f(t)) for f, t in zip((m.to_q, m.to_k, m.to_v), sides, strict=True))
        return m.to_out(_merged(F.scaled_dot_product_attention(q, k, v)))
    image = x.transpose(1, 2).reshape(b, d, 4, 4)
    q = F.conv2d(image, m.q_dw.weight, m.q_dw.bias, padding=1, groups=d).flatten(2).transpose(1, 2)
    pooled = F.max_pool2d(image, 2).flatten(2).transpose(1, 2)
    q, k, v = _heads(m.wq(q)), _heads(m.wk(_ln(pooled, m.k_norm))), _heads(m.wv(_ln(pooled, m.v_norm)))
    return m.wo(_merged(F.scaled_dot_product_attention(q, k, v)))


# (style, --init, options, n_K, the plant, its catalog entry)
CASES = [
    ("ConvProjection", "", CVT, 5, "scale_none", "scale.none"),
    ("ConvProjection", "", CVT, 5, "merge_no_transpose", "heads.merge_without_transpose"),
    ("ConvProjection", "attn_drop=0.1, ", CVT, 5, "dropout_on", "dropout.left_on"),
    ("ConvProjection", "method='avg', ", CVT, 10, "scale_none", "scale.none"),
    ("SeparableConvProjection", "", (), 4, "kv_swapped", "kv.swapped"),
    ("SeparableConvProjection", "", (), 4, "softmax_axis", "softmax.axis"),
    ("PooledQueriesKeys", "", ("--nq", "16"), 4, "scale_d_model", "scale.d_model"),
    ("PooledQueriesKeys", "", ("--nq", "16"), 4, "merge_no_transpose", "heads.merge_without_transpose"),
]


def _built(name, init, bug=None):
    kw = eval(f"dict({init}bug={bug!r})")  # noqa: S307 - the cases' own --init text
    return getattr(styles, name)(**kw).double().eval()


@pytest.mark.parametrize(("name", "init", "options", "n_K", "bug", "cause"), CASES)
def test_the_styles_are_sdpa_and_the_plants_change_them(name, init, options, n_K, bug, cause):
    n = 17 if name == "ConvProjection" else 16
    x = torch.randn(2, n, 32, dtype=torch.float64)
    given = {"h": 4, "w": 4} if name == "ConvProjection" else {}
    m = _built(name, init)
    with torch.no_grad():
        want = _want(m, x, avg="avg" in init)
        assert (m(x, **given) - want).abs().max() < 1e-10
        wrong = _built(name, init, bug)
        wrong.load_state_dict(m.state_dict())
        torch.manual_seed(0)
        assert (wrong(x, **given) - want).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "init", "options", "n_K", "bug", "cause"), CASES)
def test_each_role_read_through_a_tensor_of_its_own_is_its_input_side(runner, name, init, options, n_K, bug, cause):
    """The correct module passes with a note saying which tensors each projection reads, n_K theirs; its plant is
    named by experiment."""
    given = ("--init", init.rstrip(", ")) if init else ()
    result, out = trace(runner, f"{STYLES}:{name}", *options, *given)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert out["params"]["sizes"]["n_K"] == n_K, out["params"]
    note = next(n for n in out["notes"] if "read a tensor your module makes from its input" in n)
    assert f"n_K = {n_K} where the input has" in note, note
    if name == "ConvProjection":
        assert "1 token of your input kept aside and joined back" in note, note
    result, out = trace(runner, f"{STYLES}:{name}", *options, "--init", f"{init}bug='{bug}'")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]


def test_a_key_step_is_never_shown_at_a_tensor_of_the_queries_alone(runner, tmp_path):
    """Keys cut from the input (`x[:, ::2]`: no weight or pooling made them, no input side) beside queries the module
    lays out anew and joins back (CvT's class token): no key or value step is paired with the queries' tensor of its
    shape (line 15), which the keys never read."""
    path = tmp_path / "cut.py"
    path.write_text('''import torch
import torch.nn.functional as F
from torch import nn


class Cut(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        first, rest = torch.split(x, [1, n - 1], 1)
        q = torch.cat((first, rest.transpose(1, 2).reshape(b, d, n - 1).transpose(1, 2)), dim=1)
        kv = torch.cat((first, rest[:, ::2]), dim=1)
        q, k, v = self.to_q(q), self.to_k(kv), self.to_v(kv)
        q, k, v = (t.reshape(b, -1, self.heads, d // self.heads).permute(0, 2, 1, 3) for t in (q, k, v))
        attn = torch.einsum("bhlk,bhtk->bhlt", [q, k]).mul(d ** -0.5).softmax(-1)
        out = torch.einsum("bhlt,bhtv->bhlv", [attn, v])
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, d))
''')
    result, out = trace(runner, f"{path}:Cut")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert not any(n.startswith("your key and value projections") for n in out["notes"]), out["notes"]
    for row in out["alignment"]:
        assert row["reference"][:1] not in "KV" or row["line"] != 15, row
    assert out["first_divergence"]["line"] != 15, out["first_divergence"]
