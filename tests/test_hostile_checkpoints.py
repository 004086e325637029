"""Hostile checkpoints (issue 17): every crafted, cut or overwritten file is one ``error:`` line,
a ``hint:`` and exit 2 -- never an internal error, a traceback, a hang or a huge allocation
(docs/checkpoints.md, "What is refused").

Most cases edit a real checkpoint of the ``stages`` fixture (loaded with weights_only, one
value changed, saved again) and run ``qdebug inspect`` in-process.  The allocation cases run
``python -m qdebug`` in a subprocess limited to 3 GiB of address space and a minute, the
FIFO cases in a subprocess with a timeout.
"""

from __future__ import annotations

import copy
import os
import resource
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import qdebug
from qdebug.checkpoint import SAMPLE_LIMIT
from qdebug.engine import QConfig, calibrate, prepare
from qdebug.io.modelspec import ModelSpec, build_meta

ADDRESS_SPACE = 3 << 30  # bytes: the allocation cases must fail cleanly inside it
SECONDS = 60
REPO = Path(__file__).resolve().parent.parent


def _edited(stages, stage: str, edit: Callable[[dict], Any], tmp_path: Path, name: str = "x.pt") -> Path:
    """``stage``'s checkpoint with ``edit`` applied to its loaded dict, saved as ``name``."""
    ckpt = copy.deepcopy(torch.load(stages.path(stage), map_location="cpu", weights_only=True))
    edit(ckpt)
    path = tmp_path / name
    torch.save(ckpt, path)
    return path


def _set(*keys: str, value: Any) -> Callable[[dict], None]:
    def edit(ckpt: dict) -> None:
        target = ckpt
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return edit


def _state(key: str, value: Any) -> Callable[[dict], None]:
    return _set("state", key, value=value)


def _linear(n: int, state: dict, **kwargs: Any) -> dict:
    """A float checkpoint naming torch.nn:Linear(n, n) over ``state``."""
    return {"format": "qdebug-checkpoint", "version": 1, "stage": "float",
            "model": {"class": "torch.nn:Linear", "kwargs": {"in_features": n, "out_features": n, **kwargs}},
            "qconfig": None, "qat_mode": None, "plan": None, "absorbed": [], "points": {}, "state": state,
            "sample_inputs": None, "meta": {}}


