"""Fuzzing the loaders: damaged and crafted copies of every kind of file qdebug reads, run
through the commands that read them.

Kinds of input (``KINDS``), each made from a seed file and run through its reader(s):

- checkpoint: the demo's four stages, and a checkpoint ``import`` wrote (its import report,
  folded and frozen BN) -> ``inspect`` and ``compare``;
- data: the demo's ``eval.pt`` and a tiny model's data in every form a data file takes (a
  tensor, ``(X, y)``, a dict with integer codes and their scale, half precision, a list of
  batches, a list of kwargs dicts, a legacy non-zip file) -> ``compare`` (the tiny model's
  calibrated and quantized checkpoints);
- plan: the ``plan.toml`` suggest writes -> ``calibrate --qconfig``;
- bundle: nan-trace's repro bundle (``before.pt`` + ``batch.pt``) -> ``nan-trace`` (replay);
- config: a ``qdebug.toml`` naming every key -> ``--config FILE inspect`` and ``calibrate``;
- torch-ao: prepared ``torch.ao`` state dicts (eager QAT, eager PTQ, FX QAT) -> ``import``.

Mutations, all seeded:

- bytes: flip bits, truncate, zero-fill a run, duplicate a run (a damaged download or disk);
- structure: the file loaded (weights_only, or tomllib), one value somewhere in its nested
  dicts, lists and tuples (the root included) deleted, renamed or replaced by a value of
  another kind -- None, numbers at the edges, strings, containers, and tensors that are
  empty, 0-d, of the wrong dtype (bool, integer, complex, half), the wrong shape, huge in one
  dimension's say-so, or NaN -- then saved again (a crafted or buggy writer);
- TOML text: a line deleted, duplicated or cut, a value replaced by an odd literal (control
  characters, newlines, huge and non-finite numbers, a date, wrong types, deep nesting), raw
  control bytes or invalid UTF-8 inserted (a hand edit gone wrong, a hostile file).

The seed files are made once (``build_seeds``); each is also run unchanged (``control_cases``)
and must pass, so that the fuzz of it gets past the parser.  The cases run in worker
processes (``python tests/fuzzing.py --worker CASES.json``, two side by side) that import
torch once and call the CLI in-process for each case, with its stdout and stderr captured, a
time limit per case (SIGALRM) and an address-space limit for the whole worker, and print one
JSON line per case.  A command with ``--out`` runs without it first (plots cost seconds) and
again with it only when it failed.  ``tests/test_fuzz.py`` holds every run to the error
contract: exit 0 or 2 (or 1, a failed check or a finding, for inspect and nan-trace), never
an internal error or a traceback, and nothing left in the case's folder (an --out folder, a
-o file, a staging folder) by a run that failed.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CASE_SECONDS = 60  # a case that runs longer is a hang
WORKER_ADDRESS_SPACE = 8 << 30  # bytes: a file that makes qdebug allocate more fails the case

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "fixtures" / "demo"
CHECKPOINTS = ("float.pt", "calibrated.pt", "qat.pt", "quantized.pt")
DATA = "eval.pt"
KINDS = ("checkpoint", "data", "plan", "bundle", "config", "torch-ao")
# Commands whose exit code 1 means "a check failed" (inspect: a file whose zeroed bytes left
# all-zero weights or scales is a loadable file with an error to report, not a crash;
# nan-trace: a non-finite value found).
CHECKING_COMMANDS = ("inspect", "nan-trace")

# The tiny model of the seeds: conftest's ResNet, 1x16x16 inputs (cheap to run many times).
TINY_MODEL = "qdebug.zoo.resnet:ResNet"
TINY_KWARGS = {"layers": [1, 1], "widths": [8, 16], "num_classes": 10, "in_channels": 1, "stem": "small"}
TINY_DATA_FORMS = ("data-tuple.pt", "data-tensor.pt", "data-codes.pt", "data-half.pt", "data-batches.pt",
                   "data-kwargs.pt", "data-legacy.pt")
TORCH_AO_SOURCES = ("ao-eager-qat-x86.pt", "ao-eager-ptq-qnnpack.pt", "ao-fx-qat-x86.pt")
# The files a config case's qdebug.toml names, copied into its folder: relative paths keep the
# text, and so the seeded mutations, the same from one run to the next.
CONFIG_FILES = ("float.pt", "calibrated.pt", "data-tuple.pt")


@dataclass
class Case:
    id: int
    kind: str  # one of KINDS
    source: str  # the seed file it was made from
    mutation: str  # what was done, in words
    dir: str  # the case's folder: its file, and every output a command may write
    argv: list[list[str]] = field(default_factory=list)  # the commands run on it
    control: bool = False  # the seed as written: its commands must succeed (the fuzz gets past the parser)


# -- byte-level damage ----------------------------------------------------------------------
def damage_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    size = len(data)
    kind = rng.choice(["flip", "truncate", "zero", "duplicate"])
    if kind == "flip":
        buf = bytearray(data)
        count = rng.randint(1, 16)
        for _ in range(count):
            buf[rng.randrange(size)] ^= 1 << rng.randrange(8)
        return bytes(buf), f"{count} bit(s) flipped"
    if kind == "truncate":
        cut = rng.randrange(size)
        return data[:cut], f"truncated to {cut} of {size} bytes"
    start = rng.randrange(size)
    length = min(size - start, rng.choice([1, 8, 64, 512, 4096, 65536]))
    if kind == "zero":
        return data[:start] + bytes(length) + data[start + length:], f"{length} bytes zeroed at {start}"
    return data[:start + length] + data[start:], f"{length} bytes at {start} duplicated"


# -- structural edits -------------------------------------------------------------------------
def _replacements(torch, original) -> list[tuple[str, object]]:
    """Values of other kinds to put where ``original`` was (in a torch file)."""
    values: list[tuple[str, object]] = [
        ("None", None), ("0", 0), ("-1", -1), ("True", True), ("10**12", 10**12), ("1e308", 1e308),
        ("nan", float("nan")), ("'x'", "x"), ("[]", []), ("{}", {}), ("{1: 2}", {1: 2}), ("()", ()),
        ("tensor 0-d", torch.tensor(3.0)), ("tensor empty", torch.zeros(0)),
        ("tensor NaN", torch.full((4,), float("nan"))), ("tensor bool", torch.ones(3, dtype=torch.bool)),
        ("tensor int64", torch.arange(6)), ("tensor complex", torch.zeros(2, dtype=torch.complex64)),
    ]
    if torch.is_tensor(original) and original.numel() > 0:
        values += [
            ("same tensor as half", original.to(torch.float16)),
            ("same tensor flattened", original.reshape(-1)),
            ("same tensor with its first row dropped", original[1:] if original.dim() else original),
            ("same tensor, negated", -original if original.dtype != torch.bool else original),
            ("same tensor x 1e30", original * 1e30 if original.is_floating_point() else original),
            ("same tensor as a stride-0 view of 10^5 rows",
             original.reshape(1, -1).expand(100000, -1) if original.numel() < 64 else original),
            ("same tensor with a NaN", _with_nan(torch, original)),
            ("same tensor transposed", original.t() if original.dim() == 2 else original.unsqueeze(0)),
        ]
    if isinstance(original, int) and not isinstance(original, bool):
        values += [("value + 1", original + 1), ("-value", -original), ("value x 10^6", original * 10**6)]
    if isinstance(original, float):
        values += [("-value", -original), ("inf", math.inf), ("value as a str", str(original))]
    if isinstance(original, str):
        values += [("'' (empty)", ""), ("value reversed", original[::-1]), ("'os:system'", "os:system"),
                   ("value + newline + control chars", original + "\n\x00\x1b[2J")]
    if isinstance(original, (list, tuple)) and original:
        values += [("value twice", [*original, *original]), ("first item only", [original[0]])]
    return values


def _with_nan(torch, tensor):
    if not tensor.is_floating_point():
        return tensor.float().reshape(-1).index_fill(0, torch.tensor([0]), float("nan")).reshape(tensor.shape)
    return tensor.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("nan")).reshape(tensor.shape)


class _Tuple(list):
    """A tuple of the loaded file, made editable while a path in it is changed."""


def _thaw(obj):
    if isinstance(obj, tuple):
        return _Tuple(_thaw(v) for v in obj)
    if isinstance(obj, list):
        return [_thaw(v) for v in obj]
    if isinstance(obj, dict):
        thawed = copy.copy(obj)  # the same kind of dict (an OrderedDict stays one)
        for key, value in obj.items():
            thawed[key] = _thaw(value)
        return thawed
    return obj


def _freeze(obj):
    if isinstance(obj, _Tuple):
        return tuple(_freeze(v) for v in obj)
    if isinstance(obj, list):
        return [_freeze(v) for v in obj]
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _freeze(value)
        return obj
    return obj


def _paths(obj, prefix=()) -> list[tuple]:
    """Every (container path) to a value inside nested dicts, lists and tuples."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found.append(prefix + (key,))
            found += _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for index, value in enumerate(obj[:8]):  # long lists: the first few are enough
            found.append(prefix + (index,))
            found += _paths(value, prefix + (index,))
    return found


