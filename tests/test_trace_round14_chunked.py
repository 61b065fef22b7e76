"""`attnscope trace` on attention that never builds the whole scores (round 14a's lucidrains memory-efficient
attention, refused with 'no reference' because its projections were read from a softmax it never calls): the
projections read from the data flow through each block's exp(scores − max), the output compared whole, mistakes
named by the output's experiment. Styles of its own (tests/trace_styles_round14_chunked.py): Rabe & Staats'
chunked attention as lucidrains writes it (to_q, a fused to_kv, key padding, a causal rule by global positions),
FlashAttention's running max and sum in a PyTorch loop (a fused qkv), blocks' softmaxes merged by their
logsumexp; each checked against F.scaled_dot_product_attention in float64, each plant shown to change it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module
from trace_round14_helpers import heads as _heads
from trace_round14_helpers import merged as _merged
from trace_round14_helpers import moved, padding_file
from trace_round14_helpers import planted as _planted

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round14_chunked.py")
styles = user_module(STYLES)


def test_the_styles_are_sdpa_and_the_plants_change_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    with torch.no_grad():
        for causal, mask in ((False, None), (True, None), (False, keep), (True, keep)):
            me = moved(styles.MemoryEfficient(causal=causal), 5)
            k, v = me.to_kv(x).chunk(2, -1)
            rule = torch.ones(7, 7, dtype=torch.bool).tril() if causal else torch.ones(7, 7, dtype=torch.bool)
            allowed = rule & (mask[:, None, None, :] if mask is not None else True)
            want = me.to_out(_merged(F.scaled_dot_product_attention(_heads(me.to_q(x)), _heads(k), _heads(v),
                                                                    attn_mask=allowed)))
            assert torch.allclose(me(x, mask), want, atol=1e-10)
            bug = "causal_off_by_one" if causal else "values_from_keys"
            assert (_planted(styles.MemoryEfficient, me, bug, x, mask, causal=causal) - want).abs().max() > 1e-2

        for causal in (False, True):
            fl = moved(styles.FlashLoop(causal=causal), 5)
            q, k, v = fl.qkv(x).chunk(3, -1)
            want = fl.proj(_merged(F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), is_causal=causal)))
            assert torch.allclose(fl(x), want, atol=1e-10)
            bug = "causal_off_by_one" if causal else "scale_none"
            assert (_planted(styles.FlashLoop, fl, bug, x, causal=causal) - want).abs().max() > 1e-2

        torch.manual_seed(0)  # the dropout left on draws its cells; each against its own SDPA-checked output
        assert (_planted(styles.MemoryEfficient, me, "dropout_on", x, mask, causal=True) - me(x, mask)).abs().max() \
            > 1e-2
        assert (_planted(styles.FlashLoop, fl, "dropout_on", x, causal=True) - fl(x)).abs().max() > 1e-2

        ls = moved(styles.LogSumExpMerge(), 5)
        want = ls.o_proj(_merged(F.scaled_dot_product_attention(_heads(ls.q_proj(x)), _heads(ls.k_proj(x)),
                                                                _heads(ls.v_proj(x)))))
        assert torch.allclose(ls(x), want, atol=1e-10)
        assert (_planted(styles.LogSumExpMerge, ls, "kv_swapped", x) - want).abs().max() > 1e-2


@pytest.fixture(scope="module")
def pad(tmp_path_factory):
    return padding_file(tmp_path_factory.mktemp("r14c"), 5)


@pytest.mark.parametrize(("name", "args"), [
    ("MemoryEfficient", ()),
    ("MemoryEfficient", ("--init", "causal=True", "--causal")),
    ("MemoryEfficient", ("MASK",)),
    ("FlashLoop", ()),
    ("FlashLoop", ("--init", "causal=True", "--causal")),
    ("LogSumExpMerge", ()),
    ("MemoryEfficient", ("--init", "bucket=16")),  # one block: its exp(scores − max) has the pattern's shape
    ("FlashLoop", ("--init", "block=16, causal=True", "--causal")),
])
def test_attention_in_blocks_is_lined_up_by_its_output(runner, pad, name, args):
    args = ("--mask", pad, "--batch", "2", "--nq", "7") if args == ("MASK",) else args
    result, out = trace(runner, f"{STYLES}:{name}", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    statuses = {row["reference"]: row["status"] for row in out["alignment"]}
    assert statuses["K_split"] == statuses["V_split"] == statuses["x"] == "equal", statuses


@pytest.mark.parametrize(("name", "init", "args", "cause"), [
    ("MemoryEfficient", "bug='values_from_keys'", (), "kv.values_from_keys"),
    ("MemoryEfficient", "causal=True, bug='causal_off_by_one'", ("--causal",), "mask.off_by_one"),
    ("FlashLoop", "causal=True, bug='causal_off_by_one'", ("--causal",), "mask.off_by_one"),
    ("FlashLoop", "bug='scale_none'", (), "scale.none"),
    ("LogSumExpMerge", "bug='kv_swapped'", (), "kv.swapped"),
    ("MemoryEfficient", "bucket=16, bug='values_from_keys'", (), "kv.values_from_keys"),
    ("MemoryEfficient", "bug='dropout_on'", (), "dropout.left_on"),  # the dropped block summed as the normalizer
    ("FlashLoop", "causal=True, bug='dropout_on'", ("--causal",), "dropout.left_on"),  # the weights alone dropped
])
def test_mistakes_in_blocks_are_named_by_the_outputs_experiment(runner, name, init, args, cause):
    result, out = trace(runner, f"{STYLES}:{name}", "--init", init, *args)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert out["first_divergence"]["experiment"] == cause, out["first_divergence"]
