"""Every ``next:`` line runs as printed (issue 30 item 4).

step's, compare's and suggest's ``next:`` commands carry every option the run needed to load
its model and data (``--model`` and ``--model-kwargs`` for a factory, ``--unsafe-load``,
``--data``, ``--batches``, ``--batch-size``, ``--device``, the ``--config`` file): each test
pastes the printed command -- split as a shell splits it (shlex) -- into the CLI and asserts it
is no usage or input error (exit 2).  The checkpoints name a factory of the user's package
(``nxtpkg.net:make``), which qdebug calls only when the user names it: a command that dropped
``--model`` is refused, as the first test shows.
"""

from __future__ import annotations

import shlex

import pytest
import torch

import qdebug
from qdebug.engine import QConfig, calibrate, prepare

from user_project import clean_imports, forget, user_module

# Linear layers with orthogonal weights keep the signal's norm, so every layer's quantization
# noise weighs about the same at the output: at one width the loss builds up over all of them.
CHAIN = """\
import torch
import torch.nn as nn


class Chain(nn.Module):
    def __init__(self, width=16, layers=6):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


def make(width=16, layers=6):
    torch.manual_seed(0)
    model = Chain(width, layers)
    for layer in model.blocks:
        nn.init.orthogonal_(layer.weight)
        nn.init.zeros_(layer.bias)
    return model.eval()
"""
FACTORY = ["--model", "nxtpkg.net:make", "--model-kwargs", '{"width": 16}']


@pytest.fixture
def project(tmp_path):
    """The user's package ``nxtpkg`` (a factory ``make``), its float checkpoint, two calibrated
    ones -- ``spread.pt`` (every block's weights at 6 bits: the loss builds up) and ``blame.pt``
    (block 3's at 3 bits: one layer to blame) -- and ``data.pt``, whose targets are the float
    model's own classes (float top-1 = 1)."""
    with clean_imports(tmp_path):
        user_module(tmp_path, "nxtpkg", "net", CHAIN)
        from nxtpkg.net import make

        float_model = make(16)
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.save((x, float_model(x).argmax(-1)), tmp_path / "data.pt")
        six = {f"blocks.{i}": {"weight": {"bits": 6}} for i in range(6)}
        for name, overrides in (("spread", six), ("blame", {**six, "blocks.3": {"weight": {"bits": 3}}})):
            model = prepare(make(16), QConfig.from_dict({"overrides": overrides}), example_inputs=x)
            calibrate(model, [x])
            qdebug.save(model, tmp_path / f"{name}.pt", stage="calibrated", model_spec="nxtpkg.net:make",
                        model_kwargs={"width": 16}, sample_inputs=x[:4])
        qdebug.save(float_model, tmp_path / "float.pt", stage="float", model_spec="nxtpkg.net:make",
                    model_kwargs={"width": 16}, sample_inputs=x[:4])
        yield tmp_path
        forget("nxtpkg")  # a later test's nxtpkg is its own


def next_commands(out: str) -> list[list[str]]:
    """The command under each ``next:`` line, split as a shell splits it."""
    lines = out.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("next:"):
            assert lines[i + 1].startswith("  qdebug "), lines[i + 1]
            found.append(shlex.split(lines[i + 1]))
    return found


def run_next(cli, result) -> tuple[list[str], object]:
    """Paste ``result``'s one ``next:`` command: (its words, what running it gave), exit 2 refused."""
    assert result.code in (0, 1), result.err
    commands = next_commands(result.out)
    assert len(commands) == 1, result.out
    words = commands[0]
    assert words[0] == "qdebug", words
    ran = cli(*words[1:])
    assert ran.code != 2, (words, ran.err)
    assert "Traceback" not in ran.err, ran.err
    return words, ran


def without(words: list[str], *flags: str) -> list[str]:
    """``words`` less each of ``flags`` and the value after it."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            kept.append(word)
    return kept


def has(words: list[str], *options: str) -> bool:
    """Whether ``words`` hold ``options`` in a row (a flag and its value)."""
    n = len(options)
    return any(words[i:i + n] == list(options) for i in range(len(words) - n + 1))


def test_the_drill_next_suggest_and_its_next_lines_run_with_the_factory_model(cli, project):
    """step --drill -> suggest -> suggest --apply -> baseline: each pasted as printed."""
    step = cli("step", "float.pt", "blame.pt", "--drill", "--metric", "top1", "--data", "data.pt",
               "--batch-size", "16", "--device", "cpu", *FACTORY)
    assert "costs the most: blocks.3.weight" in step.out, step.out
    words, suggest = run_next(cli, step)
    assert words[1] == "suggest" and has(words, "float.pt", "blame.pt")
    for option in (("--metric", "top1"), ("--data", "data.pt"), ("--batch-size", "16"), ("--device", "cpu"),
                   ("--model", "nxtpkg.net:make"), ("--model-kwargs", '{"width": 16}')):
        assert has(words, *option), (option, words)
    # The same command without --model: what the line printed before, refused for the factory.
    cli(*without(words, "--model", "--model-kwargs")[1:]).assert_error("nxtpkg.net:make", "pass --model")
    words, applied = run_next(cli, suggest)
    assert has(words, "--apply", "-o", "fixed.pt") and has(words, "--model", "nxtpkg.net:make"), words
    assert (project / "fixed.pt").is_file()
    words, gate = run_next(cli, applied)
    assert words[1:4] == ["baseline", "float.pt", "fixed.pt"] and has(words, "--metric", "top1"), words
    assert has(words, "--model-kwargs", '{"width": 16}') and has(words, "--data", "data.pt"), words
    assert "pass" in gate.out or "fail" in gate.out, gate.out


def test_without_a_float_checkpoint_the_fixed_one_is_checked_by_step(cli, project):
    """suggest on the checkpoint alone (its own float run the reference): no FLOAT file for
    baseline, so the check is step's first row -- the fixed checkpoint against its float run."""
    applied = cli("suggest", "blame.pt", "--metric", "top1", "--ratio", "0.95", "--data", "data.pt", "--apply",
                  "-o", "fixed.pt", *FACTORY)
    words, check = run_next(cli, applied)
    assert words[1:3] == ["step", "fixed.pt"] and has(words, "--ratio", "0.95"), words
    assert has(words, "--model", "nxtpkg.net:make") and "FLOAT.pt" not in words, words
    assert "all quantized:" in check.out, check.out


