"""`attnscope trace` on multi-head latent attention (docs/examples/latent_attention.py): transformers'
DeepseekV2Attention and DeepseekV3Attention (a query latent, rope_interleave) as their modeling files write them,
and DeepSeek's own inference form (wq_a ... wkv_b, einsum over [b, s, h, d]). Each style is checked apart from
attnscope against transformers' eager attention holding its weights. trace has no MLA reference: it says so in
one line, read from the data flow (the layers' names play no part), rather than quote a width rule about
projections it misread; a cross-attention whose keys and values are also made by a Linear fed by another, without
MLA's rotary key part past the expansion, is not taken for MLA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_command import trace, user_module
from typer.testing import CliRunner

STYLES = str(Path(__file__).resolve().parent.parent / "docs" / "examples" / "latent_attention.py")
OTHER = str(Path(__file__).resolve().parent / "trace_styles_round10_latent.py")
styles = user_module(STYLES)
IN_DOCS = {"HubV3": "DeepseekV3Attention", "HubV3ScaleByHidden": "ScaleByHidden", "HubV3NoInterleave": "NoInterleave"}


def _target(name: str) -> str:
    """A style's class in docs/examples/latent_attention.py (the V3 form under its own names)."""
    return f"{STYLES}:{IN_DOCS.get(name, name)}"


SIZES = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 12,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "attention_bias": False}