def edit_structure(obj, rng: random.Random, replacements, prefer=None) -> tuple[object, str]:
    """``obj`` with one value somewhere in it (the root included) deleted, renamed or replaced;
    ``replacements(original)`` lists the values to put there; ``prefer(path)``: paths to pick
    half of the time (the part of the file a kind is about)."""
    root = [_thaw(obj)]  # a holder: the whole object can be replaced too
    paths = _paths(root)
    preferred = [p for p in paths if prefer and prefer(p[1:])]
    path = rng.choice(preferred if preferred and rng.random() < 0.5 else paths)
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    where = "/".join(map(str, path[1:])) or "the whole file"
    action = rng.choice(["replace", "replace", "replace", "delete", "rename"]) if len(path) > 1 else "replace"
    if action == "delete":
        del parent[key]
        return _freeze(root[0]), f"{where} deleted"
    if action == "rename" and isinstance(parent, dict):
        parent[f"{key}_renamed" if isinstance(key, str) else -1 - key] = parent.pop(key)
        return _freeze(root[0]), f"{where} renamed"
    label, value = rng.choice(replacements(parent[key]))
    parent[key] = value
    return _freeze(root[0]), f"{where} = {label}"


# -- TOML text and tables -----------------------------------------------------------------------
ODD_TOML_VALUES = (
    '""', '"\\u0000"', '"a\\nb = 1\\n[x]"', '"\\u001b[2J\\u0007"', '"\\u202e evil"', '"' + "x" * 100_000 + '"',
    "1e999", "-1e999", "inf", "-inf", "nan", "99999999999999999999999999", "-9223372036854775808", "0", "-1",
    "0.0", "1e-320", "true", "[]", "{}", '[1, "a", 2.5]', "{a = 1}", "1979-05-27T07:32:00Z", "07:32:00",
    '"../../../etc/passwd"', '"/dev/zero"', '"random:8x1x16x16"', '"qdebug.zoo.resnet:ResNet"',
    "[" * 40 + "]" * 40, "[" * 3000 + "]" * 3000, "{a = " * 30 + "1" + "}" * 30,
)
ODD_TOML_LINES = (
    "[" + ".".join(["a"] * 2000) + "]", "x = " + "[" * 100_000, "[weight]", "[[overrides]]", "= 1", "a.b.c = 1",
    "bits = 8\nbits = 9", "\x00", "\x1b[31m", "\ufeff", "key = \"unterminated",
)


