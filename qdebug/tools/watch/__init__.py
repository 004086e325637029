"""``qdebug watch``: the health of a QAT run, over its steps.

- ``timeline``: ``qdebug.watch(model)``, the per-step timeline of a run in the user's own loop;
- ``rules``: what the timeline says (oscillation, EMA start-up bias, BN drift, a dead run, ...);
- ``run``: the command's run, QAT steps with nan-trace's loop (``qdebug.tools.nan.trace``).

Built on ``qdebug.tools.nan`` (its loop and checks); nan-trace never imports this package.
"""
