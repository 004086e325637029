"""``qdebug watch``: QAT steps with nan-trace's loop under ``qdebug.watch`` -- a healthy run exits 0
with no finding, a planted dead run exits 1 naming it, ``--out`` writes CSV/JSON/PNG and
TensorBoard event files holding the timeline's scalars (and, without tensorboard, the rest and
one line saying how to install it), and bad input is one error line."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
import torch

import qdebug
from test_qat_watch import EMA, batches, float_with_data_statistics, qat_model

pytestmark = pytest.mark.usefixtures("x86_engine_one_thread")  # small models: one thread is faster on shared cores


def save_data(path, data) -> None:
    torch.save((torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])), path)


@pytest.fixture(scope="module")
def healthy(make_resnet, tmp_path_factory):
    """The core's healthy run as checkpoints: EMA ranges from the first batch, BN kept (with_bn),
    batches of 32; the data's last batch is the held-out one."""
    d = tmp_path_factory.mktemp("watch_healthy")
    fm = float_with_data_statistics(make_resnet)
    qm = qat_model(fm, EMA, mode="with_bn", observe=True)
    qdebug.save(fm, d / "float.pt", stage="float")
    qdebug.save(qm, d / "qat.pt", stage="qat")
    save_data(d / "train.pt", batches(13, 32, spread=1.0))
    return d


def test_a_healthy_run_exits_0_with_no_finding_and_writes_its_files(cli, healthy, tmp_path):
    r = cli("watch", healthy / "qat.pt", "--data", healthy / "train.pt", "--batch-size", 32, "--float",
            healthy / "float.pt", "--steps", 12, "--every", 2, "--lr", 0.01, "--out", "out")
    assert r.code == 0, (r.out, r.err)
    assert "no finding in 12 step(s) (looks every 2)" in r.out and "watch:" not in r.out
    assert "not measured" not in r.err  # the float model was given
    out = tmp_path / "out"
    data = json.loads((out / "watch.json").read_text())
    assert data["rows"] == [] and data["meta"]["held_out_batches"] == 1 and data["meta"]["batches"] == 12
    timeline = pd.read_csv(out / "timeline.csv")
    assert sorted(set(timeline.step)) == list(range(0, 12, 2)) and len(data["timeline"]) == len(timeline)
    assert set(timeline.kind) == {"point", "layer", "bn", "model"}
    sqnr = timeline.query("metric == 'output_sqnr_db'").value
    assert len(sqnr) == 6 and sqnr.iloc[0] > 20  # the held-out batch: at the start the QAT model is the float's
    assert pd.read_csv(out / "watch.csv").empty
    for name in ("watch_points.png", "watch_layers.png", "watch_bn.png", "watch_model.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"/".join(p for p in (k, n, m) if p) for k, n, m in zip(timeline.kind, timeline.name.fillna(""),
                                                                          timeline.metric)}
    assert tags == expected
    loss = events.Scalars("model/loss")
    want = timeline.query("metric == 'loss'")
    assert [e.step for e in loss] == list(want.step)
    assert [e.value for e in loss] == pytest.approx(list(want.value), rel=1e-6)


def test_a_huge_learning_rate_is_a_dead_run_exit_1(cli, make_resnet, tmp_path):
    """lr = 1e4 (the core's planted dead run): every value finite, the run dead from step 5."""
    qdebug.save(qat_model(make_resnet(0)), tmp_path / "qat.pt", stage="qat")
    save_data(tmp_path / "train.pt", batches(16, 32))
    r = cli("watch", "qat.pt", "--data", "train.pt", "--batch-size", 32, "--steps", 16, "--every", 5,
            "--lr", 1e4, "--format", "json")
    assert r.code == 1, (r.out, r.err)
    data = json.loads(r.out)
    assert [row["rule"] for row in data["rows"]] == ["dead_run"] and data["rows"][0]["from_step"] == 5
    assert data["meta"]["non_finite"] is None and "not measured" in r.err  # no float model: said on stderr
    grads = [t["value"] for t in data["timeline"] if t["metric"] == "grad_norm" and t["kind"] == "model"]
    assert grads[0] > 0 and all(g == 0 for g in grads[1:])
    table = cli("watch", "qat.pt", "--data", "train.pt", "--batch-size", 32, "--steps", 16, "--every", 5,
                "--lr", 1e4)
    assert table.code == 1 and "dead_run" in table.out and "1 finding(s) in 16 step(s) (looks every 5)" in table.out
    assert "fix, dead_run: restart" in table.out


def test_without_tensorboard_out_writes_the_rest_and_says_how_to_install_it(cli, stages, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails, as without the package
    r = cli("watch", stages.qat, "--data", stages.data, "--batch-size", 4, "--steps", 2, "--every", 1,
            "--out", "out")
    assert r.code in (0, 1), (r.out, r.err)
    assert 'pip install "qdebug[tensorboard]"' in r.err
    assert (tmp_path / "out" / "timeline.csv").exists() and (tmp_path / "out" / "watch_layers.png").exists()
    assert not (tmp_path / "out" / "tensorboard").exists()


@pytest.mark.parametrize("args, fragment", [
    (["{float}", "--steps", "2"], "expects a qat or calibrated checkpoint"),
    (["{qat}", "--steps", "2", "--every", "0"], "--every must be >= 1"),
    (["{qat}", "--steps", "0"], "--steps must be >= 1"),
    (["{qat}", "--steps", "2", "--held-out", "1"], "--held-out is for the output SQNR"),
    (["{qat}", "--steps", "2", "--float", "{calibrated}"], "is a calibrated checkpoint"),
])
def test_bad_input_is_one_error_line(cli, stages, args, fragment):
    paths = {"float": stages.float, "qat": stages.qat, "calibrated": stages.calibrated}
    r = cli("watch", *[a.format(**paths) for a in args], "--data", stages.data, "--batch-size", 4)
    r.assert_error(fragment)
