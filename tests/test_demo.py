"""The bundled demo: four stages of a trained model that load, run and score as recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.data.spec import load_batches
from qdebug.engine import engine_state
from qdebug.data.metrics import top1

DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "demo"
STAGES = ("float", "calibrated", "qat", "quantized")


@pytest.fixture(scope="module")
def eval_batches():
    return load_batches(str(DEMO / "eval.pt"), batch_size=500)


def test_eval_set_is_real_and_large_enough(eval_batches):
    n = sum(b.size() for b in eval_batches)
    assert n >= 2000
    labels = torch.cat([b.target for b in eval_batches])
    assert set(labels.tolist()) == set(range(10))  # all ten Fashion-MNIST classes
    x = eval_batches[0].inputs
    assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_loads_with_its_stage_and_scores_as_recorded(stage, eval_batches):
    recorded = json.loads((DEMO / "metrics.json").read_text())["top1"][stage]
    model, info = qdebug.load(DEMO / f"{stage}.pt")
    assert info.stage == stage
    assert info.sample_inputs is not None
    accuracy = top1(model, eval_batches)
    assert accuracy == pytest.approx(recorded, abs=0.005)
    assert accuracy > 0.85  # a really trained model, not a toy
    if stage != "float":
        assert engine_state(model).qat_mode == "with_bn_reverse_fold"


def test_quantized_stage_is_integer():
    model, _ = qdebug.load(DEMO / "quantized.pt")
    assert engine_state(model).stage == "quantized"
    assert any(k.endswith("weight_int") for k in model.state_dict())


def test_demo_fixtures_stay_small():
    total = sum(p.stat().st_size for p in DEMO.iterdir() if p.is_file())
    assert total < 5 * 2**20
