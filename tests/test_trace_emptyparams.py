"""Parameters a module's __init__ leaves as torch.empty made them (GPT-OSS's `sinks`, filled only by its model's
_init_weights): their values were whatever memory held, another each process, so trace of the same code passed one
run and failed the next. trace fills them from --seed (usertrace/emptyparams.py) and says so in a note; a parameter
an init writes (nn.Linear's kaiming_uniform_, nn.init's ones_, copy_, item assignment) keeps its values."""

from __future__ import annotations

import math
import textwrap

import torch
import torch.nn.functional as F
from tracecases import assert_passes, run_case

from attnscope.usertrace.emptyparams import Watch, fill

SINKS = """
import math
import torch
import torch.nn.functional as F
from torch import nn


class SinkAttention(nn.Module):
    \"\"\"GPT-OSS's attention as its module is written: a learned logit a head (`sinks`) joined to each row of the
    scores before the softmax and dropped after, made with torch.empty and never filled in __init__.\"\"\"

    def __init__(self, dim=32, n_head=4):
        super().__init__()
        self.n_head, self.d = n_head, dim // n_head
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.sinks = nn.Parameter(torch.empty(n_head))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (p(x).view(b, n, self.n_head, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                    self.v_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, n, c))
"""


def test_only_what_no_init_wrote_is_filled():
    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)  # kaiming_uniform_(tensor=...) writes it
            self.sinks = torch.nn.Parameter(torch.empty(3))
            self.gain = torch.nn.Parameter(torch.empty(4))
            torch.nn.init.ones_(self.gain)
            self.table = torch.nn.Parameter(torch.empty(2, 4))
            with torch.no_grad():
                self.table.copy_(torch.arange(8.0).view(2, 4))
            self.part = torch.nn.Parameter(torch.empty(4))
            with torch.no_grad():
                self.part[:2] = 1.0  # a write through a view: the tensor counts as written
            self.register_buffer("state", torch.empty(5))

    watch = Watch()
    with watch:
        module = Module()
    assert fill(module, watch.blank, 0) == ["sinks", "state"]
    again = Watch()
    with again:
        other = Module()
    fill(other, again.blank, 0)
    assert torch.equal(module.sinks, other.sinks) and torch.equal(module.state, other.state)
    assert torch.equal(module.gain, torch.ones(4)) and torch.equal(module.table, torch.arange(8.0).view(2, 4))
    assert fill(module, {}, 0) == []


def test_a_sink_left_empty_is_filled_from_the_seed(runner, tmp_path):
    path = tmp_path / "sinks.py"
    path.write_text(textwrap.dedent(SINKS))
    from test_trace_command import user_module

    styles = user_module(str(path))
    torch.manual_seed(0)  # as trace builds it, with --seed 0
    watch = Watch()
    with watch:
        m = styles.SinkAttention()
    assert fill(m, watch.blank, 0) == ["sinks"]
    m = m.double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    q, k, v = (p(x).view(2, 5, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    weights = torch.exp(scores - torch.logsumexp(torch.cat([scores, m.sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)],
                                                            -1), -1, keepdim=True))  # the sink's share left out
    want = m.o_proj((weights @ v).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(m(x), want, atol=1e-10)
    assert (m(x) - m.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                            .reshape(2, 5, 32))).abs().max() > 1e-3  # the filled sinks matter
    for _ in range(2):  # the same on every run
        code, out = run_case(runner, str(path), "SinkAttention", None, ("--causal",))
        assert_passes(code, out)
        assert any(n.startswith("sinks: your module's __init__ leaves it as torch.empty made it")
                   for n in out["notes"]), out["notes"]


def test_transformers_own_gpt_oss_attention_in_its_file(runner):
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss

    code, out = run_case(runner, gpt_oss.__file__, "GptOssAttention",
                         "config=GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, "
                         "head_dim=8), layer_idx=0", ("--rope", "--causal"))
    assert_passes(code, out)
    assert any(n.startswith("sinks: your module's") for n in out["notes"]), out["notes"]
