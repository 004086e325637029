"""The ``qdebug`` command line: parse, load, call a tool, render -- nothing else."""

from qdebug.cli.app import app, main

__all__ = ["app", "main"]