def damage_toml(text: str, rng: random.Random) -> tuple[bytes, str]:
    """``text`` with one TOML-level mistake (a hand edit gone wrong, a hostile file)."""
    lines = text.splitlines()
    kind = rng.choice(["delete", "duplicate", "value", "value", "value", "line", "bytes", "invalid utf-8", "cut"])
    at = rng.randrange(len(lines))
    if kind == "delete":
        del lines[at]
        return "\n".join(lines).encode(), f"line {at + 1} deleted"
    if kind == "duplicate":
        lines.insert(at, lines[at])
        return "\n".join(lines).encode(), f"line {at + 1} duplicated"
    if kind == "value":
        assignments = [i for i, line in enumerate(lines) if "=" in line and not line.lstrip().startswith("#")]
        at = rng.choice(assignments)
        key = lines[at].split("=", 1)[0]
        value = rng.choice(ODD_TOML_VALUES)
        lines[at] = f"{key}= {value}"
        return "\n".join(lines).encode(), f"line {at + 1}'s value = {value[:40]}{'...' if len(value) > 40 else ''}"
    if kind == "line":
        line = rng.choice(ODD_TOML_LINES)
        lines.insert(at, line)
        return "\n".join(lines).encode(), f"{line[:40]!r} inserted at line {at + 1}"
    data = "\n".join(lines).encode()
    if kind == "bytes":
        return damage_bytes(data, rng)
    if kind == "invalid utf-8":
        cut = rng.randrange(len(data))
        return data[:cut] + b"\xff\xfe\xc3" + data[cut:], f"invalid UTF-8 inserted at byte {cut}"
    cut = rng.randrange(len(data))
    return data[:cut], f"cut at byte {cut} of {len(data)}"


