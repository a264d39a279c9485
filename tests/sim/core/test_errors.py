"""Library errors name the library's arguments; each command writes them as the flags the user typed.

Oracles: the messages as written by hand, a library call against the same value given to a command, and each
command's parser (every flag its mapping names is a flag it has)."""

from __future__ import annotations

import pickle

import pytest

from executor.run import FLAGS as EXECUTOR_FLAGS
from executor.run import make_parser as executor_parser
from executor.slowdown import parse_slowdown
from sim.core.errors import SpecError, run_cli
from sim.ir.parallel import Parallelism
from sim.run import FLAGS as RUN_FLAGS
from sim.run import main as run_main
from sim.run import make_parser as run_parser
from sim.search.cli import FLAGS as SEARCH_FLAGS
from sim.search.cli import main as search_main
from sim.search.cli import make_parser as search_parser
from sim.search.driver import evaluate_all


def test_a_message_names_its_arguments_and_a_command_writes_them_as_flags():
    error = SpecError("{zero} 1 shards optimizer state; it needs {dp} > 1 (got {dp} {1})", "zero", "dp")
    assert str(error) == "zero 1 shards optimizer state; it needs dp > 1 (got dp {1})"
    assert error.for_flags({"zero": "--zero"}) == "--zero 1 shards optimizer state; it needs dp > 1 (got dp {1})"
    assert error.for_flags({"zero": "--zero", "dp": "--dp"}) == \
        "--zero 1 shards optimizer state; it needs --dp > 1 (got --dp {1})"
    plain = SpecError("a {brace} that is no argument")
    assert str(plain) == plain.for_flags({"brace": "--brace"}) == "a {brace} that is no argument"


def test_an_error_crosses_a_process_boundary_as_its_message():
    error = pickle.loads(pickle.dumps(SpecError("{tp} must be >= 1", "tp")))
    assert type(error) is SpecError and str(error) == "tp must be >= 1"


def test_run_cli_prints_the_flag_the_command_maps(capsys):
    def body():
        raise SpecError("{tp} must be an integer >= 1, got 0", "tp")

    with pytest.raises(SystemExit) as info:
        run_cli(body, {"tp": "--tp"})
    assert info.value.code == 2 and capsys.readouterr().err == "error: --tp must be an integer >= 1, got 0\n"
    with pytest.raises(SystemExit):
        run_cli(body)
    assert capsys.readouterr().err == "error: tp must be an integer >= 1, got 0\n"


@pytest.mark.parametrize(("parser", "flags"), [(run_parser, RUN_FLAGS), (search_parser, SEARCH_FLAGS),
                                               (executor_parser, EXECUTOR_FLAGS)])
def test_every_mapped_flag_is_a_flag_of_its_command(parser, flags):
    options = {option for action in parser()._actions for option in action.option_strings}
    assert set(flags.values()) <= options
    assert all(name.isidentifier() for name in flags)


def test_the_library_names_tp_and_sim_run_names_its_flag(tmp_path, capsys):
    with pytest.raises(SpecError) as info:
        Parallelism(tp=0)
    assert str(info.value) == "tp must be an integer >= 1, got 0"
    with pytest.raises(SystemExit):
        run_main(["--topology", "4xV100", "--model", "uniform:layers=8", "--schedule", "1f1b", "--tp", "0",
                  "--out", str(tmp_path / "out")])
    assert capsys.readouterr().err == "error: --tp must be an integer >= 1, got 0\n"


def test_the_library_names_its_partition_and_sim_run_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_main(["--topology", "4xV100", "--model", "uniform:layers=8", "--schedule", "1f1b", "--partition", "x",
                  "--out", str(tmp_path / "out")])
    assert capsys.readouterr().err.startswith("error: --partition must be uniform, balanced, blocks, layer counts")


def test_the_library_names_workers_and_sim_search_names_its_flag(tmp_path, capsys):
    with pytest.raises(SpecError) as info:
        evaluate_all(None, [], workers=0)  # type: ignore[arg-type]
    assert str(info.value) == "workers must be an integer >= 1, got 0"
    with pytest.raises(SystemExit):
        search_main(["--topology", "4xV100", "--model", "uniform:layers=8", "--global-batch", "8", "--workers", "0",
                     "--out", str(tmp_path / "out")])
    assert capsys.readouterr().err == "error: --workers must be an integer >= 1, got 0\n"


def test_the_library_names_slowdown():
    with pytest.raises(SpecError) as info:
        parse_slowdown(["1"], 2)
    assert str(info.value) == "slowdown '1': expected RANK:FACTOR, e.g. 1:2 or 0:1.5,3:2"
    assert EXECUTOR_FLAGS["slowdown"] == "--slowdown"


