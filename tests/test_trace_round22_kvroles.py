"""`attnscope trace` reads which projection makes the keys and which the values from the data flow. (1) The keys made
by the value projection (`k = self.value(x)`, `self.v_proj(key)`) had no catalog entry ('none of the usual causes
fits' at the scores): kv.keys_from_values, the mirror of kv.values_from_keys, by experiment. (2) `v = k` read as a
shared-KV design where the module holds a value weight it never uses (an nn.Parameter beside Linear layers) is
kv.values_from_keys; a real shared-KV design (no value weight) whose scores read `k.transpose(-1, -2)` was read as a
fused K/V projection split in halves: it passes. (3) A weight on the left that contracts the input's tokens
(Linformer's `E.t() @ x`) was read as a feature projection ('E writes 4 features'): it is the module's own
projection of the sequence. Styles of our own (tests/trace_styles_round22_kvroles.py), each checked against
F.scaled_dot_product_attention in float64 on its own weights; each plant shown to change the output."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from test_trace_command import user_module
from tracecases import passing_test, plants_test, run_case

from attnscope.usertrace import unused

STYLES = str(Path(__file__).resolve().parent / "trace_styles_round22_kvroles.py")
styles = user_module(STYLES)


def _heads(t: torch.Tensor, h: int = 4) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)  # [B, n, d] -> [B, h, n, d/h]


def _merged(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)


def _made(cls, **kwargs) -> torch.nn.Module:
    return cls(**kwargs).double().eval()


def test_the_styles_are_attention():
    torch.manual_seed(0)
    x, mem = torch.randn(2, 8, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    sdpa = F.scaled_dot_product_attention
    m = _made(styles.BertSelf)
    want = m.dense(_merged(sdpa(_heads(m.query(x)), _heads(m.key(x)), _heads(m.value(x)))))
    torch.testing.assert_close(m(x), want)
    m = _made(styles.SharedKeyValue)
    k = _heads(m.to_k(x))
    torch.testing.assert_close(m(x), m.to_out(_merged(sdpa(_heads(m.to_q(x)), k, k))))
    m = _made(styles.ParamValue)
    want = m.o_proj(_merged(sdpa(_heads(m.q_proj(x)), _heads(m.k_proj(x)), _heads(x @ m.w_v))))
    torch.testing.assert_close(m(x), want)
    m = _made(styles.FairseqCross)
    want = m.out_proj(_merged(sdpa(_heads(m.q_proj(x)), _heads(m.k_proj(mem)), _heads(m.v_proj(mem)))))
    torch.testing.assert_close(m(x, mem, mem), want)
    m = _made(styles.ClonedLinears)
    q, k, v = (_heads(lin(x)) for lin in m.linears[:3])
    torch.testing.assert_close(m(x), m.linears[3](_merged(sdpa(q, k, v))))
    m = _made(styles.LinformerLeft)
    pooled = torch.einsum("nk,bnd->bkd", m.E, x), torch.einsum("nk,bnd->bkd", m.F, x)  # the tokens mixed
    want = m.to_out(_merged(sdpa(_heads(m.to_q(x)), _heads(m.to_k(pooled[0])), _heads(m.to_v(pooled[1])))))
    torch.testing.assert_close(m(x), want)
    m = _made(styles.LinformerLeft, shared=True)
    k = _heads(torch.einsum("nk,bnd->bkd", m.E, m.to_k(x)))
    torch.testing.assert_close(m(x), m.to_out(_merged(sdpa(_heads(m.to_q(x)), k, k))))


def test_each_plant_changes_the_output():
    torch.manual_seed(1)
    x, mem = torch.randn(2, 8, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    for cls, kwargs, bug, call in (
            (styles.BertSelf, {}, "values_from_keys", None), (styles.BertSelf, {}, "keys_from_values", None),
            (styles.SharedKeyValue, {}, "no_scale", None), (styles.ParamValue, {}, "values_from_keys", None),
            (styles.ParamValue, {}, "keys_from_values", None),
            (styles.FairseqCross, {}, "keys_from_values", lambda m: m(x, mem, mem)),
            (styles.ClonedLinears, {}, "keys_from_values", None), (styles.LinformerLeft, {}, "scale_dim", None),
            (styles.LinformerLeft, {"shared": True}, "scale_dim", None)):
        right = _made(cls, **kwargs)
        wrong = _made(cls, **kwargs, bug=bug)
        wrong.load_state_dict(right.state_dict())
        run = call or (lambda m: m(x))
        assert not torch.allclose(run(right), run(wrong), atol=1e-6), (cls.__name__, bug)


LINFORMER = ("--nq", "8")  # its E and F are [seq_len = 8, k = 4]
CORRECT = [("BertSelf", None, ()),
           ("SharedKeyValue", None, ()),
           ("ParamValue", None, ()),
           ("FairseqCross", None, ("--nk", "5")),
           ("ClonedLinears", None, ()),
           ("LinformerLeft", None, LINFORMER),
           ("LinformerLeft", "shared=True", LINFORMER)]


test_correct_styles_pass = passing_test(STYLES, CORRECT)


PLANTED: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "kv.keys_from_values": [("BertSelf", "bug='keys_from_values'", ()),
                            ("ParamValue", "bug='keys_from_values'", ()),
                            ("FairseqCross", "bug='keys_from_values'", ("--nk", "5")),
                            ("ClonedLinears", "bug='keys_from_values'", ())],
}
PLANTS = [("BertSelf", "bug='values_from_keys'", (), "kv.values_from_keys"),
          ("ParamValue", "bug='values_from_keys'", (), "kv.values_from_keys"),  # w_v held, never used
          ("SharedKeyValue", "bug='no_scale'", (), "scale.none"),
          ("LinformerLeft", "bug='scale_dim'", LINFORMER, "scale.d_model"),
          ("LinformerLeft", "shared=True, bug='scale_dim'", LINFORMER, "scale.d_model"),
          *((target, init, options, entry) for entry, cases in PLANTED.items() for target, init, options in cases)]


test_plants_are_named_by_experiment = plants_test(STYLES, PLANTS)


def test_an_unused_value_weight_is_the_values_projection_a_shared_design_holds_none(runner):
    """`v = k` beside a value weight the code never uses: the reference holds that weight as V (the line-up then
    shows the mistake); with no value weight at all, K = V is the design's, a convention."""
    _, out = run_case(runner, STYLES, "ParamValue", "bug='values_from_keys'")
    assert "v=w_v" in out["reference"] and "never uses" in out["reference"]
    code, out = run_case(runner, STYLES, "SharedKeyValue")
    assert code == 0 and "v=to_k" in out["reference"] and "K = V" in out["reference"]


def test_an_unused_weight_declared_before_the_writer_takes_the_first_role():
    """unused.sibling_reading where no name says a role: the roles go in the order the module registers them."""
    modules = {name: torch.nn.Linear(4, 4) for name in ("a", "b", "c", "d")}
    shared = {"q": "a", "k": "c", "v": "c", "o": "d"}
    found, _ = unused.sibling_reading(shared, modules, ["b"], lambda name: None)
    assert (found["k"], found["v"]) == ("b", "c")
    found, _ = unused.sibling_reading({**shared, "k": "b", "v": "b"}, modules, ["c"], lambda name: None)
    assert (found["k"], found["v"]) == ("b", "c")
