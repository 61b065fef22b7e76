"""attnscope.watch on a CUDA model (issue 42's "any backend", on the device it runs on): the model stays on the GPU in
its own dtype and backend (SDPA picks flash or memory-efficient kernels there in half precision), its outputs are
untouched bit for bit, and every pattern comes back on the CPU in float32, held against transformers' eager
attention with output_attentions on the same GPU, weights and dtype. Runs only where CUDA is; test_watch.py holds
the same on the CPU everywhere."""

from __future__ import annotations

import math

import pytest
import torch
from test_watch import Net, assert_every_layer_is_eagers, eager_attentions, tiny, watched_padded
from tiny_models import perturb

from attnscope import watch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# float32: eager and the watched formula differ by rounding alone. Half precision: eager rounds its scores to the
# model's dtype before its float32 softmax and its attentions after it (2^-8 relative in bfloat16), the watched
# pattern is float32 from the same rounded q and k.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CELLS = [("llama", "sdpa", torch.float32), ("llama", "sdpa", torch.bfloat16), ("qwen3", "sdpa", torch.float16),
         ("mistral", "sdpa", torch.bfloat16), ("gemma2", "eager", torch.bfloat16), ("gpt_oss", "eager", torch.float32)]


@pytest.mark.parametrize(("family", "impl", "dtype"), CELLS, ids=[f"{f}-{i}-{d}" for f, i, d in CELLS])
def test_a_gpu_model_is_watched_in_its_own_dtype_and_backend(family, impl, dtype):
    model = tiny(family, impl).to("cuda", dtype)
    ids, mask, seen = watched_padded(model)  # the watched logits equal the plain ones bit for bit
    assert model.config._attn_implementation == impl and next(model.parameters()).device.type == "cuda"
    assert_every_layer_is_eagers(model, ids, mask, seen, TOLERANCE[dtype])


def test_generate_on_the_gpu_appends_each_step():
    model = tiny("llama", "sdpa").to("cuda", torch.bfloat16)
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=5, do_sample=False)
        with watch(model, layers=[1]) as seen:
            watched = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(plain, watched)
    fed = watched[:, :-1]
    assert seen.tokens == fed[0].tolist()
    ours, theirs = seen.patterns(1), eager_attentions(model, input_ids=fed)[1][0]
    assert ours.shape == theirs.shape == (4, fed.shape[1], fed.shape[1])
    torch.testing.assert_close(ours, theirs.float().cpu(), atol=TOLERANCE[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_any_module_on_sdpa_is_watched_on_the_gpu(dtype):
    """nanoGPT's fast path (is_causal, then a boolean mask) on the GPU: in bfloat16 SDPA takes its flash kernel for
    the causal call; the pattern is PyTorch's formula on the module's own q and k in float64."""
    torch.manual_seed(0)
    net = perturb(Net().eval()).to("cuda", dtype)
    x = torch.randn(2, 7, 16, device="cuda", dtype=dtype)
    mask = torch.rand(2, 1, 7, 7, device="cuda") > 0.3
    mask[..., 0] = True
    with torch.no_grad():
        plain = net(x, mask)
        with watch(net) as seen:
            watched = net(x, mask)
        assert torch.equal(plain, watched)
        h = net.blocks[0](x)
        for layer, (block, inp, m) in enumerate([(net.blocks[0], x, None), (net.blocks[1], h, mask)]):
            q, k, _ = block.qk(inp)
            scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
            allowed = torch.ones(7, 7, dtype=torch.bool, device="cuda").tril() if m is None else m
            expected = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).cpu()
            for batch in range(2):
                torch.testing.assert_close(seen.patterns(layer, batch).double(), expected[batch], atol=1e-5, rtol=0)
    assert all(c.passed for c in seen.check())
