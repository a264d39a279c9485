"""The command-line reference (docs/_ext/cli_reference.py): every command is in it, and every flag of every
command is on its page with a description."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "_ext" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


cli_reference = _load("cli_reference")


def command_modules() -> set[str]:
    """Every module a user runs with ``python -m``: a ``__main__`` block or a package's ``__main__.py``, but the
    launcher's internal worker entry (tests/test_architecture.py's INTERNAL_ENTRY_POINTS)."""
    from tests.test_architecture import INTERNAL_ENTRY_POINTS

    found = set()
    for package in ("sim", "executor", "profiles", "experiments"):
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if path.name == "__main__.py":
                found.add(module.removesuffix(".__main__"))
                continue
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                        and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
                    found.add(module)
    return found - set(INTERNAL_ENTRY_POINTS)


def test_every_command_and_every_experiment_is_in_the_reference():
    from experiments.run import EXPERIMENTS

    assert command_modules() == {command.module for command in cli_reference.COMMANDS}
    assert {command.module for command in cli_reference.experiment_commands()} == {
        f"experiments.run {name}" for name in EXPERIMENTS}
    page = cli_reference.render_all()
    for command in cli_reference.all_commands():
        assert f"## `python -m {command.module}`" in page


@pytest.mark.parametrize("command", cli_reference.all_commands(), ids=lambda c: c.module)
def test_every_flag_is_on_the_page_with_what_it_does(command):
    page = cli_reference.render(command)
    parser = command.make_parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = action.option_strings or [action.metavar or action.dest]
        for name in names:
            assert f"`{name}" in page, f"{command.module}: {name} is missing from the reference"
        assert action.help and action.help.strip(), f"{command.module}: {names[0]} has no help text"


def planted_parser() -> argparse.ArgumentParser:
    """A command's parser with one flag the reference has never seen."""
    parser = argparse.ArgumentParser(prog="python -m planted", description="A planted command.")
    parser.add_argument("--planted-flag", default=3, help="what it does")
    parser.add_argument("--planted-zero", type=int, default=0, help="a default that equals False")
    parser.add_argument("--planted-switch", action="store_true", help="no default to show")
    return parser


def test_the_page_is_the_parsers_text():
    """A planted command's flag appears on its rendering: the page is generated from the parser, not typed."""
    command = cli_reference.Command("planted", "tests.docs.test_cli_reference:planted_parser", "a planted command")
    page = cli_reference.render(command)
    assert page.startswith("(cli-planted)=\n## `python -m planted`")
    assert "| `--planted-flag PLANTED_FLAG` | 3 | what it does |" in page
    assert "| `--planted-zero PLANTED_ZERO` | 0 | a default that equals False |" in page
    assert "| `--planted-switch` |  | no default to show |" in page
