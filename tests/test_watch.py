"""attnscope.watch (issue 42): a model the user holds, watched on its own backend. Every pattern is held against
transformers' eager attention with output_attentions (the same weights, switched to eager after the watched run),
through generate too; the watched outputs against the unwatched ones bit for bit; a plain module against PyTorch's
own formula; seen.check() against its float64 reference. Tiny models with every weight moved off its initial
value (tiny_models.perturb), and the real SmolLM2 GGUF through transformers (gguf_file=)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import perturb

from attnscope import AttnscopeError, watch

TOLERANCE = 1e-5


def tiny(family: str, impl: str):
    """A tiny causal LM of `family` on `impl`, every weight off its initial value."""
    import transformers as tf

    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "num_hidden_layers": 2}
    config = {
        "llama": lambda: tf.LlamaConfig(**base, attention_bias=True),
        "qwen3": lambda: tf.Qwen3Config(**{**base, "num_hidden_layers": 3}, head_dim=16, use_sliding_window=True,
                                        sliding_window=4, max_window_layers=1),  # qk-norm, layers 1, 2 sliding
        "gemma2": lambda: tf.Gemma2Config(**{**base, "num_hidden_layers": 3}, head_dim=8, query_pre_attn_scalar=12,
                                          attn_logit_softcapping=5.0, sliding_window=4),  # softcap
        "mistral": lambda: tf.MistralConfig(**base, sliding_window=3),
        "gpt_oss": lambda: tf.GptOssConfig(**{**base, "num_hidden_layers": 3}, head_dim=8, sliding_window=4,
                                           num_local_experts=4, num_experts_per_tok=2),  # sinks
    }[family]()
    cls = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "gemma2": tf.Gemma2ForCausalLM,
           "mistral": tf.MistralForCausalLM, "gpt_oss": tf.GptOssForCausalLM}[family]
    config.pad_token_id, config.eos_token_id = 0, None
    torch.manual_seed(7)
    model = perturb(cls._from_config(config, attn_implementation=impl).eval())
    assert model.config._attn_implementation == impl
    return model


def eager_attentions(model, **inputs) -> tuple:
    """transformers' eager output_attentions on the same weights; the model's backend put back after."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(**inputs, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(impl)


def watched_padded(model) -> tuple:
    """Two sequences of 9 tokens on the model's device, element 1 left-padded by 2, run plain and watched: the
    watched logits must equal the plain ones bit for bit. Returns the ids, the mask and what was seen."""
    device = next(model.parameters()).device
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with watch(model) as seen:
            watched = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(plain, watched)
    return ids, mask, seen


CELLS = [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("gemma2", "eager"), ("mistral", "sdpa"),
         ("gpt_oss", "eager")]


@pytest.mark.parametrize(("family", "impl"), CELLS, ids=[f"{f}-{i}" for f, i in CELLS])
def test_every_layer_equals_eager_and_outputs_are_untouched(family, impl):
    model = tiny(family, impl)
    ids, mask, seen = watched_padded(model)
    assert model.config._attn_implementation == impl  # never switched to eager
    assert_every_layer_is_eagers(model, ids, mask, seen, TOLERANCE)


def assert_every_layer_is_eagers(model, ids, mask, seen, tolerance: float) -> None:
    """Each watched layer's patterns, on the CPU in float32, against transformers' eager attentions on the model's
    device and dtype (rows of padded queries left out: eager's and SDPA's fills differ, no pattern to read)."""
    eager = eager_attentions(model, input_ids=ids, attention_mask=mask)
    assert seen.layers == list(range(len(eager)))
    for layer, theirs in enumerate(eager):
        theirs = theirs.float().cpu()
        for batch in range(2):
            ours = seen.patterns(layer, batch)
            assert ours.dtype == torch.float32 and ours.device.type == "cpu"
            real = mask[batch].bool().cpu()
            torch.testing.assert_close(ours[:, real], theirs[batch][:, real], atol=tolerance, rtol=0)
        torch.testing.assert_close(seen.pattern(layer, 1, batch=0), theirs[0, 1], atol=tolerance, rtol=0)
    assert all(c.passed for c in seen.check())


GENERATE = [("llama", "sdpa"), ("mistral", "sdpa"), ("gemma2", "eager"), ("gpt_oss", "eager")]


@pytest.mark.parametrize(("family", "impl"), GENERATE, ids=[f"{f}-{i}" for f, i in GENERATE])
def test_generate_appends_each_step_as_eager_reads_it(family, impl):
    model = tiny(family, impl)
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=5, do_sample=False)
        with watch(model, layers=[1]) as seen:
            watched = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(plain, watched)
    fed = watched[:, :-1]  # the last token is chosen, never fed
    assert seen.tokens == fed[0].tolist()
    eager = eager_attentions(model, input_ids=fed)
    ours = seen.patterns(1)
    assert ours.shape == eager[1][0].shape == (4, fed.shape[1], fed.shape[1])
    torch.testing.assert_close(ours, eager[1][0], atol=TOLERANCE, rtol=0)
    assert all(c.passed for c in seen.check())


