"""Resemblyzer's waveform preprocessing in torch: resampling, loudness and long-silence trimming.

The GE2E speaker encoder (``qdebug.zoo.speech.SpeakerEncoder``) was trained on power mel
frames of waveforms prepared by Resemblyzer's ``preprocess_wav``; its input scale depends on
each step, so features made otherwise are not the ones its weights expect:

- ``resample(wave, orig_sr, new_sr)``: to 16 kHz first (``librosa.resample``).  The mel's
  25 ms window is ``n_fft = 0.025 sr`` samples and an STFT's power grows with the window
  (a tone's |X|^2 = (A sum_n w[n] / 2)^2, proportional to n_fft^2): a 22.05 kHz mel (n_fft 551)
  reads ~(551 / 400)^2 = 1.9x the 16 kHz one's power (and spectra above 8 kHz add to the RMS).
- ``normalize_volume(wave)``: to -30 dBFS, *increase only* (``audio_norm_target_dBFS``,
  ``increase_only=True``): louder speech keeps its level.  Forcing every wave to -30 dBFS
  turns espeak-ng's -18..-21 dBFS speech 8-18x quieter in power than Resemblyzer feeds it.
- ``trim_long_silences(wave)``: Resemblyzer's ``trim_long_silences`` -- 30 ms windows flagged
  voiced or not, a moving average over 8 windows rounded (5 of 8 voiced), dilated by 3 windows
  each side, unvoiced windows dropped -- so pauses inside an utterance shrink to at most
  ~0.2 s, not only its ends.  The flags come from an energy detector (window power above
  ``threshold_dbfs``) where Resemblyzer asks webrtcvad (mode 3); on espeak-ng's noiseless
  speech the two agree on 93-99 % of windows at -60 dBFS.
- ``preprocess_wav(wave, sample_rate)``: the three, in Resemblyzer's order.

Resampling is a windowed-sinc (Kaiser) polyphase filter: with L = new_sr / g, M = orig_sr / g
(g their gcd) output sample j = q L + p reads

    y[j] = sum_n x[q M + n] h_p[n],  h_p[n] = (f_c / M) sinc(f_c (n / M - p / L)) kaiser(...)

over the filter's ``zero_crossings`` zero crossings each side, f_c = rolloff min(L, M) (the
cutoff below the lower Nyquist; rolloff 0.945 and Kaiser beta 14.77 are resampy's
``kaiser_best``, librosa's default resampler before soxr).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qdebug.errors import QDebugError

__all__ = ["SAMPLE_RATE", "TARGET_DBFS", "normalize_volume", "preprocess_wav", "resample", "trim_long_silences"]

SAMPLE_RATE = 16000
# Resemblyzer normalises every utterance up to this loudness (audio_norm_target_dBFS).
TARGET_DBFS = -30.0
# Resemblyzer's VAD hyperparameters (resemblyzer/hparams.py).
VAD_WINDOW_MS = 30
VAD_MOVING_AVERAGE_WIDTH = 8
VAD_MAX_SILENCE_LENGTH = 6


def _sinc_kernel(orig: int, new: int, zero_crossings: int, rolloff: float, beta: float
                 ) -> tuple[torch.Tensor, int]:
    """(new, 2 width + orig) polyphase filter rows (float64), and width in input samples."""
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64)[None, :] / orig
    phase = -torch.arange(new, dtype=torch.float64)[:, None] / new
    t = ((taps + phase) * cutoff).clamp(-zero_crossings, zero_crossings)  # in zero crossings
    window = torch.special.i0(beta * torch.sqrt(1 - (t / zero_crossings) ** 2)) / torch.special.i0(
        torch.tensor(beta, dtype=torch.float64))
    return torch.special.sinc(t) * window * (cutoff / orig), width


def resample(wave: torch.Tensor, orig_sr: int, new_sr: int = SAMPLE_RATE, *, zero_crossings: int = 64,
             rolloff: float = 0.9475937167399596, beta: float = 14.769656459379492) -> torch.Tensor:
    """A mono waveform from ``orig_sr`` to ``new_sr`` Hz (band-limited below min of the two
    Nyquists); ceil(len * new_sr / orig_sr) samples."""
    if wave.dim() != 1:
        raise QDebugError(f"resample takes a mono waveform, got shape {tuple(wave.shape)}", "pass wave[0] or a mix")
    if orig_sr <= 0 or new_sr <= 0:
        raise QDebugError(f"sample rates must be positive, got {orig_sr} -> {new_sr}", "pass rates in Hz")
    if orig_sr == new_sr:
        return wave
    g = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // g, new_sr // g
    kernel, width = _sinc_kernel(orig, new, zero_crossings, rolloff, beta)
    x = F.pad(wave.double()[None, None], (width, width + orig))
    y = F.conv1d(x, kernel[:, None, :], stride=orig)  # (1, new phases, blocks)
    out = y[0].T.reshape(-1)[:math.ceil(new * wave.numel() / orig)]
    return out.to(wave.dtype if wave.is_floating_point() else torch.float32)


def dbfs(wave: torch.Tensor) -> float:
    """Loudness in dB relative to full scale: 20 log10(rms) of samples in [-1, 1]."""
    return 20 * math.log10(max(float(wave.double().pow(2).mean().sqrt()), 1e-12))


def normalize_volume(wave: torch.Tensor, target_dbfs: float = TARGET_DBFS, *, increase_only: bool = True
                     ) -> torch.Tensor:
    """``wave`` scaled to ``target_dbfs``; with ``increase_only`` (Resemblyzer's) a louder wave
    is returned as is."""
    change = target_dbfs - dbfs(wave)
    if change < 0 and increase_only:
        return wave
    return wave * 10 ** (change / 20)


def trim_long_silences(wave: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, threshold_dbfs: float = -60.0
                       ) -> torch.Tensor:
    """``wave`` without its long unvoiced stretches (Resemblyzer's smoothing and dilation of
    30 ms voice flags; flags from window power > ``threshold_dbfs``).  The tail short of a
    whole window is dropped, as Resemblyzer does."""
    window = VAD_WINDOW_MS * sample_rate // 1000
    wave = wave[:wave.numel() - wave.numel() % window]
    if wave.numel() == 0:
        return wave
    power = wave.double().view(-1, window).pow(2).mean(1)
    voiced = (10 * torch.log10(power.clamp(min=1e-30)) > threshold_dbfs).double()
    w = VAD_MOVING_AVERAGE_WIDTH  # numpy's moving average of Resemblyzer: (w-1)//2 zeros before, w//2 after
    padded = F.pad(voiced, ((w - 1) // 2, w // 2))
    smooth = padded.unfold(0, w, 1).mean(1)
    mask = torch.round(smooth).bool()  # half to even, as np.round: 4 of 8 is unvoiced
    reach = VAD_MAX_SILENCE_LENGTH // 2  # binary_dilation with ones(7): 3 windows each side
    mask = F.max_pool1d(mask.double()[None, None], 2 * reach + 1, 1, reach)[0, 0].bool()
    return wave.view(-1, window)[mask].reshape(-1)


def preprocess_wav(wave: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Resemblyzer's ``preprocess_wav``: to 16 kHz, up to -30 dBFS, long silences trimmed."""
    return trim_long_silences(normalize_volume(resample(wave, sample_rate, SAMPLE_RATE)))
