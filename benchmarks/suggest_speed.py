"""Suggest speed: the evaluations and the wall time of ``suggest`` against AIMET AMP's count.

Target (issue 14, item 7): "on a zoo model with L candidates, evaluations used and wall time
against AIMET AMP's count (L + log2 L) on the same model; --rank fast against --rank exact."

Model: ``qdebug.zoo.resnet:ResNet`` at its defaults (ResNet-18: ImageNet stem, stages
[2, 2, 2, 2], 1000 classes), seeded random weights; BN running statistics from a few
train-mode forwards on random data (cumulative average), then eval.  A planted defect, on the
float model before ``prepare`` and function-preserving (as in tests/test_suggest.py):
``layer1.0.bn1``'s channel ``--channel`` x64 (weight and bias; ReLU is positively homogeneous),
``layer1.0.conv2``'s input column of that channel / 64.  The stretched activation range costs
``layer1.0.relu`` its int8 resolution and the compensated weight column underflows at int8, so
the plan should hold ``layer1.0.conv2.weight`` and ``layer1.0.relu``.  Prepared with
``prepare(model, QConfig(), mode="fuse_bn")``, calibrated on ``--calib-batches`` (2) seeded random
batches of ``--batch-size`` (8) x 3 x ``--size`` (64) px; evaluated on ``--batches`` (4) others.
The reference is the planted float model.

Target SQNR.  One experiment pass measures the output SQNR against float of: everything
quantized (*before*), the two defect points at 16 bits (*fixed*: what the model gives without
its defect), and every candidate at 16 bits (*all16*).  ``--min-sqnr`` defaults to
before + ``--frac`` (0.8) x (fixed - before), rounded to 0.1 dB: the defect makes the model miss
it, and a plan exists.  All three are printed.

Measured.
(a) ``suggest(model, batches, reference=float, min_sqnr=..., diagnoses=...)`` with the exact
    rank, and with ``rank="fast"`` when ``suggest`` takes a ``rank`` keyword
    (``inspect.signature``; else the row says "not available in this build").  Its wall time is
    the ranking and the plan search (``Experiment.run`` calls are logged through a subclass
    patched into ``qdebug.tools.suggest``: each call's trials and seconds).  compare's
    diagnoses (which ``qdebug suggest`` runs first, ``diagnoses_of``) are timed apart and shown.
(b) Evaluations: ``plan["evaluations"]`` (the plan search, after the ranking) against the bound
    1 + ceil(log2 L) + |plan| (and, in brackets, 1 + ceil(log2 L) + k with k = ``plan["prefix"]``,
    the shortest passing prefix: the bound suggest's docstring states), and the whole count --
    the ranking's trials (exact: L + 1; fast: 1, plus its noise-score pass counted as one) plus
    the search's evaluations -- against AMP's L + ceil(log2 L) (its per-candidate sensitivity
    pass, then its binary search on the Pareto front), as a ratio.  Forward passes per batch are
    counted as ``Experiment.run`` makes them: per call, one recorded all-float base run, one
    reference run, and one per trial (a trial serves the calls before its first changed point
    from a recorded run).
(c) Time: suggest's wall time against (L + ceil(log2 L)) x one full evaluation, timed here: the
    model with every point quantized (as calibrated) run over the evaluation batches
    (``run_model`` per batch, eval, no_grad; warmed up once).  ``--suggest-repeats`` (2) rounds,
    each timing ``--repeats`` (3) full evaluations, then suggest once per rank: the best time of
    each is reported (every sample is printed and in the JSON).

PASS when the plan search's evaluations are within the bound and suggest's wall time (ranking
+ search) is below the AMP-count baseline's; a separate line checks the plan holds both defect
points.  Exit status 0 when every line passes, else 1.

Usage:  python benchmarks/suggest_speed.py [--size 64] [--batch-size 8] [--batches 4]
            [--calib-batches 2] [--channel 3] [--min-sqnr DB] [--frac 0.8] [--repeats 3]
            [--suggest-repeats 2] [--seed 0] [--json PATH]
The machine may be shared: only the ratios mean much.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn as nn

import qdebug.tools.suggest as suggest_module
from qdebug.engine.context import run_model
from qdebug.tools.experiment import Experiment, Trial
from qdebug.tools.suggest import candidates, diagnoses_of, suggest
from qdebug.config.memory import reuse_freed_memory
from workload import calibrated, random_batches, resnet18

BN_WARMUP_FORWARDS = 3
DEFECT = (("layer1.0.conv2", "weight"), ("layer1.0.relu", "activation"))
DEFECT_POINTS = ["layer1.0.conv2.weight", "layer1.0.relu"]  # as plan["points"] names them
SCALE = 64.0


# -- model, data --------------------------------------------------------------------------------
def build_float(size: int, batch: int, channel: int, seed: int, plant: bool = True) -> nn.Module:
    """ResNet-18 with BN statistics from random data, then (``plant``) the outlier channel."""
    model = resnet18(batch, size, seed, BN_WARMUP_FORWARDS)
    if not plant:
        return model
    with torch.no_grad():  # function-preserving: ReLU(64 a) / 64 = ReLU(a)
        bn = model.layer1[0].bn1
        bn.weight[channel] *= SCALE
        bn.bias[channel] *= SCALE
        model.layer1[0].conv2.weight[:, channel] /= SCALE
    return model


def build_prepared(float_model: nn.Module, args: argparse.Namespace) -> nn.Module:
    return calibrated(float_model, args.batch_size, args.size, args.seed, batches=args.calib_batches)


def check_function_preserved(float_model: nn.Module, args: argparse.Namespace) -> float:
    """Max |planted - unplanted| output on one batch (the plant keeps the float function)."""
    clean = build_float(args.size, args.batch_size, args.channel, args.seed, plant=False)
    with torch.no_grad():
        x = next(random_batches(1, 2, args.size, args.seed + 9))
        return float((float_model(x) - clean(x)).abs().max())


def sqnr(result) -> float:
    return min(o["sqnr_db"] for o in result.outputs.values())


def target_levels(prepared: nn.Module, float_model: nn.Module, batches: list[torch.Tensor]) -> dict[str, Any]:
    """Output SQNR with everything quantized, with the defect points at 16 bits, with all at 16."""
    experiment = Experiment(prepared, batches, reference=float_model)
    found = candidates(prepared, experiment.quantizable, 16)
    everything = frozenset(experiment.quantizable)
    defect = [c for c in found if (c.glob, c.kind) in DEFECT]
    if len(defect) != len(DEFECT):
        raise SystemExit(f"the defect's candidates were not found: {[(c.glob, c.kind) for c in defect]}")

    def raised(chosen) -> Trial:
        return Trial(everything, {}, {p: 16 for c in chosen for p in c.points})

    before, fixed, all16 = experiment.run([Trial(everything, {}), raised(defect), raised(found)])
    return {"L": len(found), "before": sqnr(before), "fixed": sqnr(fixed), "all16": sqnr(all16),
            "floor": min(o["sqnr_db"] for o in experiment.floor.values())}


# -- timing ---------------------------------------------------------------------------------------
def full_evaluation(prepared: nn.Module, batches: list[torch.Tensor]) -> None:
    """One full evaluation: every point quantized (as calibrated), run over the batches."""
    with torch.no_grad():
        for x in batches:
            run_model(prepared, x)


def best_time(fn, repeats: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples), samples


@contextlib.contextmanager
def logged_runs(log: list[dict]):
    """Every ``Experiment.run`` suggest makes: its trials, forwards per batch and seconds."""

    class Logged(Experiment):
        def run(self, trials, **kwargs):
            trials = list(trials)
            start = time.perf_counter()
            try:
                return super().run(trials, **kwargs)
            finally:
                # Each forward the experiment makes ticks its progress counter once.
                log.append({"trials": len(trials), "forwards_per_batch": self._done // max(len(self.batches), 1),
                            "batches": len(self.batches), "seconds": time.perf_counter() - start})

    saved = suggest_module.Experiment
    suggest_module.Experiment = Logged
    try:
        yield
    finally:
        suggest_module.Experiment = saved


def measure(rank: str | None, prepared, float_model, batches, min_sqnr: float, diagnoses) -> dict[str, Any]:
    kwargs = {} if rank is None else {"rank": rank}
    log: list[dict] = []
    with logged_runs(log):
        start = time.perf_counter()
        result = suggest(prepared, batches, reference=float_model, min_sqnr=min_sqnr, diagnoses=diagnoses, **kwargs)
        seconds = time.perf_counter() - start
    plan = result.meta["plan"]
    evaluations = plan["evaluations"]
    # The plan search's evaluations are the last runs (one trial each); the ranking is the rest.
    search = log[len(log) - evaluations:] if evaluations else []
    ranking = log[:len(log) - evaluations]
    rank_used = result.meta.get("rank", "exact")
    noise_pass = rank_used == "fast"  # noise_scores: per batch a reference forward, a forward+backward
    return {"rank": rank_used, "seconds": seconds, "L": result.meta["candidates"], "plan": plan["points"],
            "passed": plan["passed"], "evaluations": evaluations, "prefix": plan.get("prefix"),
            "before": plan["before"].get("sqnr_db"), "after": plan["after"].get("sqnr_db"),
            "history": plan["history"], "runs": log, "ranking_runs": ranking, "noise_pass": noise_pass,
            "ranking_trials": sum(r["trials"] for r in ranking) + noise_pass,
            "search_seconds": sum(r["seconds"] for r in search),
            "ranking_seconds": seconds - sum(r["seconds"] for r in search),
            "forwards": sum(r["forwards_per_batch"] * r["batches"] for r in log)
            + (2 * len(batches) if noise_pass else 0),
            "served_calls": result.meta.get("served_calls"), "summary": result.summary,
            "meta": {k: v for k, v in result.meta.items() if k not in ("plan", "recalibrate")}}


def ranking_cell(r: dict) -> str:
    parts = [f"{x['trials']} trial(s), {x['forwards_per_batch']} forwards per batch" for x in r["ranking_runs"]]
    if r["noise_pass"]:
        parts.append("noise scores: 1 reference forward + 1 forward+backward per batch")
    return f"{'; '.join(parts) or 'none'}: {r['ranking_seconds']:.1f} s"


# -- main -----------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--calib-batches", type=int, default=2)
    parser.add_argument("--channel", type=int, default=3)
    parser.add_argument("--min-sqnr", type=float, default=None)
    parser.add_argument("--frac", type=float, default=0.8, help="target = before + frac x (fixed - before)")
    parser.add_argument("--repeats", type=int, default=3, help="full evaluations timed per round (best reported)")
    parser.add_argument("--suggest-repeats", type=int, default=2,
                        help="rounds: each times --repeats full evaluations, then suggest once per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reuse_freed_memory()  # as the command line does (qdebug.config.memory); QDEBUG_MALLOC=default: glibc's own

    started = time.perf_counter()
    load_start = os.getloadavg()
    float_model = build_float(args.size, args.batch_size, args.channel, args.seed)
    drift = check_function_preserved(float_model, args)
    prepared = build_prepared(float_model, args)
    batches = list(random_batches(args.batches, args.batch_size, args.size, args.seed + 300))

    levels = target_levels(prepared, float_model, batches)
    min_sqnr = args.min_sqnr if args.min_sqnr is not None else round(
        levels["before"] + args.frac * (levels["fixed"] - levels["before"]), 1)
    print(f"output SQNR against float: everything quantized {levels['before']:.2f} dB; defect points at 16 bits "
          f"{levels['fixed']:.2f} dB; every candidate at 16 bits {levels['all16']:.2f} dB; no point quantized "
          f"{levels['floor']:.1f} dB (BN folded)")
    print(f"target: min_sqnr = {min_sqnr:g} dB" + ("" if args.min_sqnr is not None else
                                                   f" (before + {args.frac:g} x (fixed - before))"))
    print(f"planted outlier: layer1.0.bn1 channel {args.channel} x{SCALE:g}, float output changed by at most "
          f"{drift:.2e}")

    # compare's diagnoses (qdebug suggest runs them first): timed apart.
    start = time.perf_counter()
    diagnoses = diagnoses_of(float_model, prepared, batches)
    t_diag = time.perf_counter() - start
    flagged = {k: v for k, v in diagnoses.items() if v not in ("propagated",)}
    print(f"compare's diagnoses: {t_diag:.1f} s; not propagated: {flagged}")

    # The baseline, one full evaluation (warmed up), and suggest take turns: each round times
    # --repeats full evaluations, then suggest once per rank; the best of each is reported.
    full_evaluation(prepared, batches[:1])
    has_rank = "rank" in inspect.signature(suggest).parameters
    ranks = ["exact", "fast"] if has_rank else [None]
    runs: dict[str, list[dict]] = {}
    full_samples: list[float] = []
    for _ in range(args.suggest_repeats):
        full_samples += best_time(lambda: full_evaluation(prepared, batches), args.repeats)[1]
        for rank in ranks:
            r = measure(rank, prepared, float_model, batches, min_sqnr, diagnoses)
            runs.setdefault(r["rank"], []).append(r)
    rows = []
    for same in runs.values():
        best = min(same, key=lambda r: r["seconds"])
        best["samples_s"] = [r["seconds"] for r in same]
        best["same_plans"] = all(r["plan"] == best["plan"] and r["evaluations"] == best["evaluations"] for r in same)
        rows.append(best)
    t_full = min(full_samples)

    print()
    print("| rank | L | ranking pass | plan search evaluations | bound 1 + ceil(log2 L) + abs(plan) (with the prefix k) | "
          "trials in all / AMP's L + ceil(log2 L) | suggest wall (ranking + search) | "
          "AMP count x one full evaluation | time ratio | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for r in rows:
        L = r["L"]
        log_l = math.ceil(math.log2(L)) if L > 1 else 0
        amp = L + log_l
        bound = 1 + log_l + len(r["plan"])
        bound_k = 1 + log_l + r["prefix"] if r["prefix"] else None
        baseline = amp * t_full
        total = r["ranking_trials"] + r["evaluations"]
        r.update(amp_count=amp, bound=bound, bound_prefix=bound_k, baseline_seconds=baseline,
                 time_ratio=r["seconds"] / baseline, eval_ratio=total / amp)
        print(f"| {r['rank']} | {L} | {ranking_cell(r)} | {r['evaluations']} ({r['search_seconds']:.1f} s) | {bound} ({bound_k}) | "
              f"{total} / {amp} = {r['eval_ratio']:.2f} | {r['seconds']:.1f} s | {amp} x {t_full:.3f} s = "
              f"{baseline:.1f} s | **{r['time_ratio']:.2f}** | {', '.join(r['plan']) or '-'} |")
        ok_eval = r["evaluations"] <= bound
        ok_time = r["seconds"] < baseline
        ok_plan = r["passed"] and all(p in r["plan"] for p in DEFECT_POINTS)
        verdicts += [ok_eval and ok_time, ok_plan]
        r.update(ok_eval=ok_eval, ok_time=ok_time, ok_plan=ok_plan)
    if not has_rank:
        print("| fast | fast: not available in this build | | | | | | | | |")

    print()
    for r in rows:
        print(f"{r['rank']}: {r['summary']}")
        print(f"  suggest wall (s): {', '.join(f'{t:.2f}' for t in r['samples_s'])} (best reported); "
              f"same plan and evaluations in every run: {r['same_plans']}")
        print("  Experiment.run calls: " + ", ".join(
            f"{x['trials']} trial(s) x {x['batches']} batches ({x['forwards_per_batch']} forwards per batch) "
            f"{x['seconds']:.2f} s" for x in r["runs"]))
        print(f"  forwards in all: {r['forwards']} (AMP count x {args.batches} batches = "
              f"{r['amp_count'] * args.batches}); served calls in the ranking: {r['served_calls']}")
        print("  search: " + ", ".join(f"size {h['size']} {h['sqnr_db']:.2f} dB {'pass' if h['passed'] else 'fail'}"
                                        for h in r["history"]))
        if r["ranking_trials"]:
            print(f"  ranking: {r['ranking_seconds']:.2f} s = {r['ranking_seconds'] / t_full:.1f} full evaluations' worth "
                  f"(its trials{' + the noise pass' if r['noise_pass'] else ''}: {r['ranking_trials']})")
        if r["evaluations"]:
            each = r["search_seconds"] / r["evaluations"]
            print(f"  one plan-search evaluation: {each:.3f} s on average = {each / t_full:.2f} x one full evaluation "
                  f"({t_full:.3f} s)")
        print(f"  with compare's diagnoses ({t_diag:.1f} s): {r['seconds'] + t_diag:.1f} s, "
              f"ratio {(r['seconds'] + t_diag) / r['baseline_seconds']:.2f}")
    if len(rows) == 2:
        e, f = rows
        print(f"fast against exact: time {f['seconds']:.1f} / {e['seconds']:.1f} s = {f['seconds'] / e['seconds']:.2f}; "
              f"same plan: {sorted(f['plan']) == sorted(e['plan'])}")
    load_end = os.getloadavg()
    seconds = time.perf_counter() - started
    print(f"\nfull evaluations (s): {', '.join(f'{t:.3f}' for t in full_samples)} (best of {len(full_samples)}); "
          f"{args.batches} batches of {args.batch_size}x3x{args.size}x{args.size}")
    print(f"qdebug.zoo.resnet:ResNet() (ResNet-18), fuse_bn, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end; {seconds:.0f} s in all.")
    for r in rows:
        print(f"{'PASS' if r['ok_eval'] and r['ok_time'] else 'FAIL'}: {r['rank']}: plan search {r['evaluations']} "
              f"evaluations (bound {r['bound']}), wall {r['seconds']:.1f} s against {r['baseline_seconds']:.1f} s "
              f"(ratio {r['time_ratio']:.2f}, target < 1)")
        print(f"{'PASS' if r['ok_plan'] else 'FAIL'}: {r['rank']}: the plan holds {' and '.join(DEFECT_POINTS)}")
    if not has_rank:
        print("SKIP: fast: not available in this build")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "min_sqnr": min_sqnr, "levels": levels, "diagnoses_seconds": t_diag,
                       "full_evaluation_s": t_full, "full_samples_s": full_samples, "fast_available": has_rank,
                       "threads": torch.get_num_threads(), "torch": torch.__version__, "loadavg_start": load_start,
                       "loadavg_end": load_end, "seconds_total": seconds,
                       "rows": [{k: v for k, v in r.items() if k != "meta"} for r in rows]}, fh, indent=2, default=str)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
