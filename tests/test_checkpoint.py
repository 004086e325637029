"""Checkpoints: the file format of all four stages, exact round trips, plain state_dicts,
pickled modules, model-spec safety, architecture/shape mismatches and atomic writes."""

from __future__ import annotations

import datetime as dt
import os
import sys
import uuid

import pytest
import torch

import qdebug
from qdebug.checkpoint import FORMAT, VERSION, read_file
from qdebug.engine import QConfig, absorb_bn, calibrate, convert, engine_state, prepare, quant_points, set_mode
from qdebug.errors import QDebugError

STAGES = ("float", "calibrated", "qat", "quantized")


def _run(model, x):
    with torch.no_grad():
        return model(x)


def _only_safe_types(obj, path="ckpt"):
    """Tensors, numbers, strings, None, lists and dicts with string keys -- nothing else."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str), f"{path}: key {k!r} is {type(k).__name__}"
            _only_safe_types(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _only_safe_types(v, f"{path}[{i}]")
    else:
        assert obj is None or isinstance(obj, (torch.Tensor, bool, int, float, str)), f"{path}: {type(obj).__name__}"


# -- the format ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_file_format_of_every_stage(stages, stage):
    raw = torch.load(stages.path(stage), map_location="cpu", weights_only=True)
    _only_safe_types(raw)
    assert raw["format"] == FORMAT == "qdebug-checkpoint"
    assert raw["version"] == VERSION == 1
    assert raw["stage"] == stage
    assert raw["model"] == {"class": "qdebug.zoo.resnet:ResNet", "kwargs": stages.kwargs}
    assert torch.equal(raw["sample_inputs"], stages.x)
    meta = raw["meta"]
    assert meta["torch"] == str(torch.__version__)
    assert isinstance(meta["qdebug"], str) and meta["qdebug"]
    assert dt.datetime.fromisoformat(meta["time"]).tzinfo is not None

    state = raw["state"]
    model = stages.models[stage]
    assert set(state) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    if stage == "float":
        assert raw["qconfig"] is None
        assert "bn1.running_mean" in state and "bn1.running_var" in state
        assert not any(k.startswith("qdebug_points.") for k in state)
        return
    assert QConfig.from_dict(raw["qconfig"]) == engine_state(model).qconfig
    assert raw["qat_mode"] == "fuse_bn"
    points = quant_points(model)
    assert set(raw["points"]) == set(points)
    # every quant point's scale, zero point and observer state is in the file
    for name in points:
        key = "qdebug_points." + name.replace(".", "/")
        for part in ("scale", "zero_point", "qparams_set", "observer.min_val", "observer.max_val"):
            assert f"{key}.{part}" in state, (name, part)
    assert bool(state["qdebug_points.input.qparams_set"])
    assert float(state["qdebug_points.input.scale"]) != 1.0  # calibrated, not the placeholder
    if stage == "quantized":
        ints = {k: v for k, v in state.items() if k.endswith(".weight_int")}
        assert {"conv1.weight_int", "fc.weight_int", "layer2.0.downsample.0.weight_int"} <= set(ints)
        assert all(not v.is_floating_point() for v in ints.values())
    else:
        assert not any(k.endswith(".weight_int") for k in state)


@pytest.mark.parametrize("stage", STAGES)
def test_loaded_checkpoint_reproduces_outputs_exactly(stages, stage):
    model, info = qdebug.load(stages.path(stage))
    assert info.stage == stage and info.source == "qdebug"
    assert info.model.target == stages.spec and info.model.kwargs == stages.kwargs
    assert not model.training
    x = torch.cat([stages.x, torch.randn(3, 1, 16, 16)])
    assert torch.equal(_run(model, x), _run(stages.models[stage], x))
    if stage != "float":
        assert info.qconfig == engine_state(stages.models[stage]).qconfig
        assert info.qat_mode == "fuse_bn"
        assert not torch.allclose(_run(model, x), _run(stages.models["float"], x))  # fake quant is active
    else:
        assert info.qconfig is None


def _assert_round_trip(model, path, probe, stage, mode):
    loaded, info = qdebug.load(path)
    assert info.stage == stage and info.qat_mode == mode
    assert torch.equal(_run(loaded, probe), _run(model, probe))
    for name, point in quant_points(model).items():
        twin = quant_points(loaded)[name]
        assert (twin.mode, twin.frozen, twin.observe_in_fake) == (point.mode, point.frozen, point.observe_in_fake)
    return loaded


@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_qat_modes_round_trip(tmp_path, make_resnet, images, qat_steps, mode):
    x = images(4, seed=7)
    probe = torch.cat([x, images(2, seed=9)])
    qm = prepare(make_resnet(1), QConfig(), mode=mode, example_inputs=x)
    calibrate(qm, [images(8, seed=8)])
    set_mode(qm, "fake", kind="activation", observe=True)  # QAT with running activation observers
    qat_steps(qm, steps=1)
    path = qdebug.save(qm, tmp_path / "qat.pt", stage="qat")
    raw = torch.load(path, weights_only=True)
    assert raw["qat_mode"] == mode and raw["absorbed"] == []
    if mode != "fuse_bn":  # BNs kept for QAT: their statistics are saved
        assert torch.equal(raw["state"]["layer1.0.bn1.running_mean"], qm.get_submodule("layer1.0.bn1").running_mean)
    loaded = _assert_round_trip(qm, path, probe, "qat", mode)
    assert any(p.observe_in_fake for p in quant_points(loaded).values())

    if mode != "fuse_bn":  # fold one BN mid-QAT, train on, save again
        assert absorb_bn(qm, "layer1.0.conv1") == ["layer1.0.conv1"]
        qat_steps(qm, steps=1, seed=4)
        path = qdebug.save(qm, tmp_path / "absorbed.pt", stage="qat")
        raw = torch.load(path, weights_only=True)
        assert raw["absorbed"] == ["layer1.0.conv1"]
        assert "layer1.0.bn1.running_mean" not in raw["state"] and "layer1.0.bn2.running_mean" in raw["state"]
        loaded = _assert_round_trip(qm, path, probe, "qat", mode)
        assert loaded.get_submodule("layer1.0.conv1").bn is None
        assert loaded.get_submodule("layer1.0.conv2").bn is not None

    # converting the loaded model gives the same quantized model, and that round-trips too
    quant = convert(qm)
    quant_loaded = convert(loaded)
    assert torch.equal(_run(quant_loaded, probe), _run(quant, probe))
    qpath = qdebug.save(quant_loaded, tmp_path / "quantized.pt")
    _assert_round_trip(quant, qpath, probe, "quantized", mode)


def test_resumed_qat_trains_identically(tmp_path, make_resnet, images, qat_steps):
    """Weights, BN statistics and observer state all come back: one more training step matches."""
    qm = prepare(make_resnet(2), QConfig(), mode="with_bn_reverse_fold", example_inputs=images(2))
    calibrate(qm, [images(8, seed=3)])
    set_mode(qm, "fake", kind="activation", observe=True)
    loaded, _ = qdebug.load(qdebug.save(qm, tmp_path / "qat.pt", stage="qat"))
    qat_steps(qm, steps=1, seed=11)
    qat_steps(loaded, steps=1, seed=11)
    probe = images(4, seed=12)
    assert torch.equal(_run(loaded, probe), _run(qm, probe))


def test_save_refuses_a_stage_the_model_is_not(tmp_path, stages):
    with pytest.raises(QDebugError, match="cannot save a float model"):
        qdebug.save(stages.models["float"], tmp_path / "x.pt", stage="quantized")
    with pytest.raises(QDebugError, match="unknown stage"):
        qdebug.save(stages.models["float"], tmp_path / "x.pt", stage="trained")
    assert not (tmp_path / "x.pt").exists()


def test_newer_version_is_refused(tmp_path, stages):
    raw = torch.load(stages.float, weights_only=True)
    raw["version"] = VERSION + 1
    torch.save(raw, tmp_path / "future.pt")
    with pytest.raises(QDebugError, match="version"):
        qdebug.load(tmp_path / "future.pt")


# -- plain state_dicts and pickled modules ---------------------------------------------------
@pytest.mark.parametrize("wrap", [False, True])
def test_plain_state_dict_with_model_named(tmp_path, stages, wrap):
    sd = stages.models["float"].state_dict()
    torch.save({"state_dict": sd, "epoch": 3} if wrap else sd, tmp_path / "sd.pt")
    model, info = qdebug.load(tmp_path / "sd.pt", model=stages.spec, model_kwargs=stages.kwargs)
    assert info.stage == "float" and info.source == "state_dict"
    assert torch.equal(_run(model, stages.x), _run(stages.models["float"], stages.x))


def test_plain_state_dict_without_model_asks_for_model(tmp_path, stages):
    torch.save(stages.models["float"].state_dict(), tmp_path / "sd.pt")
    with pytest.raises(QDebugError) as exc:
        qdebug.load(tmp_path / "sd.pt")
    assert 'model="package.module:Class"' in str(exc.value)  # from Python: the argument, not --model


def test_pickled_module_refused_unless_unsafe(tmp_path, stages):
    torch.save(stages.models["float"], tmp_path / "whole.pt")
    with pytest.raises(QDebugError) as exc:
        qdebug.load(tmp_path / "whole.pt")
    assert "unsafe=True" in str(exc.value) and "--unsafe-load" not in str(exc.value)
    model, info = qdebug.load(tmp_path / "whole.pt", unsafe=True)
    assert info.source == "pickle"
    assert torch.equal(_run(model, stages.x), _run(stages.models["float"], stages.x))


@pytest.mark.parametrize("content", ["random", "truncated", "empty"])
def test_unreadable_files_are_not_called_pickles(tmp_path, stages, content):
    blob = stages.calibrated.read_bytes()
    data = {"random": os.urandom(4096), "truncated": blob[: len(blob) // 2], "empty": b""}[content]
    (tmp_path / "bad.pt").write_bytes(data)
    for unsafe in (False, True):
        with pytest.raises(QDebugError) as exc:
            read_file(tmp_path / "bad.pt", unsafe=unsafe)
        assert "not a readable torch file" in exc.value.message
        assert "--unsafe-load" not in str(exc.value)


# -- model spec safety ----------------------------------------------------------------------
def _crafted(tmp_path, stages, spec, kwargs=None, stage="float"):
    raw = torch.load(stages.path(stage), weights_only=True)
    raw["model"] = {"class": spec, "kwargs": kwargs or {}}
    path = tmp_path / f"crafted-{uuid.uuid4().hex[:6]}.pt"
    torch.save(raw, path)
    return path


@pytest.mark.parametrize(
    "spec, kwargs",
    [("os:system", {"command": "echo pwned"}), ("builtins:eval", {"source": "1 + 1"}),
     ("builtins:exec", {}), ("qdebug.zoo.resnet:resnet18", {})],
)
def test_spec_naming_a_function_is_refused_and_not_called(tmp_path, stages, monkeypatch, spec, kwargs):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a) or 0)
    import builtins

    monkeypatch.setattr(builtins, "exec", lambda *a, **k: calls.append(a))
    path = _crafted(tmp_path, stages, spec, kwargs)
    for stage_path in (path, _crafted(tmp_path, stages, spec, kwargs, stage="calibrated")):
        with pytest.raises(QDebugError, match="not an nn.Module subclass"):
            qdebug.load(stage_path)
    assert calls == []


def test_spec_naming_an_unimported_module_is_refused_without_importing(tmp_path, stages, monkeypatch):
    name = f"qdebug_side_effect_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported.txt"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = [f"{name}:Net", "qdebug_no_such_module_xyz:Net"]
    if "json.tool" not in sys.modules:
        specs.append("json.tool:main")
    for spec in specs:
        module = spec.split(":")[0]
        assert module not in sys.modules
        refusal = "in the standard library" if module == "json.tool" else "does not import modules named by a file"
        with pytest.raises(QDebugError, match=refusal) as exc:
            qdebug.load(_crafted(tmp_path, stages, spec))
        # --model is suggested only for a class the module's source (read, not run) defines
        assert (f'model="{spec}"' in (exc.value.hint or "")) == (spec == f"{name}:Net")
        assert module not in sys.modules
    assert not marker.exists()


def test_trusted_module_and_user_factory_are_allowed(tmp_path, stages, monkeypatch):
    name = f"qdebug_user_nets_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from qdebug.zoo.resnet import ResNet\n"
        "class MyNet(ResNet):\n"
        "    pass\n"
        "def make(**kw):\n"
        "    return ResNet(**kw)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _crafted(tmp_path, stages, f"{name}:MyNet", stages.kwargs)
    with pytest.raises(QDebugError):
        qdebug.load(path)
    assert name not in sys.modules
    model, info = qdebug.load(path, trusted_modules=(name,))  # e.g. the config's model names it
    assert type(model).__name__ == "MyNet"
    assert torch.equal(_run(model, stages.x), _run(stages.models["float"], stages.x))
    # the user may name a factory function (the file may not)
    model, info = qdebug.load(stages.float, model=f"{name}:make", model_kwargs=stages.kwargs)
    assert info.model.target == f"{name}:make"
    assert torch.equal(_run(model, stages.x), _run(stages.models["float"], stages.x))
    sys.modules.pop(name, None)


# -- architecture / shape mismatches -----------------------------------------------------------
def test_other_architecture_names_missing_and_unexpected_keys(stages):
    with pytest.raises(QDebugError) as exc:
        qdebug.load(stages.float, model="qdebug.zoo.multitask:MultiTaskNet", model_kwargs={"in_channels": 1, "width": 8})
    message = exc.value.message
    assert "missing" in message and "unexpected" in message
    assert "backbone.0.0.weight" in message and "conv1.weight" in message


def test_state_dict_with_a_removed_key(tmp_path, stages):
    sd = dict(stages.models["float"].state_dict())
    del sd["fc.bias"]
    torch.save(sd, tmp_path / "sd.pt")
    with pytest.raises(QDebugError) as exc:
        qdebug.load(tmp_path / "sd.pt", model=stages.spec, model_kwargs=stages.kwargs)
    assert "missing 1 key(s)" in exc.value.message and "fc.bias" in exc.value.message
    assert "unexpected" not in exc.value.message


def test_shape_mismatch_names_tensor_and_both_shapes(stages):
    with pytest.raises(QDebugError) as exc:
        qdebug.load(stages.float, model=stages.spec, model_kwargs={**stages.kwargs, "num_classes": 7})
    message = exc.value.message
    assert "'fc.weight'" in message and "[10, 16]" in message and "[7, 16]" in message


@pytest.mark.parametrize("stage", ["calibrated", "quantized"])
def test_prepared_checkpoint_with_other_architecture(stages, stage):
    with pytest.raises(QDebugError):
        qdebug.load(stages.path(stage), model="qdebug.zoo.multitask:MultiTaskNet", model_kwargs={"width": 8})


# -- atomic writes ----------------------------------------------------------------------------
@pytest.mark.parametrize("error", [OSError("No space left on device"), KeyboardInterrupt()])
@pytest.mark.parametrize("existing", [False, True])
def test_failing_save_leaves_no_target_and_no_temp_file(tmp_path, stages, monkeypatch, error, existing):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.pt"
    if existing:
        target.write_bytes(b"old content")
    written = []

    def broken_save(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 half a checkpoint")
        written.append(str(f))
        raise error

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(type(error)):
        qdebug.save(stages.models["calibrated"], target)
    assert written and written[0] != str(target)  # it wrote somewhere else first
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["model.pt"]
        assert target.read_bytes() == b"old content"
    else:
        assert list(out.iterdir()) == []


def test_successful_save_leaves_only_the_target(tmp_path, stages):
    qdebug.save(stages.models["float"], tmp_path / "sub" / "f.pt")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["f.pt"]


def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_umasks(tmp_path):
    import os
    import stat

    from qdebug.io.atomic import atomic_open

    private = tmp_path / "qdebug.toml"
    private.write_text("old\n")
    private.chmod(0o600)
    with atomic_open(private, "w") as fh:
        fh.write("new\n")
    assert private.read_text() == "new\n" and stat.S_IMODE(private.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    try:
        with atomic_open(tmp_path / "fresh.csv", "w") as fh:
            fh.write("x\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh.csv").stat().st_mode) == 0o644


# -- your own model without friction -------------------------------------------------------------
from pathlib import Path  # noqa: E402

from user_project import clean_imports, forget, write_package  # noqa: E402


@pytest.fixture
def project(tmp_path, monkeypatch):
    """tmp_path as the user's project (mypkg/net.py), the current directory, and not on sys.path."""
    write_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    with clean_imports(tmp_path):
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p) != tmp_path])
        forget("mypkg")
        yield tmp_path
        forget("mypkg")


