"""Issue 34: value-weighted attention, sink accounting and rollout, against a plain reimplementation (loops,
float64) from transformers' own eager `output_attentions` and value projections (hooks on v_proj / value), never
from attnscope's steps. Tiny models here (LLaMA: grouped-query attention and biases; BERT; GPT-OSS: learned
sinks); the trained checkpoints, all-MiniLM-L6-v2 and SmolLM2-135M, in tests/test_readings_models.py."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import build, cached_builder

from attnscope.cli import app
from attnscope.readings.moved import value_norms, weighted
from attnscope.readings.rollout import last_row, rollout
from attnscope.readings.sinkshare import TOP, sink_shares

TEXT = "The cat sat on the mat. The cat sat on the mat because it was tired."


# --- the independent reference: loops over heads, keys and rows, in float64 -------------------------------------

def ref_value_norms(V: torch.Tensor, W_O: torch.Tensor, n_head: int) -> torch.Tensor:
    """`||(x_j W_V^h + b_V^h) W_O^h||` from transformers' value projection output V `[n, n_kv_head·d_head]` (its
    bias in) and the output projection's weight `[d_model, n_head·d_head]`: a head and a key at a time."""
    n, width = V.shape
    d_head = W_O.shape[1] // n_head
    n_kv = width // d_head
    out = torch.zeros(n_head, n, dtype=torch.float64)
    for h in range(n_head):
        g = h // (n_head // n_kv)  # transformers' repeat_kv: query head h reads KV head h // n_group
        v = V[:, g * d_head : (g + 1) * d_head].double()
        W = W_O[:, h * d_head : (h + 1) * d_head].double()
        for j in range(n):
            out[h, j] = torch.linalg.norm(W @ v[j])
    return out


def ref_shares(A: torch.Tensor, norms: torch.Tensor | None, sink: torch.Tensor | None) -> list[dict]:
    """first, sink, top (and value-weighted) shares, head by head and row by row."""
    A = A.double()
    out = []
    for h in range(A.shape[0]):
        parked = [float(A[h, i].sum()) + (float(sink[h, i]) if sink is not None else 0) for i in range(A.shape[1])]
        rows = [i for i in range(A.shape[1]) if parked[i] > 0]
        entry = {"first": sum(float(A[h, i, 0]) for i in rows) / len(rows)}
        columns = [sum(float(A[h, i, j]) for i in rows) for j in range(A.shape[2])]
        keys = sorted(range(A.shape[2]), key=lambda j: (-columns[j], j))[:TOP]
        entry["top"] = sum(columns[j] for j in keys) / len(rows)
        entry["top_keys"] = keys
        if sink is not None:
            entry["sink"] = sum(float(sink[h, i]) for i in rows) / len(rows)
        if norms is not None:
            W = [[float(A[h, i, j]) * float(norms[h, j]) for j in range(A.shape[2])] for i in range(A.shape[1])]
            moving = [i for i in range(A.shape[1]) if sum(W[i]) > 0]
            share = {i: [w / sum(W[i]) for w in W[i]] for i in moving}
            entry["weighted_first"] = sum(share[i][0] for i in moving) / len(moving)
            wcol = [sum(share[i][j] for i in moving) for j in range(A.shape[2])]
            wkeys = sorted(range(A.shape[2]), key=lambda j: (-wcol[j], j))[:TOP]
            entry["weighted_top"] = sum(wcol[j] for j in wkeys) / len(moving)
            entry["weighted_top_keys"] = wkeys
        out.append(entry)
    return out


def ref_rollout(layers: list[torch.Tensor], norms: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Abnar & Zuidema's recipe: (mean over heads + I) / row sums, multiplied from layer 0 up."""
    n = layers[0].shape[-1]
    R = torch.eye(n, dtype=torch.float64)
    for index, A in enumerate(layers):
        A = A.double()
        if norms is not None:  # value-weighted: each head's a_ij ||f(x_j)||, every row as shares
            A = A * norms[index][:, None, :]
            A = A / torch.where(A.sum(-1, keepdim=True) > 0, A.sum(-1, keepdim=True), 1.0)
        M = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n):
            for j in range(n):
                M[i, j] = 0.5 * float(A[:, i, j].mean()) + (0.5 if i == j else 0.0)
            M[i] /= M[i].sum()
        R = M @ R
    return R


