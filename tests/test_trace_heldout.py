"""`attnscope trace` on attention modules as their users call them (issue 29): minGPT's `key, query, value`
registered in that order, Meta's llama `Attention(args)` with complex `freqs_cis` and interleaved pairs,
transformers' `LlamaAttention(config)` with `position_embeddings` and a 4-D additive mask, cross-attention
`forward(x, memory)`, Stable Diffusion's `CrossAttention(context_dim)`, and `F.multi_head_attention_forward`
called with the module's own parameters. Each correct one exits 0 whatever the order of its registration.

That each is correct is checked against torch.nn.MultiheadAttention / F.scaled_dot_product_attention holding the
same weights, which share no code with attnscope.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_trace_command import trace, user_module, write
from torch_mha import holding

DOCS = Path(__file__).resolve().parent.parent / "docs" / "examples"
MINGPT = (DOCS / "mingpt.py").read_text()
META = (DOCS / "meta_llama.py").read_text()
GPT = "--init", "config=GPTConfig(n_embd=64, n_head=4)"
ARGS = "--init", "args=ModelArgs(dim=64, n_heads=4, n_kv_heads=2, max_batch_size=4, max_seq_len=32)"


def saved(tmp_path, body: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def statuses(out) -> set[str]:
    return {row["status"] for row in out["alignment"]}


# --- minGPT: key, query, value registered in that order ----------------------------------------------------------


REGISTRATION = """        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
"""


@pytest.mark.parametrize("order", ["key query value", "value query key", "query key value"])
def test_mingpt_projections_are_matched_by_data_flow_whatever_their_order(tmp_path, runner, order):
    lines = {line.split("=")[0].strip().split(".")[1]: line for line in REGISTRATION.splitlines(keepends=True)}
    assert REGISTRATION in MINGPT
    path = saved(tmp_path, MINGPT.replace(REGISTRATION, "".join(lines[n] for n in order.split())))
    result, out = trace(runner, f"{path}:CausalSelfAttention", *GPT, "--causal")
    assert result.exit_code == 0, result.output
    assert statuses(out) == {"equal"}
    assert "q=query, k=key, v=value, o=proj" in out["reference"]
    assert "data flow" in out["reference"]  # `proj` names no role: the flow says which is which

    # independently: minGPT's module is nn.MultiheadAttention holding query, key, value and proj, causal
    module_file = user_module(str(path))
    torch.manual_seed(0)
    module = module_file.CausalSelfAttention(module_file.GPTConfig(n_embd=64, n_head=4)).eval()
    mha = holding(module.query, module.key, module.value, module.proj, 4)
    with torch.no_grad():
        x = torch.randn(2, 7, 64)
        causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
        torch.testing.assert_close(module(x), mha(x, x, x, attn_mask=causal)[0], rtol=1e-5, atol=1e-5)


def test_mingpt_computing_k_q_transposed_is_q_k_with_the_roles_of_its_weights_swapped(tmp_path, runner):
    """One input: `k @ qᵀ` is `Q Kᵀ` with `key` as the query projection, which the data flow says (with query,
    key and value given apart, the input each projection reads is its role: test_trace_command's transposed
    scores still diverge)."""
    path = saved(tmp_path, MINGPT.replace("att = (q @ k.transpose(-2, -1))", "att = (k @ q.transpose(-2, -1))"))
    result, out = trace(runner, f"{path}:CausalSelfAttention", *GPT, "--causal")
    assert result.exit_code == 0, result.output
    assert "q=key, k=query" in out["reference"]


# --- Meta's llama Attention(args): ModelArgs, freqs_cis, interleaved pairs ---------------------------------------


def test_meta_llama_attention_aligns_with_interleaved_pairing(tmp_path, runner):
    path = saved(tmp_path, META)
    result, out = trace(runner, f"{path}:Attention", *ARGS, "--rope", "--rope-pairing", "interleaved", "--causal")
    assert result.exit_code == 0, result.output
    assert statuses(out) <= {"equal", "permuted"}
    sizes = out["params"]["sizes"]
    assert (sizes["n_head"], sizes["n_kv_head"], sizes["d_head"]) == (4, 2, 16)  # read from the built module
    assert "interleaved" in out["reference"] and out["params"]["rope_pairing"] == "interleaved"
    freqs = next(s for s in out["steps"] if s["name"] == "freqs_cis")
    assert freqs["shape"] == [out["params"]["sizes"]["n_Q"], 8]  # never [n, 0]


def test_meta_llama_attention_without_the_pairing_reads_it_from_the_code(tmp_path, runner):
    """Issue 41: the code says its pairing itself (view_as_complex): a convention, a note and exit 0; asked for
    half-split with --rope-pairing, the difference is a divergence named so."""
    path = saved(tmp_path, META)
    result, out = trace(runner, f"{path}:Attention", *ARGS, "--rope", "--causal")
    assert result.exit_code == 0, result.output
    assert statuses(out) <= {"equal", "permuted"}
    assert any("pairs RoPE's coordinates interleaved" in note for note in out["notes"])
    result, out = trace(runner, f"{path}:Attention", *ARGS, "--rope", "--rope-pairing", "half-split", "--causal")
    assert result.exit_code == 1
    first = out["first_divergence"]
    assert first["reference"] == "Q_rot" and "interleaved" in first["diagnosis"]


def test_a_head_count_nothing_tells_is_asked_for_not_run_with_zero(tmp_path, runner):
    """No n_heads, no head_dim anywhere: RoPE's tables cannot be made; one line asks for --heads."""
    body = META.replace("self.head_dim = args.dim // args.n_heads", "hd = args.dim // args.n_heads").replace(
        "self.head_dim", "hd").replace("self.n_local_heads = args.n_heads", "nlh = args.n_heads").replace(
        "self.n_local_heads", "nlh").replace("self.n_local_kv_heads = self.n_kv_heads", "nlkv = self.n_kv_heads")
    body = body.replace("self.n_local_kv_heads", "nlkv")
    body = body.replace("    def forward(self, x", "        self.shape = (nlh, nlkv, hd)\n\n    def forward(self, x")
    body = body.replace("        bsz, seqlen, _ = x.shape\n",
                        "        bsz, seqlen, _ = x.shape\n        nlh, nlkv, hd = self.shape\n")
    body = body.replace("def __init__(self, args: ModelArgs):", "def __init__(self, dim, n_kv, heads_of_q):").replace(
        "args.n_heads", "heads_of_q").replace("args.n_kv_heads", "n_kv").replace("args.dim", "dim").replace(
        "args.max_batch_size", "4").replace("args.max_seq_len", "32").replace(
        "heads_of_q if n_kv is None else n_kv", "n_kv")
    path = saved(tmp_path, body)
    result, _ = trace(runner, f"{path}:Attention", "--init", "dim=64, n_kv=2, heads_of_q=4", "--rope",
                      "--rope-pairing", "interleaved")
    assert result.exit_code == 2, result.output
    assert "--heads" in result.output and "Traceback" not in result.output
    result, out = trace(runner, f"{path}:Attention", "--init", "dim=64, n_kv=2, heads_of_q=4", "--rope",
                        "--rope-pairing", "interleaved", "--heads", "4")
    assert result.exit_code == 0, result.output


