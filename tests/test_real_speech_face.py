"""Real architectures (issue 28 item 7): the GE2E speaker encoder (LSTM), a GRU keyword spotter
and MTCNN's PReLU ONet, small and seeded, through the engine and the command line.

Oracles: the published state dicts' key lists (Resemblyzer's ``pretrained.pt``, facenet-pytorch's
``onet.pt``, copied here), the models' formulas written out with torch.nn.functional, the mel
filterbank's definition, and, for the LSTM's costliest point, a loop of our own that quantizes
each point alone. The published weights themselves are only in benchmarks/published_weights.py.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import qdebug
from each_point_alone import sqnr_of_each_point_alone
from qdebug.engine import QConfig, calibrate, prepare, quant_points, set_mode
from qdebug.engine.ops import FLOAT_REASONS
from qdebug.io.modelspec import ModelSpec, build
from qdebug.zoo import PUBLISHED_ARCHITECTURES
from qdebug.zoo.face import ONet
from qdebug.zoo.speech import KeywordGRU, SpeakerEncoder, mel_filterbank, speech_mels

SPEAKER = "qdebug.zoo.speech:SpeakerEncoder"
GRU = "qdebug.zoo.speech:KeywordGRU"
ONET = "qdebug.zoo.face:ONet"
TINY = {  # target -> (kwargs, input maker): small enough for the command line in a few seconds
    SPEAKER: ({"hidden_size": 16, "embedding_size": 8, "num_layers": 2}, lambda seed: _features(4, 12, seed)),
    GRU: ({"conv_channels": 8, "hidden_size": 8, "num_layers": 2, "num_classes": 4},
          lambda seed: _features(4, 12, seed)),
    ONET: ({"width": 0.25}, lambda seed: torch.randn(4, 3, 48, 48, generator=torch.Generator().manual_seed(seed))),
}

# Keys and shapes of the published files (resemblyzer 0.1.4 pretrained.pt["model_state"],
# facenet-pytorch 2.6.0 data/onet.pt), read from the wheels.
RESEMBLYZER_KEYS = {
    "similarity_weight": (1,), "similarity_bias": (1,),
    **{f"lstm.{kind}_l{k}": shape for k in range(3) for kind, shape in (
        ("weight_ih", (1024, 40 if k == 0 else 256)), ("weight_hh", (1024, 256)), ("bias_ih", (1024,)),
        ("bias_hh", (1024,)))},
    "linear.weight": (256, 256), "linear.bias": (256,),
}
ONET_KEYS = {
    "conv1.weight": (32, 3, 3, 3), "conv1.bias": (32,), "prelu1.weight": (32,),
    "conv2.weight": (64, 32, 3, 3), "conv2.bias": (64,), "prelu2.weight": (64,),
    "conv3.weight": (64, 64, 3, 3), "conv3.bias": (64,), "prelu3.weight": (64,),
    "conv4.weight": (128, 64, 2, 2), "conv4.bias": (128,), "prelu4.weight": (128,),
    "dense5.weight": (256, 1152), "dense5.bias": (256,), "prelu5.weight": (256,),
    "dense6_1.weight": (2, 256), "dense6_1.bias": (2,), "dense6_2.weight": (4, 256), "dense6_2.bias": (4,),
    "dense6_3.weight": (10, 256), "dense6_3.bias": (10,),
}


def _features(batch: int, frames: int, seed: int) -> torch.Tensor:
    """Log-mel frames of synthetic speech, mean and variance normalised per utterance (the GE2E
    paper's 40-d log-mel features; Resemblyzer's published model reads power mel instead)."""
    mels = speech_mels(batch, frames, log=True, seed=seed)
    return (mels - mels.mean(dim=(1, 2), keepdim=True)) / mels.std(dim=(1, 2), keepdim=True)


def _sqnr(ref, out) -> float:
    ref = torch.cat([t.flatten() for t in (ref if isinstance(ref, tuple) else (ref,))]).double()
    out = torch.cat([t.flatten() for t in (out if isinstance(out, tuple) else (out,))]).double()
    return 10 * math.log10(float(ref.pow(2).sum()) / float((ref - out).pow(2).sum()))


def _tiny(target: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build(ModelSpec(target, TINY[target][0]), from_user=True).eval()


def trained_like(model: SpeakerEncoder) -> SpeakerEncoder:
    """Give a freshly initialised speaker encoder what training gives a speech LSTM and random
    initialisation does not: a long memory (forget-gate biases +3, f ~ 0.95) so the cell state
    integrates to ten times the hidden state's +-1 (+-13.5 here; Resemblyzer's last layer reaches
    +-15 on speech), input weights x2, and contracting recurrent weights (x0.5)."""
    hidden = model.lstm.hidden_size
    with torch.no_grad():
        for name, p in model.lstm.named_parameters():
            if name.startswith("weight_ih"):
                p.mul_(2)
            elif name.startswith("weight_hh"):
                p.mul_(0.5)
            elif name.startswith("bias_ih"):
                p[hidden:2 * hidden] += 3
    return model


# -- the architectures as published ------------------------------------------------------------------
def test_state_dicts_have_the_published_keys_and_shapes():
    assert {k: tuple(v.shape) for k, v in SpeakerEncoder().state_dict().items()} == RESEMBLYZER_KEYS
    assert {k: tuple(v.shape) for k, v in ONet().state_dict().items()} == ONET_KEYS
    lstm = SpeakerEncoder().lstm
    assert (lstm.input_size, lstm.hidden_size, lstm.num_layers, lstm.batch_first) == (40, 256, 3, True)
    assert set(PUBLISHED_ARCHITECTURES.values()) == {SpeakerEncoder, KeywordGRU, ONet}


def test_speaker_encoder_is_resemblyzers_formula():
    model = _tiny(SPEAKER)
    x = _features(3, 12, seed=1)
    with torch.no_grad():
        _, (h, _) = model.lstm(x)  # torch's own nn.LSTM (the model is not prepared)
        raw = F.relu(F.linear(h[-1], model.linear.weight, model.linear.bias))
        expected = raw / torch.norm(raw, dim=1, keepdim=True)  # Resemblyzer's VoiceEncoder.forward
        torch.testing.assert_close(model(x), expected)


def test_onet_is_facenets_forward():
    model = _tiny(ONET)
    sd = model.state_dict()
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(2))

    def block(x, k, pool):
        x = F.prelu(F.conv2d(x, sd[f"conv{k}.weight"], sd[f"conv{k}.bias"]), sd[f"prelu{k}.weight"])
        return F.max_pool2d(x, pool[0], pool[1], ceil_mode=True) if pool else x

    with torch.no_grad():
        y = block(block(block(block(x, 1, (3, 2)), 2, (3, 2)), 3, (2, 2)), 4, None)
        assert y.shape[-2:] == (3, 3)
        y = y.permute(0, 3, 2, 1).reshape(2, -1)  # facenet-pytorch's Caffe order
        y = F.prelu(F.linear(y, sd["dense5.weight"], sd["dense5.bias"]), sd["prelu5.weight"])
        box, landmarks, prob = model(x)
        torch.testing.assert_close(box, F.linear(y, sd["dense6_2.weight"], sd["dense6_2.bias"]))
        torch.testing.assert_close(landmarks, F.linear(y, sd["dense6_3.weight"], sd["dense6_3.bias"]))
        torch.testing.assert_close(prob, F.softmax(F.linear(y, sd["dense6_1.weight"], sd["dense6_1.bias"]), dim=1))


def test_mel_filterbank_is_slaneys():
    """Slaney's scale: linear 0-1 kHz at 200/3 Hz per mel (1 kHz = mel 15), then 27 mels per
    factor 6.4; each triangle scaled to unit area, peaking at mel-equispaced centres."""
    fb = mel_filterbank(16000, 400, 40).double()
    df = 16000 / 400
    widths = (fb > 0).sum(1)
    assert torch.allclose((fb.sum(1) * df)[widths >= 8], torch.ones(1, dtype=torch.float64), atol=0.08)
    top = 15 + 27 * math.log(8000 / 1000) / math.log(6.4)
    centres = torch.linspace(0, top, 42)[1:-1]
    hz = torch.where(centres < 15, centres * 200 / 3, 1000 * torch.exp((centres - 15) * math.log(6.4) / 27))
    peak = fb.argmax(1).double() * df
    assert (peak - hz.double()).abs().max() <= df / 2 + 1e-9


# -- L2 normalisation ---------------------------------------------------------------------------------
class _Normalised(torch.nn.Module):
    def __init__(self, inline_norm: bool):
        super().__init__()
        self.linear = torch.nn.Linear(8, 6)
        self.inline_norm = inline_norm

    def forward(self, x):
        r = F.relu(self.linear(x))
        return r / torch.norm(r, dim=1, keepdim=True) if self.inline_norm else F.normalize(r, dim=1)


def test_l2_normalisation_is_one_op_quantized_at_its_output():
    """F.normalize: torch's normalize on the dequantized input, then torch's fake quantization."""
    torch.manual_seed(1)
    model = _Normalised(inline_norm=False).eval()
    x = torch.randn(5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float-fallback warning
        qm = prepare(model, QConfig(), example_inputs=x)
    calibrate(qm, [x])
    points = quant_points(qm)
    assert not points["normalize"].fallback
    spec = points["normalize"].spec
    with torch.no_grad():
        relu = model.linear(x).relu()  # the relu point's grid: torch's fake quant with its qparams
        p = points["relu"]
        relu = torch.fake_quantize_per_tensor_affine(relu, float(p.scale), int(p.zero_point), p.spec.qmin, p.spec.qmax)
        p = points["normalize"]
        expected = torch.fake_quantize_per_tensor_affine(F.normalize(relu, dim=1), float(p.scale), int(p.zero_point),
                                                         spec.qmin, spec.qmax)
        set_mode(qm, "float")
        set_mode(qm, "fake", "relu")
        set_mode(qm, "fake", "normalize")
        assert torch.equal(qm(x), expected)


def test_resemblyzers_own_division_by_the_norm_is_named_with_its_reason():
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="no quantized kernel") as record:
        prepare(_Normalised(inline_norm=True).eval(), QConfig(), example_inputs=torch.randn(5, 8))
    message = " ".join(str(w.message) for w in record)
    assert f"norm (norm: {FLOAT_REASONS['norm']})" in message and "F.normalize" in FLOAT_REASONS["norm"]
    assert f"(div: {FLOAT_REASONS['div']})" in message or f"(truediv: {FLOAT_REASONS['truediv']})" in message


# -- the engine: no undocumented float op, a sane int8 error -----------------------------------------
@pytest.mark.parametrize("target", list(TINY), ids=["speaker", "gru", "onet"])
def test_prepare_has_no_float_fallback_outside_the_table_and_int8_is_sane(target):
    model = _tiny(target)
    make = TINY[target][1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm = prepare(model, QConfig(), example_inputs=make(1))
    fallbacks = [p for p in quant_points(qm).values() if p.fallback]
    assert all(p.op in FLOAT_REASONS for p in fallbacks), [(p.name, p.op) for p in fallbacks]
    assert not fallbacks and not [w for w in caught if "no quantized kernel" in str(w.message)]
    calibrate(qm, [make(2), make(3)])
    x = make(4)
    with torch.no_grad():
        sqnr = _sqnr(model(x), qm(x))
    assert 10 < sqnr < 80, sqnr  # int8: neither broken nor unquantized


# -- the LSTM's own error, and step's costliest point ------------------------------------------------
FRAMES = 24  # 0.24 s: the cell state reaches +-13.5 (the python step loop's cost grows with it)


@pytest.fixture(scope="module")
def speech_lstm():
    torch.manual_seed(0)
    model = trained_like(SpeakerEncoder(hidden_size=32, embedding_size=16, num_layers=2)).eval()
    x = _features(8, FRAMES, seed=3)
    with torch.no_grad():
        _, (_, c) = model.lstm(x)
    return model, x, float(c.abs().max())


def _lstm_only(model, x, qconfig: QConfig) -> tuple:
    qm = prepare(model, qconfig, example_inputs=x)
    calibrate(qm, [_features(8, FRAMES, seed=1), _features(8, FRAMES, seed=2)])
    set_mode(qm, "float")
    set_mode(qm, "fake", "lstm")
    with torch.no_grad():
        return qm, _sqnr(model(x), qm(x))


def test_only_the_lstm_quantized_keeps_30_db_and_the_cell_state_range_is_not_the_error(speech_lstm):
    model, x, cell_range = speech_lstm
    assert cell_range > 10  # the cell state spans ten times the hidden state's +-1
    qm, sqnr = _lstm_only(model, x, QConfig())
    assert {quant_points(qm)[f"lstm.l0.{p}"].spec.bits for p in ("fgate_cx", "igate_cgate", "cell")} == {16}
    assert sqnr >= 30, sqnr  # measured 33.0 dB
    cell8 = {f"lstm.*.{p}": {"activation": {"bits": 8}} for p in ("fgate_cx", "igate_cgate", "cell")}
    _, sqnr8 = _lstm_only(model, x, QConfig.from_dict({"overrides": cell8}))
    assert sqnr8 < sqnr - 6, (sqnr8, sqnr)  # the cell state on int8 grids: 17.8 dB


def test_step_names_the_point_that_costs_most_when_quantized_alone(speech_lstm):
    """Our own loop quantizes each point alone (every other one float) on the trained-like
    encoder; step's drill must name the worst of them (here the model input: 23.8 dB, clipped
    on these frames; the LSTM's 26 points together 33.0 dB), and its rows must be those numbers.
    (tests/test_step.py has the drill passing the costliest point at an upper level.)"""
    model, x, _ = speech_lstm
    qm = prepare(model, QConfig(), example_inputs=x)
    calibrate(qm, [_features(8, FRAMES, seed=1), _features(8, FRAMES, seed=2)])
    alone = sqnr_of_each_point_alone(model, qm, x, _sqnr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = qdebug.step(model, qm, data=[x], mode="drill")
    meta = frame.attrs["meta"]
    worst = min(alone, key=alone.get)
    assert meta["culprit"]["selection"] == worst, sorted(alone.items(), key=lambda kv: kv[1])[:3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inside = qdebug.step(model, qm, data=[x], module="lstm", mode="drill")  # each of the LSTM's points
    rows = {**frame.set_index("selection")["sqnr_db"], **inside.set_index("selection")["sqnr_db"]}
    for name, sqnr in alone.items():  # a unit of one point is named after its layer (linear.weight: linear)
        assert rows[name if name in rows else name.rsplit(".", 1)[0]] == pytest.approx(sqnr, abs=1e-6), name


# -- the command line, end to end --------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    out = {}
    for target, (kwargs, make) in TINY.items():
        name = target.rsplit(":", 1)[1]
        model = _tiny(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qm = prepare(model, QConfig(), example_inputs=make(1))
        calibrate(qm, [make(2), make(3)])
        qdebug.save(model, d / f"{name}_float.pt", stage="float", sample_inputs=make(1))
        qdebug.save(qm, d / f"{name}_calibrated.pt", stage="calibrated", sample_inputs=make(1))
        data = make(5)  # one batch: suggest evaluates every candidate on it
        torch.save(data, d / f"{name}_data.pt")
        with torch.no_grad():
            target_db = _sqnr(model(data), qm(data)) + 1  # above int8's: suggest has a plan to find
        out[target] = (d / f"{name}_float.pt", d / f"{name}_calibrated.pt", d / f"{name}_data.pt", target_db)
    return out


@pytest.mark.parametrize("target", list(TINY), ids=["speaker", "gru", "onet"])
def test_compare_step_suggest_and_nan_trace_run_end_to_end(cli, files, target):
    fp, cal, data, target_db = files[target]
    compared = cli("compare", fp, cal, "--data", data, "--batch-size", 4)
    assert compared.code in (0, 1) and "Traceback" not in compared.err, compared.err
    assert "calibrated vs float" in compared.out
    if target == SPEAKER:
        assert "lstm.l1.cell " in compared.out and "normalize" in compared.out
    stepped = cli("step", fp, cal, "--drill", "--data", data, "--batch-size", 4)
    assert stepped.code == 0, stepped.err
    assert "costs the most: " in stepped.out and "drill: " in stepped.out
    suggested = cli("suggest", fp, cal, "--data", data, "--batch-size", 4, "--min-sqnr", f"{target_db:.1f}")
    assert suggested.code in (0, 1), suggested.err
    assert "suggest: top" in suggested.out and ("plan: " in suggested.out or "no plan" in suggested.out), suggested.out
    traced = cli("nan-trace", cal, "--data", data, "--steps", 2, "--batch-size", 4)
    assert traced.code == 0, traced.err
    assert "all finite: 2 step(s)" in traced.out
