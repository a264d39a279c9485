"""sim.core.output_set and run_cli: a command's files are all kept, or the directory is as it was before."""

import os

import pytest

from sim.core.errors import INTERRUPTED_STATUS, SpecError, run_cli
from sim.core.fileio import prepare_output_dir, write_text_atomic
from sim.core.output_set import active_set, all_or_none


def _tree(root):
    """Every file under ``root`` (hidden ones too) with its text, and every directory."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(directory, name), root) + "/"] = None
        for name in files:
            path = os.path.join(directory, name)
            with open(path) as handle:
                found[os.path.relpath(path, root)] = handle.read()
    return found


@pytest.fixture()
def old_run(tmp_path):
    """A directory holding a complete earlier run: ``a`` and ``b``."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old a")
    (out / "b").write_text("old b")
    return out


def _write_new_run(out, *, fail_after=None):
    prepare_output_dir(out / "sub" / "deeper", "--out")
    for i, name in enumerate(("a", "c", "sub/deeper/d")):
        if i == fail_after:
            raise SpecError("boom")
        write_text_atomic(f"new {name}", out / name)


def test_a_completed_set_keeps_every_file_and_no_backup(old_run):
    with all_or_none():
        _write_new_run(old_run)
    assert _tree(old_run) == {"a": "new a", "b": "old b", "c": "new c", "sub/": None, "sub/deeper/": None,
                              "sub/deeper/d": "new sub/deeper/d"}
    assert active_set() is None


@pytest.mark.parametrize("fail_after", [0, 1, 2])
@pytest.mark.parametrize("error", [SpecError("x"), KeyboardInterrupt(), SystemExit(2), OSError(28, "full")])
def test_a_failed_set_leaves_the_directory_exactly_as_it_was(old_run, fail_after, error):
    before = _tree(old_run.parent)

    def fail_at(*_):
        raise error

    with pytest.raises(type(error)):
        with all_or_none():
            prepare_output_dir(old_run / "sub" / "deeper", "--out")
            for i, name in enumerate(("a", "c", "sub/deeper/d")):
                if i == fail_after:
                    fail_at()
                write_text_atomic(f"new {name}", old_run / name)
    assert _tree(old_run.parent) == before  # replaced files back, new ones and made directories gone, no backups


def test_a_directory_made_for_the_set_stays_when_something_else_was_put_in_it(tmp_path):
    with pytest.raises(SpecError):
        with all_or_none():
            prepare_output_dir(tmp_path / "out", "--out")
            write_text_atomic("ours", tmp_path / "out" / "ours")
            (tmp_path / "out" / "theirs").write_text("not written through fileio")
            raise SpecError("boom")
    assert _tree(tmp_path) == {"out/": None, "out/theirs": "not written through fileio"}


def test_exit_status_zero_completes_the_set(tmp_path):
    with pytest.raises(SystemExit):
        with all_or_none():
            write_text_atomic("kept", tmp_path / "a")
            raise SystemExit(0)
    assert _tree(tmp_path) == {"a": "kept"}


def test_an_inner_set_that_completes_is_undone_when_the_outer_one_fails(tmp_path):
    with pytest.raises(SpecError):
        with all_or_none():
            with all_or_none():
                write_text_atomic("inner", tmp_path / "inner")
            assert _tree(tmp_path) == {"inner": "inner"}
            raise SpecError("later")
    assert _tree(tmp_path) == {}


def test_an_inner_set_that_fails_undoes_only_its_own_files(tmp_path):
    with all_or_none():
        write_text_atomic("outer", tmp_path / "outer")
        with pytest.raises(SpecError):
            with all_or_none():
                write_text_atomic("inner", tmp_path / "inner")
                raise SpecError("inner failed")
    assert _tree(tmp_path) == {"outer": "outer"}


def test_without_a_set_a_replaced_file_is_simply_replaced(tmp_path):
    (tmp_path / "a").write_text("old")
    write_text_atomic("new", tmp_path / "a")
    assert _tree(tmp_path) == {"a": "new"}


# --- run_cli --------------------------------------------------------------------------------------------------------


def _cli(capsys, body):
    """``run_cli(body)``: (exit status, stderr)."""
    try:
        status = run_cli(body)
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("error,status,line", [
    (SpecError("bad value 'x'"), 2, "error: bad value 'x'\n"),
    (KeyboardInterrupt(), INTERRUPTED_STATUS, "error: interrupted\n"),
])
def test_run_cli_reports_one_line_and_removes_what_the_command_wrote(old_run, capsys, error, status, line):
    before = _tree(old_run.parent)

    def body():
        _write_new_run(old_run)
        raise error

    assert _cli(capsys, body) == (status, line)
    assert _tree(old_run.parent) == before
    assert INTERRUPTED_STATUS == 128 + 2  # the shell's status for a process ended by SIGINT (signal 2)


def test_run_cli_keeps_the_files_of_a_command_that_returns(old_run, capsys):
    assert _cli(capsys, lambda: _write_new_run(old_run) or 0) == (0, "")
    assert _tree(old_run)["c"] == "new c"


def _leave_with_os_exit(directory: str) -> None:  # pragma: no cover - runs in a child process
    """What an executor rank does: its body runs under run_cli, writes over earlier files, and leaves with
    os._exit, so run_cli's set never ends."""
    from pathlib import Path

    def body():
        with all_or_none():  # the rank's own set (write_run_outputs opens one)
            prepare_output_dir(directory, "--out")
            write_text_atomic("new a", Path(directory) / "a")
        write_text_atomic("new b", Path(directory) / "b")  # outside any recording set: a plain atomic write
        os._exit(0)

    run_cli(body)


def test_a_process_that_leaves_with_os_exit_leaves_no_backups(old_run):
    import subprocess
    import sys
    from pathlib import Path

    code = ("from tests.sim.core.test_output_set import _leave_with_os_exit; "
            f"_leave_with_os_exit({str(old_run)!r})")
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert result.returncode == 0, result.stderr
    assert _tree(old_run) == {"a": "new a", "b": "new b"}  # no hidden .bak-* link to the old files


def test_run_clis_set_records_only_once_the_command_prepares_its_output_directory(tmp_path, capsys):
    def body():
        write_text_atomic("before", tmp_path / "log")  # not an output of the set: kept
        prepare_output_dir(tmp_path / "out", "--out")
        write_text_atomic("output", tmp_path / "out" / "a")
        raise SpecError("failed")

    assert _cli(capsys, body) == (2, "error: failed\n")
    assert _tree(tmp_path) == {"log": "before"}
