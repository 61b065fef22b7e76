"""Whisper <- Bart <- EncoderDecoder <- Family

Whisper: an encoder over audio and a text decoder attending to it (transformers' modeling_whisper.py).

Checkpoint keys, under `model.` in `WhisperForConditionalGeneration` and bare in `WhisperModel`:

    encoder.conv1.{weight,bias} [d_model, n_mel, 3], encoder.conv2.{weight,bias} [d_model, d_model, 3] (stride 2)
    encoder.embed_positions.weight [max_source_positions, d_model]   sinusoids, stored
    encoder.layers.L.self_attn.{q,k,v,out}_proj   q, v, out with biases, k without   head h = rows h·d_head ...
    encoder.layers.L.{self_attn_layer_norm, fc1, fc2, final_layer_norm}, encoder.layer_norm
    decoder.embed_tokens.weight, decoder.embed_positions.weight [max_target_positions, d_model] (learned)
    decoder.layers.L.self_attn.*, decoder.layers.L.encoder_attn.* (cross-attention), decoder.layer_norm

The encoder reads a log-mel spectrogram `[n_mel, 2·max_source_positions]` (30 s of audio at 100 frames a
second for the published models: 3000 frames), made by `WhisperFeatureExtractor` from `--audio` (models/audio.py);
two convolutions halve it to `max_source_positions` positions (1500, one per 20 ms), the sinusoids are added,
and the layers are pre-norm (`h = h + attention(LayerNorm(h))`), as mBART's. `WhisperAttention` is
`BartAttention` without a key bias. The decoder's tokens get learned positions without offset or scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.models.families.bart import Bart
from attnscope.models.family import Slice

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


class Whisper(Bart):
    model_types = ("whisper",)
    pre_norm = True
    embedding_norm = False
    final_norm = True

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        self.n_mel = config.integer("num_mel_bins", default=80)
        self.n_source = config.integer("max_source_positions", default=1500)
        self.max_positions = {"encoder": self.n_source,
                              "decoder": config.integer("max_target_positions", default=448)}

    # --- where head h lives: no key bias -----------------------------------------------------------------

    def head_slices(self, layer: int, head: int) -> list[Slice]:
        """BART's slices without b_K: `WhisperAttention.k_proj` has no bias."""
        return [part for part in super().head_slices(layer, head) if part.name != "b_K"]

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        return ["k_proj has no bias in WhisperAttention (q_proj, v_proj and out_proj have one): b_K is 0"]

    def projections(self, layer: int) -> dict[str, Any]:
        import torch

        names = self.stack.names
        state = {f"W_{x}.weight": self.weight(layer, f"{names[x]}.weight") for x in "qkvo"}
        state.update({f"W_{x}.bias": self.weight(layer, f"{names[x]}.bias") for x in "qvo"})
        state["W_k.bias"] = torch.zeros(self.d_model)  # WhisperAttention: k_proj(bias=False)
        return state

    # --- the encoder reads audio --------------------------------------------------------------------------

    def embed_source(self, source: list[int] | torch.Tensor) -> torch.Tensor:
        """`WhisperEncoder.forward`: gelu(conv1), gelu(conv2) (stride 2), `[1, n_source, d_model]`, plus every
        position's sinusoid."""
        import torch.nn.functional as F

        if isinstance(source, list):
            raise UsageError("Whisper's encoder reads audio, not text: give {audio} FILE (a .wav)", "audio")
        want = (1, self.n_mel, 2 * self.n_source)
        if tuple(source.shape) != want:
            raise UsageError(f"{{audio}}: the features are {list(source.shape)} but this Whisper reads {list(want)} "
                             "(num_mel_bins, 2 · max_source_positions); its preprocessor_config.json does not "
                             "match config.json", "audio")
        stem = f"{self.prefix}encoder"
        weight = self.checkpoint.tensor
        x = F.gelu(F.conv1d(source, weight(f"{stem}.conv1.weight"), weight(f"{stem}.conv1.bias"), padding=1))
        x = F.gelu(F.conv1d(x, weight(f"{stem}.conv2.weight"), weight(f"{stem}.conv2.bias"), stride=2, padding=1))
        positions = weight(f"{stem}.embed_positions.weight")  # [max_source_positions, d_model]
        return x.permute(0, 2, 1) + positions[None, : x.shape[-1]]  # [1, n_source, d_model]

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """The decoder's tokens plus its learned positions (`WhisperPositionalEmbedding`: row p for position p)."""
        if self.side == "encoder":
            raise UsageError("Whisper's encoder reads audio, not text: give {audio} FILE (a .wav)", "audio")
        stem = f"{self.prefix}decoder"
        return (self.checkpoint.rows(f"{stem}.embed_tokens.weight", ids)
                + self.checkpoint.rows(f"{stem}.embed_positions.weight", list(range(len(ids)))))[None]

    def positions(self, n: int) -> torch.Tensor:
        raise AssertionError("Whisper's embed reads its own positions")
