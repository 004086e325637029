"""Ctrl-C and SIGTERM: SIGTERM ends a run as Ctrl-C does, and both wait for torch's import.

SIGTERM (what ``timeout``, CI runners and Kubernetes send) raises ``Terminated`` in the main
thread, as SIGINT raises KeyboardInterrupt: the run's cleanup (``finally`` blocks, staged
outputs discarded) runs, and the command line ends with ``error: terminated`` and exit 143.
Only the first SIGTERM raises: ``timeout`` sends it to the process and then to its group, and
a second exception in the middle of the cleanup would cut the cleanup short.

torch's import calls back into Python from C++ (pybind11).  A KeyboardInterrupt raised
inside such a callback cannot cross the C++ frames: the process aborts (SIGABRT, exit
134, a C++ message on stderr) instead of ending with ``error: interrupted`` and 130.
So, while ``torch`` imports, the Python handlers of SIGINT and SIGTERM only record the
signal; when the import is over the handlers in place before are restored and the signals
raised again, so a Ctrl-C or a SIGTERM during the import interrupts right after it, at a
Python line.

Python runs signal handlers in the main thread whichever thread the OS delivered the
signal to, which is why the handler is swapped rather than the signal mask.
"""

from __future__ import annotations

import signal
import sys
import threading
from importlib.abc import Loader, MetaPathFinder

_HELD_BACK = "torch"
TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (a BaseException, as KeyboardInterrupt is: code that
    catches Exception lets it through to the cleanup)."""


def raise_on_sigterm() -> None:
    """From now on, the first SIGTERM raises ``Terminated`` in the main thread."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def default_sigterm() -> None:
    """The run is over (its verdict said and flushed): SIGTERM kills again, as by default."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup it starts must run to its end
    raise Terminated()


def _held_signals() -> tuple[int, ...]:
    """SIGINT, and SIGTERM where qdebug raises on it: the signals whose handler raises."""
    return (signal.SIGINT,) + ((signal.SIGTERM,) if signal.getsignal(signal.SIGTERM) is _terminate else ())


class _HoldInterruptsLoader(Loader):
    """Runs the wrapped loader with SIGINT (and SIGTERM) recorded instead of raised."""

    def __init__(self, inner: Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
            self._inner.exec_module(module)
            return
        held: list[int] = []
        previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum))
                    for signum in _held_signals()}
        try:
            self._inner.exec_module(module)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.default_int_handler)
            for signum in dict.fromkeys(held):
                signal.raise_signal(signum)  # now the usual handler: KeyboardInterrupt or Terminated here

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._inner, name)


class _HoldInterruptsDuringImport(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _HELD_BACK:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _HoldInterruptsLoader(spec.loader)
                return spec
        return None


def hold_interrupts_during_torch_import() -> None:
    """Install the hook once, unless torch is already loaded."""
    if _HELD_BACK in sys.modules:
        return
    if not any(isinstance(finder, _HoldInterruptsDuringImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HoldInterruptsDuringImport())
