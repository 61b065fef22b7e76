"""Tiny random encoder-decoders of every family attnscope reads (T5, UMT5, BART, Marian, mBART, Whisper), built
from transformers' configs and classes and saved with save_pretrained, each with a small tokenizer of its
family's class where it needs no SentencePiece (Marian's does: a T5 unigram tokenizer stands in, as the model
never sees the tokenizer's class), and Whisper with a tiny feature extractor (8 mel bins, 100 frames of 10 ms at
16 kHz) and a WAV file to read.

`build(family, folder)` returns transformers' eager model loaded back from the folder: the oracle. Weights are
drawn with std 0.3 (norms too) for sharp, varied patterns; Marian's and Whisper's encoder sinusoids are kept.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import torch
from tiny_models import CORPUS, _bpe

from attnscope.models.nopage.cache_names import cache_keyword, cache_of

ENCDEC = ("t5", "umt5", "bart", "marian", "mbart", "whisper")
SOURCE = "The cat sat on the mat because it was tired."
TARGET = "A dog ran to the park."
AUDIO_RATE = 16000  # the tiny feature extractor's sampling rate, Whisper's


def _unigram():
    from transformers import T5Tokenizer

    words = sorted({w.strip(".,") for s in CORPUS for w in s.split()})
    pieces = [f"▁{w}" for w in words] + sorted(set("".join(CORPUS)) - {" "}) + ["▁"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(p, -1.0 - i / 100) for i, p in enumerate(pieces)]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _tokenizer(family: str):
    from transformers import BartTokenizer, MBartTokenizer, WhisperTokenizer

    if family in ("t5", "umt5", "marian"):
        return _unigram()
    if family == "bart":
        return BartTokenizer(*_bpe(True, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]))
    if family == "mbart":
        vocab = [(token, 0.0) for token, _ in _unigram().get_vocab().items()]
        return MBartTokenizer(vocab=[("<s>", 0.0), *vocab], src_lang="en_XX", tgt_lang="fr_XX")
    return WhisperTokenizer(*_bpe(True, ["<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"]))


def _config_and_class(family: str, vocab: int, tokenizer):
    import transformers as tf

    if family in ("t5", "umt5"):
        config, cls = (tf.T5Config, tf.T5ForConditionalGeneration) if family == "t5" else \
            (tf.UMT5Config, tf.UMT5ForConditionalGeneration)
        sizes = {"vocab_size": vocab, "d_model": 24, "d_kv": 8, "d_ff": 40, "num_layers": 2, "num_decoder_layers": 3,
                 "num_heads": 4, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 12,
                 "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
        gated = {"feed_forward_proj": "gated-gelu"} if family == "umt5" else {}
        return config(**sizes, **gated), cls
    # the stacks' head counts differ (each head d_model // its stack's heads wide), as transformers allows
    bart = {"vocab_size": vocab, "d_model": 24, "encoder_layers": 2, "decoder_layers": 3, "encoder_attention_heads": 4,
            "decoder_attention_heads": 6, "encoder_ffn_dim": 40, "decoder_ffn_dim": 40, "max_position_embeddings": 40}
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
           "bos_token_id": tokenizer.bos_token_id}
    if family == "bart":
        return (tf.BartConfig(**bart, **ids, decoder_start_token_id=tokenizer.eos_token_id),
                tf.BartForConditionalGeneration)
    if family == "marian":
        return (tf.MarianConfig(**bart, **ids, decoder_start_token_id=tokenizer.pad_token_id, scale_embedding=True),
                tf.MarianMTModel)
    if family == "mbart":
        start = tokenizer.convert_tokens_to_ids("fr_XX")
        return (tf.MBartConfig(**bart, **ids, decoder_start_token_id=start, scale_embedding=True),
                tf.MBartForConditionalGeneration)
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    whisper = {k: v for k, v in bart.items() if k != "max_position_embeddings"}
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return (tf.WhisperConfig(**whisper, num_mel_bins=8, max_source_positions=50, max_target_positions=24,
                             decoder_start_token_id=start, pad_token_id=end, eos_token_id=end, bos_token_id=end,
                             suppress_tokens=[], begin_suppress_tokens=[]), tf.WhisperForConditionalGeneration)


def feature_extractor():
    """Whisper's rate, hop and window with 8 mel bins and a 1 s chunk: 100 frames of 10 ms, 2 · max_source_positions,
    as the tiny Whisper's encoder reads."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=8, sampling_rate=AUDIO_RATE, hop_length=160, chunk_length=1, n_fft=400)


