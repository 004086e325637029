"""A converted torch.ao model as a compare stage, run by torch's own kernels (qdebug.interop.torch_stage).

The oracle is torch itself: each tapped row must be, bit for bit, the dequantized output of the
torch module (or op) that computes it, hooked here independently of the stage; the row names
must be the float model's, written out by hand for each model; the end-to-end SQNR compare
gives the torch stage must be the one computed directly from torch's converted output and the
float model's output.
"""

from __future__ import annotations

import math

import pytest
import torch

import qdebug
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao
from qdebug.interop.torch_stage import PROPAGATED_ONLY, TorchStage
from small_models import module_io
from test_interop_converted import _batches, _eager, _fx

tq = pytest.importorskip("torch.ao.quantization")
pytestmark = [
    pytest.mark.usefixtures("x86_engine_one_thread"),  # tests/conftest.py
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning"),  # torch.save of quantized tensors
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]


# Row (the float model's call) -> the torch module whose output it is, written out by hand:
# a fused ConvReLU2d's output is its ReLU's row, a conv with its BN folded in is the BN's row,
# a QFunctional add_relu (its result passes its activation_post_process) the add's ReLU.
EAGER_ROWS = {
    "input": "quant", "relu": "conv", "block1.relu1": "block1.conv1", "block1.bn2": "block1.conv2",
    "block1.relu": "block1.skip.activation_post_process", "block2.relu1": "block2.conv1", "block2.bn2": "block2.conv2",
    "block2.downsample.1": "block2.downsample.0", "block2.relu": "block2.skip.activation_post_process",
    "pool": "pool", "fc": "fc",
}
# FX: module nodes by their module's path; add_relu is a graph op (checked against its inputs).
FX_ROWS = {
    "relu": "conv1", "layer1.0.relu": "layer1.0.conv1", "layer1.0.bn2": "layer1.0.conv2",
    "layer2.0.relu": "layer2.0.conv1", "layer2.0.bn2": "layer2.0.conv2",
    "layer2.0.downsample.1": "layer2.0.downsample.0", "avgpool": "avgpool", "fc": "fc",
}
FX_OPS = {"input", "layer1.0.relu#2", "layer2.0.relu#2"}  # a quantize op and the two add_relu ops


@pytest.fixture(scope="module", params=["eager", "fx"])
def case(request):
    float_model, converted = (_eager("resnet", False, True) if request.param == "eager"
                              else _fx("resnet", False, True))
    return request.param, float_model, converted, _batches(2, 21)


def _sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - y) ** 2).sum()))


def test_tapped_rows_are_torchs_module_outputs_bit_for_bit(case):
    flow, float_model, converted, batches = case
    stage = TorchStage(converted, float_model=float_model, example_inputs=batches[0])
    x = batches[1]
    taps = stage.tapped(x)
    expected = EAGER_ROWS if flow == "eager" else FX_ROWS
    assert set(taps) == set(expected) | (set() if flow == "eager" else FX_OPS)
    hooked = {path: out.dequantize() for path, (_, out) in module_io(converted, set(expected.values()), x).items()}
    for row, path in expected.items():
        assert torch.equal(taps[row], hooked[path]), row
    if flow == "fx":  # the graph ops: torch's own add_relu on the hooked inputs, the input's quantize
        ops = {n.name: n for n in converted.graph.nodes}
        scale, zero = converted.conv1_input_scale_0, converted.conv1_input_zero_point_0
        assert torch.equal(taps["input"], torch.quantize_per_tensor(x, scale, zero, torch.quint8).dequantize())
        hooked = {path: out for path, (_, out) in module_io(converted, ["layer1.0.conv2", "conv1"], x).items()}
        add = ops["add_relu"]
        assert str(add.args[0]) == "layer1_0_conv2" and str(add.args[1]) == "conv1"
        want = torch.ops.quantized.add_relu(hooked["layer1.0.conv2"], hooked["conv1"],
                                            float(converted.layer1_0_relu_scale_0),
                                            int(converted.layer1_0_relu_zero_point_0))
        assert torch.equal(taps["layer1.0.relu#2"], want.dequantize())
    # The stage's forward is torch's model: its output, dequantized.
    with torch.no_grad():
        out = converted(x)
    assert torch.equal(stage(x), out.dequantize() if out.is_quantized else out)