def _saved_user_model(project, name: str, save, seed: int):
    """mypkg.net:Net built the way the user's training script would, written by ``save(model,
    path)``; (path, an input, the model's output on it)."""
    sys.path.insert(0, str(project))
    try:
        from mypkg.net import Net

        torch.manual_seed(seed)
        model = Net().eval()
        save(model, project / name)
        x = torch.randn(3, 4)
        expected = _run(model, x)
    finally:
        sys.path.remove(str(project))
        forget("mypkg")
    return project / name, x, expected


def _user_checkpoint(project, name="net.pt"):
    """A qdebug checkpoint of mypkg.net:Net."""
    return _saved_user_model(
        project, name, lambda m, p: qdebug.save(m, p, stage="float", sample_inputs=torch.randn(2, 4)), seed=0)


def test_an_untrusted_user_class_is_refused_with_the_one_time_fix(project):
    path, _, _ = _user_checkpoint(project)
    with pytest.raises(QDebugError) as exc:
        qdebug.load(path)
    assert exc.value.message == ("the checkpoint names model class mypkg.net:Net; qdebug does not import modules "
                                 "named by a file unless you trust them, and 'mypkg' is not trusted")
    assert exc.value.hint == ('if you trust it, pass trusted_modules=["mypkg"] (or add  trust = ["mypkg"]  to '
                              'qdebug.toml), or pass model="mypkg.net:Net"')  # Python's terms (the CLI's: test_trust)
    assert "mypkg" not in sys.modules


