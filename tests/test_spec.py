"""Tests of qdebug.engine.spec: QuantSpec, QConfig and qparams_from_range.

Expected values are written out by hand (with the arithmetic in a comment) or
come from torch's own observers; none is computed by the code under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.ao.quantization import MinMaxObserver as TorchMinMax

from qdebug.engine.spec import SCALE_EPS, QConfig, QuantSpec, qparams_from_range
from qdebug.errors import QDebugError

F32_EPS = 1.1920928955078125e-07  # 2**-23, float32 machine epsilon


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


# --------------------------------------------------------------------------- QuantSpec


def test_quant_spec_defaults():
    s = QuantSpec()
    assert s.bits == 8
    assert s.signed is True
    assert s.symmetric is True
    assert s.per_channel is False
    assert s.ch_axis == 0
    assert s.observer == "minmax"
    assert s.estimator == "clipped_ste"
    assert (s.qmin, s.qmax) == (-128, 127)
    assert s.dtype_name == "int8"
    assert s.learnable_scale is False


@pytest.mark.parametrize(
    "bits, signed, qmin, qmax",
    [
        (2, True, -2, 1),
        (2, False, 0, 3),
        (8, True, -128, 127),
        (8, False, 0, 255),
        (16, True, -32768, 32767),
        (16, False, 0, 65535),
    ],
)
def test_qmin_qmax_hand_values(bits, signed, qmin, qmax):
    s = QuantSpec(bits=bits, signed=signed)
    assert (s.qmin, s.qmax) == (qmin, qmax)


def test_qmin_qmax_every_width():
    for bits in range(2, 17):
        levels = 1 << bits  # 2**bits integer codes
        signed = QuantSpec(bits=bits, signed=True)
        unsigned = QuantSpec(bits=bits, signed=False)
        assert signed.qmin == -levels // 2 and signed.qmax == levels // 2 - 1
        assert unsigned.qmin == 0 and unsigned.qmax == levels - 1
        assert signed.qmax - signed.qmin + 1 == levels
        assert unsigned.dtype_name == f"uint{bits}" and signed.dtype_name == f"int{bits}"


def test_learnable_scale_estimators():
    assert {e for e in ("ste", "clipped_ste", "qte", "alpha_blend", "lsq") if QuantSpec(estimator=e).learnable_scale} == {
        "qte",
        "lsq",
    }


def test_describe():
    assert QuantSpec().describe() == "int8 sym per-tensor minmax"
    assert QuantSpec(bits=4, signed=False, symmetric=False, per_channel=True, ch_axis=1, observer="ema").describe() == (
        "uint4 affine per-channel(1) ema"
    )


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"bits": 1}, "bits"),
        ({"bits": 17}, "bits"),
        ({"bits": 0}, "bits"),
        ({"bits": True}, "bits"),
        ({"bits": 8.0}, "bits"),
        ({"bits": "8"}, "bits"),
        ({"observer": "max"}, "observer"),
        ({"estimator": "stee"}, "estimator"),
        ({"averaging_constant": 0}, "averaging_constant"),
        ({"averaging_constant": 0.0}, "averaging_constant"),
        ({"averaging_constant": 1.5}, "averaging_constant"),
        ({"percentile": 50}, "percentile"),
        ({"percentile": 100.5}, "percentile"),
        ({"bins": 8}, "bins"),
        ({"bins": True}, "bins"),
        ({"ch_axis": 1.0}, "ch_axis"),
        ({"ch_axis": True}, "ch_axis"),
        ({"signed": "false"}, "signed"),
        ({"symmetric": 0}, "symmetric"),
        ({"per_channel": "yes"}, "per_channel"),
    ],
)
def test_invalid_spec_raises_naming_the_problem(kwargs, word):
    with pytest.raises(QDebugError) as info:
        QuantSpec(**kwargs)
    assert word in str(info.value)
    # The same check runs through replace and from_dict (what a config file uses).
    with pytest.raises(QDebugError):
        QuantSpec().replace(**kwargs)
    with pytest.raises(QDebugError):
        QuantSpec.from_dict(kwargs)


def test_unknown_observer_and_estimator_messages_list_the_choices():
    with pytest.raises(QDebugError) as info:
        QuantSpec(observer="histogram")
    assert "'histogram'" in str(info.value)
    assert "minmax" in info.value.hint and "kl" in info.value.hint
    with pytest.raises(QDebugError) as info:
        QuantSpec(estimator="gumbel")
    assert "'gumbel'" in str(info.value)
    assert "lsq" in info.value.hint


def test_averaging_constant_one_is_valid():
    assert QuantSpec(averaging_constant=1.0).averaging_constant == 1.0
    assert QuantSpec(percentile=100).percentile == 100


def test_replace_and_from_dict_unknown_key():
    with pytest.raises(QDebugError) as info:
        QuantSpec().replace(bitz=4)
    assert "bitz" in str(info.value)
    assert "bits" in info.value.hint  # lists the valid keys
    with pytest.raises(QDebugError) as info:
        QuantSpec.from_dict({"bits": 4, "granularity": "channel"})
    assert "granularity" in str(info.value)
    with pytest.raises(QDebugError):
        QuantSpec.from_dict([("bits", 4)])


def test_replace_is_a_new_value():
    a = QuantSpec()
    b = a.replace(bits=4, symmetric=False)
    assert a.bits == 8 and a.symmetric is True
    assert b.bits == 4 and b.symmetric is False
    assert b == QuantSpec(bits=4, symmetric=False)
    with pytest.raises(Exception):
        a.bits = 4  # frozen


def test_quant_spec_round_trip():
    s = QuantSpec(bits=5, signed=False, symmetric=False, per_channel=True, ch_axis=-1, observer="kl", estimator="lsq")
    d = s.to_dict()
    assert d["bits"] == 5 and d["ch_axis"] == -1 and d["estimator"] == "lsq"
    assert QuantSpec.from_dict(json.loads(json.dumps(d))) == s
    assert QuantSpec.from_dict(None) == QuantSpec()
    assert QuantSpec.from_dict({}) == QuantSpec()


# --------------------------------------------------------------------------- QConfig


def test_qconfig_defaults():
    q = QConfig()
    w, a = q.weight, q.activation
    assert (w.bits, w.signed, w.symmetric, w.per_channel, w.ch_axis, w.observer) == (8, True, True, True, 0, "minmax")
    assert (a.bits, a.signed, a.symmetric, a.per_channel, a.observer) == (8, True, False, False, "minmax")
    assert (w.qmin, w.qmax, a.qmin, a.qmax) == (-128, 127, -128, 127)
    assert dict(q.overrides) == {}
    # With no overrides every point gets the defaults.
    assert q.spec_for("weight", ("conv1", "conv1.weight")) == w
    assert q.spec_for("activation", ("conv1", "conv1.out")) == a


def _rich_qconfig() -> QConfig:
    return QConfig(
        weight=QuantSpec(bits=4, per_channel=True, ch_axis=0, estimator="lsq"),
        activation=QuantSpec(bits=8, signed=False, symmetric=False, observer="ema", averaging_constant=0.1),
        overrides={
            "backbone.*": {"weight": {"bits": 6}, "activation": {"observer": "percentile", "percentile": 99.9}},
            "head.fc": {"weight": None},
            "*.downsample.*": {"activation": None},
        },
    )


def test_qconfig_round_trip_through_json():
    q = _rich_qconfig()
    text = json.dumps(q.to_dict())
    back = QConfig.from_dict(json.loads(text))
    assert back == q
    assert back.to_dict() == q.to_dict()
    # And the defaults.
    assert QConfig.from_dict(json.loads(json.dumps(QConfig().to_dict()))) == QConfig()
    assert QConfig.from_dict(None) == QConfig()
    assert QConfig.from_dict({}) == QConfig()


def test_qconfig_from_partial_dict_fills_defaults():
    q = QConfig.from_dict({"weight": {"bits": 4}, "activation": {"signed": False}})
    # Partial tables apply over the *kind's* default, not over QuantSpec().
    assert q.weight == QuantSpec(bits=4, per_channel=True, ch_axis=0)
    assert q.activation == QuantSpec(signed=False, symmetric=False)


def test_qconfig_from_dict_unknown_top_level_key():
    with pytest.raises(QDebugError) as info:
        QConfig.from_dict({"weights": {"bits": 4}})
    assert "weights" in str(info.value)


def test_override_glob_by_module_path():
    q = QConfig(overrides={"backbone.*": {"weight": {"bits": 4}}})
    assert q.spec_for("weight", ("backbone.conv1", "backbone.conv1.weight")).bits == 4
    # fnmatch's * also crosses dots: nested modules match too.
    assert q.spec_for("weight", ("backbone.layer1.0.conv", None)).bits == 4
    assert q.spec_for("weight", ("head.fc", "head.fc.weight")) == q.weight
    # The glob is case-sensitive and anchored.
    assert q.spec_for("weight", ("Backbone.conv1",)) == q.weight
    assert q.spec_for("weight", ("model.backbone.conv1",)) == q.weight
    # Only the overridden kind changes; the rest of the spec is the default.
    w = q.spec_for("weight", ("backbone.conv1",))
    assert w == q.weight.replace(bits=4)
    assert q.spec_for("activation", ("backbone.conv1",)) == q.activation


def test_override_matches_the_point_name_too():
    q = QConfig(overrides={"*.out": {"activation": {"bits": 16}}})
    assert q.spec_for("activation", ("backbone.conv1", "backbone.conv1.out")).bits == 16
    assert q.spec_for("activation", ("backbone.conv1", "backbone.conv1.in")).bits == 8
    assert q.matching_globs(("backbone.conv1", "backbone.conv1.out")) == ["*.out"]


def test_later_globs_win():
    first = QConfig(overrides={"backbone.*": {"weight": {"bits": 4}}, "backbone.conv1": {"weight": {"bits": 6}}})
    assert first.spec_for("weight", ("backbone.conv1",)).bits == 6
    assert first.spec_for("weight", ("backbone.conv2",)).bits == 4
    reversed_ = QConfig(overrides={"backbone.conv1": {"weight": {"bits": 6}}, "backbone.*": {"weight": {"bits": 4}}})
    assert reversed_.spec_for("weight", ("backbone.conv1",)).bits == 4
    # A glob that does not mention a kind leaves the earlier result for it alone.
    q = QConfig(overrides={"a.*": {"weight": {"bits": 4}}, "a.b": {"activation": {"bits": 6}}})
    assert q.spec_for("weight", ("a.b",)).bits == 4
    assert q.spec_for("activation", ("a.b",)).bits == 6


def test_none_means_float_and_can_be_undone_later():
    q = QConfig(overrides={"head.*": {"activation": None}})
    assert q.spec_for("activation", ("head.fc",)) is None
    assert q.spec_for("weight", ("head.fc",)) == q.weight  # only the named kind is float
    assert q.spec_for("activation", ("body.fc",)) == q.activation
    q2 = QConfig(overrides={"head.*": {"weight": None}, "head.fc": {"weight": {"bits": 4}}})
    assert q2.spec_for("weight", ("head.fc",)).bits == 4
    assert q2.spec_for("weight", ("head.proj",)) is None
    q3 = QConfig(overrides={"head.fc": {"weight": {"bits": 4}}, "head.*": {"weight": None}})
    assert q3.spec_for("weight", ("head.fc",)) is None


@pytest.mark.parametrize(
    "overrides, word",
    [
        ({"a.*": 4}, "a.*"),  # entry not a table
        ({"a.*": {"weights": {"bits": 4}}}, "weights"),  # unknown kind
        ({"a.*": {"weight": {"bitz": 4}}}, "bitz"),  # unknown spec key
        ({"a.*": {"weight": {"bits": 1}}}, "bits"),  # invalid value
        ({"a.*": {"activation": {"observer": "nope"}}}, "observer"),
        ({"a.*": {"weight": 8}}, "weight"),  # spec not a table
        ({"a.*": {"weight": "int4"}}, "weight"),
    ],
)
def test_invalid_override_content_raises(overrides, word):
    with pytest.raises(QDebugError) as info:
        QConfig(overrides=overrides)
    assert word in str(info.value)
    with pytest.raises(QDebugError):
        QConfig.from_dict({"overrides": overrides})


@pytest.mark.parametrize("data", [{"overrides": ["a.*"]}, {"weight": "int8"}, {"activation": 8}, ["weight"]])
def test_invalid_qconfig_shapes_raise(data):
    with pytest.raises(QDebugError):
        QConfig.from_dict(data)


def test_qconfig_rejects_non_spec_defaults():
    with pytest.raises(QDebugError):
        QConfig(weight={"bits": 4})
    with pytest.raises(QDebugError):
        QConfig(overrides=[("a", {})])


# --------------------------------------------------------------------------- qparams_from_range


def _qp(lo, hi, **spec):
    return qparams_from_range(f32(lo), f32(hi), QuantSpec(**spec))


def test_symmetric_signed_by_hand():
    # max|x| = 2 -> s = 2 / 127, z = 0
    s, z = _qp(-2.0, 1.0)
    assert s.dtype == torch.float32 and z.dtype == torch.int32
    assert s.shape == () and z.shape == ()
    assert torch.equal(s, f32(2.0) / 127)
    assert z.item() == 0
    s, z = _qp(-0.5, 3.0, bits=4)  # max|x| = 3, qmax 7
    assert torch.equal(s, f32(3.0) / 7)
    assert z.item() == 0


def test_symmetric_unsigned_by_hand():
    # unsigned symmetric: s = max / qmax, negatives saturate at 0
    s, z = _qp(-2.0, 1.0, signed=False)
    assert torch.equal(s, f32(1.0) / 255)
    assert z.item() == 0


def test_affine_signed_by_hand():
    # s = (3 - (-1)) / 255 = 4/255; -1 / s = -63.75 -> round -64; z = -128 - (-64) = -64
    s, z = _qp(-1.0, 3.0, symmetric=False)
    assert torch.equal(s, f32(4.0) / 255)
    assert z.item() == -64
    # 0 is exactly representable: fq(0) == 0.
    assert torch.fake_quantize_per_tensor_affine(torch.zeros(1), s, z, -128, 127).item() == 0.0


def test_affine_unsigned_by_hand():
    # s = 4/255, z = 0 - round(-63.75) = 64
    s, z = _qp(-1.0, 3.0, signed=False, symmetric=False)
    assert torch.equal(s, f32(4.0) / 255)
    assert z.item() == 64
    # 4-bit unsigned [-1, 2]: s = 3/15 = 0.2, -1/0.2 = -5 -> z = 5
    s, z = _qp(-1.0, 2.0, bits=4, signed=False, symmetric=False)
    assert torch.equal(s, f32(3.0) / 15)
    assert z.item() == 5


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8])
@pytest.mark.parametrize("lo, hi", [(-1.0, 3.0), (-0.37, 0.81), (-5.0, -2.0), (2.0, 5.0), (-100.0, 0.001), (0.0, 0.0)])
def test_affine_matches_torch_minmax_observer(dtype, lo, hi):
    obs = TorchMinMax(dtype=dtype, qscheme=torch.per_tensor_affine, eps=F32_EPS)
    obs(torch.tensor([lo, hi]))
    t_scale, t_zp = obs.calculate_qparams()
    s, z = _qp(lo, hi, signed=dtype == torch.qint8, symmetric=False)
    assert torch.equal(s, t_scale.reshape(()).float())
    assert z.item() == t_zp.item()


def test_range_not_containing_zero_is_widened():
    # [2, 5] -> [0, 5]
    s, z = _qp(2.0, 5.0, symmetric=False)
    assert torch.equal(s, f32(5.0) / 255)
    assert z.item() == -128  # -128 - round(0 / s)
    s, z = _qp(2.0, 5.0)
    assert torch.equal(s, f32(5.0) / 127)
    assert z.item() == 0
    # [-5, -2] -> [-5, 0]: -5 / (5/255) = -255 -> z = -128 + 255 = 127
    s, z = _qp(-5.0, -2.0, symmetric=False)
    assert torch.equal(s, f32(5.0) / 255)
    assert z.item() == 127
    # unsigned affine [2, 5] -> [0, 5], z = 0
    s, z = _qp(2.0, 5.0, signed=False, symmetric=False)
    assert torch.equal(s, f32(5.0) / 255)
    assert z.item() == 0


def test_constant_tensor():
    assert SCALE_EPS == F32_EPS
    for spec in ({}, {"symmetric": False}, {"signed": False}, {"signed": False, "symmetric": False}, {"bits": 16}):
        s, z = _qp(0.0, 0.0, **spec)
        assert s.item() == F32_EPS, spec
        q = QuantSpec(**spec)
        # zero point: symmetric 0, affine qmin - round(0) = qmin
        assert z.item() == (0 if q.symmetric else q.qmin), spec
    # A constant non-zero tensor: [3, 3] -> [0, 3]
    s, z = _qp(3.0, 3.0)
    assert torch.equal(s, f32(3.0) / 127)


@pytest.mark.parametrize(
    "lo, hi",
    [
        (float("inf"), float("-inf")),  # an observer that saw nothing
        (float("nan"), float("nan")),
        (float("-inf"), 1.0),
        (-1.0, float("inf")),
        (float("nan"), 2.0),
    ],
)
@pytest.mark.parametrize("symmetric", [True, False])
def test_non_finite_bounds(lo, hi, symmetric):
    s, z = _qp(lo, hi, symmetric=symmetric)
    assert s.item() == 1.0
    assert z.item() == 0


def test_per_channel_vectors():
    lo = f32([-2.0, 0.0, 2.0, -1.0, float("inf")])
    hi = f32([1.0, 0.0, 5.0, 3.0, float("-inf")])
    s, z = qparams_from_range(lo, hi, QuantSpec(per_channel=True))
    assert s.shape == (5,) and s.dtype == torch.float32 and z.dtype == torch.int32
    expected = torch.stack([f32(2.0) / 127, f32(F32_EPS), f32(5.0) / 127, f32(3.0) / 127, f32(1.0)])
    assert torch.equal(s, expected)
    assert z.tolist() == [0, 0, 0, 0, 0]

    s, z = qparams_from_range(lo, hi, QuantSpec(per_channel=True, symmetric=False))
    expected = torch.stack([f32(3.0) / 255, f32(F32_EPS), f32(5.0) / 255, f32(4.0) / 255, f32(1.0)])
    assert torch.equal(s, expected)
    # [-2,1]: -2/(3/255) = -170 -> z = 42;  [0,0]: -128;  [0,5]: -128;  [-1,3]: -64;  non-finite: 0
    assert z.tolist() == [42, -128, -128, -64, 0]


def test_per_channel_matches_torch_observer():
    torch.manual_seed(0)
    w = torch.randn(6, 10) * torch.tensor([0.01, 0.1, 1.0, 10.0, 3.0, 0.5]).reshape(6, 1)
    w[4] = w[4].abs() + 1.0  # one channel entirely positive
    obs = torch.ao.quantization.PerChannelMinMaxObserver(
        ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_affine, eps=F32_EPS
    )
    obs(w)
    t_scale, t_zp = obs.calculate_qparams()
    s, z = qparams_from_range(w.amin(dim=1), w.amax(dim=1), QuantSpec(per_channel=True, symmetric=False))
    assert torch.equal(s, t_scale.float())
    assert torch.equal(z.long(), t_zp.long())


def test_accepts_python_numbers():
    s, z = qparams_from_range(-1.0, 3.0, QuantSpec(symmetric=False))
    assert torch.equal(s, f32(4.0) / 255)
    assert z.item() == -64


@pytest.mark.parametrize("bins", [15, 65537, 10**9, True, 2048.0])
def test_histogram_bins_outside_16_to_65536_are_refused(bins):
    """A histogram holds channels x bins int64 counts: a file naming 10^9 bins would allocate
    8 GB per channel on the first batch."""
    with pytest.raises(QDebugError, match=r"bins=.* must be an integer in \[16, 65536\]"):
        QuantSpec(observer="kl", bins=bins)
    assert QuantSpec(observer="kl", bins=65536).bins == 65536


def test_narrow_range_drops_the_lowest_signed_code():
    spec = QuantSpec(bits=8, narrow_range=True)
    assert (spec.qmin, spec.qmax) == (-127, 127)
    assert spec.describe().startswith("int8[-127] sym")
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(QDebugError, match="narrow_range needs a signed range"):
        QuantSpec(signed=False, narrow_range=True)