# --- transformers' LlamaAttention(config): position_embeddings, a 4-D mask ---------------------------------------

HF = (Path(__file__).resolve().parent / "fixtures_hf_llama.py").read_text()


def test_hf_llama_attention_gets_position_embeddings_and_a_4d_mask(tmp_path, runner):
    path = saved(tmp_path, HF)
    result, out = trace(runner, f"{path}:LlamaAttention", "--init",
                        "config=LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)",
                        "--rope", "--causal")
    assert result.exit_code == 0, result.output
    assert statuses(out) == {"equal"}
    mask = next(s for s in out["steps"] if s["name"] == "mask")
    sizes = out["params"]["sizes"]
    assert mask["shape"] == [sizes["n_batch"], 1, sizes["n_Q"], sizes["n_K"]]
    assert "q=q_proj" in out["reference"]

    # independently: the module is F.scaled_dot_product_attention on its own projections, rotated half-split
    module_file = user_module(str(path))
    torch.manual_seed(0)
    module = module_file.LlamaAttention(module_file.LlamaConfig()).eval()
    x = torch.randn(2, 5, 64)
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    angles = torch.arange(5).float()[:, None] * inv
    cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
    mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))[None, None]
    with torch.no_grad():
        out_hf, _ = module(x, (cos, sin), mask)

        def heads(t, n):
            return t.view(2, 5, n, 16).transpose(1, 2)

        def rot(t):
            half = torch.cat([-t[..., 8:], t[..., :8]], -1)
            return t * cos[:, None] + half * sin[:, None]

        q, k = rot(heads(module.q_proj(x), 4)), rot(heads(module.k_proj(x), 2))
        v = heads(module.v_proj(x), 2)
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        torch.testing.assert_close(out_hf, module.o_proj(y.transpose(1, 2).reshape(2, 5, 64)), rtol=1e-5, atol=1e-5)