def _toml_replacements(original) -> list[tuple[str, object]]:
    """Values of other kinds to put where ``original`` was (in a TOML table)."""
    values: list[tuple[str, object]] = [
        ("None (dropped)", None), ("0", 0), ("-1", -1), ("true", True), ("10**30", 10**30), ("1e308", 1e308),
        ("inf", math.inf), ("nan", math.nan), ("'x'", "x"), ("'a\\nb\\x00'", "a\nb\x00"), ("[]", []), ("{}", {}),
        ("['a', 1]", ["a", 1]), ("{a = {b = {c = 1}}}", {"a": {"b": {"c": 1}}}),
        ("a list nested 50 deep", _nested_list(50)), ("a 10^5-character string", "y" * 100_000),
    ]
    if isinstance(original, int) and not isinstance(original, bool):
        values += [("value + 1", original + 1), ("-value", -original), ("value x 10^6", original * 10**6),
                   ("value as a float", float(original)), ("value as a str", str(original))]
    if isinstance(original, float):
        values += [("-value", -original), ("value as a str", str(original))]
    if isinstance(original, str):
        values += [("'' (empty)", ""), ("value reversed", original[::-1]), ("value upper-cased", original.upper()),
                   ("value + '/..'", original + "/.."), ("value in a list", [original])]
    if isinstance(original, dict):
        values += [("value in a list", [original]), ("value with an unknown key", {**original, "unknown": 1})]
    return values


def _nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def to_toml(table: dict) -> str:
    """``table`` written as TOML (None values are left out: TOML has no null)."""
    lines: list[str] = []

    def emit(prefix: tuple, sub: dict) -> None:
        scalars = [(k, v) for k, v in sub.items() if not isinstance(v, dict) and v is not None]
        tables = [(k, v) for k, v in sub.items() if isinstance(v, dict)]
        if prefix and (scalars or not tables):
            lines.append("[" + ".".join(_toml_key(k) for k in prefix) + "]")
        lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars)
        for k, v in tables:
            emit(prefix + (k,), v)

    emit((), table)
    return "\n".join(lines) + "\n"


def _toml_key(key) -> str:
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else _toml_string(text)


def _toml_string(text: str) -> str:
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    return _toml_string(str(value))