def test_vlm_language_layers_equal_eager(tmp_path):
    from tiny_vlm import build, image, reference_inputs

    model = build("llava", tmp_path / "llava")
    model.set_attn_implementation("sdpa")
    inputs = reference_inputs(model, tmp_path / "llava", "The cat sat.", image(tmp_path / "p.png"))
    with torch.no_grad():
        plain = model(**inputs).logits
        with watch(model) as seen:
            watched = model(**inputs).logits
    assert torch.equal(plain, watched)
    eager = eager_attentions(model, **inputs)
    assert seen.layers == list(range(len(eager)))
    for layer, theirs in enumerate(eager):
        torch.testing.assert_close(seen.patterns(layer), theirs[0], atol=TOLERANCE, rtol=0)
    assert any("vision" in note and "not watched" in note for note in seen.all_notes())


class Block(torch.nn.Module):
    """nanoGPT's attention on its fast path (F.scaled_dot_product_attention, is_causal), and a second, masked one."""

    def __init__(self, d: int = 16, n_head: int = 2, causal: bool = True) -> None:
        super().__init__()
        self.c_attn, self.n_head, self.causal = torch.nn.Linear(d, 3 * d), n_head, causal

    def qk(self, x):
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        heads = lambda t: t.view(*x.shape[:2], self.n_head, -1).transpose(1, 2)  # noqa: E731  [B, nh, T, hs]
        return heads(q), heads(k), heads(v)

    def forward(self, x, mask=None):
        q, k, v = self.qk(x)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
        return x + y.transpose(1, 2).reshape(x.shape)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block(causal=False)])

    def forward(self, x, mask=None):
        x = self.blocks[0](x)
        return self.blocks[1](x, mask)


def test_any_module_on_sdpa_is_watched_at_the_call():
    torch.manual_seed(0)
    net = perturb(Net().eval())
    x = torch.randn(2, 7, 16)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    original = F.scaled_dot_product_attention
    with torch.no_grad():
        plain = net(x, mask)
        with watch(net) as seen:
            watched = net(x, mask)
        assert F.scaled_dot_product_attention is original
        assert torch.equal(plain, watched)
        assert seen.layers == [0, 1] and seen.paths == {0: "blocks.0", 1: "blocks.1"}
        h = net.blocks[0](x)  # the reference: PyTorch's formula on the module's own q and k, in float64
        for layer, (block, inp, m) in enumerate([(net.blocks[0], x, None), (net.blocks[1], h, mask)]):
            q, k, _ = block.qk(inp)
            scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
            allowed = torch.ones(7, 7, dtype=torch.bool).tril() if m is None else m
            expected = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
            for batch in range(2):
                torch.testing.assert_close(seen.patterns(layer, batch).double(), expected[batch], atol=TOLERANCE,
                                           rtol=0)
    assert all(c.passed for c in seen.check())


def test_outside_the_interface_gives_transformers_own_attentions():
    import transformers as tf

    config = tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(1)
    model = perturb(tf.BloomForCausalLM._from_config(config, attn_implementation="eager").eval())
    ids = torch.randint(1, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids)
        with watch(model) as seen:
            watched = model(ids)
        theirs = model(ids, output_attentions=True).attentions
    assert torch.equal(plain.logits, watched.logits) and watched.attentions is None
    assert "its own code" in seen.all_notes()[0]
    for layer, attention in enumerate(theirs):
        torch.testing.assert_close(seen.patterns(layer), attention[0], atol=TOLERANCE, rtol=0)
    falcon = tf.FalconForCausalLM._from_config(tf.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=4), attn_implementation="sdpa")
    with torch.no_grad():
        plain = falcon(ids).logits
        with watch(falcon) as seen:  # its SDPA path is its own code: said in one line, nothing changed
            assert torch.equal(falcon(ids).logits, plain)
    assert seen.layers == [] and 'attn_implementation="eager"' in seen.all_notes()[0]
    assert len(seen.all_notes()) == 1
    with pytest.raises(AttnscopeError, match="no attention call of layer 0 was seen"):
        seen.pattern(0, 0)


