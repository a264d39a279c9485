"""sim.core.cli: the house parser's one-line errors, with the closest names for a misspelt flag or choice."""

from __future__ import annotations

import pytest

from sim.core.cli import CliParser


def _parser() -> CliParser:
    parser = CliParser(prog="python -m planted")
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe", "zb1p"])
    return parser


@pytest.mark.parametrize(("argv", "line"), [
    # the closest first (difflib's likeness, the shared "--" left out of it)
    (["--microbatchs", "4"], "error: unrecognized arguments: --microbatchs 4; did you mean --microbatches?\n"),
    (["--global_batch=8"], "error: unrecognized arguments: --global_batch=8; did you mean --global-batch?\n"),
    (["--zzz"], "error: unrecognized arguments: --zzz\n"),  # nothing close: nothing suggested
    (["--schedule", "1fb1"], "error: argument --schedule: invalid choice: '1fb1'; did you mean 1f1b, zb1p? "
                             "(choose from 1f1b, gpipe, zb1p)\n"),
])
def test_a_misspelt_flag_or_choice_is_one_line_naming_the_closest(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == line
