"""Which views of `attnscope head --text` each family computes: the one source of docs/models.md's matrix and of
the conformance tests (tests/test_conformance.py), which hold every "exact" cell equal to transformers' eager
`output_attentions` (float32, 1e-5) and every other cell refused in one line.

A view is one way of running a family's attention, all of them through the family's one attention module (its
`forward`, `head_inputs` for blocks of rows, `empty_cache`/`cache_after` for decode steps):
- short: `--text`, layers 0..L run and layer L traced step by step (models/forward/run.py); a vision tower's `--image`;
- long: a text past LONG_TOKENS, head h's rows computed in blocks, each a decode step after the rows before it
  (models/forward/long.py);
- generate: `--generate N`, greedy decoding with a KV cache, every layer one token at a time (models/forward/stream.py);
- all-layers: `--all-layers`, every layer's every head on the text (models/forward/stream.py);
- check: `--check`, the run held against transformers' own eager run of the checkpoint at run time
  (runs/check_model.py, models/nopage/eager.py): PASS where the cells above are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

VIEWS = ("short", "long", "generate", "all-layers", "check")
EXACT = "exact"

ENCODER = {"short": EXACT, "long": EXACT, "generate": "refused: an encoder attends both ways, it does not decode",
           "all-layers": EXACT, "check": EXACT}
DECODER = dict.fromkeys(VIEWS, EXACT)
# each of the three attentions (encoder, decoder, cross), each stack with its own head count
# generate: the target decoded greedily (--attention decoder or cross), the encoder's output projected once for the
# cross-attention, a KV cache for the self-attention (models/forward/seq2seq_decode.py); long: a source or target past
# 2,048 tokens, every layer in blocks of query rows and the head's pattern pooled (models/forward/seq2seq_long.py)
ENCODER_DECODER = {"short": EXACT, "long": EXACT,
                   "generate": EXACT, "all-layers": EXACT, "check": EXACT}
# through transformers' attention interface (nopage/interface.py, interface_stream.py): the long input is the whole
# pattern, memory-guarded up front; generate is transformers' own forward and cache, the attention captured each step
INTERFACE = dict.fromkeys(VIEWS, EXACT)
# a sparse indexer (DeepSeek-V3.2, GLM-5): each query's keys are the indexer's top-k over the whole layer, not a block's
SPARSE_INDEXER = {**DECODER, "long": "refused: its indexer picks each query's keys from the whole layer"}
# a vision tower on `--image` (models/vision/tower.py, through the attention interface): short is the image's
# tokens, layer L traced; an image is one short input, and a tower does not decode
VISION = {**INTERFACE, "long": "refused: an image's tokens are one short input, no long view",
          "generate": "refused: a vision tower does not decode"}
# a vision-language model's text with `--image` (models/vision/vlm*.py): the text model from the VLM's embeddings on
# its family page (Gemma 3's image block both ways), every view; Qwen's M-RoPE through the attention interface,
# where a long prompt's pattern is computed whole, so `--rows` is refused
VLM = dict.fromkeys(VIEWS, EXACT)
VLM_MROPE = {**VLM, "long": "refused: --rows: transformers computes an M-RoPE model's whole pattern"}
# a hybrid (attention and Mamba or convolution layers): every view on its attention layers; a layer with none is
# refused in one line naming those that have
HYBRID = dict.fromkeys(VIEWS, EXACT)
# a hybrid of linear attention and full attention layers with a page (linear_attention.py): every view on every
# layer, the full layers' patterns against output_attentions and the linear layers' exact matrix M (M @ V against
# transformers' own recurrence: its output, and --check's comparison, tests/test_linear_attention.py)
LINEAR_HYBRID = dict.fromkeys(VIEWS, EXACT)


@dataclass(frozen=True)
class Row:
    """A family page (its class in models/, the model_types it reads) or the families with no page, and what each
    view does for it."""

    family: str  # the class; "interface:<model_type>" or "hybrid:<model_type>" for a model_type without a page
    model_types: tuple[str, ...]
    views: dict[str, str]

    @property
    def page(self) -> bool:
        """Whether the row is a family page of attnscope's (not one run through transformers)."""
        return ":" not in self.family


