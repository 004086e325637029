"""``--data`` specs (qdebug.data) and metrics (qdebug.data.metrics)."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn as nn

from qdebug.data.batch import Batch
from qdebug.data.spec import load_batches
from qdebug.errors import QDebugError
from qdebug.data.metrics import agreement, metric_direction, mse, resolve_metric, run_metric, top1, top5


def _ramp(n, c=1, hw=2):
    return torch.arange(n * c * hw * hw, dtype=torch.float32).reshape(n, c, hw, hw)


# -- data ------------------------------------------------------------------------------------
def test_tensor_file_is_split_into_batches(tmp_path):
    x = _ramp(10)
    torch.save(x, tmp_path / "x.pt")
    batches = load_batches(str(tmp_path / "x.pt"), batch_size=4)
    assert [b.size() for b in batches] == [4, 4, 2]
    assert all(b.target is None for b in batches)
    assert torch.equal(torch.cat([b.inputs for b in batches]), x)
    assert len(load_batches(str(tmp_path / "x.pt"), batch_size=4, batches=2)) == 2


def test_tuple_file(tmp_path):
    x, y = _ramp(5), torch.arange(5)
    torch.save((x, y), tmp_path / "xy.pt")
    batches = load_batches(str(tmp_path / "xy.pt"), batch_size=2)
    assert [b.target.tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert torch.equal(batches[1].inputs, x[2:4])


@pytest.mark.parametrize("keys", [("inputs", "targets"), ("x", "y"), ("images", "labels")])
def test_dict_file(tmp_path, keys):
    x, y = _ramp(6), torch.arange(6)
    torch.save({keys[0]: x, keys[1]: y, "classes": ["a", "b"]}, tmp_path / "d.pt")
    batches = load_batches(str(tmp_path / "d.pt"), batch_size=4)
    assert len(batches) == 2
    assert torch.equal(batches[0].inputs, x[:4]) and torch.equal(batches[1].target, y[4:])


def test_dict_file_with_multitask_targets(tmp_path):
    x = _ramp(4)
    torch.save({"inputs": x, "targets": {"cls": torch.arange(4), "aux": torch.tensor([0, 1, 0, 1])}}, tmp_path / "d.pt")
    batches = load_batches(str(tmp_path / "d.pt"), batch_size=3)
    assert batches[0].target["cls"].tolist() == [0, 1, 2] and batches[1].target["aux"].tolist() == [1]


def test_uint8_inputs_are_decoded_with_scale_and_offset(tmp_path):
    codes = torch.tensor([0, 1, 128, 255], dtype=torch.uint8).reshape(4, 1, 1, 1)
    torch.save({"inputs": codes, "targets": torch.arange(4), "input_scale": 0.5, "input_offset": -1.0}, tmp_path / "u.pt")
    (batch,) = load_batches(str(tmp_path / "u.pt"), batch_size=8)
    assert batch.inputs.dtype == torch.float32
    assert batch.inputs.flatten().tolist() == [-1.0, -0.5, 63.0, 126.5]
    # per-channel scale/offset tensors broadcast too
    codes = torch.full((2, 3, 1, 1), 10, dtype=torch.uint8)
    torch.save({"inputs": codes, "input_scale": torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1),
                "input_offset": torch.tensor([0.0, 1.0, 2.0]).reshape(3, 1, 1)}, tmp_path / "c.pt")
    (batch,) = load_batches(str(tmp_path / "c.pt"))
    assert batch.inputs[0].flatten().tolist() == [10.0, 21.0, 32.0]


def test_half_inputs_are_upcast(tmp_path):
    x = torch.randn(3, 1, 4, 4).half()
    torch.save({"inputs": x}, tmp_path / "h.pt")
    (batch,) = load_batches(str(tmp_path / "h.pt"))
    assert batch.inputs.dtype == torch.float32 and torch.equal(batch.inputs, x.float())


def test_list_of_batches(tmp_path):
    a, b = _ramp(2), _ramp(3)
    torch.save([a, (b, torch.tensor([1, 2, 3])), {"x": a}], tmp_path / "l.pt")
    batches = load_batches(str(tmp_path / "l.pt"), batch_size=1)  # ready batches are not re-cut
    assert len(batches) == 3
    assert torch.equal(batches[0].inputs, a) and batches[0].target is None
    assert torch.equal(batches[1].inputs, b) and batches[1].target.tolist() == [1, 2, 3]
    assert isinstance(batches[2].inputs, dict)
    assert len(load_batches(str(tmp_path / "l.pt"), batches=2)) == 2


def test_function_spec(tmp_path, monkeypatch):
    name = f"qdebug_test_data_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def batches():\n"
        "    for i in range(3):\n"
        "        yield torch.full((2, 1, 4, 4), float(i)), torch.tensor([i, i])\n"
        "def broken():\n"
        "    raise ValueError('no dataset here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    batches = load_batches(f"{name}:batches")
    assert [float(b.inputs[0, 0, 0, 0]) for b in batches] == [0.0, 1.0, 2.0]
    assert batches[2].target.tolist() == [2, 2]
    assert len(list(load_batches(f"{name}:batches", batches=1))) == 1  # a generator's count is known after a pass
    with pytest.raises(QDebugError, match="ValueError: no dataset here"):
        load_batches(f"{name}:broken")
    with pytest.raises(QDebugError):
        load_batches(f"{name}:missing_function")


def test_random_spec_is_seeded():
    a = load_batches("random:2x1x16x16")
    b = load_batches("random:2x1x16x16")
    c = load_batches("random:2x1x16x16:seed=1")
    assert len(a) == 4 and a[0].inputs.shape == (2, 1, 16, 16) and a[0].target is None
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b))
    assert not torch.equal(a[0].inputs, c[0].inputs)
    assert not torch.equal(a[0].inputs, a[1].inputs)  # batches differ from each other
    assert len(load_batches("random:2x1x16x16", batches=2)) == 2
    assert torch.equal(load_batches("random:2x1x16x16", batches=2)[1].inputs, a[1].inputs)


@pytest.mark.parametrize("spec", ["random:2xAx3", "random:", "nonsense", "random:2x3:seed=x"])
def test_bad_specs(spec):
    with pytest.raises(QDebugError):
        load_batches(spec)


def test_bad_files_and_limits(tmp_path):
    with pytest.raises(QDebugError, match="no such file"):
        load_batches(str(tmp_path / "missing.pt"))
    torch.save({"weights": torch.ones(3)}, tmp_path / "w.pt")
    with pytest.raises(QDebugError, match="not data qdebug understands"):
        load_batches(str(tmp_path / "w.pt"))
    torch.save((torch.ones(4, 2), torch.ones(3)), tmp_path / "mis.pt")
    with pytest.raises(QDebugError, match="4 inputs but 3 targets"):
        load_batches(str(tmp_path / "mis.pt"))
    torch.save([], tmp_path / "empty.pt")
    with pytest.raises(QDebugError, match="no batches"):
        load_batches(str(tmp_path / "empty.pt"))
    with pytest.raises(QDebugError, match="--batches"):
        load_batches("random:2x2", batches=0)


# -- metrics ---------------------------------------------------------------------------------
class Fixed(nn.Module):
    """Returns the logits stored for each batch, looked up by the batch's first value."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = outputs

    def forward(self, x):
        return self.outputs[int(x.flatten()[0])]