# -- the seed files -------------------------------------------------------------------------------
def build_seeds(folder: Path) -> Path:
    """Every seed file a case is made from, written once under ``folder`` (its path returned):
    a tiny model's float, calibrated and quantized checkpoints and its data in each form, the
    plan, the repro bundle, the config, the torch.ao state dicts and what ``import`` makes of one."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is the fastest, and leaves a core to others
    try:
        _write_seeds(torch, folder)
    finally:
        torch.set_num_threads(threads)
    return folder


def _write_seeds(torch, folder: Path) -> None:
    import warnings

    import qdebug
    from qdebug.engine import QConfig, calibrate, convert, prepare
    from qdebug.io.modelspec import ModelSpec, build

    torch.manual_seed(0)
    net = build(ModelSpec(TINY_MODEL, TINY_KWARGS), from_user=True).eval()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 1, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    qdebug.save(net, folder / "float.pt", sample_inputs=x[:2])
    calibrated = prepare(net, QConfig(), mode="fuse_bn", example_inputs=x[:2])
    calibrate(calibrated, [x[:4], x[4:]])
    qdebug.save(calibrated, folder / "calibrated.pt", stage="calibrated", sample_inputs=x[:2])
    qdebug.save(convert(calibrated), folder / "quantized.pt", stage="quantized", sample_inputs=x[:2])
    _write_data_forms(torch, folder, x, y)
    _write_plan(folder)
    _write_bundle(torch, folder, x, y)
    _write_config(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notes
        _write_torch_ao(torch, folder, x)
    imported = _run_one(_commands("torch-ao", folder / "ao-eager-qat-x86.pt", "ao-eager-qat-x86.pt", folder)[0])
    if imported["code"] != 0:
        raise RuntimeError(f"qdebug import failed on the seed: {imported}")


def _write_data_forms(torch, folder: Path, x, y) -> None:
    scale, offset = (x.max() - x.min()) / 255, x.min()
    codes = ((x - offset) / scale).round().clamp(0, 255).to(torch.uint8)
    forms = {
        "data-tuple.pt": (x, y),
        "data-tensor.pt": x,
        "data-codes.pt": {"inputs": codes, "input_scale": scale, "input_offset": offset, "targets": y},
        "data-half.pt": {"x": x.half(), "labels": y},
        "data-batches.pt": [(x[:4], y[:4]), (x[4:], y[4:])],
        "data-kwargs.pt": [{"x": x[:4]}, {"x": x[4:]}],
    }
    for name, obj in forms.items():
        torch.save(obj, folder / name)
    torch.save((x, y), folder / "data-legacy.pt", _use_new_zipfile_serialization=False)


def _write_plan(folder: Path) -> None:
    """plan.toml as suggest writes it (its own writer): the calibrated checkpoint's qconfig plus
    a plan's 16-bit overrides (suggest's search itself is too slow to run for a seed)."""
    from qdebug.checkpoint import load
    from qdebug.cli.suggest import _plan_toml

    _, info = load(str(folder / "calibrated.pt"))
    overrides = {"layer1.0.conv2": {"weight": {"bits": 16}}, "layer2.0.relu": {"activation": {"bits": 16}},
                 "layer2.*": {"weight": {"bits": 16}, "activation": {"bits": 16}}}
    meta = {"bits": 16, "plan": {"points": list(overrides), "evaluations": 4, "overrides": overrides}}
    command = "qdebug calibrate float.pt --data CALIBRATION_DATA --qconfig plan.toml -o c16.pt"
    (folder / "plan.toml").write_text(_plan_toml(meta, info.qconfig.to_dict(), command))


def _write_bundle(torch, folder: Path, x, y) -> None:
    """nan-trace's repro bundle: an Inf in the second batch, found in step 2 (the optimizer's
    momentum is in the bundle too)."""
    bad = x.clone()
    bad[6, 0, 1, 1] = math.inf
    torch.save((bad, y), folder / "nan-data.pt")
    out = folder / "nan-out"
    run = _run_one(["nan-trace", str(folder / "calibrated.pt"), "--data", str(folder / "nan-data.pt"),
                    "--batch-size", "4", "--steps", "3", "--format", "json", "--out", str(out)])
    if run["code"] != 1 or not (out / "before.pt").is_file():
        raise RuntimeError(f"nan-trace wrote no repro bundle: {run}")
    for name in ("before.pt", "batch.pt"):
        (folder / name).write_bytes((out / name).read_bytes())


def _write_config(folder: Path) -> None:
    """A qdebug.toml that sets every key (its paths: the files ``CONFIG_FILES`` copies beside it)."""
    text = to_toml({
        "model": TINY_MODEL, "model_kwargs": TINY_KWARGS,
        "float": "float.pt", "calibrated": "calibrated.pt", "data": "data-tuple.pt", "batch_size": 4, "batches": 2,
        "metric": "top1", "ratio": 0.99, "mode": "fuse_bn", "device": "cpu", "out": "cfg_out", "trust": ["mypkg"],
        "tasks": {"top1": {"direction": "higher", "ratio": 0.98}},
        "qconfig": {"weight": {"bits": 8, "per_channel": True}, "activation": {"observer": "percentile"},
                    "overrides": {"layer2.*": {"activation": {"bits": 16}}}},
    })
    (folder / "qdebug.toml").write_text(text)


def _write_torch_ao(torch, folder: Path, x) -> None:
    """State dicts of a tiny model prepared by torch.ao: eager QAT (x86), eager PTQ (qnnpack)
    and FX QAT (x86), as docs/interop.md has users save them."""
    import torch.ao.quantization as tq
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    from qdebug.io.modelspec import ModelSpec, build

    fused = [["conv1", "bn1", "relu"], ["layer1.0.conv1", "layer1.0.bn1"], ["layer1.0.conv2", "layer1.0.bn2"],
             ["layer2.0.conv1", "layer2.0.bn1"], ["layer2.0.downsample.0", "layer2.0.downsample.1"]]

    def fresh(train: bool):
        torch.manual_seed(0)
        return build(ModelSpec(TINY_MODEL, TINY_KWARGS), from_user=True).train(train)

    def observed(prepared):
        """Two forward passes (the observers see data; the weights are not trained: a file's
        layout is what the import reads), then torch's eval oracle."""
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _ in range(2):
                prepared(torch.randn(4, 1, 16, 16, generator=gen))
        prepared.eval()
        prepared.apply(tq.disable_observer)
        return prepared

    qat = tq.fuse_modules_qat(fresh(True), fused)
    qat.qconfig = tq.get_default_qat_qconfig("x86")
    ptq = tq.fuse_modules(fresh(False), fused)
    ptq.qconfig = tq.get_default_qconfig("qnnpack")
    models = {
        "ao-eager-qat-x86.pt": observed(tq.prepare_qat(qat)),
        "ao-eager-ptq-qnnpack.pt": observed(tq.prepare(ptq)),
        "ao-fx-qat-x86.pt": observed(prepare_qat_fx(fresh(True), tq.get_default_qat_qconfig_mapping("x86"), (x[:2],))),
    }
    for name, model in models.items():
        torch.save(model.state_dict(), folder / name)


