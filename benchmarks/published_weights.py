"""The published weights of the speech and face models of ``qdebug.zoo``, and real inputs for them.

Not part of the test suite (it needs two wheels from PyPI, no download at run time):

    pip download --no-deps resemblyzer facenet-pytorch -d DIR    # then unzip them, or leave the wheels
    python benchmarks/published_weights.py DIR                     # the figures of docs/benchmarks.md

``load_published(DIR)`` returns ``{"speaker_encoder": SpeakerEncoder, "onet": ONet}`` in eval mode
with the published weights: Resemblyzer's ``resemblyzer/pretrained.pt`` (its ``model_state``:
the GE2E encoder, 3-layer LSTM 40 -> 256) and facenet-pytorch's ``facenet_pytorch/data/onet.pt``
(MTCNN's ONet). DIR is searched for the two files, unzipped or still inside the ``.whl`` files;
each is read with ``torch.load(weights_only=True)`` (tensors only, no code runs) and loaded with
``strict=True``. Neither package is imported or installed (facenet-pytorch pins an old torch).

Inputs:

- ``speech_batches``: Resemblyzer's features (power mel, 40 bins, 160-frame partials of 1.6 s)
  of English sentences spoken by espeak-ng (``apt-get install espeak-ng``) in several voices
  and pitches, prepared as Resemblyzer's ``preprocess_wav`` does (``qdebug.zoo.audio``:
  22.05 kHz resampled to 16 kHz, loudness raised to -30 dBFS but never lowered, long pauses
  trimmed); without espeak-ng, the seeded synthetic speech of ``qdebug.zoo.speech`` (the
  returned ``source`` says which).
- ``face_crops``: 48x48 crops of matplotlib's bundled photograph of Grace Hopper, scaled as
  MTCNN does ((x - 127.5) / 128): jittered boxes around her face (3 of 4) and crops of the
  background.

Run as a script it measures, with the published weights, the int8 output SQNR of each model
(everything quantized at the default QConfig; for the speaker encoder also only its LSTM) and
what ``qdebug.suggest`` raises to int16 to reach ``--min-sqnr``.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import wave
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qdebug.zoo.face import ONet  # noqa: E402
from qdebug.zoo.audio import SAMPLE_RATE, preprocess_wav  # noqa: E402
from qdebug.zoo.speech import SpeakerEncoder, mel_spectrogram, speech_mels  # noqa: E402

RESEMBLYZER = "resemblyzer/pretrained.pt"
ONET = "facenet_pytorch/data/onet.pt"

SENTENCES = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "A debugger for quantized networks tells you which layer loses the precision.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "We will meet at nine in the morning near the old railway station on the hill.",
    "Numbers such as three hundred and forty two are read aloud one digit at a time.",
)
VOICES = (("en-us", 50), ("en-gb", 35), ("en-us+f3", 70), ("en-gb-scotland", 45), ("en-us+m3", 40), ("en-us+f4", 80))


def _read(folder: Path, member: str) -> dict:
    """The state dict at ``member`` under ``folder``, unzipped or inside a wheel there."""
    for path in sorted(folder.rglob(Path(member).name)):
        if path.as_posix().endswith(member):
            return torch.load(path, map_location="cpu", weights_only=True)
    for whl in sorted(folder.rglob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            if member in zf.namelist():
                return torch.load(io.BytesIO(zf.read(member)), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{member} not found under {folder} (pip download --no-deps resemblyzer facenet-pytorch "
                            f"-d {folder})")


def speaker_encoder(folder: str | Path) -> SpeakerEncoder:
    """Resemblyzer's published GE2E speaker encoder (3-layer LSTM 40 -> 256, 256-d embedding)."""
    model = SpeakerEncoder()
    model.load_state_dict(_read(Path(folder), RESEMBLYZER)["model_state"], strict=True)
    return model.eval()


def onet(folder: str | Path) -> ONet:
    """facenet-pytorch's published MTCNN ONet."""
    model = ONet()
    model.load_state_dict(_read(Path(folder), ONET), strict=True)
    return model.eval()


