"""qdebug.config.memory: glibc's malloc keeps freed memory for reuse in the command line's process
(docs/benchmarks.md, "Compare": the page faults it saves), and only where it can."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from qdebug.config import memory

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")


def _in_child(code: str, env: dict | None = None) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_blocks_are_reused_not_faulted_in_again():
    # 64 MiB blocks, above every default threshold: each is a fresh mapping the kernel zeroes
    # (16,384 faults of 4 KiB) unless malloc keeps the freed one for the next.  glibc's malloc
    # itself, through ctypes: where torch puts a tensor in the heap varies from run to run.
    code = """
        import ctypes, resource
        from qdebug.config.memory import reuse_freed_memory
        if REUSE:
            assert reuse_freed_memory()
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        def block():
            p = libc.malloc(64 << 20); ctypes.memset(p, 1, 64 << 20); libc.free(p)
        block()  # the first one faults in either way
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(8):
            block()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
    fresh = int(_in_child(code.replace("REUSE", "False")))
    reused = int(_in_child(code.replace("REUSE", "True")))
    assert fresh > 8 * 16_000  # every block faulted in again
    assert reused < 1_000  # the freed block served the next


def test_it_is_done_once_and_says_so(monkeypatch):
    memory.reuse_freed_memory.cache_clear()
    first = memory.reuse_freed_memory()
    assert first == GLIBC
    monkeypatch.setenv("QDEBUG_MALLOC", "default")  # read once: a later call answers from the first
    assert memory.reuse_freed_memory() == first


def test_qdebug_malloc_default_leaves_malloc_alone(monkeypatch):
    memory.reuse_freed_memory.cache_clear()
    monkeypatch.setenv("QDEBUG_MALLOC", "default")
    assert memory.reuse_freed_memory() is False


def test_a_command_tunes_malloc_before_it_runs(cli, stages, monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "reuse_freed_memory", lambda: calls.append(1) or True)
    assert cli("inspect", stages.float).code == 0
    assert calls == [1]