def eager_with_values(model, ids: list[int], values: list, outs: list) -> tuple[tuple, list[torch.Tensor],
                                                                                   list[torch.Tensor]]:
    """transformers' eager run: `output_attentions`, each layer's value projection output `[n, n_kv·d_head]` (a
    forward hook on `values[i]`) and W_O (`outs[i]`, the output projection: `[d_model, n_head·d_head]`)."""
    caught: dict[int, torch.Tensor] = {}
    hooks = [module.register_forward_hook(lambda m, a, out, i=i: caught.__setitem__(i, out[0].detach()))
             for i, module in enumerate(values)]
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    for hook in hooks:
        hook.remove()
    return attentions, [caught[i] for i in range(len(values))], [W.detach() for W in outs]


def assert_shares(ours: list[dict], theirs: list[dict], atol: float) -> None:
    assert len(ours) == len(theirs)
    for mine, ref in zip(ours, theirs, strict=True):
        assert set(mine) == set(ref)
        for key, value in ref.items():
            if key.endswith("top_keys"):
                continue  # keys whose column sums tie to within atol may swap: compared through their shares
            assert abs(mine[key] - value) <= atol, (key, mine[key], value)


# --- tiny models -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return cached_builder(tmp_path_factory, build)


def _modules(family: str, model):
    """The value projections and output projections' weights, layer by layer."""
    if family == "bert":
        layers = model.encoder.layer
        return [x.attention.self.value for x in layers], [x.attention.output.dense.weight for x in layers]
    layers = model.model.layers
    return [x.self_attn.v_proj for x in layers], [x.self_attn.o_proj.weight for x in layers]


@pytest.mark.parametrize("family", ["llama", "bert", "gpt_oss"])
def test_readings_equal_the_reference_from_transformers(tiny, runner, family):
    folder, model = tiny(family)
    payload = json.loads(runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "1",
                                             "--text", TEXT, "--all-layers", "--all-heads", "--json"]).stdout)
    assert_readings(payload, model, *_modules(family, model), sinks=family == "gpt_oss", atol=2e-5)


def assert_readings(payload: dict, model, values: list, outs: list, *, sinks: bool, atol: float) -> None:
    """Every layer's value_norms, moved, sinks_share, layer L's steps and heads entries, and both rollouts: the
    CLI's JSON (`--all-layers --all-heads --json`) against the loops above fed with transformers' eager tensors
    (`atol`: float32 forwards differ), and attnscope's reading functions fed with the same tensors (the
    arithmetic alone: 1e-6 in float64)."""
    attentions, V, W_O = eager_with_values(model, payload["token_ids"], values, outs)
    n_head = attentions[0].shape[1]
    norms = [ref_value_norms(v, w, n_head) for v, w in zip(V, W_O, strict=True)]
    parked = [1 - A[0].double().sum(-1) if sinks else None for A in attentions]  # the dropped sink column
    for layer, (entry, A) in enumerate(zip(payload["all_layers"], attentions, strict=True)):
        torch.testing.assert_close(torch.tensor(entry["value_norms"], dtype=torch.float64), norms[layer],
                                   atol=atol, rtol=atol)
        reference = ref_shares(A[0], norms[layer], parked[layer])
        assert_shares(entry["sinks_share"], reference, atol=atol)
        # the arithmetic alone, on transformers' own tensors: 1e-6
        d_head = W_O[layer].shape[1] // n_head
        mine = value_norms(V[layer].double().view(len(V[layer]), -1, d_head).transpose(0, 1),  # [n_kv, n, d_head]
                           W_O[layer].double())
        torch.testing.assert_close(mine, norms[layer], atol=1e-6, rtol=0)
        assert_shares(sink_shares(A[0], parked[layer], mine), reference, atol=1e-6)
        moved = (A[0].double() * norms[layer][:, None, :]).sum(-1).mean(-1)
        torch.testing.assert_close(torch.tensor(entry["moved"], dtype=torch.float64), moved, atol=atol, rtol=atol)
    # layer L's heads entries and steps
    L = payload["params"]["layer"]
    A_L, n_L = attentions[L][0].double(), norms[L]
    for h, head in enumerate(payload["heads"]):
        torch.testing.assert_close(torch.tensor(head["weighted"], dtype=torch.float64), A_L[h] * n_L[h][None, :],
                                   atol=atol, rtol=atol)
        assert head["sinks_share"] == payload["all_layers"][L]["sinks_share"][h]
    steps = [s["name"] for s in payload["steps"]]
    assert steps[-2:] == ["value_norms", "weighted"] and [s["name"] for s in payload["layer_steps"]][-2:] == steps[-2:]
    # rollout and value-weighted rollout, layer 0 up to the last
    layers = [A[0] for A in attentions]
    assert payload["rollout_layers"] == list(range(len(layers)))
    torch.testing.assert_close(torch.tensor(payload["rollout"], dtype=torch.float64), ref_rollout(layers),
                               atol=atol, rtol=0)
    torch.testing.assert_close(torch.tensor(payload["rollout_weighted"], dtype=torch.float64),
                               ref_rollout(layers, norms), atol=atol, rtol=0)
    torch.testing.assert_close(rollout(layers), ref_rollout(layers), atol=1e-6, rtol=0)
    grid = payload["sinks_share"]
    assert grid["layers"] == list(range(len(layers))) and len(grid["first"][0]) == n_head
    assert ("sink" in grid) == sinks