def test_compare_rows_for_torch_next_to_the_simulation(case):
    flow, float_model, converted, batches = case
    sim = from_torch_ao(converted, batches[0], float_model=float_model)
    frame = qdebug.compare(float_model, ("torch", converted), ("sim", sim), data=batches)
    expected = set(EAGER_ROWS if flow == "eager" else FX_ROWS) | (set() if flow == "eager" else FX_OPS)
    torch_rows = frame[frame["target"] == "torch"].set_index("layer")
    measured = set(torch_rows.index[torch_rows["note"] == ""])
    assert measured == expected
    # The same rows, in the same table, as qdebug's simulation of the model.
    sim_rows = frame[frame["target"] == "sim"].set_index("layer")
    assert measured == set(sim_rows.index[sim_rows["note"] == ""])
    assert torch_rows.loc[sorted(measured), "sqnr_db"].map(math.isfinite).all()
    assert torch_rows["isolated_sqnr_db"].isna().all()  # propagated error only, and said so
    assert frame.attrs["meta"]["propagated_only"] == {"torch": PROPAGATED_ONLY}
    assert f"torch: {PROPAGATED_ONLY}" in frame.attrs["summary"]
    # A folded conv and a fused ReLU's conv say where they are measured.
    folded = "block1.conv2" if flow == "eager" else "layer1.0.conv2"
    assert torch_rows.loc[folded, "note"].startswith("torch folded")
    fused = "block1.conv1" if flow == "eager" else "layer1.0.conv1"
    assert "compared at" in torch_rows.loc[fused, "note"]


def test_end_to_end_sqnr_is_torchs_own(case):
    _, float_model, converted, batches = case
    frame = qdebug.compare(float_model, ("torch", converted), data=batches)
    with torch.no_grad():
        ref = torch.cat([float_model(x) for x in batches])
        got = torch.cat([converted(x) for x in batches])
    row = frame[(frame["target"] == "torch") & (frame["layer"] == "fc")].iloc[0]
    # compare's statistics take x - y in float32 (then sum in float64): 1e-7 dB; the simulation is 0.05-0.2 dB off
    assert row["sqnr_db"] == pytest.approx(_sqnr(ref, got), abs=1e-5)


def test_pt2e_converted_output_row_is_torchs():
    pt2e = pytest.importorskip("test_interop_pt2e")
    float_model, _, converted, _ = pt2e._ptq(pt2e._resnet(), per_channel=False, strict=True)
    batches = [pt2e._batch(1), pt2e._batch(2)]
    frame = qdebug.compare(float_model, ("torch", converted), data=batches)
    with torch.no_grad():
        ref = torch.cat([float_model(b) for b in batches])
        got = torch.cat([converted(b) for b in batches])
    rows = frame.set_index("layer")
    # The last linear is float in convert_pt2e's graph: its row is the graph's output itself.
    assert rows.loc["fc", "sqnr_db"] == pytest.approx(_sqnr(ref, got), abs=1e-5)
    assert {"input", "relu", "layer1.0.relu#2", "avgpool"} <= set(rows.index[rows["note"] == ""])


def test_refusals(case):
    _, float_model, converted, batches = case
    with pytest.raises(QDebugError, match="runs a model torch.ao converted"):
        TorchStage(float_model)
    sim = from_torch_ao(converted, batches[0], float_model=float_model)
    with pytest.raises(QDebugError, match="reference is not one"):
        qdebug.compare(sim, converted, data=batches, ref=0)


def test_an_unlabelled_converted_model_is_a_torch_stage(case):
    _, float_model, converted, batches = case
    frame = qdebug.compare(float_model, converted, data=batches[:1])
    assert list(frame["target"].unique()) == ["model1"]
    assert frame.attrs["meta"]["propagated_only"] == {"model1": PROPAGATED_ONLY}


def test_a_converted_state_dict_is_rebuilt_by_torch_into_the_model_it_came_from(case, tmp_path):
    """What ``qdebug import`` and ``compare --torch-kernels`` read: the converted model's tensors
    alone, and torch converts the float model again (eager: fused as the keys say) to load them."""
    from qdebug.interop.state_dict import (
        is_converted_state,
        read_state_dict,
        rebuild_converted,
    )

    flow, float_model, converted, batches = case
    path = tmp_path / "converted_state.pt"
    torch.save(converted.state_dict(), path)
    state = read_state_dict(str(path))
    assert is_converted_state(state)
    rebuilt = rebuild_converted(state, float_model, batches[0], "x86", source=str(path))
    assert (rebuilt.flow, rebuilt.converted) == (flow, True)
    with torch.no_grad():
        for x in batches:
            assert torch.equal(rebuilt.prepared(x), converted(x))
