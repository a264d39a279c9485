"""Every command the README and the guides show runs as shown, so the pages cannot drift from the code.

The commands are read from the pages' fenced blocks as a shell reads them (a backslash-newline joins lines, ``&&``
chains commands, ``#`` starts a comment, a leading ``$ `` is a prompt whose following lines are the output shown).
Each ``python -m`` command of the project is parsed by its command's own argument parser (made by the function the
CLI reference uses, ``docs/_ext/cli_reference.py``): every flag and choice must exist and every value parse. The
cheap ones (``sim.run`` on small models, about a second each) are also run, from an empty directory, and must exit
with status 0, or print exactly the output shown after a ``$`` prompt. :data:`PARSED_ONLY` lists the commands that
are parsed but not run, and why; the search guide's commands are parsed, never run (the search's own work).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.test_cli_reference import cli_reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md")))

#: ``python -m`` modules the pages show that are not the project's commands: the tools, run as they document.
TOOLS = ("venv", "pytest", "sphinx")

#: Commands parsed but not run here, each by its module or a part of its text, with why.
PARSED_ONLY = {
    "executor.run": "starts a process per rank and trains for real (seconds to minutes), from a plan.json an earlier "
                    "command of the page writes",
    "experiments.run": "an experiment takes from half a minute to several minutes",
    "sim.search": "a search takes seconds to minutes (the search's own tests run it)",
    "sim.bench": "times the engine against baselines for minutes",
    "--profile runs/cpu-profile.json": "reads the profile that the README's executor.run --calibrate-out writes",
    "--topology 16xV100 --model gpt:layers=48": "a 48-layer model over 32 microbatches: about 4 s",
    "--schedule csp --space c": "a 64-subnet CSP run on 8 V100s: 3 to 4 s",
    "--topology 2048x8xH100": "16,384 GPUs and a 1,296-hour run's checkpoint sweep: about 40 s",
    "--topology 128x8xH100": "a 720-hour run with a failure every 2 hours, 16 trials: about 15 s",
    "--topology 64x8xA100": "512 GPUs over 96 microbatches: about 17 s",
}

#: The pages whose commands are parsed only, and why.
PAGES_PARSED_ONLY = {"search.md": "every command there is a search (PARSED_ONLY's sim.search)"}


@dataclass(frozen=True)
class Shown:
    """One command a page shows.

    Attributes:
        page: the page's file name.
        line: the line of the page its block starts on.
        argv: the command's words after ``python -m``, the module first.
        output: the output shown after it (``$`` prompts only), else ``None``.
    """

    page: str
    line: int
    argv: tuple[str, ...]
    output: str | None

    @property
    def module(self) -> str:
        """The module ``python -m`` runs."""
        return self.argv[0]

    @property
    def text(self) -> str:
        """The command as one line."""
        return "python -m " + shlex.join(self.argv)

    def why_not_run(self) -> str | None:
        """Why the command is parsed and not run (``None``: it is run)."""
        if self.page in PAGES_PARSED_ONLY:
            return PAGES_PARSED_ONLY[self.page]
        return next((why for key, why in PARSED_ONLY.items() if key == self.module or key in self.text), None)


def _commands(command_line: str, page: str, line: int, output: str | None) -> list[Shown]:
    """The ``python -m`` commands of one shell line (``&&`` chains them)."""
    found = []
    for part in command_line.split("&&"):
        words = shlex.split(part, comments=True)
        if len(words) >= 3 and re.fullmatch(r"python3?", words[0]) and words[1] == "-m":
            found.append(Shown(page, line, tuple(words[2:]), output))
    return found


def shown_commands(page: Path) -> list[Shown]:
    """Every ``python -m`` command in ``page``'s fenced blocks (not ``python`` blocks: those are code), in order."""
    text = page.read_text()
    found: list[Shown] = []
    for match in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M):
        if match.group(1).strip() == "python":
            continue
        line = text[:match.start()].count("\n") + 1
        block = match.group(2).replace("\\\n", "")  # a shell joins a backslash-newline
        if block.startswith("$ "):  # prompts, each followed by its output
            for shown in re.split(r"^\$ ", block, flags=re.M)[1:]:
                command, _, output = shown.partition("\n")
                found += _commands(command, page.name, line, output)
        else:
            for command in block.splitlines():
                found += _commands(command, page.name, line, None)
    return found