# --- cross-attention: forward(x, memory) -------------------------------------------------------------------------

CROSS = """
class CrossAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def split(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads, self.d_k).transpose(1, 2)

    def forward(self, x, memory):
        q, k, v = self.split(self.w_q(x)), self.split(self.w_k(memory)), self.split(self.w_v(memory))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        out = scores.softmax(dim=-1) @ v
        b, _, n, _ = out.shape
        return self.w_o(out.transpose(1, 2).reshape(b, n, -1))
"""


def test_cross_attention_gets_x_and_a_memory_of_other_length(tmp_path, runner):
    path = write(tmp_path, CROSS)
    result, out = trace(runner, f"{path}:CrossAttention", "--init", "d_model=32, n_heads=4")
    assert result.exit_code == 0, result.output
    assert statuses(out) == {"equal"}
    sizes = out["params"]["sizes"]
    assert sizes["n_Q"] != sizes["n_K"]

    module = user_module(path).CrossAttention(32, 4).eval()
    mha = holding(module.w_q, module.w_k, module.w_v, module.w_o, 4)
    with torch.no_grad():
        x, memory = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
        torch.testing.assert_close(module(x, memory), mha(x, memory, memory)[0], rtol=1e-5, atol=1e-5)


# --- Stable Diffusion's CrossAttention: to_k and to_v read context_dim, forward(x, context=None) -----------------

SD = (DOCS / "stable_diffusion.py").read_text()
SD_INIT = "--init", "query_dim=32, context_dim=16, heads=4, dim_head=8"


def test_stable_diffusion_cross_attention_gets_a_context_of_its_keys_width(tmp_path, runner):
    path = saved(tmp_path, SD)
    result, out = trace(runner, f"{path}:CrossAttention", *SD_INIT)
    assert result.exit_code == 0, result.output
    assert statuses(out) <= {"equal", "permuted"} and "equal" in statuses(out)
    sizes = out["params"]["sizes"]
    assert sizes["d_feat"] == 32 and sizes["d_kv_in"] == 16 and sizes["n_Q"] != sizes["n_K"]
    assert "q=to_q, k=to_k, v=to_v, o=to_out.0" in out["reference"]

    # independently: the module's own weights through F.scaled_dot_product_attention
    module = user_module(str(path)).CrossAttention(32, 16, 4, 8).eval()
    x, context = torch.randn(2, 5, 32), torch.randn(2, 9, 16)

    def heads(t):
        return t.view(2, -1, 4, 8).transpose(1, 2)

    with torch.no_grad():
        y = F.scaled_dot_product_attention(heads(module.to_q(x)), heads(module.to_k(context)),
                                           heads(module.to_v(context)))
        expected = module.to_out(y.transpose(1, 2).reshape(2, 5, 32))
        torch.testing.assert_close(module(x, context), expected, rtol=1e-5, atol=1e-5)


