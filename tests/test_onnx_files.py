"""Reading ONNX files (qdebug.onnx.model_file) and naming their tensors (qdebug.onnx.names).

The graphs are torch's own exports and ONNX Runtime's own quantization of them (tests/onnx_helpers.py);
the expected rows are written out by hand from the models' forward code."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from onnx_helpers import onnx, ort_quantize, torch_export  # noqa: F401  (skips without the [onnx] extra)
from qdebug.engine import engine_state, prepare
from qdebug.errors import QDebugError
from qdebug.onnx.model_file import read_onnx, tensor_array
from qdebug.onnx.names import map_tensors


class Block(nn.Module):
    """A ResNet basic block with a second residual (a scaled add) and one ReLU module called twice."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y)) + x
        return self.relu(y * 0.5 + x)


class Net(nn.Module):
    """Two blocks, then inline ops at the root: a pooled feature, F.gelu (which the exporter writes as
    Div, Erf, Add, Mul, Mul), a real add, and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(Block(), Block())
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.layer1(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(F.gelu(x) + x)


def _net() -> Net:
    torch.manual_seed(0)
    net = Net().eval()
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    return net


def _plan(net: nn.Module, x: torch.Tensor):
    return engine_state(prepare(net, example_inputs=x)).plan


EXPECTED_ROWS = {
    "input": "input",
    # The exporter folds each BN into its conv: the conv's tensor is the BN's output.
    "/layer1/layer1.0/conv1/Conv_output_0": "layer1.0.bn1",
    "/layer1/layer1.0/relu/Relu_output_0": "layer1.0.relu",
    "/layer1/layer1.0/conv2/Conv_output_0": "layer1.0.bn2",
    "/layer1/layer1.0/Add_output_0": "layer1.0.add",
    "/layer1/layer1.0/Mul_output_0": "layer1.0.mul",
    "/layer1/layer1.0/Add_1_output_0": "layer1.0.add#2",
    "/layer1/layer1.0/relu_1/Relu_output_0": "layer1.0.relu#2",  # the module's second call
    "/layer1/layer1.1/conv1/Conv_output_0": "layer1.1.bn1",
    "/layer1/layer1.1/relu/Relu_output_0": "layer1.1.relu",
    "/layer1/layer1.1/conv2/Conv_output_0": "layer1.1.bn2",
    "/layer1/layer1.1/Add_output_0": "layer1.1.add",
    "/layer1/layer1.1/Mul_output_0": "layer1.1.mul",
    "/layer1/layer1.1/Add_1_output_0": "layer1.1.add#2",
    "/layer1/layer1.1/relu_1/Relu_output_0": "layer1.1.relu#2",
    "/GlobalAveragePool_output_0": "adaptive_avg_pool2d",
    "/Add_1_output_0": "add",  # the real add, not GELU's inner Add (/Add_output_0)
    "output": "fc",
}


def test_torch_export_tensors_map_to_the_calls_written_in_the_forward(tmp_path):
    net, x = _net(), torch.randn(2, 4, 8, 8)
    path = torch_export(net, x, tmp_path / "net.onnx")
    mapped = map_tensors(read_onnx(path), _plan(net, x), net)
    rows = dict(mapped.rows)
    gelu = rows.pop("/Mul_1_output_0", None)  # F.gelu: one call, five ONNX nodes -- its last is its output
    assert rows == EXPECTED_ROWS
    assert gelu in (None, "gelu")
    assert "/Add_output_0" not in mapped.rows  # GELU's inner Add reads no row: never taken for the add
    assert set(mapped.weights.values()) == {"layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1", "layer1.1.conv2",
                                            "fc"}


def test_onnx_runtime_quantized_names_follow_the_absorbed_activation(tmp_path):
    """ORT's quantize_static drops the Relu after a conv and names the conv's output after it: the
    tensor is the ReLU's row; the Q/DQ tensors it inserts are no rows of their own."""
    net, x = _net(), torch.randn(4, 4, 8, 8)
    quantized = ort_quantize(torch_export(net, x, tmp_path / "net.onnx"), tmp_path / "q.onnx", [x])
    model = read_onnx(quantized)
    mapped = map_tensors(model, _plan(net, x), net)
    assert mapped.rows["/layer1/layer1.0/relu/Relu_output_0"] == "layer1.0.relu"
    producer = {o: n for n in model.graph.node for o in n.output}
    assert producer["/layer1/layer1.0/relu/Relu_output_0"].op_type == "Conv"  # the Relu is gone
    # The block's last ReLU is absorbed into the add before it, whose output takes the ReLU's name.
    assert mapped.rows["/layer1/layer1.0/relu_1/Relu_output_0"] == "layer1.0.relu#2"
    assert producer["/layer1/layer1.0/relu_1/Relu_output_0"].op_type == "Add"
    assert mapped.rows["/layer1/layer1.0/Add_output_0"] == "layer1.0.add"
    assert not any(t.endswith(("_QuantizeLinear_Output", "_DequantizeLinear_Output")) for t in mapped.rows)
    # Weights are read through their DequantizeLinear: the layer each Conv/Gemm reads them in.
    assert sorted(set(mapped.weights.values())) == ["fc", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1",
                                                    "layer1.1.conv2"]
    assert all(producer[w].op_type == "DequantizeLinear" for w in mapped.weights)


