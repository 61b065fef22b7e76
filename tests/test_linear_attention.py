"""Linear attention layers (linear_attention.py) and the hybrids built on them (Qwen3-Next, Qwen3.5, Kimi Linear,
MiniMax)
against transformers' own eager models: tiny random checkpoints with every weight perturbed off its init
(tests/tiny_linear.py). Every layer's output equals the module's own; a full layer's pattern equals eager
output_attentions; a linear layer's exact matrix M, times the values after the convolution, equals the
recurrence's output as transformers computes it (its gated norm's input) to 1e-5; M equals a float64 product of
the recurrence's matrices written out here; greedy decoding gives transformers' tokens. The chunked M (the UT
transform) equals the recurrence run on the identity token by token (tests/linear_reference.py) to 1e-10 on
random shapes, gates, betas and chunk sizes (hypothesis), in pieces and decode steps, and M @ V equals
transformers' chunked gated delta rule and Kimi's per-channel rules."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fuzz import fuzz_settings
from hypothesis import example, given
from hypothesis import strategies as st
from linear_reference import effective_matrix_by_recurrence
from tiny_linear import FAMILIES, build, linear_modules
from tiny_models import SENTENCE

from attnscope.attention.linear_attention import TOLERANCE, effective_matrix, recurrence
from attnscope.models.tokenizer import encode
from attnscope.runs.head import model_head, run_head
from attnscope.runs.head_result import HeadOptions


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (folder, eager model, ids, attentions, each layer's attention output, each linear layer's
    recurrence output before its gated norm), built the first time a test asks."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = build(family, folder)
            ids = encode(folder, SENTENCE).ids
            outputs, cores, hooks = {}, {}, []
            for index, layer in enumerate(model.model.layers):
                module = getattr(layer, "linear_attn", None) or layer.self_attn
                hooks.append(module.register_forward_hook(
                    lambda m, a, out, i=index: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)))
            for index, module in linear_modules(model).items():
                norm = getattr(module, "norm", None) or module.o_norm  # its input: the recurrence's output
                hooks.append(norm.register_forward_hook(lambda m, a, out, i=index: cores.__setitem__(i, a[0])))
            with torch.no_grad():
                attentions = model(torch.tensor([ids]), output_attentions=True).attentions
            for hook in hooks:
                hook.remove()
            cache[family] = folder, model, ids, attentions, outputs, cores
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_equals_transformers(built, family):
    """Each layer's attention output (x), the full layers' patterns, and M @ V against the recurrence's output as
    transformers computes it, for every layer of the model."""
    folder, model, _, attentions, outputs, cores = built(family)
    n_layer = len(model.model.layers)
    if len(attentions) == n_layer:  # MiniMax's output_attentions holds its lightning layers' states too
        attentions = tuple(a for i, a in enumerate(attentions) if i not in cores)
    full = iter(attentions)
    for layer in range(n_layer):
        result = model_head(folder, layer, 1, text=SENTENCE)
        steps = result.run.layer
        assert torch.allclose(steps["x"], outputs[layer], atol=1e-5, rtol=1e-4), layer
        if layer in cores:
            M, V = steps["effective_attention"][0].double(), steps["V_split"][0].double()  # [n_head, n, n], [.., d_V]
            theirs = cores[layer].view(V.shape[1], V.shape[0], V.shape[2]).transpose(0, 1).double()  # [n_head, n, d_V]
            assert (M @ V - theirs).abs().max() <= TOLERANCE * max(1.0, float(theirs.abs().max()))
            assert "is equal to x_raw" in " ".join(steps.notes)
            assert torch.equal(result.attention, result.all_heads[1])
            assert "effective_attention" in result.run.head and "attention" not in steps
        else:
            assert torch.allclose(result.all_heads, next(full)[0], atol=1e-5)
    assert next(full, None) is None  # every full layer was compared


def _product_reference(q, k, g, beta):
    """M[t, s] = q_t^T P_t P_(t-1) ... P_(s+1) beta_s k_s with P_r = (I - beta_r k_r k_r^T) D_r, the matrices
    multiplied out in float64 (D_r = diag(exp(g_r)), a scalar decay broadcast over d_K)."""
    n, d_K = q.shape
    M = torch.zeros(n, n, dtype=torch.float64)
    eye = torch.eye(d_K, dtype=torch.float64)
    for s in range(n):
        a = beta[s] * k[s]
        M[s, s] = q[s] @ a
        for t in range(s + 1, n):
            D = torch.diag(g[t].exp() * torch.ones(d_K, dtype=torch.float64))
            a = (eye - beta[t] * torch.outer(k[t], k[t])) @ D @ a
            M[t, s] = q[t] @ a
    return M


@pytest.mark.parametrize("per_channel", [False, True])
def test_effective_matrix_is_the_product_of_the_recurrence(per_channel):
    torch.manual_seed(3)
    n, d_K, d_V = 7, 5, 3
    q, k = torch.randn(1, 1, n, d_K, dtype=torch.float64), torch.randn(1, 1, n, d_K, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    g = -torch.rand(1, 1, n, d_K) if per_channel else -torch.rand(1, 1, n)
    beta = torch.rand(1, 1, n, dtype=torch.float64)
    empty = torch.zeros(1, 1, d_K, 0, dtype=torch.float64)
    M, _ = effective_matrix(q, k, g, beta, empty)
    assert torch.allclose(M[0, 0], _product_reference(q[0, 0], k[0, 0], g[0, 0].double(), beta[0, 0]), atol=1e-12)
    v = torch.randn(1, 1, n, d_V, dtype=torch.float64)
    out, _ = recurrence(q, k, v, g.double(), beta, torch.zeros(1, 1, d_K, d_V, dtype=torch.float64))
    assert torch.allclose(M[0, 0] @ v[0, 0], out[0, 0], atol=1e-12)
    # in two pieces, the second carrying the first's effective keys: the same rows
    first, A = effective_matrix(q[..., :4, :], k[..., :4, :], g[:, :, :4], beta[..., :4], empty)
    second, _ = effective_matrix(q[..., 4:, :], k[..., 4:, :], g[:, :, 4:], beta[..., 4:], A)
    assert torch.allclose(torch.cat([torch.nn.functional.pad(first, (0, 3)), second], dim=-2), M, atol=1e-12)


def test_against_transformers_recurrent_rule():
    """M @ V against transformers' own `torch_recurrent_gated_delta_rule` on random inputs, with grouped heads: q and
    k repeated per value head (`repeat_interleave`) before the kernel, as Qwen3NextGatedDeltaNet does in
    transformers 5.17 (whose kernel takes equal heads only) and the kernel does itself in later ones."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    torch.manual_seed(5)
    n, n_k, n_v, d_K, d_V = 9, 2, 4, 6, 5
    q, k = torch.randn(1, n, n_k, d_K), torch.randn(1, n, n_k, d_K)
    v, beta, g = torch.randn(1, n, n_v, d_V), torch.rand(1, n, n_v), -torch.rand(1, n, n_v)
    theirs, _ = torch_recurrent_gated_delta_rule(q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v, g,
                                                 beta, use_qk_l2norm_in_kernel=True)
    qn = torch.nn.functional.normalize(q, dim=-1, eps=0).repeat_interleave(2, dim=2).transpose(1, 2) / math.sqrt(d_K)
    kn = torch.nn.functional.normalize(k, dim=-1, eps=0).repeat_interleave(2, dim=2).transpose(1, 2)
    M, _ = effective_matrix(qn, kn, g.transpose(1, 2), beta.transpose(1, 2), torch.zeros(1, n_v, d_K, 0))
    mine = M @ v.transpose(1, 2).double()  # [1, n_v, n, d_V]
    assert torch.allclose(mine.float(), theirs.transpose(1, 2), atol=1e-4)  # eps 1e-6 in their l2norm, 0 here


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_carries_the_state(built, family):
    """Greedy decoding through every layer, the linear layers' state carried step to step: transformers' tokens;
    the cache grows only by the full layers' keys and values."""
    folder, model, ids, *_ = built(family)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    result = run_head(HeadOptions(model=str(folder), layer=0, head=2, text=SENTENCE, generate=4))
    assert [step.token_id for step in result.decode] == theirs
    first, second = result.decode[0], result.decode[1]
    n_head = 6 if family.startswith("qwen") else 4  # layer 0's: a linear layer's value heads
    assert first.attention.shape == (n_head, len(ids)) and second.attention.shape == (n_head, len(ids) + 1)
    # the last step's row of layer 0's M, carried through the decode steps, is the last row of M on the whole text
    from attnscope.models.config import read_config
    from attnscope.models.families import open_model
    from attnscope.models.forward.run import run_layer

    fed = ids + theirs[:-1]  # every token the steps fed in
    opened = open_model(folder, read_config(folder))
    with opened.checkpoint:
        whole = run_layer(opened, fed, [0] * len(fed), 0, 2).layer["effective_attention"][0, :, -1]  # [n_head, n_K]
    assert torch.allclose(result.decode[-1].attention, whole, atol=1e-5)
    grown = second.kv_cache_bytes - first.kv_cache_bytes
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert 0 < grown <= 4 * 64 * len(full)  # one position's keys and values (or latent) in each full layer