def test_stable_diffusion_keys_and_values_swapped_are_caught(tmp_path, runner):
    path = saved(tmp_path, SD.replace("k = self.to_k(context)\n        v = self.to_v(context)",
                                      "k = self.to_v(context)\n        v = self.to_k(context)"))
    result, out = trace(runner, f"{path}:CrossAttention", *SD_INIT)
    assert result.exit_code == 1, result.output
    assert out["first_divergence"]["reference"] in ("K_feat", "scores")


def test_stable_diffusion_context_ignored_is_caught(tmp_path, runner):
    """x used for the keys: to_k reads 16 features, x has 32: the user's own shape error, at their line."""
    path = saved(tmp_path, SD.replace("k = self.to_k(context)", "k = self.to_k(x)"))
    result, out = trace(runner, f"{path}:CrossAttention", *SD_INIT)
    assert result.exit_code == 1, result.output
    assert "to_k" in out["error"]["op"] and out["error"]["line"] == 36


def test_stable_diffusion_without_a_context_width_stays_self_attention(tmp_path, runner):
    path = saved(tmp_path, SD)
    result, out = trace(runner, f"{path}:CrossAttention", "--init", "query_dim=32, heads=4, dim_head=8")
    assert result.exit_code == 0, result.output
    sizes = out["params"]["sizes"]
    assert sizes["n_Q"] == sizes["n_K"] and "d_kv_in" not in sizes


# --- F.multi_head_attention_forward called with the module's own parameters --------------------------------------

FUNCTIONAL = (DOCS / "functional_mha.py").read_text()

# CLIP's AttentionPool2d: four Linear layers, passed apart, the biases concatenated
SEPARATE = """
class SeparateMHA(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.c_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        x = x.transpose(0, 1)
        out, _ = F.multi_head_attention_forward(
            query=x, key=x, value=x, embed_dim_to_check=x.shape[-1], num_heads=self.num_heads,
            q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight,
            in_proj_weight=None, in_proj_bias=torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
            bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=self.c_proj.weight,
            out_proj_bias=self.c_proj.bias, use_separate_proj_weight=True, training=self.training,
            need_weights=False)
        return out.transpose(0, 1)
"""


def test_a_functional_mha_call_is_traced_with_the_weights_it_passes(tmp_path, runner):
    path = str(saved(tmp_path, FUNCTIONAL))
    result, out = trace(runner, f"{path}:FunctionalMHA", "--init", "embed_dim=32, num_heads=4")
    assert result.exit_code == 0, result.output
    assert "q=in_proj_weight[0:32]" in out["reference"] and "o=out_proj.weight" in out["reference"]

    module = user_module(path).FunctionalMHA(32, 4).eval()
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(module.in_proj_weight)
        mha.in_proj_bias.copy_(module.in_proj_bias)
        mha.out_proj.load_state_dict(module.out_proj.state_dict())
        x = torch.randn(2, 5, 32)
        torch.testing.assert_close(module(x), mha(x, x, x)[0], rtol=1e-5, atol=1e-5)


def test_a_functional_mha_call_with_separate_weights_is_traced(tmp_path, runner):
    path = write(tmp_path, SEPARATE)
    result, out = trace(runner, f"{path}:SeparateMHA", "--init", "embed_dim=32, num_heads=4")
    assert result.exit_code == 0, result.output
    assert "q=q_proj.weight, k=k_proj.weight, v=v_proj.weight, o=c_proj.weight" in out["reference"]


@pytest.mark.parametrize("old, new", [
    ("self.embed_dim, self.num_heads, self.in_proj_weight", "self.embed_dim, self.num_heads // 2, self.in_proj_weight"),
    ("self.out_proj.weight, self.out_proj.bias", "self.out_proj.weight.t(), self.out_proj.bias"),
], ids=["num_heads halved", "out_proj weight transposed"])
def test_a_functional_mha_call_with_a_planted_bug_diverges(tmp_path, runner, old, new):
    assert old in FUNCTIONAL
    path = saved(tmp_path, FUNCTIONAL.replace(old, new))
    result, out = trace(runner, f"{path}:FunctionalMHA", "--init", "embed_dim=32, num_heads=4")
    assert result.exit_code == 1, result.output
    assert out["first_divergence"] is not None