def test_the_auto_next_drills_with_the_same_model_and_data(cli, project):
    result = cli("step", "float.pt", "blame.pt", "--auto", "--depth", "2", "--data", "data.pt", "--batches", "1",
                 "--kind", "weight", *FACTORY)
    words, drill = run_next(cli, result)
    assert words[1:4] == ["step", "float.pt", "blame.pt"] and has(words, "--drill", "--module", "blocks.3"), words
    assert has(words, "--batches", "1") and has(words, "--kind", "weight"), words
    assert drill.code == 0 and "costs the most: blocks.3.weight" in drill.out, drill.out


def test_no_single_culprit_points_to_suggest_and_that_runs(cli, project):
    result = cli("step", "float.pt", "spread.pt", "--drill", "--data", "data.pt", *FACTORY)
    assert "no single culprit: the loss builds up" in result.out, result.out
    assert "next: no single culprit: the smallest verified int16 set" in result.out
    words, _ = run_next(cli, result)
    assert words[1] == "suggest" and has(words, "--model", "nxtpkg.net:make"), words


def test_the_config_file_goes_with_the_next_command(cli, project):
    """A config named by --config (not found upward) that names the factory: without it the
    next command could not load the checkpoints."""
    (project / "my.toml").write_text('model = "nxtpkg.net:make"\nmodel_kwargs = {width = 16}\n')
    result = cli("--config", "my.toml", "step", "float.pt", "blame.pt", "--auto", "--data", "data.pt")
    words, _ = run_next(cli, result)
    assert words[:4] == ["qdebug", "--config", "my.toml", "step"], words
    assert "--model" not in words  # the config's model is read again, not copied
    cli(*without(words, "--config")[1:]).assert_error("nxtpkg.net:make", "pass --model")


def test_compare_next_lines_carry_the_model_and_run(cli, project):
    result = cli("compare", "float.pt", "blame.pt", "--data", "data.pt", "--batch-size", "16", *FACTORY)
    words, _ = run_next(cli, result)
    assert has(words, "--model", "nxtpkg.net:make") and has(words, "--model-kwargs", '{"width": 16}'), words
    assert has(words, "--data", "data.pt") and has(words, "--batch-size", "16"), words
    # Nothing flagged (thresholds no layer crosses), no --data: baseline on the checkpoint's sample
    # inputs, which have no targets -- agreement with the float model, not top-1.
    quiet = cli("compare", "float.pt", "blame.pt", "--threshold", "sqnr_db=-100", "--threshold",
                "isolated_sqnr_db=-100", *FACTORY)
    words, gate = run_next(cli, quiet)
    assert words[1] == "baseline" and has(words, "--metric", "agreement") and "--data" not in words, words
    assert has(words, "--model", "nxtpkg.net:make"), words
    assert "agreement" in gate.out, gate.out


def test_compare_against_a_calibrated_reference_offers_no_baseline(cli, project):
    """baseline gates a checkpoint against its float model and refuses any other order: with a
    calibrated reference and nothing flagged, no baseline command is offered at all."""
    quiet = cli("compare", "spread.pt", "blame.pt", "--threshold", "sqnr_db=-100", "--threshold",
                "isolated_sqnr_db=-100", "--data", "data.pt", *FACTORY)
    assert quiet.code == 0, quiet.err
    assert not [w for w in next_commands(quiet.out) if w[1] == "baseline"], quiet.out
    assert cli("baseline", "spread.pt", "blame.pt", "--data", "data.pt", *FACTORY).code == 2  # why


def test_command_lines_quote_what_a_shell_would_split(monkeypatch, tmp_path):
    from qdebug.cli.common import STATE, RunOptions, command_line, option_text

    monkeypatch.setattr(STATE, "config_path", tmp_path / "my config.toml")
    run = RunOptions(model="pkg.m:make", model_kwargs='{"width": 16, "name": "a b"}', unsafe_load=True,
                     device="cuda:0", data="my data.pt", batches=2)
    line = command_line("suggest", "float ckpt.pt", "q.pt") + run.text() + option_text([("--ratio", 0.98)])
    assert shlex.split(line) == [
        "qdebug", "--config", str(tmp_path / "my config.toml"), "suggest", "float ckpt.pt", "q.pt",
        "--data", "my data.pt", "--batches", "2", "--model", "pkg.m:make", "--model-kwargs",
        '{"width": 16, "name": "a b"}', "--unsafe-load", "--device", "cuda:0", "--ratio", "0.98"]
    # inspect takes no --batches / --batch-size: the data counts stay out when asked.
    assert "--batches" not in run.text(counts=False)
    monkeypatch.setattr(STATE, "config_path", None)
    assert command_line("inspect", "x.pt") == "qdebug inspect x.pt"
