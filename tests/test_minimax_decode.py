"""MiniMax with a sliding window, decoding (`head --generate`), against transformers' own forward on the whole
sequence without a cache: each step's row of every layer (a softmax layer's pattern from eager output_attentions,
a lightning layer's effective matrix M from the module's own q and k written out in float64, and M @ V against the
module's recurrence), and the new ids against an argmax loop over the uncached eager logits.

Why not transformers' cached `generate`: in transformers 5.23 it is wrong here. `MiniMaxModel.forward` builds the
full layers' mask with `create_sliding_window_causal_mask` and no layer_idx, so masking_utils sizes it by cache
layer 0 (`MiniMaxCache()` marks no layer sliding). When layer 0 is a lightning layer, its cache layer never holds a
key (the state lives in `linear_cache`), so on each decode step the mask is one column, [1, 1, 1, 1], that
`eager_attention_forward` adds broadcast over every cached key: the new token sees the whole cache, no window. The
prompt's forward is right, and so is a model whose layer 0 is a full layer. `test_transformers_cached_path` holds
that finding; `--check` decodes by the uncached forward there and says so.

Tiny models (tests/tiny_linear.py: lightning, full, lightning, full; every weight perturbed), window 3 on a
16-token text.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_linear import build
from tiny_models import SENTENCE

from attnscope.models.tokenizer import encode
from attnscope.runs.head import run_head
from attnscope.runs.head_result import HeadOptions

WINDOW, N_NEW = 3, 4
FULL_FIRST = ["full_attention", "linear_attention"] * 2


def _uncached_argmax(model, ids: list[int], n_new: int) -> list[int]:
    """Greedy decoding as a loop: each token the argmax of eager's last logits on every token so far, no cache."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n_new):
            tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    return tokens[len(ids):]


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """The folder, transformers' eager model, the prompt's ids, and the uncached reference's new ids."""
    folder = tmp_path_factory.mktemp("minimax_window")
    model = build("minimax", folder, sliding_window=WINDOW)
    ids = encode(folder, SENTENCE).ids
    return folder, model, ids, _uncached_argmax(model, ids, N_NEW)


@pytest.fixture(scope="module")
def full_first(tmp_path_factory):
    """The same sizes and window with layer 0 a full layer: its folder and transformers' eager model."""
    folder = tmp_path_factory.mktemp("minimax_full_first")
    return folder, build("minimax", folder, sliding_window=WINDOW, layer_types=FULL_FIRST)


def _uncached_forward(model, fed: list[int]):
    """transformers' eager forward on `fed` without a cache: output_attentions (every layer's entry; a lightning
    layer's is its state), and each lightning layer's qkv_proj output and recurrence output (its norm's input)."""
    projected, cores, hooks = {}, {}, []
    for index, layer in enumerate(model.model.layers):
        if model.config.layer_types[index] == "linear_attention":
            attention = layer.self_attn
            hooks += [attention.qkv_proj.register_forward_hook(lambda m, a, out, i=index: projected.update({i: out})),
                      attention.norm.register_forward_hook(lambda m, a, out, i=index: cores.update({i: a[0]}))]
    try:
        with torch.no_grad():
            out = model(torch.tensor([fed]), use_cache=False, output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    return out.attentions, projected, cores


def _lightning_reference(module, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """M `[n_head, n, n]` in float64 from `MiniMaxLightningAttention`'s own q, k, v (silu of its qkv_proj output,
    each head's q | k | v in turn) and its slope_rate: M[h, t, s] = exp(-slope_h (t - s)) q_t . k_s for s <= t,
    else 0; and V `[n_head, n, d_head]`."""
    n_head, d_head = module.num_attention_heads, module.head_dim
    qkv = torch.nn.functional.silu(projected[0].double())  # [n, n_head·3·d_head]
    q, k, v = qkv.view(-1, n_head, 3 * d_head).transpose(0, 1).split(d_head, dim=-1)  # [n_head, n, d_head] each
    n = q.shape[1]
    t = torch.arange(n, dtype=torch.float64)
    gap = t[:, None] - t[None, :]  # [n, n]: t - s
    slope = module.slope_rate.double().view(n_head, 1, 1)
    decay = torch.where(gap >= 0, torch.exp(-slope * gap.clamp(min=0)), torch.zeros(()))  # [n_head, n, n]
    return decay * (q @ k.transpose(-1, -2)), v  # [n_head, n, d_head] @ [n_head, d_head, n] -> [n_head, n, n]


def test_transformers_cached_path(minimax, full_first, monkeypatch):
    """transformers 5.23's cached generate: on a decode step the full layers' mask has one key column while the
    cache holds the whole text (sized by lightning layer 0); sized by the first full layer instead, generate
    gives the uncached argmax loop's ids. A model whose layer 0 is full decodes right as it is."""
    import transformers.models.minimax.modeling_minimax as modeling

    folder, model, ids, uncached = minimax
    original = modeling.create_sliding_window_causal_mask
    widths: list[int] = []

    def sized_by_layer_0(**kwargs):
        mask = original(**kwargs)
        if kwargs["inputs_embeds"].shape[1] == 1:  # a decode step
            widths.append(mask.shape[-1])
        return mask

    monkeypatch.setattr(modeling, "create_sliding_window_causal_mask", sized_by_layer_0)
    with torch.no_grad():
        cached = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)[0, len(ids):].tolist()
    assert widths == [1] * (N_NEW - 1)  # one key column, broadcast over len(ids) + t cached keys
    assert cached != uncached

    first_full = model.config.layer_types.index("full_attention")
    monkeypatch.setattr(modeling, "create_sliding_window_causal_mask",
                        lambda **kwargs: original(**kwargs, layer_idx=first_full))
    with torch.no_grad():
        fixed = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)[0, len(ids):].tolist()
    assert fixed == uncached
    monkeypatch.setattr(modeling, "create_sliding_window_causal_mask", original)

    right = full_first[1]
    with torch.no_grad():
        theirs = right.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)[0, len(ids):].tolist()
    assert theirs == _uncached_argmax(right, ids, N_NEW)