def _trained(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module.eval()


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _hub(version: int, q_lora_rank: int | None, **extra):
    """transformers' eager attention of DeepSeek-V2 or V3 and its rotary tables' maker."""
    if version == 2:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
        from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config as Config

        attention, rotary = m.DeepseekV2Attention, m.DeepseekV2RotaryEmbedding
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config as Config

        attention, rotary = m.DeepseekV3Attention, m.DeepseekV3RotaryEmbedding
    config = Config(**SIZES, q_lora_rank=q_lora_rank, **extra)
    config._attn_implementation = "eager"
    return attention(config, layer_idx=0).eval(), rotary(config)


def _hub_out(hub, rotary, x: torch.Tensor, version: int) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    tables = rotary(x, positions)
    mask = _causal(x.shape[1])
    if version == 2:
        return hub(x, attention_mask=mask, position_embeddings=tables)[0]
    return hub(x, position_embeddings=tables, attention_mask=mask)[0]


@pytest.mark.parametrize(("name", "version", "q_lora_rank", "renames"), [
    ("HubV2", 2, None, {}),
    ("HubV3", 3, 10, {}),
    ("Inference", 2, 10, {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
                          "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
                          "wo": "o_proj"}),
])
def test_styles_are_transformers_mla(name: str, version: int, q_lora_rank: int | None,
                                     renames: dict[str, str]) -> None:
    config = styles.MLAConfig(q_lora_rank=q_lora_rank)
    mine = _trained(styles.Inference() if name == "Inference" else getattr(styles, IN_DOCS.get(name, name))(config))
    hub, rotary = _hub(version, q_lora_rank, **({"rope_interleave": True} if version == 3 else {}))
    state = {}
    for key, value in mine.state_dict().items():
        head, _, rest = key.partition(".")
        state[f"{renames.get(head, head)}.{rest}"] = value
    hub.load_state_dict(state)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = _hub_out(hub, rotary, x, version)
        got = mine(x) if name == "Inference" else mine(x, _causal(7))
    assert float((got - expected).abs().max()) < 1e-5
    base = type(mine)
    plants = [c for c in vars(styles).values() if isinstance(c, type) and issubclass(c, base) and c.BUG is not None]
    assert plants
    for plant in plants:  # each planted bug, on the same weights, changes the output
        planted = (plant() if name == "Inference" else plant(config)).eval()
        planted.load_state_dict(mine.state_dict())
        with torch.no_grad():
            changed = planted(x) if name == "Inference" else planted(x, _causal(7))
        assert float((changed - expected).abs().max()) > 1e-3, plant.__name__


CORRECT = [
    ("HubV2", ("--init", "config=MLAConfig()", "--causal", "--rope"), "q=q_proj"),
    ("HubV3", ("--init", "config=MLAConfig(q_lora_rank=10)", "--causal", "--rope"), "q_a=q_a_proj, q=q_b_proj"),
    ("Inference", ("--causal", "--rope"), "kv_a=wkv_a, kv_b=wkv_b, o=wo, q_a=wq_a, q=wq_b"),
]


@pytest.mark.parametrize(("target", "args", "read"), CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_mla_lines_up_with_latent_attention_holding_its_weights(target: str, args: tuple[str, ...],
                                                                        read: str) -> None:
    result, out = trace(CliRunner(), _target(target), *args)
    assert result.exit_code == 0, result.output
    assert out["first_divergence"] is None and "attnscope LatentAttention (multi-head latent attention" in \
        out["reference"] and read in out["reference"]
    assert not any("half-split" in note for note in out["notes"])


def test_norms_as_wide_as_each_other_are_told_apart_by_the_flow() -> None:
    """q_lora_rank = kv_lora_rank: each norm's weights are those the code reads on its own latent."""
    result, out = trace(CliRunner(), f"{STYLES}:Loaded", "--init", "config=MLAConfig(q_lora_rank=12)", "--causal",
                        "--rope")
    assert result.exit_code == 0 and out["first_divergence"] is None, result.output


BUGS = [
    ("HubV2ScaleByHidden", CORRECT[0][1], "scores", "scale.d_model"),
    ("HubV2SoftmaxOverQueries", CORRECT[0][1], "attention", "softmax.axis"),
    ("HubV3ScaleByHidden", CORRECT[1][1], "scores", "scale.d_model"),
    ("InferenceScaleByHidden", CORRECT[2][1], "scores", "scale.d_model"),
    ("InferenceSoftmaxOverQueries", CORRECT[2][1], "attention", "softmax.axis"),
    ("HubV2RotateHalf", (*CORRECT[0][1], "--rope-pairing", "interleaved"), "Q_pe_rot", "rope.pairing"),
    ("HubV3NoInterleave", (*CORRECT[1][1], "--rope-pairing", "interleaved"), "Q_pe_rot", "rope.pairing"),
    ("InferenceRotateHalf", (*CORRECT[2][1], "--rope-pairing", "interleaved"), "Q_pe_rot", "rope.pairing"),
]


@pytest.mark.parametrize(("target", "args", "step", "entry"), BUGS, ids=[b[0] for b in BUGS])
def test_planted_bugs_in_mla_are_named_by_experiment(target: str, args: tuple[str, ...], step: str,
                                                     entry: str) -> None:
    result, out = trace(CliRunner(), _target(target), *args)
    assert result.exit_code == 1, result.output
    first = out["first_divergence"]
    assert (first["reference"], first["experiment"]) == (step, entry), (out["alignment"], out["notes"], first)
    assert first["evidence"].startswith("by experiment")


@pytest.mark.parametrize("lost", ["unseen", "missing", "equal", "permuted"])
def test_a_mistake_shows_at_the_first_step_its_rerun_changes_that_the_code_holds(monkeypatch, lost: str) -> None:
    """Where the line-up loses sight of the rotated query part (its row unseen or missing, or paired with another
    tensor of the code's: seen on another machine, where the divergence then went to Q_full and the diagnosis to
    the joined query on line 168), the mistake named by experiment is placed where its rerun first changes a tensor
    the code holds on the way to the joined query: the q_pe that rotate_half turns, on line 161."""
    from attnscope.usertrace import underspec

    references = underspec.references

    def losing_sight(*args, **kwargs):
        built = references(*args, **kwargs)
        row = next(r for r in built[5] if r.reference == "Q_pe_rot")
        other = next(r for r in built[5] if r.reference == "Q_pe").record if lost in ("equal", "permuted") else None
        row.status, row.record, row.max_abs_diff, row.layout = lost, other, None if other is None else 0.0, ""
        return built

    monkeypatch.setattr(underspec, "references", losing_sight)
    result, out = trace(CliRunner(), _target("HubV2RotateHalf"), *BUGS[5][1])
    first = out["first_divergence"]
    assert result.exit_code == 1 and (first["reference"], first["experiment"]) == ("Q_pe_rot", "rope.pairing"), \
        result.output
    assert first["line"] == 161 and first["diagnosis"].startswith("your q_pe (line 161) turns the rotary parts")
    row = next(r for r in out["alignment"] if r["reference"] == "Q_pe_rot")
    # a missing first step keeps its status, the tensor the diagnosis speaks of shown on its row (as before)
    assert row["status"] == ("missing" if lost == "missing" else "differs") and row["line"] == 161 \
        and row["max_abs_diff"] > 0.1


def test_half_split_rotary_parts_are_a_convention_unless_the_pairing_is_asked() -> None:
    args = ("--init", "config=MLAConfig(q_lora_rank=10)", "--causal", "--rope")
    result, out = trace(CliRunner(), _target("HubV3NoInterleave"), *args)
    assert result.exit_code == 0, result.output
    assert any(note.startswith("your code turns its rotary parts half-split") and "--rope-pairing interleaved" in note
               for note in out["notes"])
    result, out = trace(CliRunner(), _target("HubV3NoInterleave"), *args, "--rope-pairing", "interleaved")
    first = out["first_divergence"]
    assert result.exit_code == 1 and (first["reference"], first["experiment"]) == ("Q_pe_rot", "rope.pairing"), \
        result.output
    assert first["evidence"].startswith("by experiment") and "--rope-pairing half-split" in first["diagnosis"]
    result, out = trace(CliRunner(), _target("HubV3"), *args, "--rope-pairing", "interleaved")
    assert result.exit_code == 0 and out["first_divergence"] is None, result.output


def test_a_projected_context_before_a_fused_to_kv_is_not_mla() -> None:
    result, _ = trace(CliRunner(), f"{OTHER}:ContextProjected", "--nk", "5")
    assert "latent attention" not in result.output and "Traceback" not in result.output