def test_gpt_oss_sink_column_is_kept_and_moves_nothing(tiny, runner):
    """GPT-OSS: transformers' exported rows sum to less than 1 (the sink column dropped); the sink share is the
    rest, and what attnscope reports with the first token sums to the weight parked."""
    folder, model = tiny("gpt_oss")
    payload = json.loads(runner.invoke(app, ["head", "--model", str(folder), "--layer", "0", "--text", TEXT,
                                             "--all-heads", "--json"]).stdout)
    A = torch.tensor(payload["attention"])
    assert float(A.sum(-1).max()) < 1 - 1e-3  # rows sum to less than 1: the sink took the rest
    share = payload["heads"][0]["sinks_share"]
    assert 0 < share["sink"] < 1 and abs(share["sink"] - float((1 - A.double().sum(-1)).mean())) < 1e-5
    assert payload["sinks_share"]["layers"] == [0] and "sink" in payload["sinks_share"]


def test_causal_rollout_and_rows_that_see_nothing():
    """A decoder's rollout stays lower triangular with rows summing to 1; a row of zeros (no key seen) becomes the
    identity's row; shares leave such rows out."""
    torch.manual_seed(1)
    n = 6
    mask = torch.ones(n, n).tril().bool()
    layers = [torch.softmax(torch.randn(3, n, n).masked_fill(~mask, float("-inf")), -1) for _ in range(4)]
    R = rollout(layers)
    assert R is not None
    assert float(R.triu(1).abs().max()) == 0 and torch.allclose(R.sum(-1), torch.ones(n, dtype=torch.float64))
    torch.testing.assert_close(R, ref_rollout(layers), atol=1e-12, rtol=0)
    blank = layers[0].clone()
    blank[:, 2] = 0
    torch.testing.assert_close(rollout([blank]), ref_rollout([blank]), atol=1e-12, rtol=0)
    norms = torch.rand(3, n, dtype=torch.float64) + 0.1
    assert_shares(sink_shares(blank, None, norms), ref_shares(blank, norms, None), atol=1e-12)
    assert rollout([torch.rand(2, 3, 4)]) is None  # not square: cross-attention has no rollout