def load_published(folder: str | Path) -> dict[str, torch.nn.Module]:
    """``{"speaker_encoder": ..., "onet": ...}`` with the published weights, in eval mode."""
    return {"speaker_encoder": speaker_encoder(folder), "onet": onet(folder)}


# -- inputs -----------------------------------------------------------------------------------------
def _espeak(text: str, voice: str, pitch: int, out: Path) -> torch.Tensor:
    subprocess.run(["espeak-ng", "-v", voice, "-p", str(pitch), "-s", "150", "-w", str(out), text], check=True,
                   capture_output=True, timeout=60)
    with wave.open(str(out), "rb") as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1, "espeak-ng writes 16-bit mono"
        rate, raw = w.getframerate(), w.readframes(w.getnframes())
    samples = torch.frombuffer(bytearray(raw), dtype=torch.int16).float() / 32768
    # Resemblyzer's preprocess_wav: 22.05 kHz -> 16 kHz (the mel's n_fft is 400 at 16 kHz), up to
    # -30 dBFS only (espeak-ng speaks at -18..-21 dBFS and keeps it), pauses trimmed by the VAD.
    return mel_spectrogram(preprocess_wav(samples, rate), SAMPLE_RATE)


def speech_batches(batches: int = 4, batch: int = 8, frames: int = 160, *, seed: int = 0,
                   ) -> tuple[list[torch.Tensor], str]:
    """``batches`` tensors (batch, frames, 40) of mel partials, and their source
    (``"espeak-ng"`` or ``"synthetic"``)."""
    need = batches * batch
    if shutil.which("espeak-ng"):
        partials: list[torch.Tensor] = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, text in enumerate(SENTENCES * math.ceil(need / len(SENTENCES))):
                voice, pitch = VOICES[i % len(VOICES)]
                mels = _espeak(text, voice, pitch, Path(tmp) / "s.wav")
                step = frames // 2  # Resemblyzer's partials overlap by half
                partials += [mels[s:s + frames] for s in range(0, mels.shape[0] - frames + 1, step)]
                if len(partials) >= 2 * need:
                    break
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(partials), generator=gen)[:need]
        rows = torch.stack([partials[int(k)] for k in order])
        return list(rows.split(batch)), "espeak-ng"
    return [speech_mels(batch, frames, seed=seed * 100 + b) for b in range(batches)], "synthetic"


# Grace Hopper's face in matplotlib's sample photograph (512 x 600): centre and side in pixels.
_FACE_CENTRE, _FACE_SIDE = (265.0, 245.0), 200.0


def face_crops(n: int = 32, *, seed: int = 0) -> torch.Tensor:
    """(n, 3, 48, 48) MTCNN-scaled crops: 3 of 4 jittered around the face, the rest background."""
    import matplotlib
    from PIL import Image

    path = os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")
    image = Image.open(path).convert("RGB")
    gen = torch.Generator().manual_seed(seed)
    crops = []
    for i in range(n):
        r = torch.rand(4, generator=gen).tolist()
        if i % 4 != 3:
            side = _FACE_SIDE * (0.85 + 0.3 * r[0])
            cx = _FACE_CENTRE[0] + (r[1] - 0.5) * 0.3 * side
            cy = _FACE_CENTRE[1] + (r[2] - 0.5) * 0.3 * side
        else:
            side = 60 + 140 * r[0]
            cx, cy = side / 2 + r[1] * (image.width - side), side / 2 + r[2] * (image.height - side)
        box = (round(cx - side / 2), round(cy - side / 2), round(cx + side / 2), round(cy + side / 2))
        crop = image.crop(box).resize((48, 48), Image.BILINEAR)
        pixels = torch.frombuffer(bytearray(crop.tobytes()), dtype=torch.uint8).view(48, 48, 3)
        crops.append(pixels.permute(2, 0, 1).float())
    return (torch.stack(crops) - 127.5) * 0.0078125