def test_every_layer_every_step_equals_the_uncached_forward(minimax):
    """attnscope's greedy decoding with its caches (the full layers' keys, the lightning layers' states): the new
    ids are the uncached argmax loop's, and each step's row of every layer is the uncached forward's row at that
    position, a softmax layer's pattern (zero outside the window) and a lightning layer's M, with M @ V its
    recurrence's output there."""
    folder, model, ids, uncached = minimax
    fed = ids + uncached[:-1]  # every token the steps fed in
    attentions, projected, cores = _uncached_forward(model, fed)
    assert len(attentions) == model.config.num_hidden_layers
    for layer, kind in enumerate(model.config.layer_types):
        result = run_head(HeadOptions(model=str(folder), layer=layer, head=0, text=SENTENCE, generate=N_NEW))
        assert [step.token_id for step in result.decode] == uncached
        if kind == "linear_attention":
            M, V = _lightning_reference(model.model.layers[layer].self_attn, projected[layer])
            core = cores[layer][0].double().view(len(fed), M.shape[0], -1).transpose(0, 1)  # [n_head, n, d_head]
        for step in result.decode:
            p = step.position - 1  # the query that chose the step's token
            mine = step.attention.double()  # [n_head, p + 1]
            assert mine.shape == (4, p + 1)
            if kind == "full_attention":
                theirs = attentions[layer][0, :, p, : p + 1].double()
                assert torch.allclose(mine, theirs, atol=1e-5), (layer, p)
                assert bool((mine[:, : p + 1 - WINDOW] == 0).all())  # outside the window
                assert step.evicted == p + 1 - WINDOW
            else:
                assert torch.allclose(mine, M[:, p, : p + 1], atol=1e-5, rtol=1e-4), (layer, p)
                # [n_head, 1, p + 1] @ [n_head, p + 1, d_head] -> the row of M @ V at p
                product = (mine[:, None] @ V[:, : p + 1])[:, 0]
                assert torch.allclose(product, core[:, p], atol=1e-5, rtol=1e-4), (layer, p)


@pytest.mark.parametrize("layer", [1, 0])
def test_check_passes_against_the_uncached_forward(minimax, runner, layer):
    """`--generate --check` holds the ids (and a full layer's rows) to the uncached forward, names it as the
    reference and says why; no FAIL. A lightning layer's steps compare the ids only."""
    from attnscope.cli import app

    folder, _, ids, uncached = minimax
    out = runner.invoke(app, ["head", "--model", str(folder), "--layer", str(layer), "--head", "0", "--text",
                              SENTENCE, "--generate", str(N_NEW), "--check", "--json"])
    assert out.exit_code == 0, out.output
    check = {c["name"]: c for c in json.loads(out.stdout)["check"]}
    assert all(c["passed"] for c in check.values())
    assert check["generated ids"]["reference"] == "uncached forward"
    assert "drops the sliding window on decode steps" in check["generated ids"]["detail"]
    steps = [name for name in check if name.startswith("step ")]
    assert steps == ([f"step {t} layer 1" for t in range(N_NEW)] if layer == 1 else [])


def test_check_output_reads_at_80_columns(minimax, runner):
    from attnscope.cli import app

    folder, *_ = minimax
    out = runner.invoke(app, ["head", "--model", str(folder), "--layer", "1", "--head", "2", "--text", SENTENCE,
                              "--generate", "2", "--check"], env={"NO_COLOR": "1", "COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    assert "FAIL" not in out.stdout and "uncached forward" in out.stdout
    assert "\x1b[" not in out.stdout and max(map(len, out.stdout.splitlines())) <= 80
    assert "the reference is an argmax loop over its forward without a cache" in " ".join(out.stdout.split())


def test_check_keeps_generate_where_it_is_right(full_first, runner):
    """Layer 0 a full layer: transformers' cached generate keeps the window, and stays --check's reference."""
    from attnscope.cli import app

    out = runner.invoke(app, ["head", "--model", str(full_first[0]), "--layer", "0", "--head", "1", "--text", SENTENCE,
                              "--generate", "3", "--check", "--json"])
    assert out.exit_code == 0, out.output
    check = {c["name"]: c for c in json.loads(out.stdout)["check"]}
    assert all(c["passed"] for c in check.values()) and len(check) == 1 + 1 + 3
    assert check["generated ids"]["reference"] == "generate" and check["generated ids"]["detail"] == ""