def _logit_batches():
    # batch 0: sample 0 -> class 2 (target 2: right), sample 1 -> class 0 (target 1: wrong, 1 is 2nd best)
    # batch 1: sample 0 -> class 3 (target 4: wrong, 4 is the worst)
    logits = {
        0: torch.tensor([[0.1, 0.2, 3.0, 0.0, -1.0, -2.0], [5.0, 4.0, 1.0, 0.0, -1.0, -2.0]]),
        1: torch.tensor([[0.5, 0.4, 0.3, 0.9, -9.0, 0.2]]),
    }
    batches = [Batch(torch.zeros(2, 1), torch.tensor([2, 1])), Batch(torch.ones(1, 1), torch.tensor([4]))]
    return Fixed(logits), batches


def test_top1_top5_by_hand():
    model, batches = _logit_batches()
    assert top1(model, batches) == pytest.approx(1 / 3)
    assert top5(model, batches) == pytest.approx(2 / 3)  # the 4 is 6th of 6 in the last sample
    assert run_metric(resolve_metric("top5"), model, batches) == {"metric": pytest.approx(2 / 3)}


def test_topk_needs_targets():
    model, batches = _logit_batches()
    with pytest.raises(QDebugError, match="needs targets"):
        top1(model, [Batch(b.inputs) for b in batches])


def test_multitask_top1_gives_one_value_per_task():
    from qdebug.zoo import MultiTaskNet

    torch.manual_seed(0)
    net = MultiTaskNet(num_classes=5, num_aux_classes=2, in_channels=1, width=4).eval()
    x = torch.randn(6, 1, 16, 16)
    with torch.no_grad():
        out = net(x)
    cls_t = out["cls"].argmax(-1).clone()
    cls_t[:2] = (cls_t[:2] + 1) % 5  # 4 of 6 right
    aux_t = out["aux"].argmax(-1)  # all right
    batches = [Batch(x[:3], {"cls": cls_t[:3], "aux": aux_t[:3]}), Batch(x[3:], {"cls": cls_t[3:], "aux": aux_t[3:]})]
    result = run_metric(top1, net, batches)
    assert result == {"cls": pytest.approx(4 / 6), "aux": 1.0}
    with pytest.raises(QDebugError, match="several outputs"):
        top1(net, [Batch(x, cls_t)])


