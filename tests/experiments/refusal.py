"""What every experiment's bad-input test checks: ``experiments.run`` refuses the command line with status 2, prints
nothing on stdout and exactly one ``error:`` line on stderr."""

from __future__ import annotations

from experiments.run import main as run_main


def refused(capsys, argv: list[str]) -> str:
    """Run ``python -m experiments.run ARGV`` in this process, assert it was refused as above, return its stderr."""
    try:
        status = run_main(argv)
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    return captured.err
