"""Resemblyzer's feature pipeline (qdebug.zoo.audio, qdebug.zoo.speech.mel_spectrogram).

Oracles: sinusoids whose samples and STFT are known in closed form (a periodic Hann window
over a whole number of cycles puts A N / 4 in the tone's bin and A N / 8 in each neighbour),
dBFS from its definition, and Resemblyzer's own ``trim_long_silences`` smoothing written
again in numpy (its cumsum moving average and a loop for the dilation).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from qdebug.zoo.audio import dbfs, normalize_volume, preprocess_wav, resample, trim_long_silences
from qdebug.zoo.speech import mel_filterbank, mel_spectrogram


def _tone(freq: float, sr: int, seconds: float, amplitude: float = 0.5) -> torch.Tensor:
    t = torch.arange(int(sr * seconds), dtype=torch.float64) / sr
    return amplitude * torch.sin(2 * math.pi * freq * t)


def test_resample_keeps_a_tone_below_the_new_nyquist_and_removes_one_above():
    for freq in (440.0, 3000.0, 7000.0):
        y = resample(_tone(freq, 22050, 1.0), 22050, 16000)
        assert y.numel() == 16000
        exact = _tone(freq, 16000, 1.0)
        assert (y - exact)[800:-800].abs().max() < 1e-5, freq  # away from the zero-padded ends
    alias = resample(_tone(9000.0, 22050, 1.0), 22050, 16000)  # would fold to 7 kHz
    assert alias[800:-800].abs().max() < 1e-4
    assert torch.equal(resample(exact, 16000, 16000), exact)


def test_mel_of_a_tone_is_the_closed_form_at_16_and_22_05_khz():
    """1 kHz at 16 kHz: 25 whole cycles in the 400-sample window, so |X_25| = A N / 4,
    |X_24| = |X_26| = A N / 8 and the mel is fb[:, 24:27] @ those powers. 22.05 kHz speech is
    resampled first: the same frames (a mel taken at 22.05 kHz, n_fft 551, reads 1.9x)."""
    amplitude, n = 0.5, 400
    power = torch.tensor([(amplitude * n / 8) ** 2, (amplitude * n / 4) ** 2, (amplitude * n / 8) ** 2],
                         dtype=torch.float64)
    expected = mel_filterbank(16000, n, 40).double()[:, 24:27] @ power
    at16 = mel_spectrogram(_tone(1000.0, 16000, 1.0, amplitude), 16000)
    torch.testing.assert_close(at16[5:-5].double(), expected.expand(at16.shape[0] - 10, 40), rtol=1e-4,
                               atol=1e-4 * float(expected.max()))
    at22 = mel_spectrogram(_tone(1000.0, 22050, 1.0, amplitude), 22050)
    assert at22.shape == at16.shape
    torch.testing.assert_close(at22[5:-5].double(), expected.expand(at16.shape[0] - 10, 40), rtol=1e-3,
                               atol=1e-3 * float(expected.max()))


def test_loudness_is_raised_to_minus_30_dbfs_never_lowered():
    loud = _tone(300.0, 16000, 0.5, amplitude=0.1 * math.sqrt(2))  # rms 0.1: -20 dBFS
    assert abs(dbfs(loud) + 20) < 1e-6
    assert torch.equal(normalize_volume(loud), loud)  # Resemblyzer: increase_only=True
    quiet = loud / 10  # -40 dBFS
    raised = normalize_volume(quiet)
    assert abs(20 * math.log10(float(raised.pow(2).mean().sqrt())) + 30) < 1e-6
    assert abs(dbfs(normalize_volume(loud, increase_only=False)) + 30) < 1e-6


def _numpy_trim(wave: np.ndarray, sr: int, threshold_dbfs: float) -> np.ndarray:
    """resemblyzer/audio.py's trim_long_silences, voice flags by window power."""
    spw = 30 * sr // 1000
    wave = wave[:len(wave) - len(wave) % spw]
    flags = np.array([10 * np.log10(max(np.mean(wave[s:s + spw] ** 2), 1e-30)) > threshold_dbfs
                      for s in range(0, len(wave), spw)])
    width = 8
    padded = np.concatenate((np.zeros((width - 1) // 2), flags, np.zeros(width // 2)))
    ret = np.cumsum(padded, dtype=float)
    ret[width:] = ret[width:] - ret[:-width]
    mask = np.round(ret[width - 1:] / width).astype(bool)
    dilated = mask.copy()
    for i in np.flatnonzero(mask):  # binary_dilation with np.ones(7)
        dilated[max(0, i - 3):i + 4] = True
    return wave[np.repeat(dilated, spw)]


def test_long_pauses_inside_an_utterance_shrink_short_ones_stay():
    sr = 16000
    silence = lambda s: torch.zeros(int(sr * s), dtype=torch.float64)  # noqa: E731
    parts = [silence(0.5), _tone(200, sr, 0.6, 0.1), silence(1.0), _tone(300, sr, 0.6, 0.1), silence(0.09),
             _tone(250, sr, 0.6, 0.1), silence(0.4)]
    wave = torch.cat(parts)
    trimmed = trim_long_silences(wave, sr)
    expected = _numpy_trim(wave.numpy(), sr, -60.0)
    assert trimmed.numel() == expected.size and np.array_equal(trimmed.numpy(), expected)
    assert int((trimmed != 0).sum()) == int((wave != 0).sum())  # no voiced sample lost
    runs, run = [], 0  # lengths of the silent stretches left, in seconds
    for silent in (trimmed == 0).tolist() + [False]:
        if silent:
            run += 1
        elif run:
            runs, run = runs + [run / sr], 0
    runs = [r for r in runs if r > 0.005]  # not the tone's own zero crossings
    assert len(runs) == 4 and max(runs) < 0.25, runs  # 0.5 s, 1 s, 0.4 s: each cut to < 0.25 s
    assert abs(runs[2] - 0.09) < 0.001, runs  # the 90 ms pause between words is kept whole


def test_preprocess_wav_is_resample_then_loudness_then_trim():
    wave = torch.cat([_tone(220, 22050, 0.8, 0.01), torch.zeros(22050), _tone(330, 22050, 0.8, 0.01)])
    out = preprocess_wav(wave, 22050)
    manual = trim_long_silences(normalize_volume(resample(wave, 22050, 16000)), 16000)
    assert torch.equal(out, manual)
    assert out.numel() < 16000 * 2.6 - 16000 // 2