def test_all_layers_and_json(built, runner):
    """--all-layers shows every layer, the linear ones as their exact matrix, with statistics that are numbers."""
    from attnscope.cli import app

    folder, *_ = built("qwen3_next")
    result = run_head(HeadOptions(model=str(folder), layer=0, head=0, text=SENTENCE, all_layers=True))
    assert result.layer_numbers == [0, 1, 2, 3]
    for layer in result.layer_heads:
        assert all(math.isfinite(v) for head in layer.heads for v in head["stats"].values())
    out = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "3", "--text", SENTENCE,
                              "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout)  # no NaN: json.loads would take it, so look for it as text too
    assert "NaN" not in out.stdout and payload["pattern"] == "effective_attention"
    out = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--text", SENTENCE, "--all-layers",
                              "--json"])
    assert [entry["pattern"] for entry in json.loads(out.stdout)["all_layers"]] == [
        "effective_attention", "effective_attention", "attention", "effective_attention"]


def test_head_range_is_the_layers_own(built, runner):
    from attnscope.cli import app

    folder, *_ = built("qwen3_next")
    assert model_head(folder, 0, 5, text=SENTENCE).attention.shape[0] == len(encode(folder, SENTENCE).ids)
    out = runner.invoke(app, ["head", "--model", str(folder), "--layer", "0", "--head", "6", "--text", SENTENCE])
    assert out.exit_code == 2 and "--head 6 is out of range: layer 0 (linear attention) has 6 heads" in out.stderr
    out = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--head", "5", "--text", SENTENCE])
    assert out.exit_code == 2 and "--head 5 is out of range: layer 2 (full attention) has 4 heads" in out.stderr