def test_a_trusted_package_trusts_its_modules_found_from_the_cwd(project):
    path, x, expected = _user_checkpoint(project)
    model, info = qdebug.load(path, trusted_modules=("mypkg",))  # mypkg trusts mypkg.net
    assert type(model).__module__ == "mypkg.net" and info.model.target == "mypkg.net:Net"
    assert torch.equal(_run(model, x), expected)


def _naming(project, target: str, name: str):
    """The user's checkpoint, edited to name ``target`` as its model class (a crafted file)."""
    raw = torch.load(_user_checkpoint(project)[0], weights_only=True)
    raw["model"]["class"] = target
    torch.save(raw, project / name)


def test_trust_is_by_package_not_by_name_prefix(project):
    write_package(project, "mypkgevil", marker=project / "evil-imported.txt")
    (project / "mypkgevil" / "__init__.py").write_text(f"open({str(project / 'evil-imported.txt')!r}, 'w')\n")
    _naming(project, "mypkgevil.net:Net", "evil.pt")
    with pytest.raises(QDebugError, match="does not import modules named by a file"):
        qdebug.load(project / "evil.pt", trusted_modules=("mypkg",))
    assert "mypkgevil" not in sys.modules and not (project / "evil-imported.txt").exists()


def test_a_file_cannot_name_a_function_even_in_a_trusted_package(project):
    _naming(project, "mypkg.net:make", "factory.pt")
    with pytest.raises(QDebugError, match="not an nn.Module subclass"):
        qdebug.load(project / "factory.pt", trusted_modules=("mypkg",))
    assert not (project / "mypkg-make-called.txt").exists()
    # the user may name it
    model, info = qdebug.load(project / "factory.pt", model="mypkg.net:make")
    assert (project / "mypkg-make-called.txt").exists() and info.model.target == "mypkg.net:make"


