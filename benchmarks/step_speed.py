"""Step speed: the experiment primitive's sweep against the full fake-quant forwards it replaces.

Target (issue 13): "``--auto --depth 2`` on ResNet-18 at 224 px, batch 8: the sweep's time /
(number of steps x one full fake-quant forward over the same batches) <= 0.7, memory flat in the
number of batches."

Model: ``qdebug.zoo.ResNet()`` (ResNet-18: ImageNet stem, stages [2, 2, 2, 2], 1000 classes),
seeded random weights; BN running statistics from a few train-mode forwards on random data
(cumulative average), then eval.  Prepared with ``prepare(model, QConfig(), mode="fuse_bn")`` and
calibrated on two random batches: every quant point in ``fake`` mode.

The sweep is what ``qdebug step --auto --depth 2`` hands the experiment primitive: one trial with
every quantizable point (the "all" step), then one trial per unit at depth 2, alone, in execution
order.  A point's unit path is its layer (``point.owner``) for a weight point, else the point's
name without its ``#k``; its unit at depth 2 is the first two dot-separated components (shorter
paths are their own unit: ``input``, ``conv1``, ``relu``, ``avgpool``, ``fc``).  (step itself
adds two more trials after an auto sweep -- the costliest unit's weights alone and activations
alone -- and a metric if asked: not measured here.)

(a) Time.  ``Experiment(prepared, batches).run(trials)`` (``qdebug.tools.experiment``: per batch
    one recorded all-float base run, then each trial's forward with the calls before its first
    quantized point served from that recording, ``qdebug.engine.served``) against
    len(trials) x one full fake-quant forward over the same batches (the prepared model as
    calibrated, ``run_model`` per batch, eval, no_grad).  Target: ratio <= 0.7.  Both sides are
    warmed up once (one batch), then run ``--repeats`` times taking turns; the best (min) time of
    each is reported (every sample is in the JSON).  The served-call count
    (``TrialResult.served_calls``, summed) is printed beside it as a sanity check.
(a') The same sweep against its compute floor (issue 36 item 2, restated): the base run (one
    float forward: every point in float, timed as F_float), the first trial (everything
    quantized: one full fake-quant forward), and each unit trial's suffix -- the share of the
    model's multiply-accumulates from its first changed call on (``Experiment.macs`` over its
    call order), at float cost: floor = F_float + F_fq + F_float x sum of the shares.  The calls
    before a trial's first change are served, so no exact design computes less.  Target: sweep /
    floor <= 1.1 (the primitive's own overhead: recording, serving, statistics).  Issue 36's
    0.5 of the full forwards is below this floor on ResNet-18 at 224 px (~0.55).
(b) Memory.  Peak RSS of the same sweep over ``--mem-batches`` (default 2 and 8) batches, each
    in a fresh subprocess (``--child``), spawned before this process builds anything.  The
    experiment holds its batches (``Experiment`` keeps ``list(batches)``): their own bytes are
    stated and subtracted from the growth.  Peak RSS is VmHWM (the child's own address space;
    Linux carries ``ru_maxrss`` over fork/exec from the parent), with ``ru_maxrss`` beside it.
    Target: net growth < 10% of the smaller run's peak.

Usage:  python benchmarks/step_speed.py [--batches 4] [--batch-size 8] [--size 224] [--repeats 3]
            [--mem-batches 2 8] [--mem-size 112] [--no-memory] [--profile N] [--json PATH]
Small and quick:  --size 64 --batches 2 --repeats 1 --mem-size 64
Exit status 0 when both targets hold, 1 otherwise (PASS/FAIL lines at the end).  The machine may
be shared: only the ratios mean much.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time

import torch
import torch.nn as nn

from qdebug.engine import quant_points
from qdebug.engine.context import run_model
from qdebug.tools.experiment import NOTHING, Experiment, Trial
from qdebug.tools.step import Units
from qdebug.config.memory import reuse_freed_memory
from workload import calibrated, maxrss_mb, peak_rss_mb, random_batches, resnet18

TIME_TARGET = 0.7
# Issue 36 item 2, restated: the sweep's own overhead.  Its floor is the computation the trials need
# (see (a') in the module docstring); 0.5 of 14 full forwards is below that floor on ResNet-18.
FLOOR_TARGET = 1.1
MEM_TARGET = 0.10  # net peak-RSS growth, as a share of the smaller run's peak
BN_WARMUP_FORWARDS = 3


# -- model, data, trials ------------------------------------------------------------------------
def build_prepared(batch: int, size: int, seed: int) -> nn.Module:
    """ResNet-18 with realistic BN statistics, prepared (fuse_bn) and calibrated: all points fake."""
    return calibrated(resnet18(batch, size, seed, BN_WARMUP_FORWARDS), batch, size, seed)


def depth_trials(prepared: nn.Module, depth: int = 2) -> list[Trial]:
    """The "all" trial, then every unit at ``depth`` alone, in execution order: the units
    ``qdebug step --auto --depth 2`` runs (``qdebug.tools.step.Units``)."""
    points = [name for name, p in quant_points(prepared).items() if p.mode == "fake"]
    units = Units(prepared, points).group(points, depth)
    everything = Trial(frozenset(points), {"selection": "*", "mode": "all"})
    return [everything] + [Trial(frozenset(names), {"selection": unit, "mode": "auto"}) for unit, names in units.items()]


def full_forwards(prepared: nn.Module, batches: list[torch.Tensor]) -> None:
    """One full fake-quant forward per batch: the model as calibrated (every point fake)."""
    with torch.no_grad():
        for x in batches:
            run_model(prepared, x)


def sweep(prepared: nn.Module, batches: list[torch.Tensor], trials: list[Trial]):
    return Experiment(prepared, batches).run(trials)


def batches_mb(n: int, batch: int, size: int) -> float:
    return n * batch * 3 * size * size * 4 / 2**20


# -- memory ---------------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    prepared = build_prepared(args.batch_size, args.mem_size, args.seed)
    trials = depth_trials(prepared)
    setup_mb = peak_rss_mb()
    batches = list(random_batches(args.child, args.batch_size, args.mem_size, args.seed + 100))
    start = time.perf_counter()
    results = sweep(prepared, batches, trials)
    seconds = time.perf_counter() - start
    print(json.dumps({"batches": args.child, "peak_rss_mb": peak_rss_mb(), "ru_maxrss_mb": maxrss_mb(),
                      "after_setup_peak_mb": setup_mb, "batches_mb": batches_mb(args.child, args.batch_size, args.mem_size),
                      "seconds": seconds, "trials": len(trials), "served_calls": sum(r.served_calls for r in results)}))


def spawn(n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n), "--batch-size", str(args.batch_size),
           "--mem-size", str(args.mem_size), "--seed", str(args.seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child x{n} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- timing ---------------------------------------------------------------------------------------
def best_of(fns: dict, repeats: int, samples: dict[str, list[float]]) -> dict[str, float]:
    """Min seconds of each fn over ``repeats`` rounds, taking turns (every time lands in ``samples``)."""
    samples.update({k: [] for k in fns})
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    return {k: min(v) for k, v in samples.items()}


def float_forwards(prepared: nn.Module, batches: list[torch.Tensor]) -> None:
    """One forward per batch with every point in float: what a trial's unquantized calls cost."""
    points = quant_points(prepared)
    loaded = {name: p.mode for name, p in points.items()}
    for p in points.values():
        p.mode = "float"
    try:
        full_forwards(prepared, batches)
    finally:
        for name, p in points.items():
            p.mode = loaded[name]


