"""Every failure is clean (issue 27, must-have 5): hostile numbers in a qconfig, a checkpoint's
scales, a repro bundle or a timeout; metadata nested absurdly deep; user code raising what no
``except Exception`` catches; the Python API's wrong arguments -- each one ``error:`` line, a
``hint:`` line and exit 2 (a ``QDebugError`` from the API), never a traceback or an internal error.

User modules are written into the working directory under unique names, where qdebug finds
them as ``python -m`` would (as in tests/test_hostile_inputs.py).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.engine.spec import QConfig, QuantSpec
from qdebug.errors import QDebugError


def _module(tmp_path: Path, source: str) -> str:
    """A user module in the working directory, under a name no other test imported."""
    name = f"clean_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text("import sys\nimport torch\n" + source)
    return name


# -- qconfig numbers -------------------------------------------------------------------------
@pytest.mark.parametrize("key, value", [
    ("averaging_constant", "0.5"), ("averaging_constant", [0.5]), ("averaging_constant", None),
    ("averaging_constant", {"a": 1}), ("averaging_constant", True), ("averaging_constant", 10**400),
    ("percentile", "99.9"), ("percentile", None), ("percentile", [99]), ("bits", 10**5000), ("ch_axis", 10**30),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_qconfig_number_fields_are_type_checked(key, value):
    with pytest.raises(QDebugError, match=key):
        QConfig.from_dict({"activation": {key: value}})
    with pytest.raises(QDebugError):
        QConfig.from_dict({"overrides": {"fc*": {"weight": {key: value}}}})


@pytest.mark.parametrize("table", [{"weight": {1: 2}}, {"overrides": {7: {"weight": {}}}}, {3: 1, "weight": {}},
                                   {"overrides": {"a": {"weight": {}, 2: 3}}}])
def test_qconfig_keys_that_are_not_strings_are_refused(table):
    with pytest.raises(QDebugError):
        QConfig.from_dict(table)


def test_qconfig_numbers_that_are_ints_still_load():
    """A guard for the type check: TOML writes 1 and 100 as ints."""
    spec = QuantSpec.from_dict({"averaging_constant": 1, "percentile": 100})
    assert (spec.averaging_constant, spec.percentile) == (1, 100)


def test_qconfig_file_with_a_string_number_is_one_error(cli, stages):
    Path("q.json").write_text(json.dumps({"activation": {"observer": "ema", "averaging_constant": "0.5"}}))
    cli("calibrate", stages.float, "--data", stages.data, "--qconfig", "q.json", "-o", "c.pt").assert_error(
        "averaging_constant='0.5' must be a number")


def test_config_qconfig_table_with_a_string_number_is_one_error(cli, stages):
    Path("qdebug.toml").write_text('[qconfig.overrides."conv1"]\nactivation = {percentile = "99.9"}\n')
    cli("calibrate", stages.float, "--data", stages.data, "-o", "c.pt").assert_error(
        "percentile='99.9' must be a number")


# -- user code raising what `except Exception` does not catch --------------------------------
_RAISERS = {
    "BaseException subclass": ("class Stop(BaseException):\n    pass\n", "raise Stop('halt')", "Stop"),
    "GeneratorExit": ("", "raise GeneratorExit('closed')", "GeneratorExit"),
    "__str__ that raises": ("class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n",
                            "raise Odd()", "Odd"),
}


@pytest.mark.parametrize("case", list(_RAISERS))
def test_metric_raising_anything_is_one_error(cli, tmp_path, stages, case):
    prelude, statement, kind = _RAISERS[case]
    name = _module(tmp_path, f"{prelude}def metric(model, batches):\n    {statement}\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:metric", "--data", stages.data).assert_error(
        f"metric metric raised {kind}", f"{name}.py")


@pytest.mark.parametrize("case", list(_RAISERS))
def test_data_function_raising_anything_is_one_error(cli, tmp_path, stages, case):
    prelude, statement, kind = _RAISERS[case]
    name = _module(tmp_path, f"{prelude}def data():\n    yield torch.randn(2, 1, 16, 16)\n    {statement}\n")
    cli("compare", stages.float, stages.quantized, "--data", f"{name}:data").assert_error(
        f"data function {name}:data raised {kind}")


@pytest.mark.parametrize("case", list(_RAISERS))
def test_model_forward_raising_anything_is_one_error(cli, tmp_path, case):
    prelude, statement, kind = _RAISERS[case]
    name = _module(tmp_path, prelude + "class Net(torch.nn.Module):\n    def __init__(self):\n"
                   "        super().__init__()\n"
                   f"        self.fc = torch.nn.Linear(4, 2)\n    def forward(self, x):\n        {statement}\n")
    import importlib
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        net = importlib.import_module(name).Net().eval()
    finally:
        sys.path.remove(str(tmp_path))
    qdebug.save(net, tmp_path / "user.pt", stage="float", sample_inputs=torch.randn(2, 4))
    cli("compare", "user.pt", "user.pt", "--data", "random:2x4").assert_error(f"the model failed while comparing", kind)


@pytest.mark.parametrize("case", list(_RAISERS))
def test_module_raising_anything_on_import_is_one_error(cli, tmp_path, stages, case):
    prelude, statement, kind = _RAISERS[case]
    name = _module(tmp_path, f"{prelude}{statement}\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:metric").assert_error(
        f"importing '{name}' raised {kind}")


@pytest.mark.parametrize("case", list(_RAISERS))
def test_model_constructor_raising_anything_is_one_error(cli, tmp_path, case):
    prelude, statement, kind = _RAISERS[case]
    name = _module(tmp_path, prelude + "class Net(torch.nn.Module):\n    def __init__(self):\n"
                   f"        super().__init__()\n        {statement}\n")
    torch.save(torch.nn.Linear(4, 2).state_dict(), tmp_path / "state.pt")
    cli("inspect", "state.pt", "--model", f"{name}:Net").assert_error(f"cannot build {name}:Net", kind)


def test_train_function_raising_an_exception_with_a_raising_str_is_one_error(cli, tmp_path, stages):
    prelude, statement, kind = _RAISERS["__str__ that raises"]
    name = _module(tmp_path, f"{prelude}def step(model, batch):\n    {statement}\n")
    cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 1, "--train", f"{name}:step").assert_error(
        f"the --train function {name}:step raised {kind}")


def test_ctrl_c_in_a_metric_stays_interrupted(cli, tmp_path, stages):
    """A guard for the catches above: KeyboardInterrupt is not the user's code failing."""
    name = _module(tmp_path, "def metric(model, batches):\n    raise KeyboardInterrupt\n")
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:metric", "--data", stages.data)
    assert result.code == 130 and "error: interrupted" in result.err, result