def test_qwen3_5_multimodal_checkpoint_reads_its_text_model(tmp_path):
    """`qwen3_5` (Qwen3_5ForConditionalGeneration): the text model under model.language_model., its settings under
    text_config; its full layer's pattern and a linear layer's output as transformers computes them."""
    from tiny_linear import build_multimodal

    model = build_multimodal(tmp_path)
    ids = encode(tmp_path, SENTENCE).ids
    seen = {}
    hook = model.model.language_model.layers[3].linear_attn.register_forward_hook(
        lambda m, a, out: seen.__setitem__("x", out))
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    hook.remove()
    assert torch.allclose(model_head(tmp_path, 2, 1, text=SENTENCE).all_heads, attentions[0][0], atol=1e-5)
    result = model_head(tmp_path, 3, 1, text=SENTENCE)
    assert result.info.model_type == "qwen3_5"
    assert torch.allclose(result.run.layer["x"], seen["x"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_next", "minimax"])
def test_long_input_rows_equal_the_whole_matrix(built, family, monkeypatch):
    """A long input's head: M in blocks of query rows, the effective keys carried block to block, equal to the
    whole M of the short run; its statistics those of the whole matrix's shares of |M|."""
    from attnscope.models.forward import long
    from attnscope.readings.headstats import head_stats, shares

    folder, _, ids, *_ = built(family)
    whole = model_head(folder, 0, 1, text=SENTENCE).attention.double()  # [n, n]
    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 5)
    result = run_head(HeadOptions(model=str(folder), layer=0, head=1, text=SENTENCE, rows=f"0:{len(ids)}"))
    assert torch.allclose(result.long.exact_rows, whole, atol=1e-6)
    assert "effective_attention" in [step.name for step in result.long.layer.steps]  # the layer's shapes
    expected = head_stats(shares(whole), tokens=ids, causal=True)
    assert math.isclose(result.long.stats.entropy, expected.entropy, abs_tol=1e-5)


def test_check_on_a_long_inputs_rows_of_a_linear_layer_says_what_it_can_check(built, monkeypatch, capsys):
    """transformers returns no weights for a linear layer: --check on a long input's --rows of one refuses in a
    line (was an internal KeyError), while a full layer's rows are still checked against output_attentions."""
    from typer.testing import CliRunner

    from attnscope.cli import app
    from attnscope.models.forward import long

    folder, _, ids, *_ = built("qwen3_next")
    monkeypatch.setattr(long, "LONG_TOKENS", 8)
    monkeypatch.setattr(long, "BLOCK_ROWS", 5)
    runner = CliRunner()
    refused = runner.invoke(app, ["head", "--model", str(folder), "--layer", "0", "--text", SENTENCE,
                                  "--rows", "2:6", "--check"])
    assert refused.exit_code == 2
    assert "a linear-attention layer" in refused.output and "at most 8 tokens" in refused.output
    assert "KeyError" not in refused.output and "Traceback" not in refused.output
    full = runner.invoke(app, ["head", "--model", str(folder), "--layer", "2", "--text", SENTENCE,
                               "--rows", "2:6", "--check", "--json"])
    assert full.exit_code == 0, full.output


# --- effective_matrix's chunked form against the recurrence on the identity (tests/linear_reference.py) ---

def _case(seed: int, n_batch: int, n_head: int, n: int, d_K: int, n_cache: int, per_channel: bool, delta: bool,
          decay: float, keys: float) -> tuple[torch.Tensor, ...]:
    """q, k, g, beta and the effective keys of n_cache earlier positions, float64: keys of norm at most `keys`
    (l2-normed, as the delta rule's layers hand them over, times a random factor), beta in [0, 1] with its ends,
    g = -decay · uniform[0, 1) (per channel or per head and token), A a float64 state a few steps could have left."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_batch, n_head, n, d_K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(n_batch, n_head, n, d_K, generator=gen, dtype=torch.float64), dim=-1)
    k = k * keys * torch.rand(n_batch, n_head, n, 1, generator=gen, dtype=torch.float64)
    shape = (n_batch, n_head, n, d_K) if per_channel else (n_batch, n_head, n)
    g = -decay * torch.rand(shape, generator=gen, dtype=torch.float64)
    beta = torch.rand(n_batch, n_head, n, generator=gen, dtype=torch.float64) if delta else None
    if beta is not None and n > 2:
        beta[..., 0], beta[..., 1] = 0.0, 1.0  # no write, and a full overwrite
    A = torch.randn(n_batch, n_head, d_K, n_cache, generator=gen, dtype=torch.float64)
    return q, k, g, beta, A


def _assert_close(mine: torch.Tensor, reference: torch.Tensor) -> None:
    """Equal to 1e-10 of the reference's largest entry (exactly 0 where it is all 0)."""
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    assert mine.shape == reference.shape and bool(mine.isfinite().all())
    if reference.numel():
        assert float((mine - reference).abs().max()) <= 1e-10 * scale


@fuzz_settings(60)
@given(seed=st.integers(0, 2**31 - 1), n_batch=st.integers(1, 2), n_head=st.integers(1, 3), n=st.integers(1, 40),
       d_K=st.integers(1, 9), n_cache=st.integers(0, 6), per_channel=st.booleans(), delta=st.booleans(),
       decay=st.sampled_from([0.0, 0.05, 1.0, 8.0, 200.0]), keys=st.sampled_from([0.1, 1.0, 4.0]),
       chunk=st.integers(1, 45))
@example(seed=0, n_batch=1, n_head=1, n=1, d_K=4, n_cache=0, per_channel=False, delta=True, decay=1.0, keys=1.0,
         chunk=64)
@example(seed=1, n_batch=1, n_head=2, n=1, d_K=3, n_cache=5, per_channel=True, delta=True, decay=1.0, keys=1.0,
         chunk=1)
@example(seed=2, n_batch=1, n_head=1, n=37, d_K=5, n_cache=0, per_channel=True, delta=True, decay=200.0, keys=1.0,
         chunk=16)
def test_chunked_matrix_is_the_recurrence_on_the_identity(seed, n_batch, n_head, n, d_K, n_cache, per_channel,
                                                          delta, decay, keys, chunk):
    """Random shapes, gates (none, weak, strong, and per channel past exp(-300) within a chunk), betas (0 and 1
    among them), keys short and long (at most unit length for the delta rule, as its layers' l2 norm leaves them),
    chunks that do not divide n, n = 1, an earlier state: M and the state after equal the recurrence on the
    identity to 1e-10, and M is exactly 0 above the causal diagonal."""
    keys = min(keys, 1.0) if delta else keys
    q, k, g, beta, A = _case(seed, n_batch, n_head, n, d_K, n_cache, per_channel, delta, decay, keys)
    M, after = effective_matrix(q, k, g, beta, A, chunk=chunk)
    M_ref, after_ref = effective_matrix_by_recurrence(q, k, g, beta, A)
    _assert_close(M, M_ref)
    _assert_close(after, after_ref)
    later = torch.ones(n, n, dtype=torch.bool).triu(1)  # s > t among the new tokens
    assert bool((M[..., n_cache:][..., later] == 0).all())


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("delta", [False, True])
def test_pieces_and_decode_steps_carry_the_effective_keys(per_channel, delta):
    """M in two pieces of other chunk sizes, and token by token as decoding calls it (n = 1, the cache growing):
    the rows of M on the whole input, and the same state after."""
    n, d_K = 23, 6
    q, k, g, beta, empty = _case(7, 1, 2, n, d_K, 0, per_channel, delta, 0.5, 1.0)
    whole, after = effective_matrix(q, k, g, beta, empty, chunk=5)
    _assert_close(whole, effective_matrix_by_recurrence(q, k, g, beta, empty)[0])

    def piece(a, b, A, chunk):
        return effective_matrix(q[..., a:b, :], k[..., a:b, :], g[:, :, a:b], None if beta is None else beta[..., a:b],
                                A, chunk=chunk)

    first, A = piece(0, 9, empty, 4)
    second, A = piece(9, n, A, 64)
    _assert_close(torch.cat([torch.nn.functional.pad(first, (0, n - 9)), second], dim=-2), whole)
    _assert_close(A, after)
    A = empty
    for t in range(n):
        row, A = piece(t, t + 1, A, 64)  # [1, 2, 1, t + 1]
        _assert_close(row[..., 0, :], whole[..., t, : t + 1])
    _assert_close(A, after)


def test_strong_decay_per_channel_stays_finite():
    """A key channel decaying by exp(-100) a token: the chunk is cut every few tokens (exp(-G) would overflow
    float64 within the 64), and M stays finite and equal to the recurrence."""
    q, k, g, beta, empty = _case(11, 1, 1, 70, 4, 0, True, True, 1.0, 1.0)
    g[..., 2] = -100.0
    M, _ = effective_matrix(q, k, g, beta, empty)
    _assert_close(M, effective_matrix_by_recurrence(q, k, g, beta, empty)[0])


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("delta", [False, True])
def test_faded_keys_are_zero_not_denormal(per_channel, delta):
    """An input whose early effective keys fade below float64's normal numbers (exp(-5) a token for 200 tokens):
    M and the state hold no denormal number (they are flushed to 0 first: x86 is several times slower on them),
    and equal the recurrence."""
    q, k, g, beta, empty = _case(17, 1, 1, 200, 3, 0, per_channel, delta, 10.0, 1.0)
    M, A = effective_matrix(q, k, g, beta, empty)
    reference, A_ref = effective_matrix_by_recurrence(q, k, g, beta, empty)
    tiny = torch.finfo(torch.float64).tiny
    assert bool(((reference != 0) & (reference.abs() < tiny)).any())  # the recurrence does reach them
    assert not bool(((M != 0) & (M.abs() < tiny)).any()) and not bool(((A != 0) & (A.abs() < tiny)).any())
    _assert_close(M, reference)
    _assert_close(A, A_ref)


@pytest.mark.parametrize("rule", ["torch_chunk_gated_delta_rule", "recurrent_kimi_delta_attention",
                                  "chunk_kimi_delta_attention"])
def test_against_transformers_chunked_and_kda_rules(rule):
    """M @ V against transformers' own chunked gated delta rule (64-token chunks, 100 tokens: a last chunk of 36)
    and Kimi's per-channel rules, recurrent and chunked, on random inputs."""
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.qwen3_next import modeling_qwen3_next

    fn = getattr(modeling_qwen3_next, rule, None) or getattr(modeling_kimi_linear, rule)
    per_channel = "kimi" in rule
    torch.manual_seed(13)
    n, n_head, d_K, d_V = 100, 2, 8, 5
    q, k, v = torch.randn(1, n, n_head, d_K), torch.randn(1, n, n_head, d_K), torch.randn(1, n, n_head, d_V)
    beta = torch.rand(1, n, n_head)
    g = -torch.rand(1, n, n_head, d_K) * 0.3 if per_channel else -torch.rand(1, n, n_head) * 0.3
    theirs, _ = fn(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    qn = torch.nn.functional.normalize(q, dim=-1, eps=0).transpose(1, 2).double() / math.sqrt(d_K)
    kn = torch.nn.functional.normalize(k, dim=-1, eps=0).transpose(1, 2).double()  # [1, n_head, n, d_K]
    M, _ = effective_matrix(qn, kn, g.transpose(1, 2), beta.transpose(1, 2), torch.zeros(1, n_head, d_K, 0))
    mine = M @ v.transpose(1, 2).double()  # [1, n_head, n, n] @ [.., n, d_V] -> [1, n_head, n, d_V]
    assert torch.allclose(mine.float(), theirs.transpose(1, 2), atol=1e-4)  # float32 there, eps 1e-6 in their l2norm