def builders(folder: str | Path | None) -> dict:
    """For benchmarks/real_architectures.py: name -> a function returning (model, 48 inputs,
    metric or None). ``keyword_gru`` (random weights, default sizes; log-mel of the same speech,
    top-1 against the float model) always; ``speaker_encoder`` and ``onet`` (published weights)
    when ``folder`` is given. Without a metric a model is judged by output SQNR."""
    from qdebug.zoo.speech import KeywordGRU

    def speech(log: bool) -> torch.Tensor:
        rows, _ = speech_batches(6, 8)
        mels = torch.cat(rows)
        return torch.log(mels + 1e-6) if log else mels

    def keyword_gru():
        torch.manual_seed(0)
        return KeywordGRU().eval(), speech(log=True), "top1"

    found = {"keyword_gru": keyword_gru}
    if folder is not None:
        found["speaker_encoder"] = lambda: (speaker_encoder(folder), speech(log=False), None)
        found["onet"] = lambda: (onet(folder), face_crops(48), None)
    return found


# -- the figures ------------------------------------------------------------------------------------
def _sqnr(ref, out) -> float:
    """Output SQNR in dB; of a tuple output, its worst tensor's (as step and suggest judge it)."""
    if isinstance(ref, tuple):
        return min(_sqnr(r, o) for r, o in zip(ref, out))
    ref, out = ref.double(), out.double()
    return 10 * math.log10(float(ref.pow(2).sum()) / max(float((ref - out).pow(2).sum()), 1e-300))


def measure(model: torch.nn.Module, batches: list[torch.Tensor], *, only: str | None = None,
            min_sqnr: float = 30.0, suggest: bool = True) -> dict:
    """int8 output SQNR (default QConfig; calibrated on the first half of ``batches``, measured
    on the rest: the worst batch, and of a tuple output the worst tensor, with each tensor's
    too), optionally with only ``only`` quantized, and suggest's int16 plan."""
    import qdebug
    from qdebug.engine import QConfig, calibrate, prepare, set_mode

    half = len(batches) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = prepare(model, QConfig(), example_inputs=batches[0])
    calibrate(qm, batches[:half])
    result: dict = {}
    with torch.no_grad():
        ref = [model(x) for x in batches[half:]]
        outs = [qm(x) for x in batches[half:]]
        result["sqnr_db"] = min(_sqnr(r, o) for r, o in zip(ref, outs))
        if isinstance(ref[0], tuple):
            result["sqnr_db_per_output"] = [round(min(_sqnr(r[k], o[k]) for r, o in zip(ref, outs)), 1)
                                            for k in range(len(ref[0]))]
        if only is not None:
            set_mode(qm, "float")
            set_mode(qm, "fake", only)
            result[f"sqnr_db_{only}_only"] = min(_sqnr(r, qm(x)) for r, x in zip(ref, batches[half:]))
            set_mode(qm, "fake")
    if suggest:  # on one evaluation batch: suggest runs the model once per candidate and plan step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ranked = qdebug.suggest(model, qm, data=batches[half:half + 1], min_sqnr=min_sqnr)
        plan = ranked.attrs.get("plan", {})
        result["suggest"] = {"points": list(plan.get("points", [])), "before": plan.get("before"),
                             "after": plan.get("after"), "passed": plan.get("passed")}
        result["top5"] = [(p, round(float(g), 2)) for p, g in zip(ranked["point"][:5], ranked["gain_db"][:5])]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where `pip download --no-deps resemblyzer facenet-pytorch` put the wheels")
    parser.add_argument("--min-sqnr", type=float, default=30.0, help="suggest's target (dB)")
    parser.add_argument("--no-suggest", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    models = load_published(args.folder)
    speech, source = speech_batches()
    print(f"speaker encoder (Resemblyzer), {source} speech:",
          measure(models["speaker_encoder"], speech, only="lstm", min_sqnr=args.min_sqnr,
                  suggest=not args.no_suggest))
    faces = face_crops(32)
    print("ONet (facenet-pytorch), Grace Hopper crops:",
          measure(models["onet"], list(faces.split(8)), min_sqnr=args.min_sqnr, suggest=not args.no_suggest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