def _bounded_cli(*args: Any, timeout: float = SECONDS) -> subprocess.CompletedProcess:
    """``python -m qdebug ARGS`` in a subprocess with ADDRESS_SPACE bytes of address space."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run([sys.executable, "-m", "qdebug", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, cwd=REPO)


def _assert_clean(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert lines and lines[0].startswith("error: ") and 1 <= len(lines) <= 2, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


# -- item 5: every exception class is a clean error ----------------------------------------
STRUCTURE = {
    "meta not a dict": ("float", _set("meta", value=[1, 2]), ("'meta' is a list, not a table",)),
    "meta with an int key": ("float", _set("meta", value={1: "x"}), ("'meta' has a key 1 that is not a string",)),
    "points not a dict": ("qat", _set("points", value=["input"]), ("'points' is a list, not a table",)),
    "points entry not a dict": ("qat", _set("points", "input", value="fake"), ("points entry 'input' is a str",)),
    "points with an int key": ("qat", _set("points", 3, value={}), ("'points' has a key 3",)),
    "state not a dict": ("float", _set("state", value=[1]), ("'state' is a list, not a dict of tensors",)),
    "state value not a tensor": ("float", _state("conv1.weight", 3), ("state entry 'conv1.weight' is a int",)),
    "state value a string (quantized)": ("quantized", _state("fc.weight", "w"), ("state entry 'fc.weight' is a str",)),
    "state with an int key": ("float", _state(5, torch.zeros(1)), ("'state' has a key 5 that is not a string",)),
    "model kwargs with an int key": ("float", _set("model", "kwargs", 1, value=2),
                                     ("model kwargs have a key 1 that is not a string",)),
    "model kwarg a tensor": ("float", _set("model", "kwargs", "num_classes", value=torch.tensor(10)),
                             ("model kwarg 'num_classes' is a Tensor",)),
    "scale of the wrong shape": ("qat", _state("qdebug_points.input.scale", torch.ones(3, 3)),
                                 ("quant point 'input': saved scale has shape [3, 3]",)),
    "scale of the wrong dtype": ("qat", _state("qdebug_points.input.scale", torch.ones((), dtype=torch.complex64)),
                                 ("'qdebug_points.input.scale' has dtype torch.complex64",)),
    "zero point of the wrong shape": ("qat", _state("qdebug_points.input.zero_point", torch.zeros(7, dtype=torch.int32)),
                                      ("saved zero_point has shape [7] but its scale []",)),
    "qparams_set of the wrong shape": ("qat", _state("qdebug_points.input.qparams_set", torch.ones(3, dtype=torch.bool)),
                                       ("saved qparams_set has shape [3]",)),
    "observer buffer of the wrong shape": ("qat", _state("qdebug_points.input.observer.min_val", torch.ones(4)),
                                           ("observer.min_val has shape (4,)",)),
    "observer count of the wrong dtype": ("qat", _state("qdebug_points.input.observer.nonfinite", torch.tensor(1.5)),
                                          ("observer.nonfinite' has dtype torch.float32",)),
    "observer range NaN": ("qat", _state("qdebug_points.input.observer.min_val", torch.tensor(float("nan"))),
                           ("observer.min_val holds NaN",)),
    "absorbed not a list": ("qat", _set("absorbed", value="conv1"), ("'absorbed' is not a list of module paths",)),
    "absorbed names no pair": ("qat", _set("absorbed", value=["nope"]), ("'absorbed' names 'nope'",)),
    "frozen_bn not paths": ("qat", _set("frozen_bn", value=[1]), ("'frozen_bn' is not a list of module paths",)),
    "unknown qat_mode": ("qat", _set("qat_mode", value="bogus"), ("unknown qat_mode 'bogus'",)),
    "plan call malformed": ("qat", _set("plan", "calls", 0, value={"name": 3}), ("the saved plan has a malformed call",)),
    "plan names a missing module": ("qat", _set("plan", "calls", 1, "owner", value="no.such"),
                                    ("names module 'no.such', which it does not have",)),
    "plan pairs malformed": ("qat", _set("plan", "pairs", value=[[1, 2, 3]]), ("malformed Conv-BN pair",)),
    "plan counts not numbers": ("qat", _set("plan", "call_counts", "conv1", value="x"), ("call_counts",)),
}


@pytest.mark.parametrize("stage, edit, fragments", STRUCTURE.values(), ids=list(STRUCTURE))
def test_malformed_structure_is_a_clean_error(stages, cli, tmp_path, stage, edit, fragments):
    cli("inspect", _edited(stages, stage, edit, tmp_path)).assert_error(*fragments)


def test_malformed_checkpoint_is_clean_in_compare_too(stages, cli, tmp_path):
    path = _edited(stages, "qat", _state("conv1.weight", 3), tmp_path)
    cli("compare", stages.float, path, "--data", stages.data).assert_error("state entry 'conv1.weight' is a int")


def test_bad_input_scale_in_data_is_a_clean_error(stages, cli, tmp_path):
    data = tmp_path / "data.pt"
    torch.save({"inputs": torch.zeros(4, 1, 16, 16, dtype=torch.uint8), "targets": torch.zeros(4, dtype=torch.long),
                "input_scale": "x"}, data)
    cli("compare", stages.float, stages.qat, "--data", data).assert_error("input_scale")


# -- item 6: bad content is refused, not trusted ---------------------------------------------
def _weight_point(point: str, scale: torch.Tensor, zero_point: torch.Tensor) -> Callable[[dict], None]:
    def edit(ckpt: dict) -> None:
        key = f"qdebug_points.{point}"
        ckpt["state"][f"{key}.scale"] = scale
        ckpt["state"][f"{key}.zero_point"] = zero_point
        ckpt["state"][f"{key}.observer.min_val"] = -scale
        ckpt["state"][f"{key}.observer.max_val"] = scale
    return edit


CONTENT = {
    "version 0": ("float", _set("version", value=0), ("invalid checkpoint version 0",)),
    "version negative": ("float", _set("version", value=-1), ("invalid checkpoint version -1",)),
    "version True": ("float", _set("version", value=True), ("invalid checkpoint version True",)),
    "version a string": ("float", _set("version", value="1"), ("invalid checkpoint version '1'",)),
    "unknown point mode": ("qat", _set("points", "input", "mode", value="bogus"),
                           ("points entry 'input' has an unknown mode 'bogus'",)),
    "point alpha out of range": ("qat", _set("points", "input", "alpha", value=2.0), ("alpha is 2.0",)),
    "point frozen not a bool": ("qat", _set("points", "input", "frozen", value=1), ("frozen is 1, not true or false",)),
    "point unknown to the model": ("qat", _set("points", "nope", value={"mode": "fake"}),
                                   ("'points' names 'nope', which is no quant point",)),
    "zero point outside [qmin, qmax]": ("qat", _state("qdebug_points.input.zero_point", torch.tensor(1000, dtype=torch.int32)),
                                        ("saved zero point 1000 is outside [-128, 127]",)),
    "zero point not an integer": ("qat", _state("qdebug_points.input.zero_point", torch.tensor(0.5)),
                                  ("'qdebug_points.input.zero_point' has dtype torch.float32",
                                   "keeps integer values")),
    "symmetric zero point not 0": ("quantized", _weight_point("conv1/weight", torch.full((8,), 0.01),
                                                              torch.full((8,), 3, dtype=torch.int32)),
                                   ("saved zero point 3 is not 0",)),
    "negative scale": ("qat", _state("qdebug_points.input.scale", torch.tensor(-0.1)),
                       ("quant point 'input' has a negative scale (-0.1)",)),
    "negative per-channel scale": ("quantized", _weight_point("conv1/weight", torch.full((8,), -0.01),
                                                              torch.zeros(8, dtype=torch.int32)),
                                   ("quant point 'conv1.weight' has a negative scale (-0.01)",)),
    "per-channel scales of another length": ("quantized", _weight_point("conv1/weight", torch.full((5,), 0.01),
                                                                        torch.zeros(5, dtype=torch.int32)),
                                             ("'conv1.weight' has 5 per-channel scale(s), but its weight has 8",)),
    "weight_int of another shape": ("quantized", _state("conv1.weight_int", torch.zeros(3, dtype=torch.int8)),
                                    ("'conv1.weight_int' has shape [3], but its weight [8, 1, 3, 3]",)),
    "weight_int not integers": ("quantized", _state("conv1.weight_int", torch.zeros(8, 1, 3, 3)),
                                ("'conv1.weight_int' has dtype torch.float32",)),
    "weight_int out of range": ("quantized", _state("conv1.weight_int", torch.full((8, 1, 3, 3), 300, dtype=torch.int16)),
                                ("'conv1.weight_int' holds 300, outside [-128, 127]",)),
    "complex weights": ("float", _state("conv1.weight", torch.zeros(8, 1, 3, 3, dtype=torch.complex64)),
                        ("'conv1.weight' has dtype torch.complex64", "floating-point")),
    "bool weights": ("float", _state("conv1.weight", torch.zeros(8, 1, 3, 3, dtype=torch.bool)),
                     ("'conv1.weight' has dtype torch.bool",)),
    "integer weights": ("float", _state("conv1.weight", torch.zeros(8, 1, 3, 3, dtype=torch.int64)),
                        ("'conv1.weight' has dtype torch.int64",)),
    "integer buffer from floats": ("float", _state("bn1.num_batches_tracked", torch.tensor(1.5)),
                                   ("'bn1.num_batches_tracked' has dtype torch.float32",)),
    "sparse weights": ("float", _state("conv1.weight", torch.zeros(8, 1, 3, 3).to_sparse()),
                       ("'conv1.weight' is a torch.sparse_coo",)),
}


@pytest.mark.parametrize("stage, edit, fragments", CONTENT.values(), ids=list(CONTENT))
def test_bad_content_is_refused(stages, cli, tmp_path, stage, edit, fragments):
    cli("inspect", _edited(stages, stage, edit, tmp_path)).assert_error(*fragments)


@pytest.fixture(scope="module")
def histogram_checkpoint(tmp_path_factory, make_resnet, images) -> Path:
    """A calibrated checkpoint whose activation observers keep histograms (percentile)."""
    model = prepare(make_resnet(0), QConfig.from_dict({"activation": {"observer": "percentile"}}),
                    example_inputs=images(4))
    calibrate(model, [images(8, seed=10)])
    path = tmp_path_factory.mktemp("hist") / "calibrated.pt"
    qdebug.save(model, path, stage="calibrated", sample_inputs=images(4))
    return path


HISTOGRAM = {
    "negative counts": ("hist", lambda t: -t.abs() - 1, "histogram holds negative counts"),
    "NaN width": ("width", lambda t: torch.full_like(t, float("nan")), "histogram width is negative or not finite"),
    "negative width": ("width", lambda t: -t - 1, "histogram width is negative or not finite"),
    "anchor out of range": ("anchor", lambda t: torch.full_like(t, -(2**63)), "histogram anchor is out of range"),
    "other bin count": ("hist", lambda t: t[:, :7], "has 7 bins but the spec says bins=2048"),
    "rows disagree": ("hist", lambda t: t.repeat(3, 1), "disagree on the channel count"),
}


@pytest.mark.parametrize("buffer, change, fragment", HISTOGRAM.values(), ids=list(HISTOGRAM))
def test_bad_histogram_state_is_refused(histogram_checkpoint, cli, tmp_path, buffer, change, fragment):
    """Values the histogram's update could loop on (a NaN width never fits) are refused at load."""
    ckpt = torch.load(histogram_checkpoint, weights_only=True)
    key = f"qdebug_points.input.observer.{buffer}"
    ckpt["state"][key] = change(ckpt["state"][key]).clone()
    torch.save(ckpt, tmp_path / "x.pt")
    cli("inspect", tmp_path / "x.pt").assert_error(fragment)


