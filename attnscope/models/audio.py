"""`--audio FILE` for Whisper: the file read with Python's own `wave` module and turned into the log-mel
features the encoder reads by transformers' `WhisperFeatureExtractor` (NumPy, or torch's STFT; no network,
no code from the model's folder), with the settings of the folder's preprocessor_config.json.

Only PCM WAV files are read (8, 16, 24 or 32-bit integer samples; channels averaged to mono, as a mono
recording of the same sound): decoding MP3, FLAC or float WAV needs a codec library attnscope does not
depend on, so those are refused with the command that converts them. The sampling rate must be the
extractor's (16 kHz for the published models): transformers refuses another rate too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch

FEATURE_CONFIG = "preprocessor_config.json"


@dataclass
class Audio:
    """What the encoder reads, and how to label its positions: `features` `[1, n_mel, n_frames]`, the audio's
    length, and the seconds each encoder position spans."""

    features: torch.Tensor
    seconds: float
    sampling_rate: int
    hop_length: int
    path: Path


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """Samples in [-1, 1] as float32, channels averaged, and the sampling rate."""
    import wave

    import numpy as np

    if not path.is_file():
        raise UsageError(f"{{audio}} {path}: no such file", "audio")
    named_wav = path.suffix.lower() in (".wav", ".wave")
    converted = f"{path.stem}-pcm16.wav" if named_wav else f"{path.stem}.wav"  # never ffmpeg's own input
    convert = f"convert it first, e.g. ffmpeg -i {path.name} -ac 1 -ar 16000 -c:a pcm_s16le {converted}"
    if not named_wav:
        raise UsageError(f"{{audio}} {path}: attnscope reads PCM .wav files only; {convert}", "audio")
    try:
        with wave.open(str(path), "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            declared = wav.getnframes()
            raw = wav.readframes(declared)
    except (wave.Error, EOFError, OSError, RuntimeError) as exc:  # wave's Chunk.seek raises a bare RuntimeError
        why = str(exc)[:80] or "a chunk runs past the end of the file"  # when a chunk's size runs past the file
        raise UsageError(f"{{audio}} {path}: not a PCM WAV file ({why}); {convert}", "audio") from None
    frame = channels * width
    if len(raw) < declared * frame:  # wave reads what is there: a data chunk cut short, maybe mid-sample
        raise UsageError(f"{{audio}} {path} is truncated: its data chunk holds {len(raw):,} of the "
                         f"{declared * frame:,} bytes it declares; give the whole file", "audio")
    if width == 3:  # 24-bit: widen each sample to 32 bits (little-endian, the low byte zero)
        bytes_ = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)  # [n_samples, 3]
        samples = np.zeros((len(bytes_), 4), dtype=np.uint8)
        samples[:, 1:] = bytes_
        data = samples.view("<i4").reshape(-1).astype(np.float64) / 2**31  # [n_samples, 4] bytes -> [n_samples] int32
    elif width in (1, 2, 4):
        kind = {1: "u1", 2: "<i2", 4: "<i4"}[width]
        data = np.frombuffer(raw, dtype=np.dtype(kind)).astype(np.float64)
        data = (data - 128) / 128 if width == 1 else data / 2 ** (8 * width - 1)
    else:
        raise UsageError(f"{{audio}} {path}: {8 * width}-bit samples; {convert}", "audio")
    if not len(data):
        raise UsageError(f"{{audio}} {path} holds no samples; give a recording", "audio")
    mono = data.reshape(-1, channels).mean(axis=1)  # [n_frames, channels] -> [n_frames]
    return mono.astype(np.float32), rate


def features(folder: Path, path: Path, n_mel: int, n_frames: int) -> Audio:
    """The log-mel features of `path` as the folder's WhisperFeatureExtractor makes them (padded or cut to its
    30 s window), `[1, n_mel, n_frames]`."""
    import torch

    if not (folder / FEATURE_CONFIG).is_file():
        raise UsageError(f"{{model}} {folder} has no {FEATURE_CONFIG}: Whisper's feature extractor (mel bins, "
                         "sampling rate, hop) is unknown, so --audio cannot be read; save it beside the weights "
                         "with WhisperFeatureExtractor.save_pretrained(folder)", "model")
    samples, rate = read_wav(path)
    from transformers import WhisperFeatureExtractor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        extractor = WhisperFeatureExtractor.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"{folder / FEATURE_CONFIG}: not a Whisper feature extractor's settings "
                         f"({str(exc).splitlines()[0][:100]})") from None
    if rate != extractor.sampling_rate:
        raise UsageError(f"{{audio}} {path} is sampled at {rate} Hz but this Whisper's feature extractor takes "
                         f"{extractor.sampling_rate} Hz; resample it, e.g. ffmpeg -i {path.name} -ar "
                         f"{extractor.sampling_rate} {path.stem}-{extractor.sampling_rate}.wav", "audio")
    if extractor.feature_size != n_mel or extractor.nb_max_frames != n_frames:
        raise UsageError(f"{folder / FEATURE_CONFIG} makes {extractor.feature_size} mel bins x "
                         f"{extractor.nb_max_frames} frames but config.json's encoder reads {n_mel} x {n_frames}; "
                         "the two files are of different models")
    made = extractor(samples, sampling_rate=rate, return_tensors="np").input_features  # [1, n_mel, n_frames]
    return Audio(torch.from_numpy(made).to(torch.float32), len(samples) / rate, rate, extractor.hop_length, path)


def position_labels(n: int, seconds_each: float) -> list[str]:
    """Each encoder position by the time it starts at: `0.00s`, `0.02s`, ..."""
    return [f"{i * seconds_each:.2f}s" for i in range(n)]