def _whole_model_file(project, name="whole.pt"):
    """torch.save(model): the whole pickled module."""
    return _saved_user_model(project, name, torch.save, seed=1)


def test_a_torch_save_model_file_is_named_for_what_it_is(project):
    path, x, expected = _whole_model_file(project)
    with pytest.raises(QDebugError) as exc:
        read_file(path)
    assert exc.value.message == (f"{path} is a whole pickled model (torch.save(model)) of class mypkg.net.Net: "
                                 "loading it would run code from the file, so qdebug refuses")
    assert exc.value.hint == ("re-save it with torch.save(model.state_dict(), path) and name the class with "
                              '--model mypkg.net:Net (or model = "mypkg.net:Net" in qdebug.toml), '
                              "or pass --unsafe-load if you trust the file")
    assert "mypkg" not in sys.modules  # refused without importing anything
    # with --unsafe-load its class is found from the current directory, as the user expects
    model, info = qdebug.load(path, unsafe=True)
    assert info.source == "pickle" and torch.equal(_run(model, x), expected)


def test_unsafe_load_of_a_model_whose_class_is_not_findable_says_so(project, monkeypatch, tmp_path_factory):
    path, _, _ = _whole_model_file(project)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    with pytest.raises(QDebugError) as exc:
        qdebug.load(path, unsafe=True)
    assert "whole pickled model of class mypkg.net.Net" in exc.value.message
    assert "module 'mypkg' cannot be imported" in exc.value.message
    assert "run qdebug from the directory that holds mypkg/" in exc.value.hint
    assert 'model="mypkg.net:Net"' in exc.value.hint
    assert "damaged" not in str(exc.value)


