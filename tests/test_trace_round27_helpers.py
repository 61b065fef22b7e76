"""`attnscope trace` reading two habits of the user's code from the code itself:

- a decode cache kept as a dict keyed the code's own way (usertrace/keyedcache.py): the key that holds the cached
  length is the one whose value the code takes as a number (added to the query positions, compared with the key
  positions), never a name from a word list, so `cur_len`, `t`, `n_past`, `pos`, `idx` are all fed; a key whose
  value the code reads by keys is a dict of its own (fairseq's `incremental_state[key]["prev_key"]`);
- a mask whose rank a helper in a sibling file of the user's folder branches on (usertrace/userfolder.py): the ops
  of that helper are placed at its own lines, so the branch is seen and each form of the mask tried
  (maskranks.path), and a plant in its 3-D branch is named with the form that reaches it.

Styles: tests/trace_styles_round27_helpers_dictcache.py, tests/trace_styles_round27_helpers.py (its helper
tests/trace_styles_round27_helpers_masks.py), each correct one checked against F.scaled_dot_product_attention in
float64 first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _trace_ref import sdpa
from test_trace_command import user_module
from test_trace_round25_maskforms import _keep, files  # noqa: F401  (files: the key padding [2, 7] fixture)
from test_trace_round26_xlm import _causal, _heads, _merged
from tracecases import assert_named, passing_test, plants_test, run_case

from attnscope.usertrace.keyedcache import Keyed
from attnscope.usertrace.userfolder import Folder

HERE = Path(__file__).resolve().parent
CACHES = str(HERE / "trace_styles_round27_helpers_dictcache.py")
SIBLING = str(HERE / "trace_styles_round27_helpers.py")
caches = user_module(CACHES)


def _decode(q, k, v, k_old, v_old):
    """SDPA in float64 over the cache and the new keys, lower-right causal."""
    keys, values = torch.cat([k_old, k], 2), torch.cat([v_old, v], 2)
    return _merged(F.scaled_dot_product_attention(q, keys, values, attn_mask=_causal(q.shape[2], keys.shape[2])))


def test_the_xlm_like_layer_is_causal_attention_over_its_cache():
    torch.manual_seed(0)
    m = caches.XlmLikeLayer().double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    k_old, v_old = torch.randn(2, 2, 4, 3, 8, dtype=torch.float64)
    q, k, v = (_heads(p(x), 4) for p in (m.q_lin, m.k_lin, m.v_lin))
    cache = {"cur_len": 3, m.layer_id: (k_old, v_old)}
    torch.testing.assert_close(m(x, cache=cache)[0], m.out_lin(_decode(q, k, v, k_old, v_old)))
    assert torch.equal(cache[m.layer_id][0][:, :, :3], k_old)


def test_the_fairseq_like_layer_is_causal_attention_over_its_state():
    torch.manual_seed(0)
    m = caches.FairseqLikeAttention().double()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    k_old, v_old = torch.randn(2, 2, 3, 4, 8, dtype=torch.float64)
    q, k, v = (_heads(p(x), 3) for p in (m.q_proj, m.k_proj, m.v_proj))
    bias = torch.zeros(5, 9, dtype=torch.float64).masked_fill(~_causal(5, 9), float("-inf"))
    state = {m._state_key: {"prev_key": k_old, "prev_value": v_old}}
    torch.testing.assert_close(m(x, attn_mask=bias, incremental_state=state)[0],
                               m.out_proj(_decode(q, k, v, k_old, v_old)))


@pytest.mark.parametrize("length_key", ["t", "n_past", "pos", "idx"])
def test_the_own_key_state_is_causal_attention_over_its_cache(length_key):
    torch.manual_seed(0)
    m = caches.OwnKeyState(length_key=length_key).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    k_old, v_old = torch.randn(2, 2, 2, 3, 16, dtype=torch.float64)
    q, k, v = m.wqkv(x).view(2, 5, 3, 2, 16).permute(2, 0, 3, 1, 4)
    cache = {"k": k_old, "v": v_old, length_key: 3}
    torch.testing.assert_close(m(x, cache=cache), m.wo(_decode(q, k, v, k_old, v_old)))
    assert cache[length_key] == 8


def test_the_sibling_mask_layer_is_masked_attention_in_each_form():
    """Key padding [2, 7], [2, 1, 7] and a mask per query [2, 7, 7]: one SDPA in float64."""
    torch.manual_seed(0)
    sibling = user_module(SIBLING)
    keep = _keep()
    m = sibling.SiblingMaskAttention().double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    want = m.o_proj(sdpa(m.q_proj(x), m.k_proj(x), m.v_proj(x), 3, keep[:, None, None, :]))
    for mask in (keep, keep[:, None, :], keep[:, None, :].expand(2, 7, 7)):
        torch.testing.assert_close(m(x, attention_mask=mask.double()), want)


def test_the_plants_change_the_output():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    k_old, v_old = torch.randn(2, 2, 4, 3, 8)
    for bug in ("cache_order", "length_not_advanced"):
        good, bad = caches.XlmLikeLayer(), caches.XlmLikeLayer(bug=bug)
        bad.load_state_dict(good.state_dict())
        outs = [m(x, cache={"cur_len": 3, m.layer_id: (k_old, v_old)})[0] for m in (good, bad)]
        assert (outs[0] - outs[1]).abs().max() > 1e-3, bug
        good, bad = caches.OwnKeyState(length_key="n_past"), caches.OwnKeyState(length_key="n_past", bug=bug)
        state = {"k": k_old.reshape(2, 2, 3, 16), "v": v_old.reshape(2, 2, 3, 16), "n_past": 3}
        bad.load_state_dict(good.state_dict())
        outs = [m(x, cache=dict(state)) for m in (good, bad)]
        assert (outs[0] - outs[1]).abs().max() > 1e-3, bug
    good, bad = caches.FairseqLikeAttention(), caches.FairseqLikeAttention(bug="cache_order")
    bad.load_state_dict(good.state_dict())
    x = torch.randn(2, 5, 24)
    prev_key, prev_value = torch.randn(2, 2, 3, 4, 8)
    bias = torch.zeros(5, 9).masked_fill(~_causal(5, 9), float("-inf"))  # the order matters under the causal rule
    outs = [m(x, bias, incremental_state={m._state_key: {"prev_key": prev_key, "prev_value": prev_value}})[0]
            for m in (good, bad)]
    assert (outs[0] - outs[1]).abs().max() > 1e-3
    sibling = user_module(SIBLING)
    good, bad = sibling.SiblingMaskAttention(), sibling.SiblingMaskAttention(bug="mask3d_transposed")
    bad.load_state_dict(good.state_dict())
    x, keep = torch.randn(2, 7, 24), _keep().float()
    assert (good(x, keep[:, None, :].expand(2, 7, 7)) - bad(x, keep[:, None, :].expand(2, 7, 7))).abs().max() > 1e-3
    assert torch.equal(good(x, keep), bad(x, keep))  # the 2-D branch, which trace gives first, holds no plant


DECODE = ("--causal", "--cache", "4")
CORRECT = [("XlmLikeLayer", None, DECODE), ("FairseqLikeAttention", None, DECODE),
           *[("OwnKeyState", f"length_key='{key}'", DECODE) for key in ("t", "n_past", "pos", "idx", "cur_len")]]
PLANTS = [("XlmLikeLayer", "bug='cache_order'", DECODE, "cache.order"),
          ("XlmLikeLayer", "bug='length_not_advanced'", DECODE, "mask.upper_left"),
          ("FairseqLikeAttention", "bug='cache_order'", DECODE, "cache.order"),
          ("OwnKeyState", "bug='cache_order', length_key='n_past'", DECODE, "cache.order"),
          ("OwnKeyState", "bug='length_not_advanced', length_key='t'", DECODE, "mask.upper_left")]

test_correct_caches_pass = passing_test(CACHES, CORRECT)
test_cache_plants_are_named_by_experiment = plants_test(CACHES, PLANTS)


@pytest.mark.parametrize(("target", "init", "said"), [
    ("OwnKeyState", "length_key='idx'", ["cache['idx'] the number of cached positions", "cache['k'] the cached keys"]),
    ("XlmLikeLayer", None, ["cache['cur_len'] the number of cached positions", "(your module's layer_id) the pair"]),
    ("FairseqLikeAttention", None, ["incremental_state['attn_state.0']['prev_key'] the cached keys",
                                    "incremental_state['attn_state.0']['prev_value'] the cached values"])])
def test_the_note_says_what_each_key_got(runner, target, init, said):
    code, out = run_case(runner, CACHES, target, init, DECODE)
    notes = [" ".join(n.split()) for n in out["notes"] if "a dict keyed its own way" in n]
    assert code == 0 and notes, out["notes"]
    assert all(words in notes[0] for words in said), notes


def test_a_dict_key_read_as_a_tensor_of_no_known_name_is_said_in_one_line(runner, tmp_path):
    """A nested key whose value the code takes as a tensor, named neither keys nor values: trace cannot feed it."""
    path = tmp_path / "fairseq_other.py"
    path.write_text(Path(CACHES).read_text().replace('saved_state["prev_value"]', 'saved_state["zork"]'))
    from test_trace_command import trace

    result, _ = trace(runner, f"{path}:FairseqLikeAttention", *DECODE)
    assert result.exit_code == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "incremental_state['attn_state.0']['zork']" in said and "which trace cannot feed" in said, said
    assert "Traceback" not in result.stderr


def test_a_key_is_a_length_by_its_use_not_its_name():
    """Any word the code reads is handed n_cache as an int; taken as a number, it is the length, read by keys, a
    dict of its own; taken as neither where the run raised on an int, it is unfed."""
    parts = (torch.zeros(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    cache = Keyed(parts, 3, {})
    assert cache["n_past"] + 2 == 5 and cache["n_past"].as_number
    nested = cache["attn_state"]
    assert "prev_key" in nested and nested["prev_value"] is parts[1] and not nested.as_number
    assert "prev_key_padding_mask" not in nested and nested.get("key_padding_mask") is None
    unused = cache["zork"]
    assert unused == 3  # a comparison: a number
    cache2 = Keyed(parts, 3, {})
    cache2["zork"]
    assert cache2.unfed() == [("zork",)] and cache2.unfed(probes=False) == []
    assert ("attn_state", "key_padding_mask") in cache.unfed(probes=False)


PAD = ("--batch", "2", "--nq", "7", "--mask", "PAD")
test_the_sibling_style_passes = passing_test(SIBLING, [("SiblingMaskAttention", None, PAD)], files="files")
test_the_sibling_plants_are_named = plants_test(SIBLING, [
    ("SiblingMaskAttention", "bug='no_scale'", PAD, "scale.none"),
    ("SiblingMaskAttention", "bug='mask3d_transposed'", PAD, "mask.on_queries")], files="files")


def test_the_plant_in_the_sibling_helpers_3d_branch_says_its_form(runner, files):  # noqa: F811
    code, out = run_case(runner, SIBLING, "SiblingMaskAttention", "bug='mask3d_transposed'",
                         tuple(files.get(o, o) for o in PAD))
    found = assert_named(code, out, "mask.on_queries")
    assert found["diagnosis"].startswith(("with the mask given as [n_batch, 1, n_K], ",
                                          "with the mask given as [n_batch, n_Q, n_K], ")), found
    said = [" ".join(n.split()) for n in out["notes"] if "more than one form" in n]
    assert said and "given [n_batch, n_K], it lines up" in said[0], out["notes"]


def test_only_the_users_folder_is_followed(tmp_path):
    """Files beside the traced one and in folders under it are followed; torch, an installed package, a virtual
    environment kept in the folder, and the traced file itself are not."""
    traced = tmp_path / "model.py"
    folder = Folder(str(traced))
    assert folder.holds(str(tmp_path / "masks.py")) and folder.holds(str(tmp_path / "layers" / "attn.py"))
    assert not folder.holds(str(traced)) and not folder.holds(torch.__file__) and not folder.holds("<string>")
    venv = tmp_path / ".venv" / "lib" / "python3.12" / "site-packages" / "transformers" / "modeling_utils.py"
    assert not folder.holds(str(venv)) and not folder.holds(str(tmp_path / "env" / "site-packages" / "x.py"))
    assert not folder.holds(os.path.join(os.path.dirname(str(tmp_path)), "other.py"))
