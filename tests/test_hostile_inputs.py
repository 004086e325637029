"""Hostile data, config and user code (issue 17, items 4, 5 and 7): every bad input is one
``error:`` line, a ``hint:`` line and exit 2 -- never an internal error, a traceback, a hang
or runaway memory -- and every option is checked before a model runs.

The ``cli`` fixture runs qdebug in-process (tests/conftest.py); the cases that need a real
process (an endless generator under an address-space limit, whether torch was imported)
run ``python -m qdebug``.  User modules are written into the working directory with
unique names, where qdebug finds them as ``python -m`` would.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.data import limits
from user_project import exit_before_torch

ADDRESS_SPACE = 8 << 30  # bytes: the endless generator's run must fit in it (as tests/fuzzing.py's worker)


def _module(tmp_path: Path, source: str) -> str:
    """A user module in the working directory, under a name no other test imported."""
    name = f"hostile_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text("import sys\nimport torch\n" + source)
    return name


def _python_m(*args, cwd: Path, timeout: float = 300, limit: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}

    def bounded():  # the child may not grow past ``limit`` bytes of address space
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-m", "qdebug", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, preexec_fn=bounded if limit else None)


def _assert_clean(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The error contract for a real process: exit 2, an ``error:`` line and a ``hint:`` line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)
    return lines[0]


def _baseline(stages, *args):
    return ("baseline", stages.float, stages.quantized, "--metric", "top1", *args)


# -- item 4: no hangs, bounded reads ---------------------------------------------------------
def test_endless_generator_is_consumed_only_up_to_batches(tmp_path, stages):
    name = _module(tmp_path, "def endless():\n    while True:\n        yield torch.randn(4, 1, 16, 16)\n")
    start = time.monotonic()
    proc = _python_m("compare", stages.float, stages.quantized, "--data", f"{name}:endless", "--batches", "2",
                     "--json", cwd=tmp_path, limit=ADDRESS_SPACE)
    assert time.monotonic() - start < 120
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["meta"]["batches"] == 2


def test_endless_generator_without_batches_is_refused(cli, tmp_path, stages, monkeypatch):
    # The data is read as the model runs (issue 18): the bound is met mid-pass, so it is lowered
    # here from 100000 batches of compare to 40.
    monkeypatch.setattr(limits, "MAX_BATCHES", 40)
    name = _module(tmp_path, "def endless():\n    while True:\n        yield torch.zeros(1, 1, 16, 16)\n")
    cli("compare", stages.float, stages.quantized, "--data", f"{name}:endless").assert_error(
        "yields more than 40 batches", "--batches")


def test_function_data_past_the_memory_limit_is_streamed(cli, tmp_path, stages, monkeypatch):
    # Batches are read one at a time and dropped (issue 18): data past what qdebug may hold is fine.
    monkeypatch.setattr(limits, "memory_limit", lambda: 256 << 10)
    name = _module(tmp_path, "def big():\n    for _ in range(6):\n        yield torch.zeros(64, 1, 16, 16)\n")
    result = cli("compare", stages.float, stages.quantized, "--data", f"{name}:big", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["batches"] == 6  # 384 KiB of batches through a 256 KiB limit


def test_random_spec_with_an_absurd_shape_names_the_limit(cli, stages):
    cli("compare", stages.float, stages.quantized, "--data", "random:99999x99999x99999").assert_error(
        "GiB qdebug may hold (half this machine's memory)", "smaller shape")


def test_random_spec_with_a_billion_batches_is_refused_at_once(cli, stages):
    start = time.monotonic()
    cli("compare", stages.float, stages.quantized, "--data", "random:2x1x16x16", "--batches", "1000000000") \
        .assert_error(f"at most {limits.MAX_BATCHES} batches")
    assert time.monotonic() - start < 10


def test_random_spec_with_a_seed_past_2_64(cli, stages):
    cli("compare", stages.float, stages.quantized, "--data", f"random:2x1x16x16:seed={2**64}").assert_error(
        "the seed of 'random:2x1x16x16:seed=18446744073709551616' must be from -2**63 to 2**64 - 1 "
        "(18446744073709551615)")


def test_random_spec_with_a_zero_dimension(cli, stages):
    cli("compare", stages.float, stages.quantized, "--data", "random:0x1x16x16").assert_error("dimension of 0")


def test_random_spec_with_5000_digits(cli, stages):
    cli("compare", stages.float, stages.quantized, "--data", "random:" + "9" * 5000).assert_error(
        "dimension of 10**19 or more")


def test_bad_random_spec_is_refused_before_torch_loads(tmp_path):
    out, err = exit_before_torch(["compare", "a.pt", "b.pt", "--data", "random:0x3"], tmp_path)
    assert out.split() == ["2", "False"], (out, err)
    assert "error: random data spec 'random:0x3' has a dimension of 0" in err


# -- item 5: every uncaught exception class becomes a clean error ----------------------------
def test_zero_d_tensor_as_a_data_file(cli, tmp_path, stages):
    torch.save(torch.tensor(1.0), tmp_path / "scalar.pt")
    cli(*_baseline(stages, "--data", "scalar.pt")).assert_error("the inputs are a 0-d tensor")


def test_zero_d_targets_in_a_data_file(cli, tmp_path, stages):
    torch.save((torch.randn(4, 1, 16, 16), torch.tensor(2)), tmp_path / "xy.pt")
    cli(*_baseline(stages, "--data", "xy.pt")).assert_error("the targets are a 0-d tensor (one number) for 4 input(s)")


def test_zero_d_task_target_in_a_data_file(cli, tmp_path, stages):
    torch.save({"inputs": torch.randn(4, 1, 16, 16), "targets": {"cls": torch.tensor(2)}}, tmp_path / "d.pt")
    cli(*_baseline(stages, "--data", "d.pt")).assert_error("the targets of 'cls' are a 0-d tensor")


def test_list_targets_in_a_data_file(cli, tmp_path, stages):
    torch.save({"inputs": torch.randn(4, 1, 16, 16), "targets": [1, 2, 3, 4]}, tmp_path / "d.pt")
    cli(*_baseline(stages, "--data", "d.pt")).assert_error("the targets are a list, not a tensor")


def test_input_scale_that_cannot_decode(cli, tmp_path, stages):
    torch.save({"inputs": torch.zeros(4, 1, 16, 16, dtype=torch.uint8), "input_scale": "x"}, tmp_path / "d.pt")
    cli("compare", stages.float, stages.quantized, "--data", "d.pt").assert_error(
        "input_scale/input_offset cannot decode the inputs")


def test_zero_d_batch_from_a_function(cli, tmp_path, stages):
    name = _module(tmp_path, "def scalars():\n    return [torch.tensor(1.0)]\n")
    cli(*_baseline(stages, "--data", f"{name}:scalars")).assert_error("a batch is a 0-d tensor")


def test_zero_d_target_from_a_function_is_no_false_verdict(cli, tmp_path, stages):
    """One class index for four predictions used to broadcast: top1 counted up to 4 right of 1."""
    name = _module(tmp_path, "def batches():\n    return [(torch.randn(4, 1, 16, 16), torch.tensor(3))]\n")
    cli(*_baseline(stages, "--data", f"{name}:batches")).assert_error("the targets hold 1 class index(es) for 4 "
                                                                     "prediction(s)")


def test_mse_targets_of_another_shape_do_not_broadcast(cli, tmp_path, stages):
    name = _module(tmp_path, "def batches():\n    return [(torch.randn(4, 1, 16, 16), torch.randn(4))]\n")
    cli("baseline", stages.float, stages.quantized, "--metric", "mse", "--data", f"{name}:batches").assert_error(
        "mse: the targets ([4]) do not match the model's output ([4, 10])")


def test_data_function_returning_a_number(cli, tmp_path, stages):
    name = _module(tmp_path, "def five():\n    return 5\n")
    cli(*_baseline(stages, "--data", f"{name}:five")).assert_error(f"data function {name}:five returned int")


def test_relative_module_name_as_model(cli, stages):
    cli("inspect", stages.float, "--model", ".rel:X").assert_error("'.rel' is not an importable module name")


def test_relative_module_name_as_data(cli, stages):
    cli("compare", stages.float, stages.quantized, "--data", ".rel:x").assert_error(
        "'.rel' is not an importable module name (in data function .rel:x)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text('device = "cuda"\n')
    cli("compare", stages.float, stages.quantized, "--data", "random:2x1x16x16").assert_error(
        "device 'cuda' cannot be used here", 'device = "cpu"')


def test_unknown_device_string(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text('device = "bogus"\n')
    cli("inspect", stages.float).assert_error("device 'bogus' cannot be used here")


def test_non_utf8_qdebug_toml(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_bytes(b'metric = "top1"\n# \xff\xfe\n')
    cli("inspect", stages.float).assert_error("qdebug.toml is not UTF-8 text (byte 18)",
                                              "save the config file as UTF-8")


def test_non_utf8_qconfig_file(cli, tmp_path, stages):
    (tmp_path / "q.toml").write_bytes(b'[weight]\nbits = "\xff"\n')
    cli("calibrate", stages.float, "--data", "random:2x1x16x16", "--qconfig", "q.toml", "-o", "c.pt").assert_error(
        "q.toml is not UTF-8 text")
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("text, kind", [("[1, 2]", "an array"), ("null", "null"), ("8", "a number")])
def test_qconfig_json_that_is_not_an_object(cli, tmp_path, stages, text, kind):
    (tmp_path / "q.json").write_text(text)
    cli("calibrate", stages.float, "--data", "random:2x1x16x16", "--qconfig", "q.json", "-o", "c.pt").assert_error(
        f"qconfig file q.json holds {kind}, not an object")


def test_deeply_nested_qconfig_json(cli, tmp_path, stages):
    (tmp_path / "q.json").write_text('{"weight": ' + "[" * 100_000 + "]" * 100_000 + "}")
    cli("calibrate", stages.float, "--data", "random:2x1x16x16", "--qconfig", "q.json", "-o", "c.pt").assert_error(
        "cannot parse qconfig file q.json")


def test_deeply_nested_qdebug_toml(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text("a = " + "[" * 100_000 + "\n")
    cli("inspect", stages.float).assert_error("is not valid TOML: nested too deeply")


def test_oversized_config_is_not_read_whole(cli, tmp_path, stages, monkeypatch):
    import qdebug.config.project

    monkeypatch.setattr(qdebug.config.project, "MAX_FILE_BYTES", 1 << 20)
    (tmp_path / "qdebug.toml").write_text("# padding\n" * 200_000)
    cli("inspect", stages.float).assert_error("qdebug.toml is larger than 1 MiB: not a config file")


def test_tool_qdebug_that_is_not_a_table(cli, tmp_path, stages):
    (tmp_path / "pyproject.toml").write_text("[tool]\nqdebug = 5\n")
    cli("inspect", stages.float).assert_error("pyproject.toml: tool.qdebug must be a table, got int", "[tool.qdebug]")


def test_tool_that_is_not_a_table_is_no_qdebug_config(cli, tmp_path, stages):
    (tmp_path / "pyproject.toml").write_text('tool = "qdebug"\n')
    result = cli("inspect", stages.float)
    assert result.code == 0, result.err


def test_model_that_asserts_on_its_input(cli, tmp_path, stages):
    model = _user_model(tmp_path, "assert x.shape[-1] == 4, 'expected 4 features'")
    cli("compare", model, model, "--data", "random:2x3").assert_error(
        "the model failed while comparing (input shape [2, 3]): AssertionError: expected 4 features, at hostile_")


def test_model_that_raises_a_key_error(cli, tmp_path, stages):
    model = _user_model(tmp_path, "return {'a': x}['b']")
    cli("calibrate", model, "--data", "random:2x4", "-o", "c.pt").assert_error("KeyError: 'b', at hostile_")


def _user_model(tmp_path: Path, forward: str) -> Path:
    """A float checkpoint of a user model class whose forward runs ``forward``."""
    import importlib

    name = _module(tmp_path, "class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                             "        self.fc = torch.nn.Linear(4, 2)\n    def forward(self, x):\n"
                             f"        {forward}\n        return self.fc(x)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        net = importlib.import_module(name).Net().eval()
    finally:
        sys.path.remove(str(tmp_path))
    qdebug.save(net, tmp_path / "user.pt", stage="float", sample_inputs=torch.randn(2, 4))
    return tmp_path / "user.pt"


# -- item 7: right verdicts and early checks -------------------------------------------------
def test_negative_precomputed_metrics_are_refused(cli):
    cli("baseline", "--float-metric", "-1", "--quant-metric", "-1").assert_error(
        "--float-metric is negative (-1): the ratio rule needs metric values >= 0", 'direction = "lower"')


def test_negative_json_metrics_are_refused(cli, tmp_path):
    (tmp_path / "f.json").write_text(json.dumps({"loglik": 2.0}))
    (tmp_path / "q.json").write_text(json.dumps({"loglik": -3.5}))
    cli("baseline", "--float-json", "f.json", "--quant-json", "q.json").assert_error(
        "q.json is negative (-3.5 for task 'loglik')")


def test_negative_metric_function_is_refused(cli, tmp_path, stages):
    name = _module(tmp_path, "def loglik(model, batches):\n    return -0.25\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:loglik", "--data", stages.data).assert_error(
        "metric loglik is negative (-0.25)")


def test_negative_per_sample_scores_are_refused(cli, tmp_path, stages):
    name = _module(tmp_path, "def score(model, batches):\n    return torch.cat([model(x).amax(-1) - 100 "
                             "for x, _ in batches])\nscore.per_sample = True\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:score", "--data", stages.data).assert_error(
        "metric score is negative")


def test_metric_with_a_bad_direction_is_refused_before_evaluation(cli, tmp_path):
    name = _module(tmp_path, "def m(model, batches):\n    return 1.0\nm.direction = 'up'\n")
    cli("baseline", "f.pt", "q.pt", "--metric", f"{name}:m").assert_error("direction 'up' is not 'higher' or 'lower'")


def test_checkpoints_beside_precomputed_metrics_are_refused(cli, stages):
    cli("baseline", stages.float, stages.quantized, "--float-metric", "0.9", "--quant-metric", "0.9").assert_error(
        "not both: the checkpoints would be ignored")


def test_data_function_calling_sys_exit(cli, tmp_path, stages):
    name = _module(tmp_path, "def data():\n    sys.exit(0)\n")
    cli(*_baseline(stages, "--data", f"{name}:data")).assert_error(
        f"data function {name}:data called sys.exit(0), at {name}.py:4", "return the result")


def test_data_generator_calling_sys_exit_midway(cli, tmp_path, stages):
    name = _module(tmp_path, "def data():\n    yield torch.randn(2, 1, 16, 16)\n    sys.exit(0)\n")
    cli("compare", stages.float, stages.quantized, "--data", f"{name}:data").assert_error("called sys.exit(0)")


def test_metric_calling_sys_exit(cli, tmp_path, stages):
    name = _module(tmp_path, "def metric(model, batches):\n    sys.exit(0)\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:metric", "--data", stages.data).assert_error(
        "metric metric called sys.exit(0)")


def test_module_calling_sys_exit_on_import(cli, tmp_path, stages):
    name = _module(tmp_path, "sys.exit(0)\ndef metric(model, batches):\n    return 1.0\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:metric").assert_error(
        f"importing '{name}' called sys.exit(0)", "if __name__ == '__main__':")


def test_model_calling_sys_exit(cli, tmp_path, stages):
    model = _user_model(tmp_path, "sys.exit(3)")
    cli("compare", model, model, "--data", "random:2x4").assert_error("the model, while comparing, called sys.exit(3)")


def test_broken_unrelated_pyproject_in_a_parent_is_skipped(cli, tmp_path, stages, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[tool.black\nline-length = 3\n")
    (tmp_path / "proj").mkdir()
    monkeypatch.chdir(tmp_path / "proj")
    result = cli("inspect", stages.float)
    assert result.code == 0, result.err
    assert "warning: " in result.err and "pyproject.toml is not valid TOML" in result.err and "skipped" in result.err


def test_non_utf8_unrelated_pyproject_is_skipped(cli, tmp_path, stages):
    (tmp_path / "pyproject.toml").write_bytes(b'[project]\nname = "\xff"\n')
    result = cli("inspect", stages.float)
    assert result.code == 0 and "is not UTF-8 text" in result.err, result.err


def test_broken_pyproject_declaring_tool_qdebug_is_an_error(cli, tmp_path, stages):
    (tmp_path / "pyproject.toml").write_text("[tool.qdebug]\nratio = 0.5\n[tool.black\n")
    cli("inspect", stages.float).assert_error("pyproject.toml is not valid TOML")


def test_explicit_config_that_cannot_be_parsed_is_an_error(cli, tmp_path, stages):
    (tmp_path / "pyproject.toml").write_text("[tool.black\n")
    cli("--config", "pyproject.toml", "inspect", stages.float).assert_error("is not valid TOML")


@pytest.mark.parametrize("text, fragment", [
    ("ratio = -1\n", "ratio -1 is out of range (0, 1.5]"),
    ("[tasks.top1]\nratio = 0\n", "tasks.top1.ratio 0 is out of range (0, 1.5]"),
    ('[tasks.top1]\nratio = "abc"\n', "tasks.top1.ratio must be a number, got str"),
    ('mode = "fused"\n', "mode 'fused' is not a QAT mode"),
])
def test_config_values_checked_as_it_loads(cli, tmp_path, text, fragment):
    (tmp_path / "qdebug.toml").write_text(text)
    cli("baseline", "missing_float.pt", "missing_quant.pt", "--metric", "top1").assert_error(fragment)


@pytest.mark.parametrize("args, fragment", [
    (("baseline", "F.pt", "Q.pt", "--metric", "top1", "--confidence", "-1"), "--confidence -1"),
    (("baseline", "F.pt", "Q.pt", "--metric", "top1", "--data", "random:2x0"), "dimension of 0"),
    (("compare", "F.pt", "Q.pt", "--threshold", "sqnr_db=nan"), "the value must be a finite number"),
    (("step", "F.pt", "Q.pt", "--ratio", "0"), "--ratio 0 is out of range"),
    (("step", "F.pt", "Q.pt", "--data", "random:2x2", "--batches", "1000000000"), "at most 100000 batches"),
    (("suggest", "F.pt", "Q.pt", "--min-sqnr", "nan"), "--min-sqnr must be a number of dB"),
    (("calibrate", "F.pt", "--qconfig", "list.json", "-o", "c.pt"), "holds an array"),
    (("nan-trace", "F.pt", "--seed", str(2**64)), "--seed must be from -2**63 to 2**64 - 1"),
    (("nan-trace", "F.pt", "--data", ".rel:x"), "not an importable module name"),
])
def test_options_are_checked_before_any_checkpoint_loads(cli, tmp_path, args, fragment):
    """F.pt and Q.pt do not exist: an option checked late would say "no such file" instead."""
    (tmp_path / "list.json").write_text("[]")
    cli(*args).assert_error(fragment)


def test_step_sort_by_a_column_the_run_did_not_make_keeps_the_results(cli, stages):
    result = cli("step", stages.float, stages.calibrated, "--data", stages.data, "--sort", "nosuch_ratio", "--json")
    assert result.code == 0, result.err
    assert "warning: cannot sort by 'nosuch_ratio'" in result.err
    assert json.loads(result.out)["rows"]