# -- scales in a checkpoint ------------------------------------------------------------------
def _with_scale(stages, tmp_path: Path, point: str, scale: torch.Tensor) -> Path:
    ckpt = torch.load(stages.qat, map_location="cpu", weights_only=True)
    ckpt["state"][f"qdebug_points.{point}.scale"] = scale
    torch.save(ckpt, tmp_path / "x.pt")
    return tmp_path / "x.pt"


@pytest.mark.parametrize("value, fragment", [(0.0, "a zero scale"), (-0.0, "a zero scale"),
                                             (1e-40, "a subnormal scale")], ids=["0", "-0", "subnormal"])
def test_zero_and_subnormal_scales_are_refused_at_load(cli, stages, tmp_path, value, fragment):
    path = _with_scale(stages, tmp_path, "input", torch.tensor(value))
    for command in (("inspect", path), ("compare", stages.float, path, "--data", stages.data)):
        cli(*command).assert_error("quant point 'input' has " + fragment)
    with pytest.raises(QDebugError, match=fragment):
        qdebug.load(path)


def test_a_per_channel_scale_with_one_zero_is_refused(cli, stages, tmp_path):
    ckpt = torch.load(stages.qat, map_location="cpu", weights_only=True)
    key = next(k for k in ckpt["state"] if k.endswith("weight.scale") and ckpt["state"][k].dim() == 1)
    scale = ckpt["state"][key].clone()
    scale[-1] = 0.0
    path = _with_scale(stages, tmp_path, key[len("qdebug_points."):-len(".scale")], scale)
    cli("inspect", path).assert_error("has a zero scale")


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_scales_stay_data_compare_runs(cli, stages, tmp_path, value):
    """NaN and Inf scales are what a diverged run leaves (docs/security.md): they load, and
    compare reports on the model instead of failing inside."""
    path = _with_scale(stages, tmp_path, "input", torch.tensor(value))
    result = cli("compare", stages.float, path, "--data", stages.data)
    assert result.code in (0, 1) and "error" not in result.err, result