def test_agreement_with_reference():
    model, batches = _logit_batches()
    flipped = {k: -v for k, v in model.outputs.items()}  # arg-max of -logits: 5, 5, 4
    ref = Fixed({0: model.outputs[0].clone(), 1: torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])})
    assert run_metric(agreement, model, batches, reference=ref) == {"metric": 1.0}
    assert run_metric(agreement, model, batches, reference=Fixed(flipped)) == {"metric": 0.0}
    half = Fixed({0: torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]),
                  1: model.outputs[1]})
    assert agreement(model, batches, reference=half) == pytest.approx(2 / 3)
    with pytest.raises(QDebugError, match="reference"):
        run_metric(agreement, model, batches)


def test_mse():
    model = nn.Identity()
    batches = [Batch(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]])), Batch(torch.tensor([[3.0]]), torch.tensor([[0.0]]))]
    assert mse(model, batches) == pytest.approx((0 + 4 + 9) / 3)
    assert metric_direction(mse) == "lower" and metric_direction(top1) == "higher"


def test_run_metric_normalises_and_validates():
    model, batches = _logit_batches()
    assert run_metric(lambda m, b: 3, model, batches) == {"metric": 3.0}
    assert run_metric(lambda m, b: torch.tensor(0.25), model, batches) == {"metric": 0.25}
    assert run_metric(lambda m, b: {"a": 1, "b": torch.tensor(0.5)}, model, batches) == {"a": 1.0, "b": 0.5}
    for bad in ("0.9", None, [0.9], True, {}, {"a": "x"}, torch.ones(3)):
        with pytest.raises(QDebugError, match="returned"):
            run_metric(lambda m, b, bad=bad: bad, model, batches)


def test_run_metric_turns_exceptions_into_qdebug_errors():
    model, batches = _logit_batches()
    model.train()

    def exploding(m, b):
        raise ZeroDivisionError("division by zero in my metric")

    with pytest.raises(QDebugError) as exc:
        run_metric(exploding, model, batches)
    assert "exploding" in exc.value.message and "ZeroDivisionError" in exc.value.message
    assert isinstance(exc.value.__cause__, ZeroDivisionError)
    assert model.training  # the train/eval mode is restored even on failure

    seen = []
    run_metric(lambda m, b: seen.append(m.training) or 1.0, model, batches)
    assert seen == [False] and model.training


def test_resolve_metric_by_name_and_spec(tmp_path, monkeypatch):
    assert resolve_metric("top1") is top1
    assert resolve_metric("qdebug.data.metrics:mse") is mse
    name = f"qdebug_test_metric_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def score(model, batches):\n    return {'x': 0.5}\nvalue = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_metric(f"{name}:score")
    assert run_metric(fn, nn.Identity(), []) == {"x": 0.5}
    with pytest.raises(QDebugError, match="not callable"):
        resolve_metric(f"{name}:value")


# -- metrics and data as users write them ------------------------------------------------------
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from user_project import clean_imports  # noqa: E402

USUAL_METRIC = """\
import torch


def evaluate(model, loader):
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    return correct / total


def broken(model, loader):
    for x, y, z in loader:
        pass
    return 1.0
"""


@pytest.fixture
def project(tmp_path):
    """tmp_path as the user's project; nothing imported from it outlives the test."""
    with clean_imports(tmp_path):
        yield tmp_path


def _without_cwd_on_path(monkeypatch, folder):
    """sys.path as the installed console script has it: neither '' nor the project folder."""
    keep = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != Path(folder).resolve()]
    monkeypatch.setattr(sys, "path", keep)


def test_batch_unpacks_as_inputs_and_target():
    x, y = torch.randn(3, 2), torch.tensor([0, 1, 1])
    inputs, target = Batch(x, y)
    assert inputs is x and target is y
    assert Batch(x, y).inputs is x and Batch(x, y).target is y and Batch(x).target is None
    assert Batch(x).size() == 3 and len(Batch(x, y)) == 2


def test_for_x_y_in_batches_of_a_data_file(tmp_path):
    x, y = _ramp(5), torch.tensor([4, 3, 2, 1, 0])
    torch.save((x, y), tmp_path / "xy.pt")
    seen_x, seen_y = [], []
    for inputs, target in load_batches(str(tmp_path / "xy.pt"), batch_size=2):
        seen_x.append(inputs)
        seen_y.append(target)
    assert [t.tolist() for t in seen_y] == [[4, 3], [2, 1], [0]]
    assert torch.equal(torch.cat(seen_x), x)