# -- cases ----------------------------------------------------------------------------------------
def _compare(ref: Path, other: Path, data: Path, out: Path, batches: str = "1") -> list[str]:
    # --no-isolated: the isolated pass doubles the forward cost and reads no file.
    return ["compare", str(ref), str(other), "--data", str(data), "--batches", batches, "--batch-size", "2",
            "--no-isolated", "--format", "json", "--out", str(out)]


def _commands(kind: str, path: Path, source: str, seeds: Path) -> list[list[str]]:
    """The commands that read a case's file ``path`` (made from ``source``)."""
    out = path.parent / "out"
    if kind == "checkpoint" and source == "imported.pt":
        return [["inspect", str(path), "--format", "json"],
                _compare(seeds / "float.pt", path, seeds / "data-tuple.pt", out, batches="2")]
    if kind == "checkpoint":
        return [["inspect", str(path), "--format", "json"], _compare(DEMO / "float.pt", path, DEMO / DATA, out)]
    if kind == "data" and source == DATA:
        return [_compare(DEMO / "float.pt", DEMO / "calibrated.pt", path, out, batches="2")]
    if kind == "data":  # engine models only: the float model's torch errors would stop a bad batch first
        return [_compare(seeds / "calibrated.pt", seeds / "quantized.pt", path, out, batches="3")]
    if kind == "plan":
        return [["calibrate", str(seeds / "float.pt"), "--data", str(seeds / "data-tuple.pt"), "--batch-size", "4",
                 "--qconfig", str(path), "-o", str(path.parent / "calibrated16.pt"), "--format", "json"]]
    if kind == "bundle":
        before = path if source == "before.pt" else seeds / "before.pt"
        batch = path if source == "batch.pt" else seeds / "batch.pt"
        return [["nan-trace", str(before), "--data", str(batch), "--steps", "1", "--format", "json"]]
    if kind == "config":
        return [["--config", str(path), "inspect", "--format", "json"],
                ["--config", str(path), "calibrate", "-o", str(path.parent / "calibrated.pt"), "--format", "json"]]
    if kind == "torch-ao":
        backend = Path(source).stem.rsplit("-", 1)[1]
        return [["import", str(path), "--from", "torch-ao", "--model", TINY_MODEL, "--model-kwargs",
                 json.dumps(TINY_KWARGS), "--data", str(seeds / "data-tuple.pt"), "--backend", backend,
                 "-o", str(path.parent / "imported.pt"), "--format", "json"]]
    raise ValueError(kind)