# -- metadata nested absurdly deep -----------------------------------------------------------
def _deep(depth: int) -> dict:
    root = node = {}
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


def _save_deep(stages, path: Path, where: str, depth: int = 100_000) -> Path:
    """The qat checkpoint with a table ``depth`` levels deep at ``where`` (torch.save's
    pickler recurses: it runs in a thread with room for that)."""
    import sys
    import threading

    ckpt = torch.load(stages.qat, map_location="cpu", weights_only=True)
    if where == "meta":
        ckpt["meta"]["deep"] = _deep(depth)
    else:
        ckpt[where] = [_deep(depth)]
    limit, size = sys.getrecursionlimit(), threading.stack_size()
    sys.setrecursionlimit(max(limit, 4 * depth))
    threading.stack_size(512 << 20)
    try:
        worker = threading.Thread(target=torch.save, args=(ckpt, path))
        worker.start()
        worker.join()
    finally:
        sys.setrecursionlimit(limit)
        threading.stack_size(size)
    return path


def test_meta_nested_100000_deep_is_one_error(cli, stages, tmp_path):
    path = _save_deep(stages, tmp_path / "deep.pt", "meta")
    for args in (("inspect", path), ("inspect", path, "--format", "json")):
        cli(*args).assert_error("'meta' nests more than 64 levels deep")
    with pytest.raises(QDebugError, match="nests more than"):
        qdebug.load(path)


@pytest.mark.parametrize("where", ["version", "stage", "qat_mode"])
def test_deep_values_elsewhere_in_a_checkpoint_are_one_error(cli, stages, tmp_path, where):
    """A field that is named in the message: its repr of a deep value must not recurse."""
    cli("inspect", _save_deep(stages, tmp_path / "deep.pt", where, depth=5_000)).assert_error(where)


# -- repro bundles with huge numbers ---------------------------------------------------------
def _bundle(stages, tmp_path: Path, **settings) -> Path:
    net, _ = qdebug.load(stages.qat)
    qdebug.save(net, tmp_path / "before.pt", stage="qat", meta={"nan_trace": settings})
    return tmp_path / "before.pt"


def test_a_repro_bundle_with_a_huge_int_lr_is_refused(cli, stages, tmp_path):
    _bundle(stages, tmp_path, lr=10**400)
    cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1).assert_error("the repro bundle's lr is damaged")


def _optimizer_state(stages, name: str = "sgd") -> dict:
    net, _ = qdebug.load(stages.qat)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=0.1)
    return optimizer.state_dict()


@pytest.mark.parametrize("key, value", [("lr", 10**100), ("momentum", 10**300), ("weight_decay", float("nan")),
                                        ("nesterov", 10**100), ("lr", "fast"), ("betas", (10**100, 0.9))],
                         ids=["lr", "momentum", "weight_decay-nan", "nesterov", "lr-text", "betas"])
def test_a_repro_bundle_optimizer_state_with_huge_numbers_is_refused(cli, stages, tmp_path, key, value):
    optimizer = "adam" if key == "betas" else "sgd"
    state = _optimizer_state(stages, optimizer)
    state["param_groups"][0][key] = value
    _bundle(stages, tmp_path, optimizer=optimizer, optimizer_state=state)
    cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1).assert_error(
        f"the saved optimizer state does not fit --optimizer {optimizer}: param group 0 has '{key}'")


def test_a_repro_bundle_optimizer_state_of_the_wrong_shape_is_refused(cli, stages, tmp_path):
    state = _optimizer_state(stages)
    state["state"] = {0: {"momentum_buffer": torch.zeros(3, 3, 3)}}
    _bundle(stages, tmp_path, optimizer="sgd", optimizer_state=state)
    cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1).assert_error("parameter 0's 'momentum_buffer'")