ROWS = (
    Row("Bert", ("bert",), ENCODER),
    Row("Roberta", ("roberta", "xlm-roberta"), ENCODER),
    Row("ModernBert", ("modernbert",), ENCODER),
    Row("Gpt2", ("gpt2",), DECODER),
    Row("Llama", ("llama",), DECODER),
    Row("Mistral", ("mistral",), DECODER),
    Row("Qwen2", ("qwen2",), DECODER),
    Row("Gemma2", ("gemma2",), DECODER),
    Row("DeepseekV3", ("deepseek_v3",), DECODER),
    Row("DeepseekV2", ("deepseek_v2",), DECODER),
    Row("DeepseekV32", ("deepseek_v32",), SPARSE_INDEXER),  # MLA behind a lightning indexer's top-k
    Row("GlmMoeDsa", ("glm_moe_dsa",), SPARSE_INDEXER),  # interleaved indexer RoPE, shared layers
    Row("SmolLM3", ("smollm3",), DECODER),
    Row("Phi3", ("phi3",), DECODER),
    Row("Llama4", ("llama4", "llama4_text"), DECODER),
    Row("GptOss", ("gpt_oss",), DECODER),
    Row("Qwen3", ("qwen3",), DECODER),
    Row("Qwen3Moe", ("qwen3_moe",), DECODER),
    Row("Gemma3", ("gemma3", "gemma3_text"), DECODER),
    Row("EmbeddingGemma", ("gemma3_text",), ENCODER),  # use_bidirectional_attention: windows on both sides
    Row("Gemma4", ("gemma4", "gemma4_text"), DECODER),  # per-layer d_head, K = V, shared KV, per-layer inputs
    Row("Qwen3Next", ("qwen3_next",), LINEAR_HYBRID),  # Gated DeltaNet and gated full attention
    Row("Qwen3_5", ("qwen3_5", "qwen3_5_text"), LINEAR_HYBRID),
    Row("KimiLinear", ("kimi_linear",), LINEAR_HYBRID),  # KDA and MLA without RoPE
    Row("MiniMax", ("minimax",), LINEAR_HYBRID),  # lightning attention and Mixtral's softmax layers
    Row("Olmo2", ("olmo2",), DECODER),
    Row("Bloom", ("bloom",), DECODER),  # ALiBi
    Row("Mpt", ("mpt",), DECODER),  # ALiBi, its own scale
    Row("GptJ", ("gptj",), DECODER),  # interleaved partial RoPE, parallel block
    Row("Falcon", ("falcon",), DECODER),  # the new layout; the others: tests/test_pattern_families.py
    Row("T5", ("t5", "mt5"), ENCODER_DECODER),
    Row("Umt5", ("umt5",), ENCODER_DECODER),
    Row("Bart", ("bart",), ENCODER_DECODER),
    Row("Marian", ("marian",), ENCODER_DECODER),
    Row("MBart", ("mbart",), ENCODER_DECODER),
    Row("Whisper", ("whisper",), ENCODER_DECODER),
    Row("interface:gpt_neox", ("gpt_neox",), INTERFACE),
    Row("interface:mixtral", ("mixtral",), INTERFACE),
    Row("interface:cohere2", ("cohere2",), INTERFACE),
    Row("interface:minimax_m2", ("minimax_m2",), INTERFACE),  # qk-norm over the projection, partial RoPE, experts
    Row("interface:olmo3", ("olmo3",), INTERFACE),  # sliding and full layers, qk-norm
    Row("vision:vit", ("vit",), VISION),  # [CLS], patches
    Row("vision:deit", ("deit",), VISION),  # [CLS], [DIST], patches
    Row("vision:dinov2", ("dinov2", "dinov2_with_registers"), VISION),  # [CLS], registers, patches
    Row("vision:clip", ("clip", "clip_vision_model"), VISION),  # a whole CLIP's image tower, or the tower alone
    Row("vision:siglip", ("siglip", "siglip_vision_model"), VISION),  # patches alone
    Row("vlm:gemma3", ("gemma3",), VLM),  # SigLIP tower, the image block both ways
    Row("vlm:llama4", ("llama4",), VLM),  # tiles and a global view, chunked and NoPE layers
    Row("vlm:llava", ("llava",), VLM),  # CLIP tower over a LLaMA or Mistral
    Row("vlm:qwen2_5_vl", ("qwen2_5_vl",), VLM_MROPE),
    Row("vlm:qwen3_vl", ("qwen3_vl",), VLM_MROPE),  # interleaved M-RoPE, deepstack
    Row("hybrid:jamba", ("jamba",), HYBRID),  # Mamba layers
    Row("hybrid:lfm2", ("lfm2",), HYBRID),  # short convolutions
)


def markdown() -> str:
    """The matrix as docs/models.md shows it: a row per family, a column per view."""
    head = ["| family (model_type) | " + " | ".join(VIEWS) + " |", "|---|" + "---|" * len(VIEWS)]
    body = []
    for row in ROWS:
        how, _, model_type = row.family.partition(":")
        name = {"interface": f"any other (e.g. {model_type}), through transformers",
                "hybrid": f"a hybrid (e.g. {model_type}): its attention layers; the others refused",
                "vision": f"a vision tower ({', '.join(row.model_types)}) on --image, through transformers",
                "vlm": f"a vision-language model ({', '.join(row.model_types)}) on --text with --image"}.get(
            how, f"{row.family} ({', '.join(row.model_types)})")
        cells = ["exact" if row.views[v] == EXACT else row.views[v].removeprefix("refused: ") for v in VIEWS]
        body.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(head + body)