def test_a_scale_at_its_floor_is_data_not_damage(stages, cli, tmp_path):
    """A scale at qdebug's floor (eps: an empty or constant-zero range) loads; inspect reports
    it.  (A zero or subnormal scale is refused: tests/test_clean_failures.py.)"""
    eps = torch.finfo(torch.float32).eps
    path = _edited(stages, "qat", _state("qdebug_points.input.scale", torch.tensor(eps)), tmp_path)
    result = cli("inspect", path)
    assert result.code in (0, 1) and "zero scale" in result.out and "error:" not in result.err, result


def test_nan_weights_are_data_not_damage(stages, cli, tmp_path):
    """A model whose weights (and learned scale) went NaN still loads: inspect reports it, compare runs."""
    def diverge(ckpt: dict) -> None:
        ckpt["state"]["conv1.weight"].fill_(float("nan"))
        ckpt["state"]["qdebug_points.input.scale"] = torch.tensor(float("nan"))
    path = _edited(stages, "qat", diverge, tmp_path)
    result = cli("inspect", path)
    assert result.code == 1 and "non-finite weights" in result.out and "non-finite scale" in result.out, result
    result = cli("compare", stages.float, path, "--data", stages.data)
    assert result.code in (0, 1) and "error" not in result.err, result
    model, info = qdebug.load(path)
    assert torch.isnan(model.conv1.weight).all() and info.stage == "qat"


