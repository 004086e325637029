"""Streaming data (issue 18, item 1): ``--data`` as a lazy, re-iterable ``BatchSource``.

A data function's iterable is consumed batch by batch; a map-style DataLoader is read through
its batch sampler's index lists, the same batches on every pass; ``shard`` splits batches
DistributedSampler-style with global indices, after ``--batches``; a one-shot generator's
function is called again per pass; data that changes between passes is caught by its
fingerprints; ``.pt`` files are sliced from a memory map, equal bit for bit to the eager
batches; ``random:`` is regenerated from its seed; ``ReplayModel`` matches by position.

User modules are written into ``tmp_path`` under unique names and put on ``sys.path``.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

import pytest
import torch

import qdebug
import qdebug.io.torchfile as torchfile
from qdebug.data import file as data_file
from qdebug.data.batch import fingerprint
from qdebug.data.source import BatchSource
from qdebug.data.batch import Batch
from qdebug.data.spec import batches_from_iterable, load_batches
from qdebug.errors import QDebugError
from qdebug.tools.metric_replay import ReplayModel, input_fingerprint

DATASET = '''
import torch
from torch.utils.data import DataLoader, Dataset

LOADED = []  # sample indices read, in the main process (num_workers=0)
CALLS = []   # one entry per call of a data function
PULLED = []  # one entry per item a generator gave


class Squares(Dataset):
    """Sample i: a 1x16x16 image filled with i / 10, label i % 10; ``noise``: random augmentation."""

    def __init__(self, n=20, noise=False):
        self.n, self.noise = n, noise

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        LOADED.append(i)
        x = torch.full((1, 16, 16), i / 10.0)
        if self.noise:
            x = x + torch.rand(1, 16, 16)
        return x, i % 10


def loader(workers=0, shuffle=True, n=20, noise=False):
    return DataLoader(Squares(n, noise), batch_size=4, shuffle=shuffle, num_workers=workers)


def shuffled():
    return loader(shuffle=True)


def shuffled_with_workers():
    return loader(workers=2, shuffle=True)


def augmented():
    return loader(shuffle=False, noise=True)


def counted():
    CALLS.append(1)
    return _counting()


def _counting():
    for i in range(5):
        PULLED.append(i)
        yield torch.full((2, 1, 16, 16), float(i)), torch.tensor([i, i])


def listed():
    CALLS.append(1)
    return [torch.full((2, 1, 16, 16), float(i)) for i in range(5)]


def drifting():
    CALLS.append(1)
    later = len(CALLS) > 1
    return (torch.full((2, 1, 16, 16), float(i + (later and i == 2))) for i in range(4))


def shrinking():
    CALLS.append(1)
    return (torch.full((2, 1, 16, 16), float(i)) for i in range(4 if len(CALLS) == 1 else 3))


def nothing():
    return iter([])


def mean_logit(model, batches):
    """A metric with no per-sample function: step stores each trial's outputs and replays them."""
    total, count = 0.0, 0
    for x, _ in batches:
        out = model(x)
        total, count = total + float(out.sum()), count + out.numel()
    return abs(total / count)


one_shot = iter([torch.zeros(2, 1, 16, 16), torch.ones(2, 1, 16, 16)])
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """The DATASET module, importable under a fresh name: (name, module)."""
    import importlib

    name = f"stream_data_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(DATASET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, importlib.import_module(name)


def _values(source) -> list[float]:
    """Each batch's first input value: which batch it is."""
    return [float(b.inputs.reshape(-1)[0]) for b in source]


