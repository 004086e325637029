"""suggest's plan written back for the torch.ao flow an imported model came from (issue 29 item 10).

The oracle is torch itself: the generated config (the Python module, exec'd; and the JSON, read
here independently) re-prepares the float model with torch's own ``prepare``/``prepare_fx``,
torch's observers calibrate on the same batches, and the re-import must have 16-bit points
exactly where the plan says, every other point bit-identical to the first import, and the output
SQNR the engine measures for the plan with the int16 ranges torch's observers chose.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import qdebug
from qdebug.engine import engine_state
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao
from qdebug.tools.experiment import Experiment, Trial
from qdebug.tools.plan_torch_ao import check_imported, json_document, python_source, torch_ao_plan
from qdebug.tools.suggest import candidates, plan_changes
from small_models import INTEROP_ZOO, interop_zoo, randomize_bn

tq = pytest.importorskip("torch.ao.quantization")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")

# A plan picked directly: a weight, an activation (a BN output torch observes, the engine's point
# on the ReLU after it), a layer's weight and output both, and a point torch leaves in float.
EAGER_PLAN = {"layer1.0.conv1": {"weight": {"bits": 16}}, "layer1.0.relu": {"activation": {"bits": 16}},
              "layer2.0.conv2": {"activation": {"bits": 16}, "weight": {"bits": 16}},
              "layer2.0.relu#2": {"activation": {"bits": 16}}}
# FX: weights are expressible, an activation is not (FX's one activation qconfig per node).
FX_PLAN = {"layer1.0.conv1": {"weight": {"bits": 16}}, "layer2.0.conv2": {"weight": {"bits": 16}},
           "layer1.0.relu": {"activation": {"bits": 16}}}


def _float_and_batches():
    torch.manual_seed(0)
    model = randomize_bn(interop_zoo()["resnet"](), 1).eval()
    return model, [torch.randn(4, 3, 16, 16) for _ in range(3)]


def _observed(prepared, batches):
    with torch.no_grad():
        for x in batches:
            prepared(x)
    return prepared


def _eager_ptq(model, batches, plan_qconfigs=None):
    model = copy.deepcopy(model).eval()
    model.qconfig = tq.get_default_qconfig("x86")
    if plan_qconfigs is not None:
        plan_qconfigs(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _observed(tq.prepare(model), batches)


def _fx_ptq(model, batches, mapping=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = quantize_fx.prepare_fx(copy.deepcopy(model).eval(), mapping or tq.get_default_qconfig_mapping("x86"),
                                          (batches[0],))
    return _observed(prepared, batches)


def _wider(factory, row):
    return factory.with_args(dtype=getattr(torch, row["dtype"].removeprefix("torch.")), quant_min=row["quant_min"],
                             quant_max=row["quant_max"], reduce_range=False)


def _per_module(doc):
    out = {}
    for row in doc["rows"]:
        if row["expressible"]:
            out.setdefault(row["module_name"], {})[row["tensor"]] = row
    return out


def _sqnr(model, batches, reference, changes=None, qparams=None):
    experiment = Experiment(model, batches, reference=reference)
    trial = Trial(frozenset(experiment.quantizable), {}, changes or {}, qparams or {})
    return experiment.run([trial])[0].worst_sqnr_db


def _check_round_trip(first, again, changes, float_model, batches):
    """``again`` (torch re-prepared from the plan) has 16 bits exactly at ``changes``, every other
    point bit-identical to ``first``; the engine's plan with torch's int16 ranges gives its SQNR."""
    before, after = engine_state(first).points, engine_state(again).points
    assert set(before) == set(after)
    assert {n for n, p in after.items() if p.spec.bits == 16} == set(changes)
    for name, point in before.items():
        if name not in changes:
            assert point.spec == after[name].spec, name
            assert torch.equal(point.scale, after[name].scale), name
            assert torch.equal(point.zero_point, after[name].zero_point), name
    measured = _sqnr(again, batches, float_model)
    planned = _sqnr(first, batches, float_model, changes)
    # The plan raised the imported points from their int8 grid (the import holds no torch observer
    # statistics); torch's int16 observers chose their own ranges on the data. With those ranges
    # the engine's plan is torch's model exactly (an unsigned engine grid: the same zero point + 32768).
    widened = copy.deepcopy(first)
    from qdebug.engine.respec import raise_bits

    points = engine_state(widened).points
    raise_bits(widened, changes, points).saved.clear()
    torch_ranges = {n: (after[n].scale.clone(), after[n].zero_point + (points[n].spec.qmin - after[n].spec.qmin))
                    for n in changes}
    assert _sqnr(first, batches, float_model, changes, torch_ranges) == measured
    assert abs(measured - planned) < 0.5, (measured, planned)
    return measured, planned


def test_eager_plan_goes_back_to_prepare_and_imports_as_planned():
    float_model, batches = _float_and_batches()
    first = from_torch_ao(_eager_ptq(float_model, batches), batches[0])
    frame = torch_ao_plan(first, EAGER_PLAN)
    assert frame.attrs["meta"]["flow"] == "eager" and frame.attrs["meta"]["qat"] is False
    rows = {(r.point, r.tensor): r for r in frame.itertuples()}
    # torch observes layer1.0.bn1's output; the engine's point is the ReLU after it.
    assert rows[("layer1.0.relu", "activation")].module_name == "layer1.0.bn1"
    float_row = rows[("layer2.0.relu#2", "activation")]
    assert not float_row.expressible and "no torch quantizer" in float_row.reason
    source = python_source(frame)
    assert "#   layer2.0.relu#2 (activation): torch quantizes nothing here" in source
    namespace: dict = {}
    exec(compile(source, "plan_torch_ao.py", "exec"), namespace)  # our own generated module
    again = from_torch_ao(_eager_ptq(float_model, batches, namespace["apply_qconfigs"]), batches[0])
    chosen = [c for c in candidates(first, list(engine_state(first).points), 16)
              if (c.glob, c.kind) in {("layer1.0.conv1", "weight"), ("layer1.0.relu", "activation"),
                                       ("layer2.0.conv2", "activation"), ("layer2.0.conv2", "weight")}]
    changes = plan_changes(chosen, 16)
    assert len(changes) == 4
    _check_round_trip(first, again, changes, float_model, batches)
    # The JSON, read by hand as a user would: the same model.
    doc = json.loads(json_document(frame))
    base = tq.get_default_qconfig("x86")

    def from_json(model):
        for path, tensors in _per_module(doc).items():
            act = _wider(base.activation, tensors["activation"]) if "activation" in tensors else base.activation
            weight = _wider(base.weight, tensors["weight"]) if "weight" in tensors else base.weight
            model.get_submodule(path).qconfig = tq.QConfig(activation=act, weight=weight)

    by_json = from_torch_ao(_eager_ptq(float_model, batches, from_json), batches[0])
    for name, point in engine_state(again).points.items():
        other = engine_state(by_json).points[name]
        assert point.spec == other.spec and torch.equal(point.scale, other.scale), name


def test_eager_qat_plan_gives_int16_fake_quants():
    float_model, batches = _float_and_batches()
    from small_models import torch_ao_qat

    first = from_torch_ao(torch_ao_qat(copy.deepcopy(float_model), batches[:1]), batches[0])
    frame = torch_ao_plan(first, EAGER_PLAN)
    assert frame.attrs["meta"]["qat"] is True
    namespace: dict = {}
    exec(compile(python_source(frame), "plan_torch_ao.py", "exec"), namespace)
    model = copy.deepcopy(float_model).train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    namespace["apply_qconfigs"](model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare_qat(model)
    prepared(batches[0])
    prepared.apply(tq.disable_observer)
    again = from_torch_ao(prepared.eval(), batches[0])
    sixteen = {n for n, p in engine_state(again).points.items() if p.spec.bits == 16}
    assert sixteen == {"layer1.0.conv1.weight", "layer1.0.relu", "layer2.0.conv2", "layer2.0.conv2.weight"}


def test_fx_plan_goes_back_to_prepare_fx_and_imports_as_planned():
    float_model, batches = _float_and_batches()
    first = from_torch_ao(_fx_ptq(float_model, batches), batches[0], float_model=copy.deepcopy(float_model))
    frame = torch_ao_plan(first, FX_PLAN)
    assert frame.attrs["meta"]["flow"] == "fx"
    relu = frame[frame["point"] == "layer1.0.relu"].iloc[0]
    assert not relu["expressible"] and "one activation qconfig for its inputs and its output" in relu["reason"]
    source = python_source(frame)
    namespace: dict = {}
    exec(compile(source, "plan_torch_ao.py", "exec"), namespace)
    again = from_torch_ao(_fx_ptq(float_model, batches, namespace["qconfig_mapping"]()), batches[0],
                          float_model=copy.deepcopy(float_model))
    changes = {"layer1.0.conv1.weight": {"bits": 16}, "layer2.0.conv2.weight": {"bits": 16}}
    _check_round_trip(first, again, changes, float_model, batches)
    # prepare_qat_fx from the same module, QAT's defaults: the layers' weight fake quants are int16.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat = quantize_fx.prepare_qat_fx(copy.deepcopy(float_model).train(), namespace["qconfig_mapping"](qat=True),
                                         (batches[0],))
    assert qat.get_submodule("layer1.0.conv1").weight_fake_quant.quant_min == -32768
    assert qat.get_submodule("layer1.0.conv2").weight_fake_quant.quant_min == -128
    # The JSON, read by hand as a user would: the same model.
    doc = json.loads(json_document(frame))
    mapping = tq.get_default_qconfig_mapping("x86")
    base = mapping.global_qconfig
    for path, tensors in _per_module(doc).items():
        mapping.set_module_name(path, tq.QConfig(activation=base.activation, weight=_wider(base.weight,
                                                                                          tensors["weight"])))
    by_json = from_torch_ao(_fx_ptq(float_model, batches, mapping), batches[0],
                            float_model=copy.deepcopy(float_model))
    for name, point in engine_state(again).points.items():
        other = engine_state(by_json).points[name]
        assert point.spec == other.spec and torch.equal(point.scale, other.scale), name


def _pt2e_ptq(model, batches, quantizer):
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    graph = torch.export.export(copy.deepcopy(model).eval(), (batches[0],), strict=True).module()
    return _observed(prepare_pt2e(graph, quantizer), batches)


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning", "ignore:XNNPACKQuantizer is deprecated")
def test_pt2e_plan_goes_back_to_the_quantizer_and_imports_as_planned():
    pytest.importorskip("torchao", reason="PT2E lives in torchao: pip install 'qdebug[torchao]'")
    from qdebug.interop.pt2e import import_torchao
    from qdebug.zoo import ResNet
    from small_models import randomize_bn

    import_torchao()  # quietly
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    torch.manual_seed(0)
    # the x86 quantizer refuses interop_zoo's resnet (a conv partition with two outputs): qdebug's own
    float_model = randomize_bn(ResNet(layers=[1, 1], widths=[8, 16], num_classes=10, stem="small"), 1).eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    config = get_default_x86_inductor_quantization_config()
    first = from_torch_ao(_pt2e_ptq(float_model, batches, X86InductorQuantizer().set_global(config)), batches[0],
                          float_model=copy.deepcopy(float_model))
    frame = torch_ao_plan(first, FX_PLAN)
    assert frame.attrs["meta"]["flow"] == "pt2e" and frame.attrs["meta"]["qat"] is False
    relu = frame[frame["point"] == "layer1.0.relu"].iloc[0]
    assert not relu["expressible"] and "PT2E quantizer gives a module's nodes one config" in relu["reason"]
    namespace: dict = {}
    exec(compile(python_source(frame), "plan_torch_ao.py", "exec"), namespace)  # our own generated module
    assert namespace["LAYERS"] == ["layer1.0.conv1", "layer2.0.conv2"]
    quantizer = namespace["PlanQuantizer"](X86InductorQuantizer().set_global(config))
    again = from_torch_ao(_pt2e_ptq(float_model, batches, quantizer), batches[0],
                          float_model=copy.deepcopy(float_model))
    changes = {"layer1.0.conv1.weight": {"bits": 16}, "layer2.0.conv2.weight": {"bits": 16}}
    _check_round_trip(first, again, changes, float_model, batches)
    # XNNPACK's quantizer, QAT (conv-BN folded after annotation): the plan's weights get int16 fake quants.
    xnn = get_symmetric_quantization_config(is_per_channel=True, is_qat=True)
    graph = torch.export.export(copy.deepcopy(float_model).train(), (batches[0],), strict=True).module()
    prepared = prepare_qat_pt2e(graph, namespace["PlanQuantizer"](XNNPACKQuantizer().set_global(xnn)))
    prepared(batches[0])
    pt2e = import_torchao()
    pt2e.move_exported_model_to_eval(prepared)
    prepared.apply(pt2e.disable_observer)
    qat = from_torch_ao(prepared, batches[0], float_model=copy.deepcopy(float_model))
    assert {n for n, p in engine_state(qat).points.items() if p.spec.bits == 16} == set(changes)
    doc = json.loads(json_document(frame))
    assert doc["meta"]["flow"] == "pt2e" and "annotations" in doc["meta"]["base"]
    assert [r["module_name"] for r in doc["rows"] if r["expressible"]] == ["layer1.0.conv1", "layer2.0.conv2"]


def test_a_native_checkpoint_or_another_flow_is_refused():
    from qdebug.engine import QConfig, prepare
    from qdebug.interop.build import FLOW_ATTR

    float_model, batches = _float_and_batches()
    with pytest.raises(QDebugError, match="needs a model imported from torch.ao"):
        check_imported(prepare(copy.deepcopy(float_model), QConfig(), example_inputs=batches[0]))
    first = from_torch_ao(_eager_ptq(float_model, batches), batches[0])
    setattr(engine_state(first), FLOW_ATTR, "onnx")
    with pytest.raises(QDebugError, match="imported from onnx"):
        torch_ao_plan(first, EAGER_PLAN)


def test_cli_writes_the_torch_ao_plan(cli, tmp_path):
    float_model, batches = _float_and_batches()
    spec = {"model_spec": "qdebug.zoo.resnet:ResNet", "model_kwargs": INTEROP_ZOO["resnet"],
            "sample_inputs": batches[0]}
    first = from_torch_ao(_eager_ptq(float_model, batches), batches[0])
    qdebug.save(float_model, tmp_path / "float.pt", stage="float", **spec)
    qdebug.save(first, tmp_path / "ptq.pt", stage="calibrated", **spec)
    torch.save(torch.cat(batches), tmp_path / "eval.pt")
    args = [tmp_path / "float.pt", tmp_path / "ptq.pt", "--data", tmp_path / "eval.pt", "--batch-size", 4]
    base = json.loads(cli("suggest", *args, "--min-sqnr", 10, "--format", "json").out)["plan"]["before"]["sqnr_db"]
    result = cli("suggest", *args, "--min-sqnr", round(base + 1, 1), "--to", "torch-ao", "--out", tmp_path / "out",
                 "--format", "json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert {"plan_torch_ao.py", "plan_torch_ao.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    doc = json.loads((tmp_path / "out" / "plan_torch_ao.json").read_text())
    assert doc["meta"]["flow"] == "eager" and doc["rows"] == data["torch_ao"]["rows"]
    assert {r["point"] for r in doc["rows"]} == set(data["plan"]["points"])
    cli("suggest", *args, "--to", "torch-ao").assert_error("add --out DIR")
    cli("suggest", *args, "--to", "onnx", "--out", tmp_path / "o2").assert_error("--to 'onnx'")
    from qdebug.engine import QConfig, calibrate, prepare

    native = prepare(copy.deepcopy(float_model), QConfig(), example_inputs=batches[0])
    calibrate(native, batches)
    qdebug.save(native, tmp_path / "native.pt", stage="calibrated", **spec)
    cli("suggest", tmp_path / "float.pt", tmp_path / "native.pt", "--data", tmp_path / "eval.pt", "--to", "torch-ao",
        "--out", tmp_path / "o3").assert_error("needs a model imported from torch.ao")


class TwiceNet(torch.nn.Module):
    """One conv called twice: eager mode gives both calls one activation_post_process."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.fc = torch.nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(self.conv(self.conv(x)).mean((2, 3)))