def test_a_model_pickled_from_a_script_is_named_as_such(tmp_path, monkeypatch):
    import torch.nn as nn

    main = sys.modules["__main__"]

    class ScriptNet(nn.Linear):
        pass

    ScriptNet.__module__, ScriptNet.__qualname__ = "__main__", "ScriptNet"
    monkeypatch.setattr(main, "ScriptNet", ScriptNet, raising=False)
    torch.save(ScriptNet(2, 2), tmp_path / "script.pt")
    monkeypatch.delattr(main, "ScriptNet")
    with pytest.raises(QDebugError) as exc:
        qdebug.load(tmp_path / "script.pt")
    assert "whole pickled model (torch.save(model)) of class ScriptNet" in exc.value.message
    assert "(__main__)" in exc.value.message and "state_dict()" in exc.value.hint
    with pytest.raises(QDebugError) as exc:
        qdebug.load(tmp_path / "script.pt", unsafe=True)
    assert "defined in the script that saved it (__main__)" in exc.value.message
    assert "damaged" not in str(exc.value)


def test_a_model_inside_a_dict_is_named_by_its_class(tmp_path, stages):
    torch.save({"model": stages.models["float"], "epoch": 3}, tmp_path / "ckpt.pt")
    with pytest.raises(QDebugError) as exc:
        read_file(tmp_path / "ckpt.pt")
    assert "contains pickled Python objects (e.g. qdebug.zoo.resnet.ResNet)" in exc.value.message
    assert "--unsafe-load" in exc.value.hint


