"""Run code as the ranks of a data-parallel job: processes spawned by ``torch.multiprocessing``
with torchrun's environment (gloo on this machine), no torchrun needed.

``run_ranks(fn, world, *args)`` calls ``fn(rank, *args)`` in ``world`` processes and returns
their results in rank order; ``cli_ranks(argv, world)`` runs the command line in each and
returns ``(exit code, stdout, stderr)`` per command and rank.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, env: dict, fn: Callable, args: tuple, folder: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), **env})
    import torch

    torch.set_num_threads(1)  # two ranks on two cores
    try:
        result = ("ok", fn(rank, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
        result = ("raised", f"{type(exc).__name__}: {exc}")
    Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():  # spawn's children end without atexit handlers: gloo's threads must stop first
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, env: dict | None = None) -> list[Any]:
    """``fn(rank, *args)`` in ``world`` spawned processes; their return values in rank order
    (an exception in a rank is returned as ``("raised", text)``)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(world, free_port(), env or {}, fn, args, folder), nprocs=world, join=True)
        results = [pickle.loads(Path(folder, f"rank{r}.pkl").read_bytes()) for r in range(world)]
    return [value if status == "ok" else (status, value) for status, value in results]


def _cli(rank: int, commands: list[list[str]], cwd: str | None) -> list[tuple[int, str, str]]:
    from qdebug.cli.app import run

    if cwd is not None:
        os.chdir(cwd)
    results = []
    for argv in commands:
        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0
        results.append((code, out.getvalue(), err.getvalue()))
    return results


def cli_ranks(*commands: list[str], world: int = 2, cwd: str | None = None,
              env: dict | None = None) -> list[list[tuple[int, str, str]]]:
    """Each command line ``qdebug ARGV`` run in turn by ``world`` ranks (one job, one process
    group): per command, per rank, (exit code, stdout, stderr)."""
    sys.stdout.flush()
    per_rank = run_ranks(_cli, world, list(commands), cwd, env=env)
    for rank, result in enumerate(per_rank):
        if isinstance(result, tuple) and result[:1] == ("raised",):
            raise AssertionError(f"rank {rank} raised: {result[1]}")
    return [[per_rank[r][k] for r in range(world)] for k in range(len(commands))]