def test_a_repro_bundle_with_a_plain_optimizer_state_replays(cli, stages, tmp_path):
    """A guard for the optimizer-state check: the state torch writes passes it."""
    _bundle(stages, tmp_path, optimizer="sgd", lr=0.01, optimizer_state=_optimizer_state(stages))
    result = cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1)
    assert result.code in (0, 1) and "error" not in result.err, result


# -- QDEBUG_DIST_TIMEOUT ---------------------------------------------------------------------
@pytest.fixture
def as_ranks(monkeypatch):
    """torchrun's variables set by hand (``set(rank)``); the consoles a rank other than 0
    quiets, and the group, are as they were afterwards."""
    from qdebug.config import distributed
    from qdebug.cli.common import console, err_console

    monkeypatch.setattr(console, "quiet", console.quiet)
    monkeypatch.setattr(err_console, "quiet", err_console.quiet)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def set_rank(rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        console.quiet = err_console.quiet = False
        distributed.reset()

    yield set_rank
    distributed.reset()


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "abc", "1e400", "9" * 5000, ""])
def test_a_bad_dist_timeout_is_one_error_on_every_rank(cli, stages, monkeypatch, as_ranks, value):
    """Under torchrun (the timeout is refused before any rank joins, so none is needed), each
    rank says the error once and exits 2 -- no traceback from the final round."""
    monkeypatch.setenv("QDEBUG_DIST_TIMEOUT", value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    for rank in (1, 0):
        as_ranks(rank)
        cli("compare", stages.float, stages.quantized, "--data", stages.data).assert_error("QDEBUG_DIST_TIMEOUT=")


def test_a_missing_master_addr_is_one_error(cli, stages, monkeypatch, as_ranks):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    as_ranks(1)
    cli("compare", stages.float, stages.quantized, "--data", stages.data).assert_error("MASTER_ADDR is not")


# -- the Python API: QDebugError, never a bare TypeError/ValueError ---------------------------
_API_CASES = {
    "batches text": (lambda s: qdebug.compare(s.float, s.quantized, data=str(s.data), batches="x"), "batches must be"),
    "batches float": (lambda s: qdebug.compare(s.float, s.quantized, data=str(s.data), batches=1.5), "batches must"),
    "batch_size": (lambda s: qdebug.compare(s.float, s.quantized, data=str(s.data), batch_size=-1), "batch_size must"),
    "ref text": (lambda s: qdebug.compare(s.float, s.quantized, ref="x"), "ref must be"),
    "thresholds": (lambda s: qdebug.compare(s.float, s.quantized, thresholds=5), "thresholds must be"),
    "threshold text": (lambda s: qdebug.compare(s.float, s.quantized, thresholds={"sqnr_db": "x"}), "finite number"),
    "ratio negative": (lambda s: qdebug.step(s.float, s.quantized, ratio=-1), "ratio -1 is out of range"),
    "ratio nan": (lambda s: qdebug.step(s.float, s.quantized, ratio=float("nan")), "ratio must be a finite number"),
    "ratio text": (lambda s: qdebug.step(s.float, s.quantized, ratio="0.9"), "ratio must be a finite number"),
    "depth text": (lambda s: qdebug.step(s.float, s.quantized, depth="x"), "depth must be"),
    "module int": (lambda s: qdebug.step(s.float, s.quantized, module=5), "module must be"),
    "metric int": (lambda s: qdebug.step(s.float, s.quantized, metric=5), "metric must be"),
    "bits text": (lambda s: qdebug.suggest(s.float, s.quantized, bits="x"), "bits must be"),
    "min_sqnr text": (lambda s: qdebug.suggest(s.float, s.quantized, min_sqnr="x"), "min_sqnr must be"),
    "load int": (lambda s: qdebug.load(5), "path must be a file path"),
    "load NUL": (lambda s: qdebug.load("a\0b.pt"), "path must be a file path"),
    "load model int": (lambda s: qdebug.load(s.qat, model=5), "a model is named as a string"),
    "load model_kwargs int": (lambda s: qdebug.load(s.qat, model_kwargs=5), "model_kwargs must be a dict"),
    "save int": (lambda s: qdebug.save(5, "x.pt", stage="float"), "save takes an nn.Module"),
    "save path int": (lambda s: qdebug.save(torch.nn.Linear(2, 2), 5, stage="float"), "path must be a file path"),
    "save meta": (lambda s: qdebug.save(torch.nn.Linear(2, 2), "x.pt", meta=[1]), "meta must be a dict"),
}


@pytest.mark.parametrize("case", list(_API_CASES))
def test_python_api_raises_qdebug_error_for_wrong_arguments(stages, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    call, fragment = _API_CASES[case]
    with pytest.raises(QDebugError, match=fragment.replace("(", r"\(")):
        call(stages)


# -- batches whose inputs hold no tensor (fuzz, issue 28) --------------------------------------
@pytest.mark.parametrize("inputs", [0, None, "x", {1: 2}], ids=["int", "None", "str", "dict-int"])
def test_a_data_file_batch_whose_inputs_hold_no_tensor_is_refused(cli, stages, inputs):
    """A list of batches ``(inputs, target)`` with inputs that are no tensor reached the model
    and failed inside qdebug's layers (AttributeError 'dim')."""
    torch.save([(torch.randn(2, 1, 16, 16), torch.tensor([1, 2])), (inputs, torch.tensor([5, 6, 9, 3]))], "b.pt")
    for command in (("compare", stages.calibrated, stages.quantized), ("step", stages.qat),
                    ("nan-trace", stages.calibrated, "--steps", 0)):
        cli(*command, "--data", "b.pt").assert_error("b.pt: batch 1: a batch's inputs hold no tensor",
                                                     "data file formats")


def test_a_data_file_batch_that_is_an_empty_dict_is_refused(cli, stages):
    """``[{}]``: no kwargs at all (StopIteration from Batch.size in nan-trace)."""
    torch.save([{}], "b.pt")
    for command in (("compare", stages.calibrated, stages.quantized), ("nan-trace", stages.calibrated, "--steps", 0)):
        cli(*command, "--data", "b.pt").assert_error("b.pt: batch 0: a batch's inputs hold no tensor: {}")


def test_a_data_function_batch_whose_inputs_hold_no_tensor_is_refused(cli, tmp_path, stages):
    name = _module(tmp_path, "def data():\n    yield torch.randn(2, 1, 16, 16)\n    yield (0, torch.tensor([1]))\n")
    cli("compare", stages.float, stages.quantized, "--data", f"{name}:data").assert_error(
        f"data function {name}:data: batch 1: a batch's inputs hold no tensor: 0")


def test_documented_list_batches_still_run(cli, stages):
    """A guard for the check above: kwargs dicts of tensors, (inputs, int target) pairs, and
    a tuple of args with a non-tensor beside the tensor are batches."""
    x = torch.randn(2, 1, 16, 16)
    torch.save([{"x": x}, (x, 3), (x, torch.tensor([1, 2])), x], "b.pt")
    result = cli("compare", stages.calibrated, stages.quantized, "--data", "b.pt")
    assert result.code in (0, 1) and "error" not in result.err, result


# -- a repro bundle's optimizer state missing a setting (fuzz, issue 28) -----------------------
@pytest.mark.parametrize("optimizer, key", [("sgd", "lr"), ("sgd", "dampening"), ("sgd", "weight_decay"),
                                            ("adam", "betas"), ("adam", "eps")])
def test_a_repro_bundle_param_group_missing_a_setting_is_refused(cli, stages, tmp_path, optimizer, key):
    """torch's load_state_dict takes the saved groups wholesale: a missing setting was a
    KeyError inside the optimizer's step, not a default."""
    state = _optimizer_state(stages, optimizer)
    del state["param_groups"][0][key]
    _bundle(stages, tmp_path, optimizer=optimizer, optimizer_state=state)
    cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1).assert_error(
        f"the saved optimizer state does not fit --optimizer {optimizer}: param group 0 lacks '{key}'")


def test_a_repro_bundle_of_sgd_replayed_with_adam_is_refused(cli, stages, tmp_path):
    _bundle(stages, tmp_path, optimizer="sgd", optimizer_state=_optimizer_state(stages, "sgd"))
    cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1, "--optimizer", "adam").assert_error(
        "does not fit --optimizer adam: param group 0 lacks 'betas', 'eps'")