SHOWN = [shown for page in PAGES for shown in shown_commands(page)]
OURS = [shown for shown in SHOWN if shown.module not in TOOLS]


def _id(shown: Shown) -> str:
    return f"{shown.page}:{shown.line}:{shown.text[:90]}"


def _parser_and_args(argv: tuple[str, ...]):
    """The parser of the command ``argv`` names and the arguments it parses (an experiment's own, after its name)."""
    commands = {command.module: command for command in cli_reference.all_commands()}
    module, rest = argv[0], list(argv[1:])
    if module == "experiments.run" and rest and f"{module} {rest[0]}" in commands:
        module, rest = f"{module} {rest[0]}", rest[1:]
    assert module in commands, f"python -m {module} is none of the project's commands ({', '.join(commands)})"
    return commands[module].make_parser(), rest


def test_the_pages_show_commands_and_every_module_is_a_command_or_a_tool():
    # The extraction finds what the pages hold (a regex that matched nothing would pass every test below).
    assert len(OURS) >= 40 and {"README.md", "parallelism.md", "search.md"} <= {s.page for s in OURS}
    commands = {command.module.split()[0] for command in cli_reference.all_commands()}
    assert {shown.module for shown in SHOWN} <= commands | set(TOOLS)
    # Every entry of PARSED_ONLY still names a command shown (a stale entry would hide a new slow command).
    for key in PARSED_ONLY:
        assert any(key == shown.module or key in shown.text for shown in OURS), f"no command shown matches {key!r}"


@pytest.mark.parametrize("shown", OURS, ids=_id)
def test_every_command_shown_parses(shown, capsys):
    parser, args = _parser_and_args(shown.argv)
    try:
        parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{shown.page}:{shown.line}: {shown.text}\n{capsys.readouterr().err}")


def test_a_command_with_an_unknown_flag_or_choice_is_caught(capsys):
    # The planted errors the parse test exists for: a flag that is not there, a choice that is not one, a value
    # that does not parse.
    for argv in (("sim.run", "--topology", "2xcpu", "--tensor-parallel", "2"),
                 ("sim.run", "--topology", "2xcpu", "--schedule", "1f2b"),
                 ("sim.run", "--topology", "2xcpu", "--tp", "two")):
        parser, args = _parser_and_args(argv)
        with pytest.raises(SystemExit):
            parser.parse_args(args)
    capsys.readouterr()
    with pytest.raises(AssertionError, match="none of the project's commands"):
        _parser_and_args(("sim.runn", "--topology", "2xcpu"))


RUN = [shown for shown in OURS if shown.why_not_run() is None]


def test_what_is_run_is_sim_run():
    # Only sim.run commands are cheap enough to run here; anything else shown must say in PARSED_ONLY why not.
    assert RUN and {shown.module for shown in RUN} == {"sim.run"}


@pytest.mark.parametrize("shown", RUN, ids=_id)
def test_every_cheap_command_runs_as_shown(shown, tmp_path, monkeypatch):
    from sim.run import main

    monkeypatch.chdir(tmp_path)  # the commands write runs/...
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(shown.argv[1:]))
        except SystemExit as exc:
            status = exc.code
    if shown.output is None:
        assert status == 0, f"{shown.page}:{shown.line}: {shown.text}\n{err.getvalue()}"
    else:  # the page shows what it prints: an error line with status 2, or the output with 0
        printed = err.getvalue() if shown.output.startswith("error: ") else out.getvalue()
        assert (status, printed) == (2 if shown.output.startswith("error: ") else 0, shown.output), \
            f"{shown.page}:{shown.line}: {shown.text}"

