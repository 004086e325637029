"""The docs tell the truth about the command line: every command is in the README with its
page, and no page mentions a command that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "fixtures" / "demo" / "README.md"]


def _commands() -> list[str]:
    from qdebug.cli.app import _register, app

    _register()
    return [c.name or c.callback.__name__ for c in app.registered_commands]


def test_readme_lists_every_command_with_its_page():
    readme = (REPO / "README.md").read_text()
    for command in _commands():
        # nan-trace's page is nan_trace.md (its JSON keys are snake_case); import's is interop.md
        page = {"import": "interop"}.get(command, command.replace("-", "_"))
        assert f"`qdebug {command}" in readme, command
        assert f"(docs/{page}.md)" in readme, command
        assert (REPO / "docs" / f"{page}.md").is_file(), command


def _command_uses(text: str) -> list[str]:
    """Words after ``qdebug`` where a command is written: in `backticks` and in code (fenced
    blocks, indented lines), not in prose ("qdebug stores ...")."""
    uses = re.findall(r"`qdebug ([a-z][a-z-]*)", text)
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            uses += re.findall(r"(?:^|[\s;&|(])qdebug ([a-z][a-z-]*)", line)
    return uses


def test_docs_mention_only_commands_that_exist():
    known = set(_commands())
    for page in DOCS:
        for word in _command_uses(page.read_text()):
            assert word in known, f"{page.name}: 'qdebug {word}' is not a command"


def test_the_docs_check_would_catch_a_missing_command():
    assert _command_uses("run `qdebug nan-trace` now\n\n    qdebug step x\nqdebug stores prose") == ["nan-trace", "step"]


def test_every_option_in_the_cli_page_exists():
    """docs/cli.md's output options are the ones every command accepts."""
    from qdebug.cli.app import _register, app
    import typer.main

    _register()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        options = {opt for p in command.params for opt in p.opts}
        assert {"--format", "--json", "--out", "--wide"} <= options, name