def _sources(kind: str) -> list[str]:
    if kind == "checkpoint":
        return [*CHECKPOINTS, "imported.pt"]
    if kind == "data":
        return [DATA, DATA, *TINY_DATA_FORMS]  # the demo's file as often as two tiny forms
    return {"plan": ["plan.toml"], "bundle": ["before.pt", "before.pt", "batch.pt"], "config": ["qdebug.toml"],
            "torch-ao": list(TORCH_AO_SOURCES)}[kind]


def _prefer(kind: str, source: str):
    """The part of a file a kind is about: edits land there half of the time."""
    if kind == "bundle" and source == "before.pt":
        return lambda path: path[:2] == ("meta", "nan_trace")
    if source == "imported.pt":  # what only an imported checkpoint holds
        return lambda path: bool(path) and path[0] in ("meta", "folded_bn", "frozen_bn")
    if kind == "torch-ao":
        return lambda path: bool(path) and any(w in str(path[0]) for w in ("fake_quant", "post_process", "scale"))
    return None


def _seed_path(source: str, seeds: Path) -> Path:
    return DEMO / source if source in (*CHECKPOINTS, DATA) else seeds / source


def _copy_beside(kind: str, case_dir: Path, seeds: Path) -> None:
    if kind == "config":
        for name in CONFIG_FILES:
            (case_dir / name).write_bytes((seeds / name).read_bytes())


def control_cases(workdir: Path, seeds: Path, first_id: int = 0) -> list[Case]:
    """One case per seed file ``build_seeds`` made, unchanged: each must pass its commands
    (exit 0, or 1 for nan-trace's finding), or the fuzz of that file would stop at the parser."""
    cases = []
    for kind in KINDS:
        for source in dict.fromkeys(_sources(kind)):
            if source in (*CHECKPOINTS, DATA):  # the demo's own files: tests/test_demo.py
                continue
            case_dir = workdir / f"case{first_id + len(cases)}"
            case_dir.mkdir(parents=True, exist_ok=True)
            path = case_dir / source
            path.write_bytes((seeds / source).read_bytes())
            _copy_beside(kind, case_dir, seeds)
            cases.append(Case(first_id + len(cases), kind, source, "none (the seed as written)", str(case_dir),
                              _commands(kind, path, source, seeds), control=True))
    return cases


def make_cases(seed: int, counts: dict[str, int], workdir: Path, seeds: Path, first_id: int = 0) -> list[Case]:
    """``counts[kind]`` seeded cases of each kind written under ``workdir`` (half byte or text
    damage, half structural edits); ``seeds``: the folder ``build_seeds`` wrote."""
    import torch

    rng = random.Random(seed)
    loaded: dict[str, object] = {}
    cases = []
    case_id = first_id
    for kind in KINDS:
        for _ in range(counts.get(kind, 0)):
            source = rng.choice(_sources(kind))
            original = _seed_path(source, seeds)
            case_dir = workdir / f"case{case_id}"
            case_dir.mkdir(parents=True, exist_ok=True)
            path = case_dir / source
            if source.endswith(".toml"):
                if rng.random() < 0.5:
                    data, mutation = damage_toml(original.read_text(), rng)
                    path.write_bytes(data)
                else:
                    import tomllib

                    table, mutation = edit_structure(tomllib.loads(original.read_text()), rng, _toml_replacements)
                    path.write_text(to_toml(table) if isinstance(table, dict) else _toml_value(table))
            elif rng.random() < 0.5:
                data, mutation = damage_bytes(original.read_bytes(), rng)
                path.write_bytes(data)
            else:
                if source not in loaded:
                    loaded[source] = torch.load(original, weights_only=True)
                obj, mutation = edit_structure(loaded[source], rng, lambda v: _replacements(torch, v),
                                               prefer=_prefer(kind, source))
                torch.save(obj, path, _use_new_zipfile_serialization=source != "data-legacy.pt")
            _copy_beside(kind, case_dir, seeds)
            cases.append(Case(case_id, kind, source, mutation, str(case_dir), _commands(kind, path, source, seeds)))
            case_id += 1
    return cases


