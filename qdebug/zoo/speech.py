"""Speech models and speech-like input: the GE2E speaker encoder and a GRU keyword spotter.

``SpeakerEncoder`` is the GE2E voice encoder of Resemblyzer (and of Real-Time-Voice-Cloning's
encoder) layer for layer: ``nn.LSTM(40, 256, num_layers=3, batch_first=True)`` over mel
frames, ``Linear(256, 256)`` and ``ReLU`` on the last layer's final hidden state, then an L2
normalisation, e = r / ||r||_2 with r = relu(W h_T + b). Its state dict has Resemblyzer's
``pretrained.pt`` keys (``model_state``), ``similarity_weight`` and ``similarity_bias``
included (the GE2E loss's scale w and offset b of its similarity w cos + b, unused by
``forward``; kept as buffers so the published state dict loads with ``strict=True``). The
normalisation is written ``F.normalize(r, dim=1)``, one op quantized at its output
(docs/engine.md, "Modern blocks"); it equals Resemblyzer's ``r / torch.norm(r, dim=1,
keepdim=True)`` for every r != 0 (``F.normalize`` divides by max(||r||, 1e-12), so r = 0
gives 0 where Resemblyzer's gives NaN).

``KeywordGRU`` is a DeepSpeech2-style keyword spotter: a Conv1d-BN-ReLU front-end over the
mel frames (stride 2 in time), a 2-layer bidirectional ``nn.GRU``, the mean over time and a
``Linear`` classifier.

Both take ``(batch, frames, mel_channels)`` input (Resemblyzer's layout). Input without a
download or a dataset:

- ``mel_spectrogram(wave, sample_rate)``: Resemblyzer's features of any waveform (resampled to
  16 kHz first, then power mel: 25 ms Hann window, n_fft 400, 10 ms hop, Slaney mel filters up
  to 8 kHz; ``log=True`` for log-mel); ``qdebug.zoo.audio.preprocess_wav`` prepares a recording
  as Resemblyzer does before it (16 kHz, loudness up to -30 dBFS, long pauses trimmed);
- ``synthetic_speech(...)``: a speech-like waveform made here (source-filter: a glottal
  sawtooth at a moving pitch, shaped by vowel formants, with fricative noise and pauses,
  at -30 dBFS as Resemblyzer normalises), and ``speech_mels(...)``, a seeded batch of its
  mel frames. It is not recorded speech: ``benchmarks/published_weights.py`` feeds real
  (synthesised) speech from espeak-ng when it is installed.

Constructors take keyword-only, JSON-typed kwargs, so a checkpoint can record
``"qdebug.zoo.speech:SpeakerEncoder"`` plus kwargs and rebuild the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .audio import SAMPLE_RATE, TARGET_DBFS, resample

__all__ = ["KeywordGRU", "SpeakerEncoder", "mel_filterbank", "mel_spectrogram", "speech_mels", "synthetic_speech"]


class SpeakerEncoder(nn.Module):
    """GE2E speaker encoder (Resemblyzer's ``VoiceEncoder``): mel frames -> unit embedding.

    Kwargs:
        mel_channels: mel bins per frame (40).
        hidden_size: LSTM hidden size (256).
        embedding_size: embedding size (256).
        num_layers: stacked LSTM layers (3).
    """

    def __init__(self, *, mel_channels: int = 40, hidden_size: int = 256, embedding_size: int = 256,
                 num_layers: int = 3) -> None:
        super().__init__()
        self.lstm = nn.LSTM(mel_channels, hidden_size, num_layers, batch_first=True)
        self.linear = nn.Linear(hidden_size, embedding_size)
        self.relu = nn.ReLU()
        # GE2E's loss parameters (initial values of its paper): in the published state dict.
        self.register_buffer("similarity_weight", torch.tensor([10.0]))
        self.register_buffer("similarity_bias", torch.tensor([-5.0]))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(mels)
        embeds_raw = self.relu(self.linear(hidden[-1]))
        return F.normalize(embeds_raw, dim=1)


class KeywordGRU(nn.Module):
    """Conv front-end + bidirectional GRU keyword spotter: mel frames -> class logits.

    Kwargs:
        mel_channels: mel bins per frame.
        conv_channels: channels of the Conv1d front-end (kernel 5, stride 2 in time).
        hidden_size: GRU hidden size per direction.
        num_layers: stacked GRU layers.
        num_classes: keywords (including "unknown" / "silence" if you count them).
    """

    def __init__(self, *, mel_channels: int = 40, conv_channels: int = 128, hidden_size: int = 128,
                 num_layers: int = 2, num_classes: int = 12) -> None:
        super().__init__()
        self.conv = nn.Conv1d(mel_channels, conv_channels, 5, stride=2, padding=2, bias=False)
        self.bn = nn.BatchNorm1d(conv_channels)
        self.relu = nn.ReLU()
        self.gru = nn.GRU(conv_channels, hidden_size, num_layers, batch_first=True, bidirectional=True)
        self.classifier = nn.Linear(2 * hidden_size, num_classes)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv(mels.transpose(1, 2))))  # (batch, channels, frames / 2)
        out, _ = self.gru(x.transpose(1, 2))
        return self.classifier(out.mean(dim=1))


# -- features ---------------------------------------------------------------------------------------
def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale (librosa's default): linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(f >= min_log_hz, min_log_mel + torch.log(f.clamp(min=1e-10) / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int = 40, f_max: float = SAMPLE_RATE / 2) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) triangles on Slaney's mel scale with area normalisation
    (2 / (upper - lower) Hz), as ``librosa.filters.mel(htk=False, norm="slaney")``."""
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(0.0))), float(_hz_to_mel(torch.tensor(f_max))),
                                      n_mels + 2, dtype=torch.float64))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs - lower) / (centre - lower)
    falling = (upper - freqs) / (upper - centre)
    weights = torch.clamp(torch.minimum(rising, falling), min=0.0) * (2.0 / (upper - lower))
    return weights.float()