def test_layer_heads_and_page_are_model_heads(tmp_path):
    from attnscope.readings.headstats import LayerHeads

    model = tiny("llama", "sdpa")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with torch.no_grad(), watch(model, layers=[1], heads=[0, 2]) as seen:
        model(ids)
    heads = seen[1]
    assert isinstance(heads, LayerHeads) and [h["head"] for h in heads.heads] == [0, 2]
    eager = eager_attentions(model, input_ids=ids)[1][0]
    reference = LayerHeads.of(eager, "layer 1", tokens=ids[0].tolist())
    for ours in heads.heads:
        theirs = reference.heads[ours["head"]]
        assert ours["kind"] == theirs["kind"]
        for key, value in theirs["stats"].items():
            assert ours["stats"][key] == pytest.approx(value, abs=1e-4)
    page = seen.html(tmp_path / "page.html")
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    with pytest.raises(AttnscopeError, match="head 1 was not asked for; the heads watched are 0, 2"):
        seen.pattern(1, 1)
    with pytest.raises(AttnscopeError, match="layer 0 was not asked for; the layers watched are 1"):
        seen.pattern(0, 0)


def test_bad_input_is_one_line_naming_the_parameter():
    model = tiny("llama", "sdpa")
    with pytest.raises(AttnscopeError, match="model: watch takes a torch.nn.Module"):
        watch("model.safetensors")
    with pytest.raises(AttnscopeError, match=r"layers: layer 2 is out of range; this model has 2 layers \(0..1\)"):
        watch(model, layers=[0, 2])
    with pytest.raises(AttnscopeError, match="layers: '1' is not a layer number"):
        watch(model, layers=["1"])
    with pytest.raises(AttnscopeError, match="heads: head 4 is out of range"):
        watch(model, heads=4)
    with watch(model), pytest.raises(AttnscopeError, match="another watch is active"), watch(model):
        pass


def test_a_forward_that_raises_leaves_the_model_as_it_was():
    from transformers.modeling_utils import AttentionInterface

    model = tiny("llama", "sdpa")
    before = (AttentionInterface.get_interface, AttentionInterface.__getitem__, F.scaled_dot_product_attention)
    with pytest.raises(IndexError), watch(model):  # the model's own error, not attnscope's
        model(torch.tensor([[1, 2, 999]]))
    assert (AttentionInterface.get_interface, AttentionInterface.__getitem__, F.scaled_dot_product_attention) == before
    assert not model._forward_pre_hooks and not model._forward_hooks
    with watch(Net()):  # and the next watch is allowed
        pass


def test_watch_is_lazy_and_not_shadowed():
    import attnscope
    import attnscope.watching  # noqa: F401

    assert attnscope.watch is watch and callable(attnscope.watch)


def test_smollm2_gguf_through_transformers_on_sdpa():
    """The real trained SmolLM2-135M (Q4_1 GGUF, dequantized by transformers' loader), on its default SDPA:
    layers 3 and 20 through generate, against eager output_attentions on the tokens it fed. The prompt is ids
    drawn from the vocabulary and repeated (what an induction head follows), no tokenizer loaded."""
    from test_gguf_smollm2 import smollm2
    from transformers import AutoModelForCausalLM

    path = smollm2()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    drawn = torch.randint(100, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([drawn, drawn], dim=1)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=3, do_sample=False)
        with watch(model, layers=[3, 20]) as seen:
            watched = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(plain, watched)
    eager = eager_attentions(model, input_ids=watched[:, :-1])
    for layer in (3, 20):
        torch.testing.assert_close(seen.patterns(layer), eager[layer][0], atol=TOLERANCE, rtol=0)
    assert seen.paths[20] == "model.layers.20.self_attn"
    assert all(c.passed for c in seen.check())


def _steps(attentions: tuple, layer: int, n_keys: int) -> torch.Tensor:
    """generate's output_attentions for one layer, its steps' rows stacked: `[n_head, n_rows, n_keys]` of batch
    element 0 (a static cache's columns past the filled ones are eager's zeros: checked, then cut)."""
    rows = torch.cat([step[layer][0] for step in attentions], dim=1)  # [n_head, n_rows, max_cache_len]
    assert float(rows[..., n_keys:].abs().max()) == 0.0 if rows.shape[-1] > n_keys else True
    return rows[..., :n_keys]


@pytest.mark.parametrize("given", ["cache_implementation", "StaticCache"])
def test_static_cache_keeps_only_the_filled_keys(given):
    from transformers import StaticCache

    model = tiny("llama", "sdpa")
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(5))

    def run(eager: bool = False):
        cache = StaticCache(config=model.config, max_cache_len=24)
        how = {"cache_implementation": "static"} if given == "cache_implementation" else {"past_key_values": cache}
        out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                             output_attentions=eager, **how)
        return out, cache

    with torch.no_grad():
        plain, _ = run()
        with watch(model, layers=[0, 1]) as seen:
            watched, cache = run()
        cache.reset()  # zeroes the user's cache in place: what was seen was copied, not referenced
        model.set_attn_implementation("eager")
        try:
            eager, _ = run(eager=True)
        finally:
            model.set_attn_implementation("sdpa")
    assert torch.equal(plain.sequences, watched.sequences) and torch.equal(watched.sequences, eager.sequences)
    n = watched.sequences.shape[1] - 1  # the last token is chosen, never fed
    for layer in (0, 1):
        ours = seen.patterns(layer)
        assert ours.shape == (4, n, n)  # the 24-row cache's 13 unwritten rows not kept
        torch.testing.assert_close(ours, _steps(eager.attentions, layer, n), atol=TOLERANCE, rtol=0)
    assert not seen.all_notes()
    assert all(c.passed for c in seen.check())


