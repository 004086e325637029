"""Ctrl-C while torch is being imported: held back until the import is over.

torch's import calls back into Python from C++ (pybind11).  A KeyboardInterrupt raised
inside such a callback cannot cross the C++ frames: the process aborts (SIGABRT, exit
134, a C++ message on stderr) instead of ending with ``error: interrupted`` and 130.
So, while ``torch`` imports, SIGINT's Python handler only records the signal; when the
import is over the handler in place before is restored and the signal raised again, so
a Ctrl-C during the import interrupts right after it, at a Python line.

Python runs signal handlers in the main thread whichever thread the OS delivered the
signal to, which is why the handler is swapped rather than the signal mask.
"""

from __future__ import annotations

import signal
import sys
import threading
from importlib.abc import Loader, MetaPathFinder

_HELD_BACK = "torch"


class _HoldInterruptsLoader(Loader):
    """Runs the wrapped loader with SIGINT recorded instead of raised."""

    def __init__(self, inner: Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
            self._inner.exec_module(module)
            return
        held: list[int] = []
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        try:
            self._inner.exec_module(module)
        finally:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
            if held:
                signal.raise_signal(signal.SIGINT)  # now the usual handler: KeyboardInterrupt here

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