def mel_spectrogram(wave: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, n_mels: int = 40, window_ms: float = 25,
                    hop_ms: float = 10, log: bool = False) -> torch.Tensor:
    """(frames, n_mels) power mel spectrogram of a mono waveform (Resemblyzer's features:
    ``librosa.feature.melspectrogram`` at 16 kHz with a 25 ms window and a 10 ms hop, centred
    frames, zero padding as librosa >= 0.10). Another sample rate is resampled to 16 kHz
    first, as Resemblyzer does: the power of an STFT grows with its window (a tone's
    |X|^2 = (A sum w / 2)^2), so a mel taken at 22.05 kHz (n_fft 551) would read ~1.9x the
    power the model was trained on. ``log``: ln(mel + 1e-6)."""
    if sample_rate != SAMPLE_RATE:
        wave, sample_rate = resample(wave.float(), sample_rate, SAMPLE_RATE), SAMPLE_RATE
    n_fft = int(sample_rate * window_ms / 1000)
    hop = int(sample_rate * hop_ms / 1000)
    spec = torch.stft(wave.float(), n_fft, hop, window=torch.hann_window(n_fft), center=True, pad_mode="constant",
                      return_complex=True)
    mel = mel_filterbank(sample_rate, n_fft, n_mels) @ spec.abs().pow(2)
    mel = mel.T.contiguous()
    return torch.log(mel + 1e-6) if log else mel


# Vowel formants F1, F2, F3 in Hz (adult averages, Peterson & Barney): /a/, /e/, /i/, /o/, /u/.
_VOWELS = ((730, 1090, 2440), (530, 1840, 2480), (270, 2290, 3010), (570, 840, 2410), (300, 870, 2240))


def synthetic_speech(seconds: float = 1.6, *, sample_rate: int = SAMPLE_RATE, seed: int = 0) -> torch.Tensor:
    """A seeded speech-like waveform at -30 dBFS: syllables of 80-250 ms, each a vowel (a
    sawtooth glottal source at a pitch that glides around the speaker's 90-220 Hz, shaped by
    the vowel's three formants), a fricative (noise above 3 kHz) or a pause, with smooth
    onsets. Filtering is done per 25 ms frame in the STFT domain (then inverted)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand((), generator=gen))

    n = int(seconds * sample_rate)
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    base = uniform(90, 220)
    f0 = base * (1 + 0.12 * torch.sin(2 * math.pi * uniform(0.3, 1.2) * t + uniform(0, 6.3)))
    phase = torch.cumsum(f0 / sample_rate, 0)
    voiced = (2 * (phase - torch.floor(phase)) - 1).float()
    noise = torch.randn(n, generator=gen)
    n_fft = int(sample_rate * 0.025)
    hop = n_fft // 4
    window = torch.hann_window(n_fft)
    sv = torch.stft(voiced, n_fft, hop, window=window, return_complex=True)
    sn = torch.stft(noise, n_fft, hop, window=window, return_complex=True)
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    frames = sv.shape[1]
    gain_v, gain_n = torch.zeros(freqs.numel(), frames), torch.zeros(freqs.numel(), frames)
    start = 0
    while start < frames:
        length = max(2, int(uniform(0.08, 0.25) * sample_rate / hop))
        stop = min(frames, start + length)
        ramp = torch.sin(math.pi * torch.linspace(0, 1, stop - start)).clamp(min=0).sqrt()  # onset and decay
        kind = uniform(0, 1)
        if kind < 0.6:  # vowel
            f1, f2, f3 = (f * uniform(0.9, 1.1) for f in _VOWELS[int(uniform(0, len(_VOWELS)))])
            shape = sum(a * torch.exp(-0.5 * ((freqs - f) / bw) ** 2)
                        for f, a, bw in ((f1, 1.0, 80), (f2, 0.5, 110), (f3, 0.25, 150)))
            gain_v[:, start:stop] = shape[:, None] * ramp * uniform(0.5, 1.0)
        elif kind < 0.85:  # fricative
            shape = torch.sigmoid((freqs - uniform(2500, 4500)) / 300)
            gain_n[:, start:stop] = shape[:, None] * ramp * uniform(0.05, 0.2)
        start = stop  # a pause otherwise
    wave = torch.istft(sv * gain_v + sn * gain_n, n_fft, hop, window=window, length=n)
    wave = wave + 1e-4 * torch.randn(n, generator=gen)  # a recording's noise floor
    rms = wave.pow(2).mean().sqrt()
    return wave * (10 ** (TARGET_DBFS / 20) / rms)


def speech_mels(batch: int = 4, frames: int = 160, *, n_mels: int = 40, log: bool = False,
                seed: int = 0) -> torch.Tensor:
    """(batch, frames, n_mels) mel frames of ``synthetic_speech``, one seeded utterance per row
    (160 frames = 1.6 s, Resemblyzer's partial utterance)."""
    seconds = (frames - 1) * 0.010 + 1e-4  # centred frames: 1 + samples // hop of them
    rows = [mel_spectrogram(synthetic_speech(seconds, seed=seed * 1000 + i), n_mels=n_mels, log=log)[:frames]
            for i in range(batch)]
    return torch.stack(rows)