def _fake_flash(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                softcap=None, is_causal=None, **kwargs):
    """Flash attention's contract on the CPU, through F.scaled_dot_product_attention: transformers' flash masks
    (None, or `[n_batch, n_K]` padding), causal from the bottom right, `sliding_window` keys back including the
    query's own (modeling_flash_attention_utils: window_size (w - 1, w - 1)); output `[n_batch, n_Q, n_head, d]`."""
    n_Q, n_K = query.shape[2], key.shape[2]
    rows = torch.arange(n_Q)[:, None] + (n_K - n_Q)
    cols = torch.arange(n_K)[None, :]
    allowed = cols <= rows if (module.is_causal if is_causal is None else is_causal) else torch.ones(n_Q, n_K,
                                                                                                     dtype=torch.bool)
    if sliding_window is not None:
        allowed = allowed & (cols > rows - sliding_window)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :n_K].bool()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("name", ["flash_attention_2", "kernels-community/flash-attn3"])
def test_flash_named_backend_is_read_with_flash_masks(name):
    """flash itself cannot run here (no GPU, no flash_attn): a stand-in registered under flash's names, as
    hub_kernels.load_and_register_attn_kernel registers a kernel (its function and flash's mask function), so
    that watch's lookup and its reading of flash's masks (bottom-right causal, sliding_window) are what is tested."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny("mistral", "sdpa")  # sliding_window 3
    ids = torch.randint(1, 64, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                               output_logits=True)
    ALL_ATTENTION_FUNCTIONS[name] = _fake_flash  # the instance's local mapping: deleted after, globals untouched
    ALL_MASK_ATTENTION_FUNCTIONS[name] = ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    try:
        model.config._attn_implementation = name
        with torch.no_grad(), watch(model) as seen:
            flashed = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                                     output_logits=True)
    finally:
        model.config._attn_implementation = "sdpa"
        del ALL_ATTENTION_FUNCTIONS[name], ALL_MASK_ATTENTION_FUNCTIONS[name]
    assert torch.equal(plain.sequences, flashed.sequences)  # the stand-in computes what SDPA does
    for theirs, ours in zip(plain.logits, flashed.logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    fed = flashed.sequences[:, :-1]
    eager = eager_attentions(model, input_ids=fed)
    for layer, theirs in enumerate(eager):
        torch.testing.assert_close(seen.patterns(layer), theirs[0], atol=TOLERANCE, rtol=0)
    assert all(c.passed for c in seen.check())


def test_bfloat16_model_patterns_in_float32():
    """A bfloat16 model (on the CPU: no GPU here) on SDPA: its outputs bit-identical watched, the patterns float32
    from its bfloat16 Q and K. Layer 0's against eager output_attentions of the same weights (bfloat16: eager's
    float32 softmax rounded, half a bfloat16 step of 1 is 2e-3; later layers' inputs differ between the kernels by
    bfloat16's noise), every layer's against seen.check()'s float64 reference, and against a float64 softmax of the
    recorded Q and K written here (causal, GQA)."""
    model = tiny("llama", "sdpa").to(torch.bfloat16)
    ids = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with watch(model) as seen:
            watched = model(input_ids=ids).logits
    assert plain.dtype == torch.bfloat16 and torch.equal(plain, watched)
    eager = eager_attentions(model, input_ids=ids)
    ours = seen.patterns(0)
    assert ours.dtype == torch.float32 and eager[0].dtype == torch.bfloat16
    torch.testing.assert_close(ours, eager[0][0].float(), atol=2e-3, rtol=0)
    assert all(c.passed for c in seen.check())
    layer = seen.layers[-1]
    kept = seen._listener.layers[layer]
    Q = kept.calls[0].Q[0].double()  # [n_head, n_Q, d_head], bfloat16 -> float64
    K = kept.keys[0][0].double().repeat_interleave(2, dim=0)  # [n_kv_head, n_K, d_head] -> [n_head, n_K, d_head]
    scores = Q @ K.transpose(-1, -2) * Q.shape[-1] ** -0.5  # [n_head, n_Q, n_K]
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(seen.patterns(layer).double(), scores.softmax(-1), atol=1e-6, rtol=0)