@pytest.mark.parametrize("kind", ["tensor", "pair", "dict", "images", "list"])
def test_a_data_file_passed_as_a_checkpoint_is_called_a_data_file(tmp_path, kind):
    x, y = torch.randn(6, 1, 4, 4), torch.arange(6)
    obj = {"tensor": x, "pair": (x, y), "dict": {"inputs": x, "targets": y}, "images": {"images": x, "labels": y},
           "list": [(x[:3], y[:3]), (x[3:], y[3:])]}[kind]
    torch.save(obj, tmp_path / "eval.pt")
    with pytest.raises(QDebugError) as exc:
        qdebug.load(tmp_path / "eval.pt")
    assert exc.value.message.startswith(f"{tmp_path / 'eval.pt'} is a data file (")
    assert exc.value.message.endswith("), not a checkpoint")
    assert f"pass it as data=\"{tmp_path / 'eval.pt'}\"" in exc.value.hint
    wording = {"tensor": "a tensor of 6 input(s), no targets", "list": "a list of 2 batch(es)"}
    assert wording.get(kind, "6 input(s) and their targets") in exc.value.message


def test_state_dicts_are_not_taken_for_data(tmp_path):
    import torch.nn as nn

    torch.save(nn.Linear(2, 3).state_dict(), tmp_path / "sd.pt")  # flat, undotted keys: weight, bias
    with pytest.raises(QDebugError, match="plain state_dict"):
        qdebug.load(tmp_path / "sd.pt")
    torch.save({"state_dict": nn.Linear(2, 3).state_dict(), "x": torch.ones(2)}, tmp_path / "train.pt")
    with pytest.raises(QDebugError, match="plain state_dict"):
        qdebug.load(tmp_path / "train.pt")


def test_save_with_model_kwargs_alone_records_the_models_own_class_with_them(tmp_path):
    # The kwargs were dropped unless model_spec was a string: the file then named the class with
    # no kwargs, and loading it built the default architecture and refused the weights.
    from qdebug.zoo import ResNet

    kwargs = {"layers": [1, 1], "widths": [4, 8], "num_classes": 3, "in_channels": 1, "stem": "small"}
    model = ResNet(**kwargs).eval()
    qdebug.save(model, tmp_path / "f.pt", stage="float", model_kwargs=kwargs)
    loaded, _ = qdebug.load(tmp_path / "f.pt")
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(loaded(x), model(x))