def test_a_quantizer_shared_by_two_calls_is_raised_for_both_or_not_at_all():
    torch.manual_seed(0)
    batches = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    imported = from_torch_ao(_eager_ptq(TwiceNet(), batches), batches[0])
    both = torch_ao_plan(imported, {"conv": {"activation": {"bits": 16}}}).iloc[0]
    assert both["expressible"] and both["module_name"] == "conv" and both["engine_points"] == "conv, conv#2"
    alone = torch_ao_plan(imported, {"conv#2": {"activation": {"bits": 16}}}).iloc[0]
    assert not alone["expressible"] and alone["module_name"] == ""
    assert alone["reason"] == ("torch's quantizer conv.activation_post_process also serves conv, which the plan "
                               "leaves at its width")
    grouped = torch_ao_plan(imported, {"fc": {"weight": {"group_size": 2}}}).iloc[0]
    assert not grouped["expressible"] and "no grouped weights" in grouped["reason"]


def test_names_with_quotes_and_newlines_stay_names_in_the_python():
    import pandas as pd

    from qdebug.tools.plan_torch_ao import COLUMNS

    odd = "blocks.a'b\"\nc"
    rows = [{"point": f"{odd}.weight", "tensor": "weight", "module_name": odd, "source": "", "dtype": "torch.int16",
             "quant_min": -32768, "quant_max": 32767, "expressible": True, "reason": "", "engine_points": ""},
            {"point": f"x\nimport os  # {odd}", "tensor": "activation", "module_name": "", "source": "",
             "dtype": "torch.int16", "quant_min": -32768, "quant_max": 32767, "expressible": False,
             "reason": "why\nos.system('x')", "engine_points": ""}]
    for flow in ("eager", "fx"):
        frame = pd.DataFrame(rows, columns=COLUMNS)
        frame.attrs["meta"] = {"flow": flow, "qat": False, "bits": 16, "dtype": "torch.int16", "quant_min": -32768,
                               "quant_max": 32767, "expressible": 1, "not_expressible": 1}
        namespace: dict = {}
        exec(compile(python_source(frame), "plan_torch_ao.py", "exec"), namespace)
        assert "os" not in namespace
        if flow == "eager":
            assert list(namespace["qconfigs"]()) == [odd]
        else:
            assert list(namespace["qconfig_mapping"]().module_name_qconfigs) == [odd]
        assert json.loads(json_document(frame))["rows"][0]["module_name"] == odd