def test_last_row_is_the_rollouts_last_row():
    """What the terminal shows, R's last row alone (`e_last · M_L · ... · M_0`, a row times a matrix a layer), equals
    the last row of the loops' R, plain and value-weighted, and of the whole rollout without the first token."""
    torch.manual_seed(3)
    n = 7
    mask = torch.ones(n, n).tril().bool()
    layers = [torch.softmax(torch.randn(3, n, n).masked_fill(~mask, float("-inf")), -1) for _ in range(5)]
    norms = [torch.rand(3, n, dtype=torch.float64) + 0.1 for _ in layers]
    torch.testing.assert_close(last_row(layers), ref_rollout(layers)[-1:], atol=1e-12, rtol=0)
    torch.testing.assert_close(last_row(layers, norms), ref_rollout(layers, norms)[-1:], atol=1e-12, rtol=0)
    whole = rollout(layers, drop_first=True)
    assert whole is not None
    torch.testing.assert_close(last_row(layers, drop_first=True), whole[-1:], atol=1e-12, rtol=0)
    assert last_row([]) is None and last_row([torch.rand(2, 3, 4)]) is None  # not square: no rollout


def test_value_norms_through_the_gram_matrix_equal_the_direct_norms():
    """`sqrt(v G_h v)` equals `||v W_O^hT||` computed key by key (grouped-query attention included): to 1e-10 from
    float64 inputs, to 1e-5 from float32 ones (the Gram matrix then summed in float32, as W_o sums)."""
    torch.manual_seed(2)
    V = torch.randn(2, 40, 8, dtype=torch.float64)  # [n_kv_head, n_K, d_head]
    W_O = torch.randn(24, 4 * 8, dtype=torch.float64)  # [d_model, n_head·d_head]
    norms = value_norms(V, W_O)
    flat = V.transpose(0, 1).reshape(40, 16)  # as a v_proj's output
    torch.testing.assert_close(norms, ref_value_norms(flat, W_O, 4), atol=1e-10, rtol=0)
    single = value_norms(V.float(), W_O.float())
    assert single.dtype == torch.float64
    torch.testing.assert_close(single, norms, atol=1e-5, rtol=1e-5)
    A = torch.softmax(torch.randn(4, 5, 40), -1)
    torch.testing.assert_close(weighted(A, norms), A.double() * norms[:, None, :], atol=0, rtol=0)


def test_terminal_shows_the_sinks_grid_and_the_rollout(tiny, runner):
    folder, _ = tiny("llama")
    result = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", TEXT, "--all-layers",
                                 "--all-heads"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "sinks: where each head parks its weight  [3 layers x 4 heads]" in out
    assert "value-weighted share from the first token" in out and "rollout, the last token draws from:" in out
    assert "what each head moves" in out and all(len(line) <= 80 for line in out.splitlines())
    # the terminal computes the rollout's last row alone: the tokens it names are the whole rollout's (--json)
    payload = json.loads(runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--text", TEXT,
                                             "--all-layers", "--json"]).stdout)
    row = payload["rollout"][-1]
    top = sorted(range(len(row)), key=lambda j: (-row[j], j))[0]
    assert f"rollout, the last token draws from: {top} " in out


def test_gemma4_value_norms_read_the_normed_values(runner, tmp_path):
    """Gemma 4 norms its values per head (v_norm) after the projection: with as many KV heads as heads (no V_rep to
    read) value_norms must be taken from V_normed, as transformers' attention reads them (a hook on v_norm)."""
    from tiny_gemma4 import _tokenizer, decoder_layers, text_config
    from tiny_models import save_random
    from transformers import Gemma4ForCausalLM

    tokenizer = _tokenizer()
    config = text_config(len(tokenizer), num_key_value_heads=4, num_kv_shared_layers=0)
    model = save_random(tmp_path / "gemma4", tokenizer, config, Gemma4ForCausalLM, 7)
    payload = json.loads(runner.invoke(app, ["head", "--model", str(tmp_path / "gemma4"), "--layer", "0", "--head",
                                             "0", "--text", TEXT, "--all-heads", "--json"]).stdout)
    attention = decoder_layers(model)[0].self_attn
    _, (V,), (W_O,) = eager_with_values(model, payload["token_ids"], [attention.v_norm], [attention.o_proj.weight])
    norms = ref_value_norms(V.reshape(len(V), -1), W_O, len(payload["heads"]))  # [n, n_kv_head, d_head] -> [n, ..]
    for h, head in enumerate(payload["heads"]):
        torch.testing.assert_close(torch.tensor(head["value_norms"], dtype=torch.float64), norms[h], atol=2e-5,
                                   rtol=2e-5)