def test_a_repro_bundle_param_group_missing_a_flag_replays(cli, stages, tmp_path):
    """A guard: a flag (a bundle from a torch without it) takes the optimizer's own value."""
    state = _optimizer_state(stages)
    for flag in ("nesterov", "maximize", "foreach", "differentiable", "fused"):
        del state["param_groups"][0][flag]
    _bundle(stages, tmp_path, optimizer="sgd", optimizer_state=state)
    result = cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1)
    assert result.code in (0, 1) and "error" not in result.err, result


# -- a NUL in a config value (fuzz, issue 28) --------------------------------------------------
@pytest.mark.parametrize("key, value", [("float", r"\u0000"), ("out", r"a\nb\u0000"), ("qat", r"x\u0000.pt"),
                                        ("calibrated", r"\u0000"), ("quantized", r"\u0000"), ("data", r"d\u0000.pt"),
                                        ("model", r"m\u0000:Net")], ids=lambda v: v if "\\" not in v else None)
def test_a_config_value_holding_nul_is_one_error(cli, key, value):
    """Path.resolve raised ValueError 'embedded null byte' from inside the config's check."""
    Path("q.toml").write_text(f'{key} = "{value}"\n')
    cli("--config", "q.toml", "inspect").assert_error(f"q.toml: {key} holds a NUL character")


