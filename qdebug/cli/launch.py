"""``python -m qdebug.launch``: torchrun for qdebug commands, with qdebug's exit codes.

``torchrun`` ends with its own exit code 1 and a ``ChildFailedError`` traceback whenever a
rank fails, whatever the rank's code: an input error (2) and a failed check (1) look the same
to a CI job, and it has no option to pass a rank's code through
(``torch.distributed.run.main`` re-raises the ``ChildFailedError``; ``torch.distributed
.elastic.multiprocessing.errors.record`` only writes it to an error file).  This module runs
torchrun's own launcher (``torch.distributed.run.run``: the same options, the same
rendezvous, the same agent that stops every rank when one fails) and ends like one qdebug
process would:

- every rank ended 0: 0;
- else 2 when a rank said an input error (2), 1 when a rank's check failed (1), else the code
  of the first failure (``128 + N`` for a rank killed by signal N);
- the ranks say their own errors (rank 0 alone says an error every rank shares:
  ``qdebug.config.distributed``); torchrun's logging of the failure and its traceback stay out.

``python -m qdebug.launch --nproc-per-node 2 compare float.pt qat.pt --data eval.pt`` is
``torchrun --nproc-per-node 2 -m qdebug compare ...`` with those exit codes (docs/scale.md).
"""

from __future__ import annotations

import logging
import sys

USAGE = "usage: python -m qdebug.launch [torchrun options] COMMAND [ARGS]...  (e.g. --nproc-per-node 2 compare ...)"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.stderr.write(f"error: no command given\nhint: {USAGE}\n")
        sys.exit(2)
    if args in (["-h"], ["--help"]):
        sys.stdout.write(__doc__.split("\n\n")[0] + "\n\n" + USAGE + "\n")
        sys.exit(0)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    parsed = parse_args(args)
    _run_qdebug(parsed)
    _quiet_torchrun()
    try:
        run(parsed)
    except ChildFailedError as exc:
        sys.exit(exit_code([failure.exitcode for failure in exc.failures.values()]))
    except SignalException as exc:  # the launcher itself was stopped: its agent stopped the ranks,
        sys.exit(128 + int(exc.sigval))  # and rank 0 said so (error: terminated / interrupted)
    except Exception as exc:  # the launch itself (a rendezvous that fails, a bad option value)
        from qdebug.errors import message_of
        from qdebug.safe_text import escaped

        first = escaped(message_of(exc).splitlines()[0] if message_of(exc) else type(exc).__name__)
        sys.stderr.write(f"error: torchrun: {first}\nhint: check the torchrun options; see docs/scale.md\n")
        sys.exit(2)


def _quiet_torchrun() -> None:
    """torchrun's own log lines (a rank failed, workers stopped) stay out: the ranks say what went
    wrong. Each of its modules' loggers has a level of its own, so each is set."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
    for name in [*logging.Logger.manager.loggerDict, *prefixes]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _run_qdebug(parsed) -> None:
    """Make the script torchrun starts ``python -m qdebug COMMAND ...``: the first word after
    torchrun's options is qdebug's command (``-m qdebug COMMAND`` is accepted too)."""
    if parsed.module and parsed.training_script == "qdebug":
        return
    if parsed.module or parsed.no_python or parsed.run_path:
        sys.stderr.write("error: python -m qdebug.launch runs qdebug commands, not other programs\n"
                         f"hint: {USAGE}\n")
        sys.exit(2)
    parsed.training_script_args = [parsed.training_script, *parsed.training_script_args]
    parsed.training_script, parsed.module = "qdebug", True


def exit_code(codes: list[int]) -> int:
    """One process's exit code for ranks that ended with ``codes`` (negative: killed by that signal)."""
    failed = [c for c in codes if c != 0]
    if not failed:
        return 0
    for wanted in (2, 1):
        if wanted in failed:
            return wanted
    first = failed[0]
    return 128 - first if first < 0 else first


if __name__ == "__main__":
    main()