def write_wav(path: Path, seconds: float = 0.6, rate: int = AUDIO_RATE, channels: int = 1, width: int = 2) -> Path:
    """A chirp as PCM WAV: samples of `width` bytes, `channels` channels."""
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.5 * np.sin(2 * np.pi * (100 + 300 * t) * t)
    frames = np.repeat(signal[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        data = ((frames * 127) + 128).astype(np.uint8).tobytes()
    elif width == 3:  # the top three bytes of each little-endian 32-bit sample
        data = (frames * (2**31 - 1)).astype("<i4").view(np.uint8).reshape(-1, 4)[:, 1:].tobytes()
    else:
        data = (frames * (2 ** (8 * width - 1) - 1)).astype(f"<i{width}").tobytes()
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(data)
    return path


def save_random(model, tokenizer, folder: Path, keep: tuple[str, ...] = ()):
    """Draw every weight but those named with a word of `keep` from N(0, 0.3) (tiny_models.perturb), save the model
    and its tokenizer to `folder`, and return transformers' eager model read back from it."""
    from tiny_models import perturb

    perturb(model, keep)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return type(model).from_pretrained(folder, attn_implementation="eager").eval()


def build(family: str, folder: Path, **sizes):
    """Save a tiny `family` encoder-decoder and its tokenizer (and Whisper's feature extractor and `speech.wav`) to
    `folder`; return transformers' eager model read back. `sizes` override the config's (num_layers=6)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(family)
    config, cls = _config_and_class(family, len(tokenizer), tokenizer)
    config = type(config)(**{**config.to_dict(), **sizes})
    torch.manual_seed(ENCDEC.index(family))
    if family == "whisper":
        feature_extractor().save_pretrained(folder)
        write_wav(folder / "speech.wav")
    # sinusoids stay (Marian's are not even saved)
    keep = {"marian": ("embed_positions",), "whisper": ("encoder.embed_positions",)}.get(family, ())
    return save_random(cls(config), tokenizer, folder, keep)


def source_and_target(family: str, folder: Path, model) -> dict:
    """transformers' own inputs for the tiny model: the source (input_ids, or Whisper's features from speech.wav
    through its feature extractor) and the decoder's ids for TARGET as attnscope feeds them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    labels = tokenizer(text_target=TARGET).input_ids
    start = model.config.decoder_start_token_id
    if family == "mbart":
        decoder = [labels[-1], *labels[:-1]]
    elif labels[0] == start:
        decoder = labels[:-1]
    else:
        decoder = [start, *labels[:-1]]
    inputs = {"decoder_input_ids": torch.tensor([decoder])}
    if family == "whisper":
        with wave.open(str(folder / "speech.wav")) as wav:
            samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float32) / 32768
        inputs["input_features"] = feature_extractor()(samples, sampling_rate=AUDIO_RATE,
                                                       return_tensors="pt").input_features
    else:
        inputs["input_ids"] = torch.tensor([tokenizer(SOURCE).input_ids])
    return inputs


def greedy(model, inputs: dict, n_new: int):
    """Plain greedy decoding with transformers' eager forward and its own cache, a step at a time, from
    `source_and_target`'s inputs (generate() would apply the generation config's logits processors, Whisper's
    among them): the new ids and each step's `decoder_attentions` and `cross_attentions`, as generate() returns
    them with output_attentions (`[t][layer]`: `[1, n_head, n_new, n_K]`)."""
    ids, decoder, cross = [], [], []
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, use_cache=True)
        for _ in range(n_new):
            decoder.append(out.decoder_attentions)
            cross.append(out.cross_attentions)
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(encoder_outputs=(out.encoder_last_hidden_state,), **{cache_keyword(model): cache_of(out)},
                        decoder_input_ids=torch.tensor([[ids[-1]]]), output_attentions=True, use_cache=True)
    return ids, decoder, cross