# -- the worker ---------------------------------------------------------------------------------
class _Timeout(BaseException):
    pass


def _run_one(argv: list[str]) -> dict:
    import contextlib
    import io
    import signal

    from qdebug.cli import main
    from qdebug.cli.common import reset_state

    out, err = io.StringIO(), io.StringIO()

    def alarm(signum, frame):
        raise _Timeout()

    reset_state()  # the config and device of the case before must not carry over
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_SECONDS)
    start = time.perf_counter()
    code: object = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code if exc.code is not None else 0
    except _Timeout:
        code = "timeout"
    except BaseException as exc:  # escaped the CLI's own error handling: a bug
        code = f"escaped {type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
        reset_state()
    text = err.getvalue()
    lines = text.splitlines()
    return {"code": code, "seconds": round(time.perf_counter() - start, 3),
            "stderr": text if len(text) <= 4000 else f"{text[:1000]}\n[...]\n{text[-2000:]}",
            # judged on the whole of stderr (a 100 KB path in an error line is cut above)
            "error_line": any(line.startswith("error: ") for line in lines),
            "traceback": "Traceback" in text,
            "internal": next((line[:300] for line in lines if "internal error" in line), "")}


def _without_out(argv: list[str]) -> list[str]:
    at = argv.index("--out")
    return argv[:at] + argv[at + 2:]


def _run_watching(folder: Path, argv: list[str]) -> dict:
    """``_run_one``, plus the names it left in the case's folder (``new``)."""
    before = set(p.name for p in folder.iterdir())
    run = _run_one(argv)
    run["new"] = sorted(set(p.name for p in folder.iterdir()) - before)
    return run


def worker(cases_file: str) -> None:
    import resource

    import torch

    torch.set_num_threads(1)  # workers run side by side, one per core
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, WORKER_ADDRESS_SPACE))
    for raw in json.loads(Path(cases_file).read_text()):
        case = Case(**raw)
        folder = Path(case.dir)
        runs: list[dict] = []
        for argv in case.argv:
            # --out is what is checked after a *failure*, and its plots cost a second or
            # two: a command runs without it first, and again with it only when it failed.
            run = _run_watching(folder, _without_out(argv) if "--out" in argv else argv)
            if "--out" in argv and run["code"] not in (0, 1):
                run["with_out"] = _run_watching(folder, argv)
            runs.append(run)
        print(json.dumps({"id": case.id, "runs": runs}), flush=True)


def violations(case: Case, runs: list[dict]) -> list[str]:
    """What in one case's runs breaks the error contract (empty: none)."""
    problems = []
    for argv, first in zip(case.argv, runs):
        command = argv[2] if argv[0] == "--config" else argv[0]
        for run in [first, first["with_out"]] if "with_out" in first else [first]:
            problems += _broken(command, run)
        if case.control and first["code"] not in (0, 1):
            problems.append(f"{command}: the unchanged seed failed: exit {first['code']!r}: {first['stderr'][-300:]}")
    return problems


def _broken(command: str, run: dict) -> list[str]:
    """What in one run breaks the error contract."""
    problems = []
    code = run["code"]
    if code not in ((0, 1, 2) if command in CHECKING_COMMANDS else (0, 2)):
        problems.append(f"{command}: exit {code!r}")
    if run["internal"] or run["traceback"]:
        problems.append(f"{command}: " + (run["internal"] or run["stderr"].strip().splitlines()[-1]))
    if code == 2 and run.get("new"):
        problems.append(f"{command}: left {', '.join(run['new'])} behind after exit 2")
    if code == 2 and not run["error_line"]:
        problems.append(f"{command}: exit 2 without an error: line")
    return problems


def as_json(cases: list[Case]) -> str:
    return json.dumps([asdict(c) for c in cases])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/fuzzing.py --worker CASES.json")