@pytest.mark.parametrize(("inputs", "argv", "library", "command"), [
    ({"microbatch_size": 0}, ["--microbatch-size", "0"], "microbatch_size must be >= 1, got 0",
     "--microbatch-size must be >= 1, got 0"),
    ({"schedule": "1f1b", "fps": 30.0}, ["--fps", "30"], "fps 30 is the frame rate of a live source, for schedule",
     "--fps 30 is the frame rate of a live source, for --schedule stream"),
])
def test_build_plan_names_its_arguments_and_sim_run_its_flags(inputs, argv, library, command, tmp_path, capsys):
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs

    base = {"model": "uniform:layers=4", "topology": "2xideal", "schedule": "gpipe"}
    with pytest.raises(SpecError) as info:
        build_plan(PlanInputs(**{**base, **inputs}))
    assert str(info.value).startswith(library) and "--" not in str(info.value)
    flags = ["--schedule", inputs.get("schedule", "gpipe")]
    with pytest.raises(SystemExit):
        run_main(["--topology", "2xideal", "--model", "uniform:layers=4", *flags, *argv, "--out", str(tmp_path / "o")])
    assert capsys.readouterr().err.startswith(f"error: {command}")


def test_did_you_mean_names_the_closest_valid_names_in_their_own_spelling():
    from sim.core.errors import did_you_mean

    assert did_you_mean("1fb1", ["1f1b", "gpipe", "zb1p"]) == "; did you mean 1f1b, zb1p?"
    assert did_you_mean("GPIPE", ["1f1b", "gpipe"]) == "; did you mean gpipe?"
    assert did_you_mean("Dgx-H10", ["DGX-H100", "x"]) == "; did you mean DGX-H100?"
    assert did_you_mean("zzzz", ["1f1b", "gpipe"]) == ""


def test_an_invalid_choice_names_the_closest_choices(capsys):
    # Every command's parser is a CliParser: argparse's invalid choice gains the suggestion, in one line.
    with pytest.raises(SystemExit) as info:
        run_main(["--topology", "2xcpu", "--model", "gpt", "--schedule", "1fb1", "--out", "unused"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: argument --schedule: invalid choice: '1fb1'; did you mean 1f1b, zb1p? "
                                       "(choose from 1f1b, dualpipev, gpipe, interleaved, pipedream, stream, zb1p, "
                                       "csp)\n")


#: Every command's entry module, which must quiet Ctrl-C before its heavy imports.
COMMAND_MODULES = ("sim/run.py", "sim/search/__main__.py", "sim/bench/__main__.py", "sim/bench_memory.py",
                   "executor/run.py", "experiments/run.py", "profiles/measure.py")


def test_ctrl_c_while_a_command_starts_is_one_line_and_status_130():
    # The signal arrives while the "imports" (a sleep) run, after the guard and before run_cli.
    code = ("import os, signal, time\n"
            "from sim.core.errors import exit_on_interrupt_while_starting\n"
            "exit_on_interrupt_while_starting()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
    done = _run_python(code)
    assert (done.returncode, done.stderr, done.stdout) == (130, "error: interrupted\n", "")


def test_once_run_cli_runs_ctrl_c_is_keyboard_interrupt_again():
    import signal

    from sim.core.errors import exit_on_interrupt_while_starting

    before = signal.getsignal(signal.SIGINT)
    try:
        exit_on_interrupt_while_starting()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert run_cli(lambda: signal.getsignal(signal.SIGINT)) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_every_command_quiets_ctrl_c_before_its_heavy_imports(module):
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[3] / module).read_text())
    light = {"__future__", "sys", "time", "sim.core.errors"}
    for statement in tree.body:
        if isinstance(statement, ast.If) and "exit_on_interrupt_while_starting" in ast.unparse(statement):
            return
        if isinstance(statement, ast.Import | ast.ImportFrom):
            names = [statement.module] if isinstance(statement, ast.ImportFrom) else [a.name for a in statement.names]
            assert set(names) <= light, f"{module} imports {names} before quieting Ctrl-C"
    raise AssertionError(f"{module} never calls exit_on_interrupt_while_starting under __main__")


def test_exit_without_teardown_ends_as_a_normal_exit_would():
    """Buffered output flushed, a non-daemon thread's work finished, atexit handlers run (last registered first),
    and the status kept; only the interpreter's teardown is skipped."""
    code = ("import atexit, sys, threading, time\n"
            "from sim.core.errors import exit_without_teardown\n"
            "atexit.register(lambda: print('registered first, runs last'))\n"
            "atexit.register(lambda: print('registered last, runs first'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "sys.stdout.write('buffered, no newline; ')\n"
            "sys.stderr.write('on stderr')\n"
            "exit_without_teardown(3)\n"
            "print('never')\n")
    done = _run_python(code)
    assert done.returncode == 3
    assert done.stdout == ("buffered, no newline; thread done\nregistered last, runs first\n"
                           "registered first, runs last\n")
    assert done.stderr == "on stderr"


def _run_python(code: str):
    """``python -c code`` from the repository's root, its output captured as text."""
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
