"""Shared fixtures: a tiny ResNet (1x16x16 inputs) saved in all four stages, and an in-process CLI runner.

Fixtures (no helper imports needed in the test modules):

- ``make_resnet(seed=0, **kwargs)``: the small ResNet with non-trivial BN statistics, eval mode;
- ``images(n=4, seed=1)``: a seeded batch of 1x16x16 inputs;
- ``qat_steps(model, steps=2, seed=3)``: a few SGD steps in train mode, then eval;
- ``stages``: float / calibrated / qat / quantized checkpoint files (session scope, built once)
  plus a ``(X, y)`` data file and the in-memory models they were saved from;
- ``cli(*args)``: ``qdebug.cli.main`` run in-process in ``tmp_path``; returns code, out, err.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.engine import QConfig, calibrate, convert, prepare
from qdebug.io.modelspec import ModelSpec, build

from small_models import RESNET, SMALL_RESNET as SMALL, randomize_bn

# No plain progress line in a test's stderr unless the test asks for one (QDEBUG_PROGRESS_SECONDS):
# a command slowed by a loaded machine must still print exactly its error and hint.
os.environ.setdefault("QDEBUG_PROGRESS_SECONDS", "3600")


def pytest_addoption(parser):
    group = parser.getgroup("qdebug")
    group.addoption("--fuzz-minutes", type=float, default=0.0,
                    help="tests/test_fuzz.py: fuzz for this long with new seeds (default: the fixed CI cases)")
    group.addoption("--fuzz-seed", type=int, default=0, help="tests/test_fuzz.py: the first seed")


def _make_resnet(seed: int = 0, **overrides: Any) -> nn.Module:
    torch.manual_seed(seed)
    model = build(ModelSpec(RESNET, {**SMALL, **overrides}), from_user=True)
    randomize_bn(model, seed + 100)
    return model.eval()


def _images(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


def _qat_steps(model: nn.Module, steps: int = 2, seed: int = 3) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(steps):
        x = torch.randn(4, 1, 16, 16, generator=gen)
        y = torch.randint(0, 10, (4,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def x86_engine_one_thread():
    """torch's x86 quantized engine (what the x86 qconfigs are for), and one intra-op thread:
    the import tests' models are small, and two threads on two shared cores are many times
    slower.  A module takes it with ``pytestmark = pytest.mark.usefixtures(...)``."""
    engine, threads = torch.backends.quantized.engine, torch.get_num_threads()
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.backends.quantized.engine = engine


@pytest.fixture(scope="session")
def make_resnet():
    return _make_resnet


@pytest.fixture(scope="session")
def images():
    return _images


@pytest.fixture(scope="session")
def qat_steps():
    return _qat_steps


@dataclasses.dataclass
class Stages:
    dir: Path
    float: Path
    calibrated: Path
    qat: Path
    quantized: Path
    data: Path  # (X, y): 12 samples
    x: torch.Tensor  # the sample inputs stored in the checkpoints
    models: dict[str, nn.Module]
    spec: str = RESNET
    kwargs: dict = dataclasses.field(default_factory=lambda: dict(SMALL))

    def path(self, stage: str) -> Path:
        return getattr(self, stage)


@pytest.fixture(scope="session")
def stages(tmp_path_factory) -> Stages:
    d = tmp_path_factory.mktemp("stages")
    x = _images(4, seed=1)
    fp = _make_resnet(0)
    cal = prepare(fp, QConfig(), mode="fuse_bn", example_inputs=x)
    calibrate(cal, [_images(8, seed=s) for s in (10, 11)])
    qat = _qat_steps(copy.deepcopy(cal), steps=1)
    quant = convert(qat)
    models = {"float": fp, "calibrated": cal, "qat": qat, "quantized": quant}
    for stage, model in models.items():
        qdebug.save(model, d / f"{stage}.pt", stage=stage, sample_inputs=x)
    gen = torch.Generator().manual_seed(5)
    torch.save((torch.randn(12, 1, 16, 16, generator=gen), torch.randint(0, 10, (12,), generator=gen)), d / "data.pt")
    return Stages(d, d / "float.pt", d / "calibrated.pt", d / "qat.pt", d / "quantized.pt", d / "data.pt", x, models)


@dataclasses.dataclass
class CliResult:
    code: int
    out: str
    err: str

    def error_lines(self) -> list[str]:
        """stderr's lines, less the ``config: PATH`` line a command using a config starts with."""
        return [line for line in self.err.splitlines() if line.strip() and not line.startswith("config: ")]

    def assert_error(self, *fragments: str) -> str:
        """Exit 2, exactly one ``error:`` line (plus an optional ``hint:`` line), no traceback."""
        assert self.code == 2, (self.code, self.out, self.err)
        assert "Traceback" not in self.err, self.err
        lines = self.error_lines()
        assert 1 <= len(lines) <= 2, self.err
        assert lines[0].startswith("error: "), self.err
        assert "internal error" not in lines[0], self.err
        if len(lines) == 2:
            assert lines[1].startswith("hint: "), self.err
        for fragment in fragments:
            assert fragment in self.err, (fragment, self.err)
        return lines[0]


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """Run ``qdebug ARGS`` in-process with ``tmp_path`` as the working directory."""
    from qdebug.cli import main
    from qdebug.cli.common import console, reset_state

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(console, "_width", 250)  # wide tables: cells stay on one line (restored to None)

    def run(*args: Any) -> CliResult:
        reset_state()
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            reset_state()
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
