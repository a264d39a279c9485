"""The command-line reference, written from the commands' own argument parsers when the site builds.

:data:`COMMANDS` names every command a user types (``python -m MODULE``) and the function that makes its parser;
:func:`render` turns one parser into a Markdown section (usage, description, one table per argument group: flags,
default, help). Nothing here is typed by hand, so a flag added to a command is in the reference the next time the
site builds; ``tests/docs/test_cli_reference.py`` checks that every command module is listed here and that every
flag of every parser is on the page.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMANDS", "Command", "all_commands", "experiment_commands", "render", "render_all", "write_reference"]


@dataclass(frozen=True)
class Command:
    """A command of the product.

    Attributes:
        module: what follows ``python -m``.
        parser: ``"module:function"``, the function that returns the command's ``argparse`` parser.
        summary: one line for the reference's index.
    """

    module: str
    parser: str
    summary: str

    def make_parser(self) -> argparse.ArgumentParser:
        """The command's parser, made by its own function."""
        module, function = self.parser.split(":")
        factory: Callable[[], argparse.ArgumentParser] = getattr(importlib.import_module(module), function)
        return factory()


#: Every command, in the order a new user meets them.
COMMANDS: tuple[Command, ...] = (
    Command("sim.run", "sim.run:make_parser", "simulate one training iteration of a plan; write plan.json, the trace "
            "and the Gantt chart"),
    Command("sim.search", "sim.search.cli:make_parser", "search the plans of a model on a cluster; simulate the best"),
    Command("executor.run", "executor.run:make_parser", "run a plan.json on real devices and compare with the "
            "prediction"),
    Command("profiles.measure", "profiles.measure:make_parser", "measure a layer profile on this machine's device"),
    Command("experiments.run", "experiments.run:make_parser", "reproduce a published result or one of our own claims; "
            "each experiment's own options follow"),
    Command("sim.bench", "sim.bench.cli:make_parser",
            "time the engine, the partition and the search against baselines"),
    Command("sim.bench_memory", "sim.bench_memory:make_parser", "peak memory and time per op as plans grow"),
)


def experiment_commands() -> tuple[Command, ...]:
    """``python -m experiments.run NAME`` for every registered experiment, each with its module's ``parser``
    (the convention of :mod:`experiments`), in the registry's order."""
    from experiments.run import EXPERIMENTS

    return tuple(Command(f"experiments.run {name}", f"experiments.{name}:parser", entry.description)
                 for name, entry in EXPERIMENTS.items())


def all_commands() -> tuple[Command, ...]:
    """:data:`COMMANDS`, then every experiment's."""
    return COMMANDS + experiment_commands()


def _label(command: Command) -> str:
    """The page's target name of ``command``'s section."""
    return command.module.replace(".", "-").replace("_", "-").replace(" ", "-")


def _default(action: argparse.Action) -> str:
    """An option's default as the reference shows it: blank when there is none to speak of."""
    # by identity: a default of 0 (``--zero``, ``--seed``) equals False but is worth showing
    if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
        return ""
    if isinstance(action.default, (list, tuple)):
        return ",".join(str(item) for item in action.default) if action.default else ""
    return str(action.default)


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _flags(action: argparse.Action) -> str:
    """``--flag VALUE`` / positional name, as typed."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    value = ""
    if action.nargs != 0:
        metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                     else action.dest.upper())
        value = f" {metavar}" if action.nargs is None else f" [{metavar}]" if action.nargs == "?" else f" {metavar} …"
    return ", ".join(f"`{flag}{value}`" for flag in action.option_strings)


def render(command: Command) -> str:
    """The Markdown section of ``command``: its usage line, description and one table per argument group."""
    parser = command.make_parser()
    lines = [f"(cli-{_label(command)})=", f"## `python -m {command.module}`", "",
             command.summary[0].upper() + command.summary[1:] + ".", ""]
    if parser.description:
        lines += [parser.description, ""]
    usage = parser.format_usage().strip().removeprefix("usage: ")
    lines += ["```text", usage, "```", ""]
    for group in parser._action_groups:  # argparse keeps its groups only here
        actions = [action for action in group._group_actions if not isinstance(action, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title or "arguments"
        lines += [f"**{title[0].upper() + title[1:]}**", "", "| flag | default | what |", "|---|---|---|"]
        for action in actions:
            help_text = "" if action.help in (None, argparse.SUPPRESS) else action.help % {"default": action.default}
            lines.append(f"| {_cell(_flags(action))} | {_cell(_default(action))} | {_cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


def render_all() -> str:
    """The whole reference page."""
    head = ["# Command-line reference", "",
            "Generated from each command's own argument parser when this site is built (`docs/_ext/cli_reference.py`): "
            "what `--help` prints, as tables. Bad input to any command is one `error: ...` line and exit status 2.", ""]
    index = [f"- {{ref}}`python -m {c.module} <cli-{_label(c)}>`: {c.summary}" for c in COMMANDS]
    experiments = ["", "Each experiment's options (`python -m experiments.run NAME --help`):", ""]
    experiments += [f"- {{ref}}`{c.module.split()[-1]} <cli-{_label(c)}>`" for c in experiment_commands()]
    return "\n".join(head + index + experiments + [""] + [render(command) for command in all_commands()])


def write_reference(path: Path) -> None:
    """Write the page to ``path`` unless it already holds the same text (a rebuild then sees no change)."""
    text = render_all()
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def setup(app) -> dict:
    """Sphinx hook: write ``reference/generated/cli.md`` before the pages are read."""
    app.connect("builder-inited", lambda app: write_reference(Path(app.srcdir) / "reference" / "generated" / "cli.md"))
    return {"parallel_read_safe": True, "version": "1"}