def test_a_usual_pytorch_metric_runs_through_baseline_found_from_the_cwd(cli, stages, project, monkeypatch):
    (project / "my_metrics.py").write_text(USUAL_METRIC)
    _without_cwd_on_path(monkeypatch, project)
    assert "my_metrics" not in sys.modules
    result = cli("baseline", stages.float, stages.quantized, "--data", stages.data, "--metric",
                 "my_metrics:evaluate", "--json")
    assert result.code in (0, 1), result.err
    (row,) = json.loads(result.out)["rows"]
    x, y = torch.load(stages.data)  # the same 12 samples, scored here by hand
    with torch.no_grad():
        expected = {s: float((stages.models[s](x).argmax(-1) == y).double().mean()) for s in ("float", "quantized")}
    assert row["task"] == "evaluate"
    assert row["float"] == pytest.approx(expected["float"]) and row["quantized"] == pytest.approx(expected["quantized"])


def test_a_data_function_is_found_from_the_cwd(project, monkeypatch):
    (project / "my_data.py").write_text(
        "import torch\n"
        "def batches():\n"
        "    return [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(3)]\n"
    )
    monkeypatch.chdir(project)
    _without_cwd_on_path(monkeypatch, project)
    batches = load_batches("my_data:batches")
    assert [b.target.tolist() for b in batches] == [[0, 0], [1, 1], [2, 2]]
    assert float(batches[2].inputs[1, 2]) == 2.0


def test_a_metric_that_raises_shows_its_own_line_and_the_protocol(cli, stages, project, monkeypatch):
    (project / "my_metrics.py").write_text(USUAL_METRIC)
    _without_cwd_on_path(monkeypatch, project)
    result = cli("baseline", stages.float, stages.quantized, "--data", stages.data, "--metric", "my_metrics:broken")
    line = USUAL_METRIC.splitlines().index("    for x, y, z in loader:") + 1
    result.assert_error("metric broken raised ValueError: not enough values to unpack",
                        f"at my_metrics.py:{line} (for x, y, z in loader:)",
                        "metric(model, batches)", "each batch unpacks as (inputs, target)", ".inputs / batch.target",
                        "return", "a number or a dict task -> number", "--debug")
    assert "shape" not in result.err


def test_a_metric_whose_model_fails_names_both_lines(cli, stages, project, monkeypatch):
    (project / "my_metrics.py").write_text(USUAL_METRIC)
    _without_cwd_on_path(monkeypatch, project)
    result = cli("baseline", stages.float, stages.quantized, "--data", "random:2x3x16x16", "--metric",
                 "my_metrics:evaluate")
    line = USUAL_METRIC.splitlines().index("            correct += int((model(x).argmax(-1) == y).sum())") + 1
    result.assert_error("RuntimeError", f"at my_metrics.py:{line}", "the model failed on the data",
                        "(inputs, target)")


def test_a_failing_user_model_is_named_with_the_metric_line_that_called_it(project, monkeypatch):
    from user_project import write_package

    write_package(project)
    (project / "my_metrics.py").write_text(USUAL_METRIC)
    monkeypatch.chdir(project)
    _without_cwd_on_path(monkeypatch, project)
    net = resolve_metric("mypkg.net:Net")(width=4)  # a spec the user names: found from the cwd
    metric = resolve_metric("my_metrics:evaluate")
    with pytest.raises(QDebugError) as exc:
        run_metric(metric, net, [Batch(torch.randn(2, 5), torch.tensor([0, 1]))])  # 5 features, the model takes 4
    net_line = (project / "mypkg" / "net.py").read_text().splitlines().index("        return self.fc(x)") + 1
    metric_line = USUAL_METRIC.splitlines().index("            correct += int((model(x).argmax(-1) == y).sum())") + 1
    assert f"at mypkg/net.py:{net_line} (return self.fc(x))" in exc.value.message
    assert f"called from my_metrics.py:{metric_line}" in exc.value.message
    assert "the model failed on the data" in exc.value.hint


def test_run_metric_names_the_raising_line_of_a_metric_defined_here():
    model, batches = _logit_batches()

    def unpacks_three(m, loader):
        for a, b, c in loader:  # a Batch is (inputs, target): two values
            pass

    with pytest.raises(QDebugError) as exc:
        run_metric(unpacks_three, model, batches)
    import inspect

    lines, first = inspect.getsourcelines(unpacks_three)
    line = first + next(i for i, text in enumerate(lines) if "for a, b, c" in text)
    assert f"test_data_metrics.py:{line}" in exc.value.message
    assert "(inputs, target)" in exc.value.hint and "shape" not in exc.value.hint