def suffix_shares(experiment: Experiment, trials: list[Trial]) -> list[float]:
    """Per trial, the share of the model's multiply-accumulates from its first changed call on:
    what it must compute, the calls before being served from a recorded run."""
    order = experiment.call_order
    index = {name: i for i, name in enumerate(order)}
    macs = [experiment.macs.get(name, 0) for name in order]
    total = sum(macs) or 1
    return [sum(macs[experiment._boundary(t.differs_at(NOTHING), index, len(order)):]) / total for t in trials]


def profile_sweep(prepared: nn.Module, batches: list[torch.Tensor], trials: list[Trial], top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    sweep(prepared, batches, trials)
    prof.disable()
    for key in ("tottime", "cumulative"):
        print(f"\n-- cProfile of one sweep, top {top} by {key} --")
        pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(top)


# -- main -----------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mem-batches", type=int, nargs=2, default=[2, 8])
    parser.add_argument("--mem-size", type=int, default=112)
    parser.add_argument("--no-memory", action="store_true", help="skip (b)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one sweep, print the top N")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    reuse_freed_memory()  # as the command line does (qdebug.config.memory); QDEBUG_MALLOC=default: glibc's own
    if args.child is not None:
        child(args)
        return 0

    started = time.perf_counter()
    load_start = os.getloadavg()

    # (b) first, while this process is small.
    mem: dict[str, dict] = {}
    few, many = sorted(args.mem_batches)
    if not args.no_memory:
        for n in (few, many):
            mem[str(n)] = spawn(n, args)

    prepared = build_prepared(args.batch_size, args.size, args.seed)
    trials = depth_trials(prepared)
    batches = list(random_batches(args.batches, args.batch_size, args.size, args.seed + 300))
    one = batches[:1]
    full_forwards(prepared, one)  # warm-up
    sweep(prepared, one, trials)
    samples: dict[str, list[float]] = {}
    last: dict = {}  # the last timed sweep's experiment and results (served counts, calls per forward)

    def timed_sweep() -> None:
        last["experiment"] = experiment = Experiment(prepared, batches)
        last["results"] = experiment.run(trials)

    times = best_of({"full": lambda: full_forwards(prepared, batches), "float": lambda: float_forwards(prepared, batches),
                     "sweep": timed_sweep}, args.repeats, samples)
    results = last["results"]
    served = sum(r.served_calls for r in results)
    calls = len(last["experiment"].call_order)
    if args.profile:
        profile_sweep(prepared, batches, trials, args.profile)

    t_full, t_sweep, t_float = times["full"], times["sweep"], times["float"]
    ratio = t_sweep / (len(trials) * t_full)
    time_ok = ratio <= TIME_TARGET
    # The compute floor: the base run (a float forward), the first trial ("all": a full fake-quant
    # forward), and each later trial's suffix at float cost (one unit quantized, the rest float).
    shares = suffix_shares(last["experiment"], trials)
    floor = t_float + t_full + t_float * sum(shares[1:])
    floor_ratio = t_sweep / floor
    floor_ok = floor_ratio <= FLOOR_TARGET
    rows = [(f"(a) sweep, {len(trials)} steps (all + {len(trials) - 1} units at depth 2), {args.batches} batches "
             f"of {args.batch_size}x{args.size}px",
             f"{len(trials)} x full fake-quant forward {t_full:.2f} s = {len(trials) * t_full:.2f} s",
             f"{t_sweep:.2f} s", f"{ratio:.2f}", f"<= {TIME_TARGET}"),
            ("(a') the same sweep against its compute floor (base float run + all + each unit trial's suffix "
             "share of the MACs at float cost)",
             f"{t_float:.2f} + {t_full:.2f} + {t_float:.2f} x {sum(shares[1:]):.2f} = {floor:.2f} s "
             f"({floor / (len(trials) * t_full):.2f} of {len(trials)} full)", f"{t_sweep:.2f} s",
             f"{floor_ratio:.2f}", f"<= {FLOOR_TARGET}")]
    summary: dict = {"time_ratio": ratio, "time_ok": time_ok, "floor_s": floor, "floor_ratio": floor_ratio,
                     "floor_ok": floor_ok, "suffix_shares": shares}
    if mem:
        a, b = mem[str(few)], mem[str(many)]
        raw = b["peak_rss_mb"] - a["peak_rss_mb"]
        held = b["batches_mb"] - a["batches_mb"]
        net = raw - held
        mem_ok = net < MEM_TARGET * a["peak_rss_mb"]
        summary.update(rss_growth_mb=raw, rss_growth_net_mb=net, rss_ratio=b["peak_rss_mb"] / a["peak_rss_mb"],
                       mem_ok=mem_ok)
        rows.append((f"(b) sweep peak RSS, {many} vs {few} batches of {args.batch_size}x{args.mem_size}px, "
                     "fresh subprocesses", f"{few} batches {a['peak_rss_mb']:.0f} MB",
                     f"{many} batches {b['peak_rss_mb']:.0f} MB (+{raw:.1f} MB; +{net:.1f} MB net of the "
                     f"batches' own {held:.1f} MB)", f"{b['peak_rss_mb'] / a['peak_rss_mb']:.3f}",
                     f"net growth < {MEM_TARGET:.0%} of {few}-batch peak"))
    print("| measure | baseline | qdebug | ratio | target |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    total = len(trials) * args.batches * calls
    print(f"\nserved calls: {served} of {total} trial calls ({len(trials)} trials x {args.batches} batches x "
          f"{calls} calls per forward), {served / total:.0%}")
    print("per trial (served calls over all batches): " +
          ", ".join(f"{r.trial.info['selection']} {r.served_calls}" for r in results))
    print(f"times (s): full {', '.join(f'{t:.2f}' for t in samples['full'])}; "
          f"sweep {', '.join(f'{t:.2f}' for t in samples['sweep'])} (best of {args.repeats} reported)")
    if mem:
        for n in (few, many):
            m = mem[str(n)]
            print(f"child x{n}: VmHWM {m['peak_rss_mb']:.1f} MB, ru_maxrss {m['ru_maxrss_mb']:.1f} MB, "
                  f"after setup {m['after_setup_peak_mb']:.1f} MB, batches {m['batches_mb']:.1f} MB, "
                  f"sweep {m['seconds']:.1f} s, served {m['served_calls']}")
    load_end = os.getloadavg()
    seconds = time.perf_counter() - started
    print(f"\nqdebug.zoo.ResNet() (ResNet-18), fuse_bn, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end; {seconds:.0f} s in all.")
    print(f"{'PASS' if time_ok else 'FAIL'}: time ratio {ratio:.2f} (target <= {TIME_TARGET})")
    print(f"{'PASS' if floor_ok else 'FAIL'}: against the compute floor {floor_ratio:.2f} (target <= {FLOOR_TARGET})")
    if mem:
        print(f"{'PASS' if summary['mem_ok'] else 'FAIL'}: peak RSS net growth {summary['rss_growth_net_mb']:.1f} MB "
              f"from {few} to {many} batches ({summary['rss_growth_net_mb'] / mem[str(few)]['peak_rss_mb']:.1%} of "
              f"{mem[str(few)]['peak_rss_mb']:.0f} MB; target < {MEM_TARGET:.0%})")
    else:
        print("SKIP: memory (--no-memory)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": {**{k: v for k, v in vars(args).items() if k != "child"}, "trials": len(trials),
                                  "calls_per_forward": calls, "threads": torch.get_num_threads(),
                                  "torch": torch.__version__, "loadavg_start": load_start, "loadavg_end": load_end,
                                  "seconds_total": seconds},
                       "time_s": times, "time_samples_s": samples, "served_calls": served,
                       "served_per_trial": {r.trial.info["selection"]: r.served_calls for r in results},
                       "memory": mem, **summary}, fh, indent=2)
    return 0 if time_ok and floor_ok and (args.no_memory or summary["mem_ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