# -- a message quoting a huge value (fuzz, issue 28) -------------------------------------------
def test_an_error_quoting_a_100_kb_path_is_cut_to_one_short_line(cli, stages):
    """A config's ``out`` of 100,000 characters: exit 2 as it should, but the error line
    carried the whole path.  Every line said is at most MAX_LINE characters, cut in the middle."""
    from qdebug.safe_text import MAX_LINE

    Path("q.toml").write_text(f'out = "{"a" * 100_000}"\n')
    result = cli("--config", "q.toml", "compare", stages.calibrated, stages.quantized)
    line = result.assert_error("characters cut)...")
    assert line.endswith("File name too long"), line[:200]
    assert max(len(text) for text in result.err.splitlines()) <= MAX_LINE, len(result.err)


def test_one_line_cuts_the_middle_and_keeps_both_ends():
    from qdebug.safe_text import one_line

    assert one_line("short\x1b[31m") == "short\\x1b[31m"  # escaped as before, not cut
    text = "error: " + "x" * 5000 + "\n" + "y" * 5000 + " tail.pt"
    line = one_line(text, limit=300)
    assert len(line) <= 300 and line.startswith("error: xxx") and line.endswith("yyy tail.pt"), line
    assert f"...({len(one_line(text, limit=10**6)) - 260} characters cut)..." in line


# -- the meta build does not import torch._dynamo (speed, issue 28) ----------------------------
def test_loading_the_demo_checkpoints_does_not_import_dynamo():
    """normal_ on a meta tensor runs torch's Python reference, which imports torch._dynamo
    (1-4 s on every load: the zoo's constructors call kaiming_normal_ and normal_);
    the meta build skips the fills instead.  A fresh process: another test may import it."""
    import subprocess
    import sys

    demo = Path(__file__).resolve().parent.parent / "fixtures" / "demo"
    code = ("import sys, qdebug\n"
            f"for stage in ('float', 'calibrated', 'qat', 'quantized'):\n    qdebug.load({str(demo)!r} + f'/{{stage}}.pt')\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", (done.stdout, done.stderr[-2000:])


def test_the_meta_build_skips_fills_but_keeps_shapes():
    """A guard for the skip: what a meta build measures (shapes, dtypes) is what it was."""
    from qdebug.io.modelspec import _on_meta

    with _on_meta(1000):
        embedding, linear = torch.nn.Embedding(7, 5), torch.nn.Linear(3, 4)
        torch.nn.init.kaiming_normal_(linear.weight, mode="fan_out")
        filled = torch.nn.init.normal_(tensor=torch.empty(2, 6), std=0.01)
    assert embedding.weight.is_meta and list(embedding.weight.shape) == [7, 5]
    assert linear.weight.is_meta and list(linear.weight.shape) == [4, 3]
    assert filled.is_meta and list(filled.shape) == [2, 6]