# -- damaged files: called damaged, never "pickled objects ... --unsafe-load" ------------------
def _data_pkl(path: Path) -> tuple[int, int]:
    """(offset, size) of the pickle inside a torch zip archive."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _rezipped(src: Path, dst: Path, edit: Callable[[bytes], bytes]) -> Path:
    """``src`` with its pickle edited and every CRC valid again (a crafted, not a damaged, file)."""
    with zipfile.ZipFile(src) as archive, zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as out:
        for info in archive.infolist():
            data = archive.read(info.filename)
            out.writestr(info.filename, edit(data) if info.filename.endswith("data.pkl") else data)
    return dst


def _flipped_pickle(stages, tmp_path: Path) -> Path:
    raw = bytearray(stages.qat.read_bytes())
    offset, size = _data_pkl(stages.qat)
    raw[offset + size // 2] ^= 0xFF
    (tmp_path / "x.pt").write_bytes(raw)
    return tmp_path / "x.pt"


def _renamed_global(stages, tmp_path: Path) -> Path:
    raw = bytearray(stages.qat.read_bytes())
    offset, size = _data_pkl(stages.qat)
    at = raw.index(b"_rebuild_tensor_v2", offset, offset + size)
    raw[at:at + 18] = b"_rebuild_tensor_v3"  # a global the unpickler refuses, in a record that fails its CRC
    (tmp_path / "x.pt").write_bytes(raw)
    return tmp_path / "x.pt"


DAMAGE = {
    "pickle byte flipped": (_flipped_pickle, "fails its CRC-32 check"),
    "global renamed by damage": (_renamed_global, "fails its CRC-32 check"),
    "pickle cut short (valid CRC)": (lambda s, t: _rezipped(s.qat, t / "x.pt", lambda d: d[: len(d) // 2]),
                                     "its pickle is cut short or malformed"),
    "unknown opcode (valid CRC)": (lambda s, t: _rezipped(s.qat, t / "x.pt", lambda d: d[:2] + b"\xfe" + d[3:]),
                                   "its pickle is cut short or malformed"),
    "truncated archive": (lambda s, t: (t / "x.pt").write_bytes(s.qat.read_bytes()[:-5000]) and t / "x.pt",
                          "is not a readable torch file"),
    "zero-filled middle": (lambda s, t: (t / "x.pt").write_bytes(
        (lambda b: b[: len(b) // 3] + bytes(4096) + b[len(b) // 3 + 4096:])(s.qat.read_bytes())) and t / "x.pt",
        "is not a readable torch file"),
}


@pytest.mark.parametrize("damage, fragment", DAMAGE.values(), ids=list(DAMAGE))
def test_damaged_archive_is_called_damaged(stages, cli, tmp_path, damage, fragment):
    result = cli("inspect", damage(stages, tmp_path))
    result.assert_error(fragment)
    assert "--unsafe-load" not in result.err and "pickled" not in result.err, result.err


def test_an_intact_pickle_naming_a_class_still_says_so(stages, cli, tmp_path):
    path = _rezipped(stages.float, tmp_path / "x.pt", lambda d: d.replace(b"OrderedDict", b"OrderedDicX"))
    cli("inspect", path).assert_error("contains pickled Python objects (e.g. collections.OrderedDicX)")


def test_zip_bomb_is_refused_unread(stages, cli, tmp_path):
    ckpt = torch.load(stages.float, weights_only=True)
    ckpt["state"]["conv1.weight"] = torch.zeros(100_000_000)  # 400 MB of zeros: a few hundred KB deflated
    plain = tmp_path / "plain.pt"
    torch.save(ckpt, plain)
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(plain) as archive, zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for info in archive.infolist():
            out.writestr(info.filename, archive.read(info.filename))
    plain.unlink()
    assert bomb.stat().st_size < 5_000_000
    cli("inspect", bomb).assert_error("is a compressed archive", "torch.save never compresses")


# -- item 3: no allocation from a file's say-so ---------------------------------------------
ALLOCATION = {
    "Linear 32000x32000 over a small state": (
        _linear(32000, {"weight": torch.zeros(10, 10), "bias": torch.zeros(10)}),
        "shape mismatch for tensor 'weight': checkpoint [10, 10], model [32000, 32000]"),
    "Linear 10^6 x 10^6 over a small state": (
        _linear(10**6, {"weight": torch.zeros(10, 10), "bias": torch.zeros(10)}),
        "model [1000000, 1000000]"),
    "Linear 10^6 x 10^6 over an expanded view": (
        _linear(10**6, {"weight": torch.zeros(1).expand(10**6, 10**6), "bias": torch.zeros(1).expand(10**6)}),
        "state entry 'weight' is an expanded view"),
    "Linear asking for device=cpu": (
        _linear(32000, {"bias": torch.zeros(32000)}, device="cpu"), "missing 1 key(s) e.g. weight"),
    "Linear too large for int64": (_linear(10**10, {"bias": torch.zeros(10)}), "Storage size calculation overflowed"),
}


@pytest.mark.parametrize("ckpt, fragment", ALLOCATION.values(), ids=list(ALLOCATION))
def test_a_huge_model_over_a_small_state_allocates_nothing(tmp_path, ckpt, fragment):
    path = tmp_path / "x.pt"
    torch.save(ckpt, path)
    assert path.stat().st_size < 1_000_000
    start = time.monotonic()
    _assert_clean(_bounded_cli("inspect", path), fragment)
    assert time.monotonic() - start < SECONDS


def test_prepared_checkpoint_may_not_lack_more_than_it_stores(stages, tmp_path):
    """A prepared checkpoint may lack BatchNorm entries (folded), but not gigabytes of them."""
    ckpt = torch.load(stages.calibrated, weights_only=True)
    ckpt["model"] = {"class": "torch.nn:BatchNorm1d", "kwargs": {"num_features": 2_000_000_000}}
    ckpt["plan"] = {"calls": [], "pairs": [], "call_counts": {}}
    ckpt["state"] = {}
    torch.save(ckpt, tmp_path / "x.pt")
    _assert_clean(_bounded_cli("inspect", tmp_path / "x.pt"), "holds 30517.6 MiB of tensors",
                  "state stores only 0 bytes")


def test_tensors_sharing_one_storage_do_not_multiply_it(stages, cli, tmp_path):
    """Every weight a view of one storage: the model would hold far more than the file stores."""
    kwargs = {"layers": [2, 2], "widths": [256, 512], "num_classes": 10, "in_channels": 1, "stem": "small"}
    own = build_meta(ModelSpec(stages.spec, kwargs), from_user=True, max_modules=10**4).state_dict()
    backing = torch.zeros(max(t.numel() for t in own.values()))
    state = {k: backing[: t.numel()].view(t.shape) if t.is_floating_point() else torch.zeros(t.shape, dtype=t.dtype)
             for k, t in own.items()}
    ckpt = torch.load(stages.float, weights_only=True)
    ckpt["model"] = {"class": stages.spec, "kwargs": kwargs}
    ckpt["state"] = state
    torch.save(ckpt, tmp_path / "x.pt")
    cli("inspect", tmp_path / "x.pt").assert_error("of tensors, but the file's state stores only")


def test_a_constructor_building_too_many_modules_is_stopped(stages, tmp_path):
    def deep(ckpt: dict) -> None:
        ckpt["model"]["kwargs"]["layers"] = [10**7, 1]
    path = _edited(stages, "float", deep, tmp_path)
    start = time.monotonic()
    _assert_clean(_bounded_cli("inspect", path), "modules and tensors, far more than the file's state holds")
    assert time.monotonic() - start < SECONDS


def test_model_kwargs_nested_exponentially_are_refused(stages, tmp_path):
    nested: list = []
    for _ in range(30):
        nested = [nested] * 50  # 50^30 values when walked or printed, a few KB pickled (shared references)
    path = _edited(stages, "float", _set("model", "kwargs", "extra", value=nested), tmp_path)
    _assert_clean(_bounded_cli("inspect", path), "model kwargs are too large")


def test_expanded_sample_inputs_are_refused(stages, tmp_path):
    """20000 images as a stride-0 view of one (a few KB on disk) never reach the model."""
    path = _edited(stages, "float", _set("sample_inputs", value=torch.zeros(1, 1, 16, 16).expand(20000, 1, 16, 16)),
                   tmp_path)
    _assert_clean(_bounded_cli("inspect", path), "'sample_inputs' is an expanded view")


@pytest.mark.parametrize("samples, batches", [
    (torch.randn(500, 1, 16, 16), None),
    ([torch.randn(2, 1, 16, 16)] * 1000, SAMPLE_LIMIT // 2),
    ([(torch.randn(3, 1, 16, 16), torch.zeros(3, dtype=torch.long))] * 100, -(-SAMPLE_LIMIT // 3)),
], ids=["one batch", "list of batches", "list of (inputs, targets)"])
def test_sample_inputs_are_capped(stages, tmp_path, samples, batches):
    path = _edited(stages, "float", _set("sample_inputs", value=samples), tmp_path)
    _, info = qdebug.load(path)
    if batches is None:
        assert info.sample_inputs.shape[0] == SAMPLE_LIMIT
    else:
        assert len(info.sample_inputs) == batches


def test_sample_inputs_nested_too_deeply_are_refused(stages, cli, tmp_path):
    nested: Any = torch.zeros(1, 1, 16, 16)
    for _ in range(6):
        nested = (nested,)
    cli("inspect", _edited(stages, "float", _set("sample_inputs", value=nested), tmp_path)).assert_error(
        "'sample_inputs' nests more than 4 levels")


# -- item 4: no hangs, bounded reads ---------------------------------------------------------
@pytest.mark.parametrize("where", ["checkpoint", "data"])
def test_a_named_pipe_is_refused_before_it_is_opened(stages, tmp_path, where):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    args = ("inspect", fifo) if where == "checkpoint" else ("compare", stages.float, stages.qat, "--data", fifo)
    _assert_clean(_bounded_cli(*args, timeout=SECONDS), "pipe.pt is a named pipe (FIFO), not a regular file")


def test_a_link_to_dev_zero_is_refused(cli, tmp_path):
    (tmp_path / "zero.pt").symlink_to("/dev/zero")
    cli("inspect", tmp_path / "zero.pt").assert_error("(-> /dev/zero) is a character device, not a regular file")


def test_a_directory_is_refused(cli, tmp_path):
    (tmp_path / "d.pt").mkdir()
    cli("inspect", tmp_path / "d.pt").assert_error("is a directory")


def test_a_tensor_in_meta_is_summarised_in_json_never_an_internal_error(cli, stages, tmp_path):
    """Found by a long fuzz run: meta may hold tensors (nan-trace's bundle does), and JSON
    output called .item() on a 3-element one."""
    d = torch.load(stages.float, weights_only=True)
    d["meta"]["time"] = torch.ones(3, dtype=torch.bool)
    torch.save(d, tmp_path / "odd_meta.pt")
    result = cli("inspect", "odd_meta.pt", "--format", "json")
    assert result.code == 0, result.err
    assert "<Tensor shape=[3] dtype=torch.bool>" in result.out