def test_another_architecture_maps_nothing_and_says_why(tmp_path):
    net, x = _net(), torch.randn(2, 4, 8, 8)
    path = torch_export(net, x, tmp_path / "net.onnx")
    other = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()).eval()
    mapped = map_tensors(read_onnx(path), _plan(other, x), other)
    assert set(mapped.rows) <= {"input"}
    assert mapped.unmatched and all(why for _, why in mapped.unmatched)


# -- model_file: a file is data, and bad data is one error --------------------------------------------------


def _tiny(tmp_path, **save_options):
    from onnx import TensorProto, helper

    weight = helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "tiny.onnx"
    onnx.save(model, str(path), **save_options)
    return path, model


def test_a_valid_file_reads_and_its_tensors_convert(tmp_path):
    path, _ = _tiny(tmp_path)
    model = read_onnx(path)
    assert tensor_array(model.graph.initializer[0]).tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("content, says", [
    (b"", "is empty"),
    (b"\x00\xff not a protobuf at all \xff" * 10, "not an ONNX model"),
])
def test_not_a_model_is_one_error(tmp_path, content, says):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(QDebugError, match=says):
        read_onnx(path)


def test_truncated_and_missing_files_are_one_error(tmp_path):
    path, _ = _tiny(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(QDebugError):
        read_onnx(path)
    with pytest.raises(QDebugError, match="no such file"):
        read_onnx(tmp_path / "absent.onnx")
    with pytest.raises(QDebugError, match="not a regular file"):
        read_onnx(tmp_path)


def test_external_data_is_refused_never_followed(tmp_path):
    """A tensor whose bytes the file says live elsewhere -- here outside the folder -- is refused
    before anything is read from there."""
    from onnx import TensorProto

    _, model = _tiny(tmp_path)
    tensor = model.graph.initializer[0]
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../../../etc/passwd"
    path = tmp_path / "external.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(QDebugError, match="external data"):
        read_onnx(path)


def test_an_invalid_graph_fails_the_checker(tmp_path):
    _, model = _tiny(tmp_path)
    model.graph.node[0].input[0] = "nowhere"
    path = tmp_path / "invalid.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(QDebugError, match="not a valid ONNX model"):
        read_onnx(path)


def test_a_tensor_declaring_more_values_than_it_holds_is_not_allocated():
    from onnx import TensorProto, helper

    huge = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])  # helper checks; a file need not
    huge.ClearField("dims")
    huge.dims.extend([10**6, 10**6])
    with pytest.raises(QDebugError, match="declares shape"):
        tensor_array(huge)
    raw = helper.make_tensor("r", TensorProto.INT8, [2], b"\x01\x02", raw=True)
    raw.ClearField("dims")
    raw.dims.append(10**9)
    with pytest.raises(QDebugError, match="holds 2"):
        tensor_array(raw)


# -- the names are right by value: a mapped tensor of the float export IS its call's output -----------------


def _real_network(name: str):
    """A real architecture's own code (not qdebug's zoo), (model, channels, size): SAME padding,
    depthwise convs with BN, hard-swish, squeeze-excite, channel split and shuffle, residual adds."""
    import vision_libraries
    from small_models import SMALL_SHUFFLENETV2
    from qdebug.zoo.shufflenetv2 import ShuffleNetV2

    torch.manual_seed(0)
    if name.startswith("timm"):
        return vision_libraries.timm().create_model(name.split()[1], num_classes=10), 3, 48
    if name.startswith("torchvision"):
        return getattr(vision_libraries.torchvision().models, name.split()[1])(num_classes=10), 3, 48
    return ShuffleNetV2(**SMALL_SHUFFLENETV2), 1, 16


@pytest.mark.parametrize("name", ["timm tf_mobilenetv3_small_minimal_100 (SAME padding)", "timm mobilenetv3_small_050",
                                  "torchvision mobilenet_v2", "torchvision resnet18", "qdebug shufflenetv2"])
def test_every_point_of_a_real_network_gets_the_tensor_holding_its_value(tmp_path, name):
    from qdebug.measure.tap import Capture, tap

    net, channels, size = _real_network(name)
    net.eval()
    for module in net.modules():  # BN statistics far from (0, 1): a fold that went wrong shows
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2)
    x = torch.randn(2, channels, size, size)
    path = torch_export(net, x, tmp_path / "net.onnx")
    model = read_onnx(path)
    plan = _plan(net, x)
    mapped = map_tensors(model, plan, net)
    assert mapped.unmatched == []
    points = {c.name for c in plan.calls.values() if c.point}
    assert points <= set(mapped.rows.values())  # every quantized value has its tensor
    # ORT runs the export with every mapped tensor as an output; torch's float model is captured.
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t) for t in mapped.rows)
    from onnx_helpers import ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip(mapped.rows, session.run(None, {"input": x.numpy()})))
    capture = Capture(keep_inputs=False)
    with tap(net, capture), torch.no_grad():
        net(x)
    for tensor, row in mapped.rows.items():
        expected = capture.records[row].output
        expected = expected if isinstance(expected, torch.Tensor) else expected[0]
        got = torch.from_numpy(values[tensor]).reshape(expected.shape)
        assert torch.allclose(got, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()) + 1e-5), (row, tensor)