def _same(a: list[Batch], b: list[Batch]) -> None:
    """Batches equal bit for bit: values, dtypes, shapes, targets (nested in dicts)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert fingerprint(tuple(x)) == fingerprint(tuple(y))


# -- laziness ------------------------------------------------------------------------------
def test_a_generator_is_consumed_batch_by_batch_and_never_past_batches(user):
    name, mod = user
    source = load_batches(f"{name}:counted", batches=3)
    assert mod.CALLS == [1] and mod.PULLED == []  # called once; nothing pulled before a pass
    for position, batch in enumerate(source):
        assert len(mod.PULLED) == position + 1  # the next batch is pulled only when asked for
        assert float(batch.inputs[0, 0, 0, 0]) == position
    assert mod.PULLED == [0, 1, 2]  # --batches 3: a fourth item is never asked for


def test_count_is_known_without_a_pass_only_where_the_data_says_it(user, tmp_path):
    name, _ = user
    generator = load_batches(f"{name}:counted")
    assert generator.count is None
    with pytest.raises(TypeError, match="not known before a pass"):
        len(generator)
    assert list(generator) and generator.count == 5 and len(generator) == 5  # known once a pass counted it
    assert load_batches(f"{name}:listed").count == 5
    assert load_batches(f"{name}:shuffled").count == 5  # a DataLoader: 20 samples in batches of 4
    assert load_batches(f"{name}:shuffled", batches=2).count == 2
    torch.save(torch.zeros(10, 1, 4, 4), tmp_path / "x.pt")
    assert load_batches(str(tmp_path / "x.pt"), batch_size=4).count == 3
    assert load_batches("random:2x3", batches=7).count == 7


def test_a_one_shot_generator_function_is_called_again_for_each_pass(user):
    name, mod = user
    source = load_batches(f"{name}:counted")
    assert mod.CALLS == [1]
    first, second = _values(source), _values(source)
    assert first == second == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(mod.CALLS) == 2  # the first pass used the load's call; the second called again
    listed = load_batches(f"{name}:listed")
    _values(listed), _values(listed)
    assert len(mod.CALLS) == 3  # a list is iterated again, never re-made


def test_a_one_shot_iterator_that_cannot_be_remade_says_so_on_the_second_pass(user):
    name, _ = user
    source = load_batches(f"{name}:one_shot")
    assert _values(source) == [0.0, 1.0]
    with pytest.raises(QDebugError, match="one-shot iterator") as caught:
        list(source)
    assert "reads the data several times" in caught.value.hint


def test_a_function_that_yields_nothing_is_refused_at_the_end_of_its_pass(user):
    name, _ = user
    source = load_batches(f"{name}:nothing")
    with pytest.raises(QDebugError, match="holds no batches"):
        list(source)


# -- consistency ---------------------------------------------------------------------------
def test_a_batch_that_changes_between_passes_is_named(user):
    name, _ = user
    source = load_batches(f"{name}:drifting")
    assert _values(source) == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(QDebugError, match=f"data function {name}:drifting gave a different batch 2 on a later pass") \
            as caught:
        list(source)
    assert "shuffle=False" in caught.value.hint and "several times" in caught.value.hint


def test_a_count_that_changes_between_passes_is_an_error(user):
    name, _ = user
    source = load_batches(f"{name}:shrinking")
    list(source)
    with pytest.raises(QDebugError, match="gave 3 batch\\(es\\) on a later pass, 4 on the first"):
        list(source)


def test_random_augmentation_in_a_dataloader_is_caught(user):
    name, _ = user
    source = load_batches(f"{name}:augmented")
    list(source)
    with pytest.raises(QDebugError, match="gave a different batch 0"):
        list(source)


# -- DataLoaders -----------------------------------------------------------------------------
@pytest.mark.parametrize("function", ["shuffled", "shuffled_with_workers"])
def test_a_shuffling_dataloader_gives_the_same_batches_on_every_pass(user, function):
    name, mod = user
    source = load_batches(f"{name}:{function}")
    passes = [list(source) for _ in range(3)]
    _same(passes[0], passes[1])
    _same(passes[0], passes[2])
    seen = sorted(round(float(v) * 10) for b in passes[0] for v in b.inputs[:, 0, 0, 0])
    assert seen == list(range(20))  # every sample once
    assert [v for b in passes[0] for v in b.inputs[:, 0, 0, 0].tolist()] != [i / 10 for i in range(20)]  # shuffled
    assert all(b.target.tolist() == [round(float(v) * 10) % 10 for v in b.inputs[:, 0, 0, 0]] for b in passes[0])


def test_a_dataloader_shard_loads_only_its_own_samples(user):
    name, mod = user
    source = load_batches(f"{name}:shuffled", batches=4)
    whole = list(source.indexed())
    mod.LOADED.clear()
    shard = list(source.shard(1, 2).indexed())
    assert [i for i, _ in shard] == [1, 3]
    _same([b for _, b in shard], [whole[1][1], whole[3][1]])
    loaded = sorted(mod.LOADED)
    expected = sorted(round(float(v) * 10) for i in (1, 3) for v in whole[i][1].inputs[:, 0, 0, 0])
    assert loaded == expected  # 8 samples read, not 16 (or 20)


# -- shards --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["function", "loader", "file", "random", "list"])
def test_shards_are_strided_over_the_limited_data_with_global_indices(user, tmp_path, spec):
    name, _ = user
    torch.save(torch.arange(40.0).reshape(20, 1, 1, 2), tmp_path / "x.pt")
    specs = {"function": f"{name}:counted", "loader": f"{name}:shuffled", "file": str(tmp_path / "x.pt"),
             "random": "random:2x3", "list": f"{name}:listed"}
    source = load_batches(specs[spec], batch_size=4, batches=5) if spec != "function" else \
        load_batches(specs[spec], batches=5)
    whole = list(source.indexed())
    assert [i for i, _ in whole] == [0, 1, 2, 3, 4]
    for rank, indices in ((0, [0, 2, 4]), (1, [1, 3])):
        shard = source.shard(rank, 2)
        assert [i for i, _ in shard.indexed()] == indices
        _same(list(shard), [whole[i][1] for i in indices])
    limited = load_batches(specs[spec], batch_size=4, batches=3).shard(1, 2)  # the limit first: batches 0-2
    assert [i for i, _ in limited.indexed()] == [1]
    assert source.shard(1, 2).shard(1, 2).count in (None, 1)  # of 1 and 3: batch 3
    assert [i for i, _ in source.shard(1, 2).shard(1, 2).indexed()] == [3]
    if source.count is not None:
        assert source.shard(0, 2).count == 3 and source.shard(1, 2).count == 2 and len(source.shard(4, 5)) == 1


def test_shard_checks_its_arguments():
    source = load_batches("random:2x3")
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(QDebugError, match="cannot take shard"):
            source.shard(rank, world)


# -- devices ---------------------------------------------------------------------------------
def test_to_moves_batches_as_they_are_made_and_fingerprints_stay_on_the_cpu(user):
    name, _ = user
    source = load_batches(f"{name}:counted", batches=2)
    moved = source.to("meta")  # a device with no data: a fingerprint taken after the move would fail
    for _ in range(2):  # the second pass checks the first pass's fingerprints
        batches = list(moved)
        assert [b.inputs.device.type for b in batches] == ["meta", "meta"]
        assert [b.target.device.type for b in batches] == ["meta", "meta"]
    assert next(iter(source)).inputs.device.type == "cpu"  # the source itself is unchanged


# -- files ------------------------------------------------------------------------------------------
def _stored_forms() -> dict[str, object]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 3, 4, 4, generator=gen)
    codes = torch.randint(0, 256, (10, 3, 4, 4), generator=gen).to(torch.uint8)
    return {
        "tensor": x,
        "pair": (x, torch.arange(10)),
        "dict_targets_dict": {"inputs": x, "targets": {"cls": torch.arange(10), "box": torch.randn(10, 4, generator=gen)}},
        "scale_offset_ints": {"inputs": codes, "targets": torch.arange(10), "input_scale": 1 / 255, "input_offset": -0.5},
        "per_channel_scale": {"inputs": codes, "input_scale": torch.tensor([0.1, 0.2, 0.3]).reshape(3, 1, 1),
                              "input_offset": torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1)},
        "per_sample_scale": {"inputs": codes, "input_scale": torch.rand(10, 1, 1, 1, generator=gen)},
        "half": {"images": x.half(), "labels": torch.arange(10)},
        "bfloat16": {"x": x.bfloat16()},
        "list": [x[:3], (x[3:7], torch.arange(4)), {"x": x[7:]}],
    }


def _eager(obj, batch_size: int) -> list[Batch]:
    """The batches of a whole loaded object, decoded whole and then sliced (qdebug before issue 18)."""
    from qdebug.data.batch import to_batch
    from qdebug.data.file import INPUT_KEYS, TARGET_KEYS, _decode, _first

    if isinstance(obj, list):
        return [to_batch(b) for b in obj]
    if isinstance(obj, torch.Tensor):
        inputs, target = obj, None
    elif isinstance(obj, tuple):
        inputs, target = obj
    else:
        inputs, target = _decode(_first(obj, INPUT_KEYS), obj, "data"), _first(obj, TARGET_KEYS)
    out = []
    for start in range(0, inputs.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        tgt = {k: v[rows] for k, v in target.items()} if isinstance(target, dict) else \
            target[rows] if target is not None else None
        out.append(Batch(inputs[rows], tgt))
    return out


@pytest.mark.parametrize("form", list(_stored_forms()))
@pytest.mark.parametrize("legacy", [False, True])
def test_a_file_is_sliced_lazily_into_the_eager_batches_bit_for_bit(tmp_path, monkeypatch, form, legacy):
    obj = _stored_forms()[form]
    path = tmp_path / f"{form}.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    maps = []
    real = torchfile.read_file

    def counting(p, **kwargs):
        maps.append(kwargs.get("mmap"))
        return real(p, **kwargs)

    monkeypatch.setattr(data_file, "read_file", counting)  # the data file reads through it
    monkeypatch.setattr(data_file, "REMAP_BYTES", 1)  # map again for every batch
    source = load_batches(str(path), batch_size=4)
    lazy = list(source)
    _same(lazy, _eager(torch.load(path, weights_only=True), 4))
    _same(list(source), lazy)  # a second pass: the same batches
    assert all(maps)  # every read asked for a map
    assert len(maps) == (1 if legacy else 1 + len(lazy) * 2)  # legacy: read once and held; zip: once per batch
    for t in _tensors(lazy):  # nothing of a batch is a view into the whole file
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for item in obj for t in _tensors(item)] if isinstance(obj, (list, tuple)) else []


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_file_is_unmapped_as_the_pass_goes(tmp_path, monkeypatch):
    path = tmp_path / "big.pt"
    torch.save({"inputs": torch.randn(64, 256), "targets": torch.arange(64)}, path)

    def mapped() -> bool:
        return str(path) in Path("/proc/self/maps").read_text()

    source = load_batches(str(path), batch_size=16)
    assert not mapped()  # the load's map is gone once the file is checked
    monkeypatch.setattr(data_file, "REMAP_BYTES", 1)
    for batch in source:
        assert not mapped()  # dropped before the batch is handed over
    monkeypatch.setattr(data_file, "REMAP_BYTES", 1 << 30)
    passing = iter(source)
    next(passing)
    assert mapped()  # within the budget the map is kept between batches...
    list(passing)
    assert not mapped()  # ...and dropped at the end of the pass


def test_a_file_changed_between_passes_is_an_error(tmp_path):
    path = tmp_path / "x.pt"
    torch.save(torch.zeros(8, 2), path)
    source = load_batches(str(path), batch_size=4)
    list(source)
    torch.save(torch.ones(8, 2), path)
    os.utime(path, ns=(1, 1))  # a different modification time even on a coarse clock
    with pytest.raises(QDebugError, match="changed while qdebug was reading it"):
        list(source)


def test_a_scale_that_does_not_broadcast_to_the_inputs_is_refused_at_load(tmp_path):
    torch.save({"inputs": torch.zeros(4, 3, 2, 2, dtype=torch.uint8), "input_scale": torch.ones(2, 1, 1)},
               tmp_path / "s.pt")
    with pytest.raises(QDebugError, match="input_scale/input_offset cannot decode the inputs"):
        load_batches(str(tmp_path / "s.pt"))
    torch.save({"inputs": torch.zeros(4, 3, 2, 2, dtype=torch.uint8), "input_scale": torch.ones(5, 4, 1, 1, 1)},
               tmp_path / "grow.pt")
    with pytest.raises(QDebugError, match="make inputs of shape \\[5, 4, 3, 2, 2\\]"):
        load_batches(str(tmp_path / "grow.pt"))


# -- random: -------------------------------------------------------------------------------------
def test_random_batches_are_made_again_from_the_seed(monkeypatch):
    source = load_batches("random:2x3x4:seed=7", batches=3)
    gen = torch.Generator().manual_seed(7)
    expected = [Batch(torch.randn(2, 3, 4, generator=gen)) for _ in range(3)]  # the generator's sequence
    _same(list(source), expected)
    _same(list(source), expected)
    _same(list(source.shard(1, 3)), [expected[1]])


# -- ReplayModel ------------------------------------------------------------------------------------
def test_replay_model_matches_calls_by_position_without_the_batches():
    batches = [torch.full((2, 3), float(i)) for i in range(4)] + [torch.full((2, 3), 1.0)]  # batch 4 repeats 1
    outputs = [f"out{i}" for i in range(5)]
    prints = [input_fingerprint(b) for b in batches]
    model = ReplayModel(None, outputs, prints)
    assert [model(b.clone()) for b in batches] == outputs  # copies: matched by fingerprint, by position
    model = ReplayModel(None, outputs, prints)
    assert model(batches[3].clone()) == "out3"  # out of order: found by its fingerprint
    assert model(batches[4].clone()) == "out4"  # the next position, though batch 1 has the same values
    with pytest.raises(QDebugError, match="not the data's batches"):
        model(torch.full((2, 3), 9.0))
    held = ReplayModel(batches, outputs)  # a list: its own tensors are known by identity
    assert held(batches[4]) == "out4" and held(batches[1]) == "out1"


def test_replay_model_reads_a_batch_source_in_one_pass(user):
    name, mod = user
    source = load_batches(f"{name}:counted", batches=3)
    model = ReplayModel(source, ["a", "b", "c"])
    assert len(mod.CALLS) == 1 and len(mod.PULLED) == 3  # fingerprinted in the one pass of the load's call
    assert [model(b.inputs) for b in source] == ["a", "b", "c"]


# -- the tools on streamed data --------------------------------------------------------------------
def test_step_on_a_shuffling_dataloader_equals_step_on_its_batches_as_a_list(user, stages):
    name, _ = user
    source = load_batches(f"{name}:shuffled")
    held = [Batch(b.inputs.clone(), b.target.clone()) for b in source]
    by_source = qdebug.step(stages.float, stages.qat, data=source, metric="top1")
    by_list = qdebug.step(stages.float, stages.qat, data=held, metric="top1")
    assert by_source.attrs["meta"]["samples"] == 20 and by_source.attrs["meta"]["batches"] == 5
    columns = [c for c in by_list.columns if by_list[c].dtype.kind in "fi"]
    for column in columns:
        for a, b in zip(by_source[column], by_list[column]):
            assert (math.isnan(a) and math.isnan(b)) or a == b, column


def test_a_metric_on_stored_outputs_replays_a_streamed_generator(user, stages):
    name, mod = user
    metric = f"{name}:mean_logit"  # each trial's outputs are stored; the metric reads the data again
    streamed = qdebug.step(stages.float, stages.qat, data=f"{name}:counted", metric=metric)
    held = qdebug.step(stages.float, stages.qat, data=list(mod.counted()), metric=metric)
    assert streamed.attrs["meta"]["batches"] == 5 and streamed.attrs["meta"]["samples"] == 10
    assert streamed["mean_logit"].tolist() == held["mean_logit"].tolist()
    assert streamed.attrs["meta"]["float_metric"] == held.attrs["meta"]["float_metric"]


def test_the_api_takes_a_dataloader_and_a_generator_reads_once(user, stages):
    name, mod = user
    frame = qdebug.compare(stages.float, stages.qat, data=mod.loader(), batches=2)
    assert frame.attrs["meta"]["batches"] == 2
    generator = (torch.randn(2, 1, 16, 16) for _ in range(3))
    assert qdebug.compare(stages.float, stages.qat, data=generator).attrs["meta"]["batches"] == 3  # one pass
    source = batches_from_iterable(iter([torch.zeros(2, 1, 16, 16)]))
    assert isinstance(source, BatchSource) and source.count is None
    assert len(list(source)) == 1 and source.count == 1
    with pytest.raises(QDebugError, match="data is a one-shot iterator"):
        list(source)


@pytest.mark.parametrize("command", ["compare", "step", "suggest", "baseline", "calibrate"])
def test_every_command_runs_on_a_shuffling_dataloader(cli, user, stages, command, tmp_path):
    name, _ = user
    data = ("--data", f"{name}:shuffled", "--batches", "3")
    args = {
        "compare": ("compare", stages.float, stages.qat),
        "step": ("step", stages.float, stages.qat, "--metric", "top1"),
        "suggest": ("suggest", stages.float, stages.qat, "--metric", "agreement"),  # top1 of float: 0 here
        "baseline": ("baseline", stages.float, stages.qat, "--metric", "agreement"),  # top1 may be 0 on 3 batches
        "calibrate": ("calibrate", stages.float, "-o", str(tmp_path / "c.pt")),
    }[command]
    result = cli(*args, *data, "--json")
    assert result.code in (0, 1), result.err
    meta = json.loads(result.out)["meta"]
    assert meta.get("batches", 3) == 3
